"""Baseline of the core's simple byte path against torch and safetensors, in one run.

``python -m benchmarks.core_baseline --out results.json [--gib 1] [--repeats 3] [--device cuda]``

Saves and loads a checkpoint-like dict of float32 arrays (16 arrays of 1/16 of the total)
on the GPU (or the CPU) with arrayio's public API, ``torch.save``/``torch.load`` and
``safetensors.torch``, each save fsynced, each load cold (page cache dropped, needs root)
and warm. Reports medians in GB/s. This is the reference the transfer-tools dispatcher must
beat; it makes no claim of its own.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import arrayio
from benchmarks._pagecache import drop_caches, fsync_path


def timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", default=None, help="directory on the disk under test")
    args = parser.parse_args(argv)

    import torch

    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    total = int(args.gib * (1 << 30))
    count = 16
    tensors = {
        f"layer{i}.weight": torch.randn(total // count // 4, device=device) for i in range(count)
    }
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    scratch = tempfile.TemporaryDirectory(prefix="arrayio-core-", dir=args.dir)
    directory = scratch.name  # removed below, or at exit if the run fails

    def peers() -> dict[str, tuple[Callable[[str], None], Callable[[str], Any], str]]:
        from safetensors.torch import load_file, save_file

        def torch_save(path: str) -> None:
            torch.save(tensors, path)
            fsync_path(path)

        def st_save(path: str) -> None:
            save_file(tensors, path)
            fsync_path(path)

        entries = {
            "arrayio": (
                lambda p: arrayio.save(p, tensors),
                lambda p: arrayio.load(p, like="torch", device=device),
                "safetensors",
            ),
            "torch": (torch_save, lambda p: torch.load(p, map_location=device), "pt"),
            "safetensors": (st_save, lambda p: load_file(p, device=device), "safetensors"),
        }
        if device.startswith("cuda"):
            import cupy  # the same GPU buffers, seen through CuPy (zero-copy)

            as_cupy = {k: cupy.from_dlpack(t) for k, t in tensors.items()}
            entries["arrayio-cupy"] = (
                lambda p: arrayio.save(p, as_cupy),
                lambda p: {
                    k: torch.from_dlpack(v)
                    for k, v in arrayio.load(p, like="cupy", device=device).items()
                },
                "safetensors",
            )
        return entries

    results: dict[str, Any] = {}
    cold_ok = True
    for name, (save, load, suffix) in peers().items():
        path = os.path.join(directory, f"{name}.{suffix}")
        writes, colds, warms = [], [], []
        for _ in range(args.repeats):
            writes.append(timed(functools.partial(save, path), sync))
            cold_ok = drop_caches() and cold_ok
            colds.append(timed(functools.partial(load, path), sync))
            warms.append(timed(functools.partial(load, path), sync))
        back = load(path)
        assert all(torch.equal(back[k], tensors[k]) for k in tensors), name
        os.unlink(path)
        results[name] = {
            "write_GBps": nbytes / statistics.median(writes) / 1e9,
            "cold_read_GBps": nbytes / statistics.median(colds) / 1e9 if cold_ok else None,
            "warm_read_GBps": nbytes / statistics.median(warms) / 1e9,
            "seconds": {"write": writes, "cold": colds, "warm": warms},
        }
        print(
            f"{name:12s} write {results[name]['write_GBps']:6.2f} GB/s   cold read "
            f"{results[name]['cold_read_GBps'] or float('nan'):6.2f} GB/s   warm read "
            f"{results[name]['warm_read_GBps']:6.2f} GB/s",
            flush=True,
        )
    scratch.cleanup()

    report = {
        "benchmark": "core_baseline",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [
                os.path.basename(sys.executable),
                "-m",
                "benchmarks.core_baseline",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "machine": {
            "host": platform.node(),
            "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "bytes": nbytes,
        "arrays": count,
        "device": device,
        "repeats": args.repeats,
        "cold_cache_dropped": cold_ok,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
