"""Small-array storm: thousands of 4 to 64 KiB arrays saved and loaded, as microseconds per
array, against torch, safetensors and NumPy, beside the operating system's floor.

``python -m benchmarks.peers.small_arrays --out DIR [--count 10000] [--per-file-count 500]
[--repeats 3] [--drop-caches] [--dir SCRATCH] [--smoke] [--replot DIR/small_arrays.json]``

``--count`` float32 arrays on the GPU, each of a size drawn from the powers of two between
4 and 64 KiB, in two layouts:

* **one file**: the whole dict in one file (``torch.save``, safetensors ``save_file``,
  NumPy ``savez`` then ``cupy.asarray`` per array, ``arrayio.save``), and loaded whole;
  its floor is the disk's ceilings on a file of that size (see
  :class:`~benchmarks.peers._harness.DiskCeilings`), divided by the array count;
* **file per array**: the first ``--per-file-count`` arrays, one file each (``torch.save``,
  ``save_file``, ``numpy.save`` to ``.npy``, ``arrayio.save`` to ``.npy``); its floor is
  the operating system's, bytes from host memory: ``open``, ``write``, ``fsync``, ``close``
  per file, and ``open``, ``readv``, ``close`` to read.

Every save ends with an fsync of every file it wrote (timed, arrayio's own included); cold
loads follow an eviction of the files' pages, warm loads a read of them into the page
cache. An untimed, checked round comes first; then ``--repeats`` rounds, each peer in
turn.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.peers import _harness as h

QUANTITIES = h.QUANTITIES
LAYOUTS = ("one file", "file per array")


def make_arrays(count: int, min_kib: int, max_kib: int, device: str) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(0)
    choices = [1 << e for e in range(min_kib.bit_length() - 1, max_kib.bit_length())]
    sizes = rng.choice(choices, size=count) * 1024
    generator = torch.Generator(device=device).manual_seed(0)
    return {
        f"a{i:05d}": torch.randn(int(n) // 4, device=device, generator=generator)
        for i, n in enumerate(sizes)
    }


def one_file_peers(arrays: dict[str, Any], device: str) -> list[h.Peer]:
    import torch
    from safetensors.torch import load_file, save_file

    import arrayio

    to_device = _to_device(device)
    target = "cuda:0" if device.startswith("cuda") else "cpu"
    same_key = h.check_flat(arrays, lambda out, k, _: out[k])

    def loaded(load: Callable[[str], Any]) -> Callable[[str], Any]:
        def run(path: str) -> Any:
            out = load(path)
            h.settle()
            return out

        return run

    def np_load(path: str) -> dict[str, Any]:
        with np.load(path) as npz:
            return {k: to_device(npz[k]) for k in npz.files}

    return [
        h.Peer(
            "arrayio",
            lambda p: arrayio.save(p, arrays),
            loaded(lambda p: arrayio.load(p, like="torch", device=device)),
            same_key,
            ".safetensors",
        ),
        h.Peer(
            "torch",
            lambda p: torch.save(arrays, p),
            loaded(lambda p: torch.load(p, map_location=device, weights_only=True)),
            same_key,
            ".pt",
        ),
        h.Peer(
            "safetensors",
            lambda p: save_file(arrays, p),
            loaded(lambda p: load_file(p, device=target)),
            same_key,
            ".safetensors",
        ),
        h.Peer(
            "numpy",
            lambda p: np.savez(p, **{k: v.cpu().numpy() for k, v in arrays.items()}),
            loaded(np_load),
            same_key,
            ".npz",
            "savez; load, then a device copy per array",
        ),
    ]


def _to_device(device: str) -> Callable[[np.ndarray], Any]:
    if device.startswith("cuda"):
        import cupy

        return cupy.asarray
    return lambda a: a


def per_file_peers(arrays: dict[str, Any], device: str) -> list[h.Peer]:
    import torch
    from safetensors.torch import load_file, save_file

    import arrayio

    to_device = _to_device(device)
    target = "cuda:0" if device.startswith("cuda") else "cpu"
    keys = list(arrays)
    host = {k: v.cpu().numpy() for k, v in arrays.items()}  # the floor's bytes, made beforehand

    def per_file(
        suffix: str, save_one: Callable[[str, Any], Any], load_one: Callable[[str], Any]
    ) -> tuple[Callable, Callable]:
        def save(directory: str) -> None:
            os.makedirs(directory)
            for k in keys:
                save_one(os.path.join(directory, k + suffix), arrays[k])

        def load(directory: str) -> dict[str, Any]:
            out = {k: load_one(os.path.join(directory, k + suffix)) for k in keys}
            h.settle()
            return out

        return save, load

    def os_write(path: str, tensor: Any) -> None:
        del tensor
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, host[os.path.basename(path)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def os_read(path: str) -> np.ndarray:
        fd = os.open(path, os.O_RDONLY)
        try:
            out = np.empty(host[os.path.basename(path)].shape, np.float32)
            os.readv(fd, [out])
            return out
        finally:
            os.close(fd)

    check = h.check_flat(arrays, lambda out, k, _: out[k])
    check_host = h.check_flat({k: v.cpu() for k, v in arrays.items()}, lambda out, k, _: out[k])
    peers = []
    for name, suffix, save_one, load_one, note in (
        (
            "arrayio",
            ".npy",
            arrayio.save,
            lambda p: arrayio.load(p, like="torch", device=device),
            "",
        ),
        (
            "torch",
            ".pt",
            lambda p, t: torch.save(t, p),
            lambda p: torch.load(p, map_location=device, weights_only=True),
            "",
        ),
        (
            "safetensors",
            ".safetensors",
            lambda p, t: save_file({"x": t}, p),
            lambda p: load_file(p, device=target)["x"],
            "",
        ),
        (
            "numpy",
            ".npy",
            lambda p, t: np.save(p, t.cpu().numpy()),
            lambda p: to_device(np.load(p)),
            "numpy.save/load, then a device copy",
        ),
        (
            "os floor",
            "",
            os_write,
            os_read,
            "open/write/fsync/close and open/readv/close of each file, host memory, no format",
        ),
    ):
        save, load = per_file(suffix, save_one, load_one)
        peers.append(
            h.Peer(name, save, load, check_host if name == "os floor" else check, "", note)
        )
    return peers


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    h.common_arguments(parser)
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--per-file-count", type=int, default=500)
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-kib", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.replot:
        h.replot(plot, args.replot)
        return None
    if args.smoke:
        args.device, args.count, args.per_file_count, args.repeats = "cpu", 300, 40, 1
    if not args.out:
        parser.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "small_arrays.json")
    arrays = make_arrays(args.count, args.min_kib, args.max_kib, args.device)
    subset = dict(list(arrays.items())[: args.per_file_count])
    report = h.header("peers-small-arrays", "benchmarks.peers.small_arrays", argv)
    report.update(
        device=args.device,
        repeats=args.repeats,
        smoke=args.smoke,
        drop_caches=args.drop_caches,
        machine=h.machine(),
        layouts={},
    )
    directory = tempfile.mkdtemp(prefix="arrayio-small-", dir=args.dir)
    plans = {
        "one file": (arrays, one_file_peers(arrays, args.device)),
        "file per array": (subset, per_file_peers(subset, args.device)),
    }
    samples = {
        (layout, p.name): {q: [] for q in QUANTITIES}
        for layout, (_, peers) in plans.items()
        for p in peers
    }
    errors: dict[tuple[str, str], str] = {}
    total = sum(t.numel() * 4 for t in arrays.values())
    ceilings = h.DiskCeilings(directory, total, drop=args.drop_caches)
    try:
        ceilings.search()
        for round_index in range(-1, args.repeats):  # round -1: untimed warm-up, checked
            if round_index >= 0:
                ceilings.sample_round()
            for layout, (_, peers) in plans.items():
                for peer in peers:
                    if (layout, peer.name) in errors:
                        continue
                    path = os.path.join(directory, f"{peer.name.replace(' ', '_')}{peer.suffix}")
                    got = h.measure_round(
                        [peer],
                        {peer.name: path},
                        args.drop_caches,
                        {peer.name} if round_index < 0 else set(),
                        seed="",
                    )
                    if peer.name in got.errors:  # a failing peer is reported
                        errors[(layout, peer.name)] = got.errors[peer.name]
                        print(f"{layout} {peer.name}: {errors[(layout, peer.name)]}", flush=True)
                        continue
                    if round_index >= 0:
                        for q in QUANTITIES:
                            samples[(layout, peer.name)][q].append(got.seconds[peer.name][q])
        report["ceilings"] = ceilings.report()
    finally:
        ceilings.close()
        h.remove(directory)
    for layout, (chosen, _) in plans.items():
        report["layouts"][layout] = summarize(
            layout, chosen, samples, errors, report["ceilings"] if layout == "one file" else None
        )
    report["machine"]["versions"] = h.versions()
    h.write_json(report, out_json)
    for layout, result in report["layouts"].items():
        print(f"{layout}: {result['arrays']} arrays, {result['bytes'] / 1e6:.1f} MB")
        for name, row in result["peers"].items():
            cells = "  ".join(
                f"{q} {row[f'{q}_us_per_array'] or float('nan'):8.1f}" for q in QUANTITIES
            )
            print(f"  {name:12s} {cells}  us/array  {row.get('error', '')}", flush=True)
    h.try_plot(plot, report, os.path.join(args.out, "small_arrays.png"))
    return report


def summarize(
    layout: str,
    chosen: dict[str, Any],
    samples: dict[tuple[str, str], dict[str, list[float]]],
    errors: dict[tuple[str, str], str],
    ceilings: dict[str, Any] | None,
) -> dict[str, Any]:
    """Per peer: microseconds per array (median), ratios of torch's and safetensors' times to
    this one's (above 1: this one is faster)."""
    count = len(chosen)
    nbytes = sum(t.numel() * t.element_size() for t in chosen.values())
    peers: dict[str, Any] = {}
    for (where, name), s in samples.items():
        if where != layout:
            continue
        row: dict[str, Any] = {
            f"{q}_us_per_array": (h.median(s[q]) * 1e6 / count if s[q] else None)
            for q in QUANTITIES
        }
        row["samples"] = len(s["save"])
        row["seconds"] = s
        if (layout, name) in errors:
            row["error"] = errors[(layout, name)]
        peers[name] = row
    for row in peers.values():
        for reference in ("torch", "safetensors"):
            ref = peers.get(reference)
            if ref:
                row[f"{reference}_time_over_this"] = {
                    q: h.ratio(ref[f"{q}_us_per_array"], row[f"{q}_us_per_array"])
                    for q in QUANTITIES
                }
    out: dict[str, Any] = {"arrays": count, "bytes": nbytes, "peers": peers}
    if ceilings is not None:  # the disk's ceilings as a time per array
        floor = {}
        for q, name in (
            ("save", "write_fsync"),
            ("cold_load", "cold_read"),
            ("warm_load", "warm_read"),
        ):
            speed = ceilings[name]["GBps"]
            floor[f"{q}_us_per_array"] = nbytes / (speed * h.GB) * 1e6 / count if speed else None
        out["floor"] = {"what": "the disk's ceilings on a file of this size, per array", **floor}
    else:
        out["floor"] = {
            "what": "the os floor peer (no format, host memory)",
            **{
                f"{q}_us_per_array": peers.get("os floor", {}).get(f"{q}_us_per_array")
                for q in QUANTITIES
            },
        }
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    layouts = list(report["layouts"].items())
    fig, grid = plt.subplots(len(layouts), 3, figsize=(15, 0.6 + 3.0 * len(layouts)), squeeze=False)
    titles = {"save": "save (fsync incl.)", "cold_load": "cold load", "warm_load": "warm load"}
    for row, (layout, result) in zip(grid, layouts, strict=True):
        names = [n for n, r in result["peers"].items() if r.get("samples")]
        for ax, q in zip(row, QUANTITIES, strict=True):
            values = [result["peers"][n][f"{q}_us_per_array"] for n in names]
            colors = [
                "tab:orange"
                if n.startswith("arrayio")
                else "tab:gray"
                if n == "os floor"
                else "tab:blue"
                for n in names
            ]
            ax.barh(names, values, color=colors)
            for y, value in enumerate(values):
                ax.annotate(
                    f"{value:.0f}",
                    (value, y),
                    fontsize=7,
                    va="center",
                    xytext=(2, 0),
                    textcoords="offset points",
                )
            floor = result["floor"].get(f"{q}_us_per_array")
            if floor and layout == "one file":
                ax.axvline(floor, color="black", linestyle="--", linewidth=1)
            ax.invert_yaxis()
            ax.set_xlabel("us per array (lower is better)")
            ax.set_title(f"{layout} ({result['arrays']} arrays): {titles[q]}", fontsize=9)
    fig.suptitle(
        f"Small arrays (4-64 KiB) on {report['device']}, {report['date'][:10]}, "
        f"{report['machine']['summary']}; dashed: disk ceilings per array",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
    sys.exit(0)
