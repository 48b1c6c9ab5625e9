"""A Hugging Face checkpoint in several files against the same bytes in one file.

``python -m benchmarks.multi_file --out DIR [--gib 1.5] [--files 4] [--device cpu|cuda]
[--like numpy|torch] [--cache warm,cold] [--repeats 3] [--drop-caches] [--dir SCRATCH]
[--smoke] [--replot DIR/multi_file.json]``

The same bfloat16 decoder-like state dict (:func:`benchmarks.first_calls.layout`) is saved
by ``arrayio.save`` once as one file and once with ``max_shard_size`` as ``--files`` shards
and their ``model.safetensors.index.json``, as ``transformers`` writes them. Each round
loads both, in an order shuffled per round, with ``arrayio.load`` of the file and of the
directory, after the page cache is filled (warm: each file read twice) or emptied (cold).
One untimed load of each comes first, so that both are measured after the dispatcher has
learned them. The page cache's and the disk's read ceilings are sampled in every round.

The issue's target: the checkpoint in several files loads at least as fast, in GB/s, as one
file (the ratio ``files / one``, median of the rounds, at least 1).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from typing import Any

from benchmarks.peers import _harness as h

NAME = "multi_file"
VARIANTS = ("one_file", "files")


def make_checkpoint(directory: str, gib: float, files: int) -> dict[str, Any]:
    """The state dict saved as one file and as ``files`` shards; their paths and sizes."""
    import arrayio
    from benchmarks import first_calls

    entries = first_calls.layout(int(gib * (1 << 30)), 2048, 32000)
    if gib < 0.05:  # smoke sizes: a narrower model, so that there is more than one layer
        entries = first_calls.layout(int(gib * (1 << 30)), 256, 1024)
    state = first_calls.make_state(entries)
    total = sum(t.numel() * t.element_size() for t in state.values())
    one = os.path.join(directory, "one", "model.safetensors")
    sharded = os.path.join(directory, "sharded")
    os.makedirs(os.path.dirname(one))
    with arrayio.config.set(cache_dir=None):  # the user's own table stays as it was
        arrayio.save(one, state)
        arrayio.save(sharded, state, max_shard_size=shard_size_for(state, files))
    shards = sorted(p for p in os.listdir(sharded) if p.endswith(".safetensors"))
    for path in [one, *(os.path.join(sharded, s) for s in shards)]:
        h.fsync_tree(path)
    return {
        "bytes": total,
        "tensors": len(state),
        "paths": {"one_file": one, "files": sharded},
        "shards": len(shards),
    }


def shard_size_for(state: dict[str, Any], files: int) -> int:
    """The smallest ``max_shard_size`` that cuts ``state`` into ``files`` shards (or fewer,
    where its tensors cannot make that many), as ``arrayio.save`` cuts them."""
    from arrayio.api._save_shards import shard_groups
    from arrayio.arrays import _pytree

    sizes = [leaf.numel() * leaf.element_size() for _, leaf in _pytree.flatten(state)[0]]
    low, high = max(max(sizes), -(-sum(sizes) // files)), sum(sizes)
    while low < high:  # fewer shards as the limit grows
        middle = (low + high) // 2
        if len(shard_groups(sizes, middle)) > files:
            low = middle + 1
        else:
            high = middle
    return low


def load_seconds(path: str, like: str, device: str) -> float:
    """Seconds for ``arrayio.load`` of ``path``, the arrays on their device."""
    import arrayio

    start = time.perf_counter()
    loaded = arrayio.load(path, like=like, device=device)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del loaded
    return seconds


def measure(args: argparse.Namespace, report: dict[str, Any]) -> None:
    directory = tempfile.mkdtemp(prefix="arrayio-multi-file-", dir=args.dir)
    ceilings = None
    try:
        made = make_checkpoint(directory, args.gib, args.files)
        report["checkpoint"] = {k: v for k, v in made.items() if k != "paths"}
        report["machine"] = h.machine()
        paths = made["paths"]
        nbytes = made["bytes"]
        caches = args.cache.split(",")
        ceilings = h.DiskCeilings(
            directory,
            nbytes,
            drop=args.drop_caches,
            limits=tuple({"cold": "cold_read", "warm": "warm_read"}[c] for c in caches),
        )
        ceilings.search()
        for variant in VARIANTS:  # the untimed load: the dispatcher learns each
            h.warm(paths[variant])
            load_seconds(paths[variant], args.like, args.device)
        rng = random.Random(0)
        rounds: list[dict[str, Any]] = []
        for index in range(args.repeats):
            for cache in caches:
                order = list(VARIANTS)
                rng.shuffle(order)
                row: dict[str, Any] = {"round": index, "cache": cache, "order": order}
                for variant in order:
                    if cache == "warm":
                        h.warm(paths[variant])
                    else:
                        row.setdefault("evicted", {})[variant] = h.evict(
                            paths[variant], args.drop_caches
                        )
                    seconds = load_seconds(paths[variant], args.like, args.device)
                    row[variant] = nbytes / seconds / 1e9
                limit = "warm_read" if cache == "warm" else "cold_read"
                ceilings.sample(limit)
                samples = ceilings.limits[limit].samples
                row["ceiling"] = ceilings.nbytes / samples[-1] / 1e9 if samples else None
                rounds.append(row)
                print(
                    f"  {cache:5s} round {index}: one file {row['one_file']:.2f}, "
                    f"{made['shards']} files {row['files']:.2f} GB/s "
                    f"(ceiling {row['ceiling'] or 0:.2f})",
                    flush=True,
                )
        report["rounds"] = rounds
        report["ceilings"] = ceilings.report()
        report["summary"] = summarize(rounds, caches)
    finally:
        if ceilings is not None:
            ceilings.close()
        h.remove(directory)


def summarize(rounds: list[dict[str, Any]], caches: list[str]) -> dict[str, Any]:
    """Medians per cache state: each variant's GB/s, the ceiling's, and ``files / one``."""
    out: dict[str, Any] = {}
    for cache in caches:
        rows = [r for r in rounds if r["cache"] == cache]
        one = h.median([r["one_file"] for r in rows])
        files = h.median([r["files"] for r in rows])
        ratios = [r["files"] / r["one_file"] for r in rows]
        out[cache] = {
            "one_file_GBps": one,
            "files_GBps": files,
            "ceiling_GBps": h.median([r["ceiling"] for r in rows if r["ceiling"]]),
            "files_over_one": h.median(ratios),
            "ratios": ratios,
            "target_met": (h.median(ratios) or 0) >= 1.0,
        }
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    summary = report["summary"]
    caches = list(summary)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.25
    for k, (key, label) in enumerate(
        [
            ("one_file_GBps", "one file"),
            ("files_GBps", f"{report['checkpoint']['shards']} files"),
            ("ceiling_GBps", "ceiling"),
        ]
    ):
        values = [summary[c][key] or 0 for c in caches]
        ax.bar([i + (k - 1) * width for i in range(len(caches))], values, width, label=label)
    ax.set_xticks(range(len(caches)), caches)
    ax.set_ylabel("GB/s (median of the rounds)")
    ax.set_title(f"{report['checkpoint']['bytes'] / 1e9:.2f} GB into {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_file", description=__doc__)
    h.common_arguments(parser)
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--like", default="numpy", choices=("numpy", "torch"))
    parser.add_argument("--cache", default="warm,cold")
    args = parser.parse_args(argv)
    if args.smoke:
        args.gib, args.repeats, args.cache, args.device = 0.01, 1, "warm", "cpu"
    if args.device != "cpu" and args.like == "numpy":
        args.like = "torch"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    report = h.run_report(
        NAME,
        "benchmarks.multi_file",
        args,
        argv,
        plot,
        measure,
        device=args.device,
        like=args.like,
        files_asked=args.files,
    )
    if report is None:
        return None
    for cache, row in report["summary"].items():
        print(
            f"{cache}: one file {row['one_file_GBps']:.2f}, files {row['files_GBps']:.2f} GB/s, "
            f"files / one {row['files_over_one']:.2f} (target 1: "
            f"{'met' if row['target_met'] else 'missed'})",
            flush=True,
        )
    return report


if __name__ == "__main__":
    main()
