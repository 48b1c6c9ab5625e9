"""Feature-map offload: many medium arrays written out and read back while the GPU computes,
reported as the step time, beside torch.save/torch.load and copies to host memory.

``python -m benchmarks.peers.featuremap --out DIR [--arrays 64] [--mib 32] [--compute-ms 500]
[--repeats 3] [--drop-caches] [--dir SCRATCH] [--smoke] [--replot DIR/featuremap.json]``

A step starts a stretch of compute (a loop of bfloat16 matmuls on a CUDA stream of its own,
calibrated to ``--compute-ms``; a thread of CPU matmuls in ``--smoke``), offloads the
``--arrays`` feature maps (float32 torch tensors on the GPU), reads them all back to the
GPU, and ends when compute and reload are both done (device synchronized). The step time
is that wall time; its floor is the compute alone, or the I/O at the disk's ceilings when
that is longer.

Methods: ``compute only``; ``pinned host copy`` (non-blocking copies on a copy stream into
pinned buffers allocated beforehand, and back); ``pageable host copy`` (``.cpu()`` and
``.to(device)``); ``torch.save/load`` (one file per array, ``map_location`` on load);
``arrayio async`` (``arrayio.save_async``/``load_async``, one file per array, all in
flight at once); ``arrayio`` (``arrayio.save``/``load`` one after another).

Two cache states for the file methods: ``warm``, the reload right after the offload, as a
training step does it (what torch wrote is still in the page cache; arrayio's saves are
fsynced and its O_DIRECT writes leave nothing cached); and ``cold``, feature maps that must
come from the disk (as when they outgrow host memory): every method's offload then ends
with an fsync of its files (timed), and the files are evicted before the reload (not
timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.peers import _harness as h


class Compute:
    """A stretch of work that runs beside the I/O: matmuls on their own CUDA stream, or a
    CPU thread of them (torch releases the GIL) without a GPU."""

    def __init__(self, device: str, target_ms: float, size: int) -> None:
        import torch

        self.torch, self.device = torch, device
        self.cuda = device.startswith("cuda")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        self.a = torch.randn(size, size, device=device, dtype=dtype)
        self.b = torch.randn(size, size, device=device, dtype=dtype)
        self.c = torch.empty_like(self.a)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.thread: threading.Thread | None = None
        self.iterations = 4
        self.alone()  # the first call sets up cuBLAS (or the thread machinery)
        per = self.alone() / self.iterations
        self.iterations = max(1, math.ceil(target_ms / 1e3 / per))

    def _loop(self) -> None:
        for _ in range(self.iterations):
            self.torch.matmul(self.a, self.b, out=self.c)

    def launch(self) -> None:
        if self.cuda:
            with self.torch.cuda.stream(self.stream):
                self._loop()
        else:
            self.thread = threading.Thread(target=self._loop)
            self.thread.start()

    def wait(self) -> None:
        if self.cuda:
            self.stream.synchronize()
        elif self.thread is not None:
            self.thread.join()
            self.thread = None

    def alone(self) -> float:
        h.settle()
        start = time.perf_counter()
        self.launch()
        self.wait()
        return time.perf_counter() - start


@dataclasses.dataclass
class Method:
    name: str
    offload: Callable[[list[Any], str], Any]  # (maps, directory) -> handle
    reload: Callable[[Any], list[Any]]
    files: bool  # whether it writes files (and so has a cold variant)
    note: str = ""


def methods(device: str) -> tuple[list[Method], dict[str, str]]:
    import torch

    import arrayio

    cuda = device.startswith("cuda")
    out: list[Method] = []
    unavailable: dict[str, str] = {}

    out.append(
        Method(
            "compute only",
            lambda maps, d: None,
            lambda handle: [],
            False,
            "no offload: the floor of the step",
        )
    )

    if cuda:
        copy_stream = torch.cuda.Stream()
        pinned: list[Any] = []

        def pinned_offload(maps: list[Any], _: str) -> Any:
            if len(pinned) != len(maps):  # allocated once, outside the timed steps' spirit
                pinned[:] = [torch.empty(m.shape, dtype=m.dtype, pin_memory=True) for m in maps]
            copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copy_stream):
                for host, m in zip(pinned, maps, strict=True):
                    host.copy_(m, non_blocking=True)
            copy_stream.synchronize()
            return pinned

        def pinned_reload(handle: list[Any]) -> list[Any]:
            with torch.cuda.stream(copy_stream):
                back = [host.to(device, non_blocking=True) for host in handle]
            copy_stream.synchronize()
            return back

        out.append(
            Method(
                "pinned host copy",
                pinned_offload,
                pinned_reload,
                False,
                "non-blocking copies on a copy stream; pinned buffers reused",
            )
        )
    else:
        unavailable["pinned host copy"] = "needs a CUDA device"

    out.append(
        Method(
            "pageable host copy",
            lambda maps, _: [m.to("cpu", copy=True) for m in maps],
            lambda handle: [x.to(device, copy=True) for x in handle],
            False,
        )
    )

    def torch_offload(maps: list[Any], directory: str) -> list[str]:
        paths = [os.path.join(directory, f"map{i}.pt") for i in range(len(maps))]
        for path, m in zip(paths, maps, strict=True):
            torch.save(m, path)
        return paths

    out.append(
        Method(
            "torch.save/load",
            torch_offload,
            lambda paths: [torch.load(p, map_location=device, weights_only=True) for p in paths],
            True,
            "one file per array, in turn",
        )
    )

    def arrayio_paths(maps: list[Any], directory: str) -> list[str]:
        return [os.path.join(directory, f"map{i}.safetensors") for i in range(len(maps))]

    def async_offload(maps: list[Any], directory: str) -> list[str]:
        paths = arrayio_paths(maps, directory)
        for future in [arrayio.save_async(p, m) for p, m in zip(paths, maps, strict=True)]:
            future.result()
        return paths

    def async_reload(paths: list[str]) -> list[Any]:
        futures = [arrayio.load_async(p, like="torch", device=device) for p in paths]
        return [future.result() for future in futures]

    if hasattr(arrayio, "save_async"):
        out.append(
            Method(
                "arrayio async",
                async_offload,
                async_reload,
                True,
                "save_async/load_async, every array in flight at once "
                f"(at most config async_workers={arrayio.config.get().async_workers})",
            )
        )
    else:
        unavailable["arrayio async"] = "this arrayio has no save_async"

    def sync_offload(maps: list[Any], directory: str) -> list[str]:
        paths = arrayio_paths(maps, directory)
        for p, m in zip(paths, maps, strict=True):
            arrayio.save(p, m)
        return paths

    out.append(
        Method(
            "arrayio",
            sync_offload,
            lambda paths: [arrayio.load(p, like="torch", device=device) for p in paths],
            True,
            "save/load one after another",
        )
    )
    return out, unavailable


def step(
    method: Method,
    maps: list[Any],
    compute: Compute,
    directory: str,
    cold: bool,
    drop: bool,
    verify: bool,
) -> dict[str, float]:
    """One step's seconds: total (eviction excluded), offload and reload phases."""
    h.settle()
    start = time.perf_counter()
    compute.launch()
    handle = method.offload(maps, directory)
    if cold:
        h.fsync_tree(directory)  # the feature maps are on the disk, as cold reads need
    offloaded = time.perf_counter()
    if cold:
        h.evict(directory, drop)
    reload_start = time.perf_counter()
    back = method.reload(handle)
    reloaded = time.perf_counter()
    compute.wait()
    h.settle()
    end = time.perf_counter()
    if verify and method.name != "compute only":
        for i, (m, b) in enumerate(zip(maps, back, strict=True)):
            h.same(m, b, f"map{i}")
    for name in os.listdir(directory):
        h.remove(os.path.join(directory, name))
    return {
        "step": end - start - (reload_start - offloaded),
        "offload": offloaded - start,
        "reload": reloaded - reload_start,
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    h.common_arguments(parser)
    parser.add_argument("--arrays", type=int, default=64)
    parser.add_argument("--mib", type=float, default=32)
    parser.add_argument("--compute-ms", type=float, default=500)
    parser.add_argument("--matmul", type=int, default=8192, help="compute matmul size")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.replot:
        h.replot(plot, args.replot)
        return None
    if args.smoke:
        args.device, args.arrays, args.mib, args.compute_ms, args.matmul = "cpu", 8, 0.25, 20, 128
        args.repeats = 1
    if not args.out:
        parser.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "featuremap.json")
    import torch

    report = h.header("peers-featuremap", "benchmarks.peers.featuremap", argv)
    generator = torch.Generator(device=args.device).manual_seed(0)
    elements = int(args.mib * (1 << 20)) // 4
    maps = [
        torch.randn(elements, device=args.device, generator=generator) for _ in range(args.arrays)
    ]
    nbytes = elements * 4 * args.arrays
    compute = Compute(args.device, args.compute_ms, args.matmul)
    directory = tempfile.mkdtemp(prefix="arrayio-featuremap-", dir=args.dir)
    ceilings = h.DiskCeilings(directory, nbytes, drop=args.drop_caches)
    report.update(
        device=args.device,
        arrays=args.arrays,
        array_bytes=elements * 4,
        bytes=nbytes,
        repeats=args.repeats,
        smoke=args.smoke,
        drop_caches=args.drop_caches,
        compute_iterations=compute.iterations,
        compute_matmul=args.matmul,
        machine=h.machine(),
    )
    chosen, unavailable = methods(args.device)
    report["methods_unavailable"] = unavailable
    variants = [
        (m, cache) for m in chosen for cache in (("warm", "cold") if m.files else ("warm",))
    ]
    samples: dict[tuple[str, str], dict[str, list[float]]] = {
        (m.name, c): {"step": [], "offload": [], "reload": []} for m, c in variants
    }
    errors: dict[str, str] = {}
    scratch = os.path.join(directory, "maps")
    os.makedirs(scratch)
    try:
        ceilings.search()
        for round_index in range(-1, args.repeats):  # round -1: untimed warm-up, verified
            if round_index >= 0:
                ceilings.sample_round()
            for method, cache in variants:
                if method.name in errors:
                    continue
                try:
                    got = step(
                        method,
                        maps,
                        compute,
                        scratch,
                        cache == "cold",
                        args.drop_caches,
                        verify=round_index < 0,
                    )
                except Exception as error:  # noqa: BLE001 - a failing method is reported
                    errors[method.name] = f"{type(error).__name__}: {error}"
                    print(f"{method.name}: {errors[method.name]}", flush=True)
                    continue
                if round_index >= 0:
                    for key, value in got.items():
                        samples[(method.name, cache)][key].append(value)
                    print(
                        f"  round {round_index + 1} {method.name:20s} {cache:4s} step "
                        f"{got['step'] * 1e3:8.1f} ms  offload {got['offload'] * 1e3:8.1f}"
                        f"  reload {got['reload'] * 1e3:8.1f}",
                        flush=True,
                    )
            if round_index >= 0:  # after every round: a run cut short keeps its results
                report["ceilings"] = ceilings.report()
                report["results"] = summarize(report, chosen, samples, errors)
                h.write_json(report, out_json)
    finally:
        ceilings.close()
        h.remove(directory)
    report["results"] = summarize(report, chosen, samples, errors)
    report["machine"]["versions"] = h.versions()
    h.write_json(report, out_json)
    for row in report["results"]:
        print(
            f"{row['method']:20s} {row['cache']:4s} step {row['step_ms'] or float('nan'):8.1f}"
            f" ms  vs torch {row.get('torch_step_over_this') or float('nan'):5.2f}x  floor/step "
            f"{row.get('floor_over_step') or float('nan'):.2f}",
            flush=True,
        )
    h.try_plot(plot, report, os.path.join(args.out, "featuremap.png"))
    return report


def summarize(
    report: dict[str, Any],
    chosen: list[Method],
    samples: dict[tuple[str, str], dict[str, list[float]]],
    errors: dict[str, str],
) -> list[dict[str, Any]]:
    """Per method and cache state: median step, offload and reload times; the step's floor
    (compute alone, or the I/O at the disk's ceilings); torch's step over this one."""
    nbytes, ceilings = report["bytes"], report["ceilings"]
    compute = h.median(samples.get(("compute only", "warm"), {}).get("step", []))
    write, cold_read = ceilings["write_fsync"]["GBps"], ceilings["cold_read"]["GBps"]
    io_floor = (
        nbytes / (write * h.GB) + nbytes / (cold_read * h.GB) if write and cold_read else None
    )
    rows = []
    for (name, cache), s in samples.items():
        method = next(m for m in chosen if m.name == name)
        step_s = h.median(s["step"])
        row: dict[str, Any] = {
            "method": name,
            "cache": cache,
            "samples": len(s["step"]),
            "step_ms": step_s * 1e3 if step_s else None,
            "offload_ms": (h.median(s["offload"]) or 0) * 1e3 if s["offload"] else None,
            "reload_ms": (h.median(s["reload"]) or 0) * 1e3 if s["reload"] else None,
            "offload_GBps": h.rate(nbytes, h.median(s["offload"]))
            if name != "compute only"
            else None,
            "reload_GBps": h.rate(nbytes, h.median(s["reload"]))
            if name != "compute only"
            else None,
            "overhead_over_compute_ms": (step_s - compute) * 1e3 if step_s and compute else None,
            "seconds": s,
            "note": method.note,
        }
        if name in errors:
            row["error"] = errors[name]
        if cache == "cold" and compute and io_floor:
            row["floor_ms"] = max(compute, io_floor) * 1e3
            row["floor_over_step"] = h.ratio(row["floor_ms"], row["step_ms"])
        rows.append(row)
    for row in rows:
        torch_row = next(
            (r for r in rows if r["method"] == "torch.save/load" and r["cache"] == row["cache"]),
            None,
        )
        if torch_row and torch_row["step_ms"] and row["step_ms"]:
            row["torch_step_over_this"] = torch_row["step_ms"] / row["step_ms"]
        pinned = next((r for r in rows if r["method"] == "pinned host copy"), None)
        if pinned and pinned["step_ms"] and row["step_ms"]:
            row["pinned_step_over_this"] = pinned["step_ms"] / row["step_ms"]
    return rows


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r.get("step_ms")]
    labels = [f"{r['method']} ({r['cache']})" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.42 * len(rows)))
    offload = [r["offload_ms"] or 0 for r in rows]
    rest = [r["step_ms"] - (r["offload_ms"] or 0) for r in rows]
    colors = ["tab:orange" if r["method"].startswith("arrayio") else "tab:blue" for r in rows]
    ax.barh(labels, offload, color=colors, alpha=0.55, label="offload phase")
    ax.barh(labels, rest, left=offload, color=colors, label="reload and wait for compute")
    for y, r in enumerate(rows):
        ax.annotate(
            f"{r['step_ms']:.0f} ms",
            (r["step_ms"], y),
            fontsize=7,
            va="center",
            xytext=(2, 0),
            textcoords="offset points",
        )
    compute = next((r["step_ms"] for r in rows if r["method"] == "compute only"), None)
    if compute:
        ax.axvline(compute, color="black", linestyle=":", linewidth=1)
    floor = next((r.get("floor_ms") for r in rows if r.get("floor_ms")), None)
    if floor:
        ax.axvline(floor, color="black", linestyle="--", linewidth=1)
        ax.annotate("cold floor (disk ceilings)", (floor, len(rows) - 0.5), fontsize=7, ha="right")
    ax.invert_yaxis()
    ax.set_xlabel("step time, ms (lower is better)")
    ax.legend(fontsize=7, loc="lower right")
    mib = report["array_bytes"] / (1 << 20)
    ax.set_title(
        f"Feature-map offload: {report['arrays']} x {mib:g} MiB while the "
        f"{'GPU' if report['device'].startswith('cuda') else 'CPU'} computes, "
        f"{report['date'][:10]}, {report['machine']['summary']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
    sys.exit(0)
