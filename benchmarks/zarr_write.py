"""Writing a Zarr v3 array from host memory, durably: arrayio's store and pipeline against
zarr's LocalStore, zarrs-python and tensorstore.

``python -m benchmarks.zarr_write --out DIR [--size 256M] [--chunks 1M,64K]
[--codecs none,zstd] [--writers NAMES] [--repeats 3] [--dir SCRATCH] [--smoke]
[--replot DIR/zarr_write.json]``

Each round writes the same array (an int32 random walk, rows of 4 KiB, chunks of whole rows
of ``--chunks`` bytes, uncompressed or with zarr's zstd at level 3) with every writer, in a
shuffled order, into a directory of its own, as a user does: ``array[...] = data``. Inside
the timing, every file and directory the writer left is then fsynced (so every figure is of
a durable write, as an ``NVMeStore`` write is by itself and a LocalStore write is not). The
disk's write ceiling (threaded writes of the same bytes and an fsync) is sampled in every
round. Each written array is read back with zarr and compared with the data (untimed); a
writer that wrote other values stops the run.

Writers (``--writers``, all by default; one that cannot run here is listed under
``writers_unavailable`` with the reason):

- ``arrayio``: :class:`arrayio.zarr.NVMeStore` with ``arrayio.zarr.CodecPipeline``: chunks
  encoded and committed in groups;
- ``nvmestore+zarr``: the same store with zarr's own pipeline (one durable write a chunk);
- ``zarr.LocalStore``: zarr's defaults;
- ``zarrs``: zarrs-python's pipeline over a LocalStore;
- ``tensorstore``: the ``zarr3`` driver over the ``file`` kvstore.

GB/s of array bytes; ``DIR/zarr_write.json`` holds every round, ``DIR/zarr_write.png`` the
medians per case.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.peers import _harness as h
from benchmarks.sweep import parse_size

NAME = "zarr_write"
WRITERS = ("arrayio", "nvmestore+zarr", "zarr.LocalStore", "zarrs", "tensorstore")
_ROW = 1024  # int32 columns: rows of 4 KiB
PIPELINE = "arrayio.zarr.CodecPipeline"


def make_data(nbytes: int) -> np.ndarray:
    rows = max(1, nbytes // (4 * _ROW))
    walk = np.cumsum(np.random.default_rng(0).integers(-2, 3, rows * _ROW, dtype=np.int32))
    return walk.astype(np.int32).reshape(rows, _ROW)


def unavailable(names: list[str]) -> dict[str, str]:
    """The writers of ``names`` that cannot run here, with the reason."""
    needs = {"zarrs": "zarrs", "tensorstore": "tensorstore"}
    return {
        name: f"{needs[name]} is not installed"
        for name in names
        if name in needs and importlib.util.find_spec(needs[name]) is None
    }


def writer(name: str, codec: str, chunk_rows: int) -> Callable[[str, np.ndarray], None]:
    """A function that writes ``data`` as a new array at ``root`` the way ``name`` does."""
    if name == "tensorstore":
        return lambda root, data: _tensorstore_write(root, data, codec, chunk_rows)

    def write(root: str, data: np.ndarray) -> None:
        import zarr

        import arrayio.zarr

        config = {"arrayio": {"codec_pipeline.path": PIPELINE}}.get(name, {})
        if name == "zarrs":
            config = {"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"}
        store = (
            arrayio.zarr.NVMeStore(root)
            if name.startswith(("arrayio", "nvmestore"))
            else (zarr.storage.LocalStore(root))
        )
        with zarr.config.set(config):
            array = zarr.create_array(
                store,
                shape=data.shape,
                chunks=(chunk_rows, _ROW),
                dtype="int32",
                compressors=zarr.codecs.ZstdCodec(level=3) if codec == "zstd" else None,
                fill_value=0,
            )
            array[...] = data

    return write


def _tensorstore_write(root: str, data: np.ndarray, codec: str, chunk_rows: int) -> None:
    import tensorstore as ts

    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if codec == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 3}})
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": root},
        "metadata": {
            "shape": list(data.shape),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_rows, _ROW]}},
            "data_type": "int32",
            "codecs": codecs,
            "fill_value": 0,
        },
        "create": True,
        "delete_existing": True,
    }
    ts.open(spec).result().write(data).result()


def check(root: str, data: np.ndarray, name: str) -> None:
    """Raise unless the array at ``root``, read by zarr, holds ``data``."""
    import zarr

    got = zarr.open_array(zarr.storage.LocalStore(root), mode="r")[...]
    if not np.array_equal(got, data):
        raise AssertionError(f"{name} wrote other values than the data")


def measure(args: argparse.Namespace, report: dict[str, Any]) -> None:
    directory = tempfile.mkdtemp(prefix="arrayio-zarr-write-", dir=args.dir)
    data = make_data(args.size)
    nbytes = int(data.nbytes)
    report.update(array_bytes=nbytes, shape=list(data.shape), machine=h.machine())
    writers = [w for w in args.writers if w not in report["writers_unavailable"]]
    ceilings = h.DiskCeilings(directory, nbytes, drop=False, limits=("write_fsync",))
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    try:
        ceilings.search()
        for chunk in args.chunks:
            chunk_rows = max(1, chunk // (4 * _ROW))
            for codec in args.codecs:
                case = {"chunk_bytes": chunk_rows * 4 * _ROW, "codec": codec}
                for name in writers:  # untimed: imports, the dispatcher's first choices
                    root = os.path.join(directory, "warm-up")
                    writer(name, codec, chunk_rows)(root, data)
                    shutil.rmtree(root)
                for index in range(args.repeats):
                    order = list(writers)
                    rng.shuffle(order)
                    row: dict[str, Any] = {**case, "round": index, "order": order, "GBps": {}}
                    for name in order:
                        root = os.path.join(directory, f"{name}-{index}")
                        start = time.perf_counter()
                        writer(name, codec, chunk_rows)(root, data)
                        h.fsync_tree(root)
                        row["GBps"][name] = nbytes / (time.perf_counter() - start) / 1e9
                        check(root, data, name)
                        shutil.rmtree(root)
                    ceilings.sample("write_fsync")
                    samples = ceilings.limits["write_fsync"].samples
                    row["ceiling_GBps"] = nbytes / samples[-1] / 1e9 if samples else None
                    rows.append(row)
                    print(
                        f"  {case['chunk_bytes'] >> 10} KiB {codec:4s} round {index}: "
                        + ", ".join(f"{n} {v:.2f}" for n, v in row["GBps"].items())
                        + f" GB/s (ceiling {row['ceiling_GBps'] or 0:.2f})",
                        flush=True,
                    )
        report["rows"] = rows
        report["ceilings"] = ceilings.report()
        report["summary"] = summarize(rows, writers)
    finally:
        ceilings.close()
        h.remove(directory)


def summarize(rows: list[dict[str, Any]], writers: list[str]) -> dict[str, Any]:
    """Per case: each writer's median GB/s, the ceiling's, and arrayio's ratios."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r["chunk_bytes"], r["codec"]) for r in rows):
        mine = [r for r in rows if (r["chunk_bytes"], r["codec"]) == key]
        medians = {w: h.median([r["GBps"][w] for r in mine]) for w in writers}
        ceiling = h.median([r["ceiling_GBps"] for r in mine if r["ceiling_GBps"]])
        peers = {w: v for w, v in medians.items() if w != "arrayio" and v}
        best = max(peers, key=lambda w: peers[w]) if peers else None
        out[f"{key[0] >> 10}K/{key[1]}"] = {
            "GBps": medians,
            "ceiling_GBps": ceiling,
            "best_peer": best,
            "arrayio_over_best_peer": h.ratio(medians.get("arrayio"), peers.get(best or "")),
            "arrayio_over_ceiling": h.ratio(medians.get("arrayio"), ceiling),
        }
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    summary = report["summary"]
    cases = list(summary)
    writers = list(next(iter(summary.values()))["GBps"]) if summary else []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(writers) + 1)
    for k, name in enumerate([*writers, "ceiling"]):
        values = [
            (summary[c]["ceiling_GBps"] if name == "ceiling" else summary[c]["GBps"][name]) or 0
            for c in cases
        ]
        ax.bar(
            [i + (k - len(writers) / 2) * width for i in range(len(cases))],
            values,
            width,
            label=name,
        )
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("GB/s, durable (median of the rounds)")
    ax.set_title(f"{report['array_bytes'] / 1e9:.2f} GB written from host memory")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zarr_write", description=__doc__)
    h.common_arguments(parser)
    parser.add_argument("--size", default="256M")
    parser.add_argument("--chunks", default="1M,64K")
    parser.add_argument("--codecs", default="none,zstd")
    parser.add_argument("--writers", default=",".join(WRITERS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.size, args.chunks, args.repeats = "4M", "1M,256K", 1
    args.size = parse_size(args.size)
    args.chunks = [parse_size(c) for c in args.chunks.split(",")]
    args.codecs = args.codecs.split(",")
    args.writers = args.writers.split(",")
    unknown = [w for w in args.writers if w not in WRITERS] + [
        c for c in args.codecs if c not in ("none", "zstd")
    ]
    if unknown:
        parser.error(f"unknown writers or codecs: {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    report = h.run_report(
        NAME,
        "benchmarks.zarr_write",
        args,
        argv,
        plot,
        measure,
        writers_unavailable=unavailable(args.writers),
    )
    if report is None:
        return None
    for case, row in report["summary"].items():
        print(
            f"{case}: "
            + ", ".join(f"{w} {v:.2f}" for w, v in row["GBps"].items() if v)
            + f" GB/s; ceiling {row['ceiling_GBps'] or 0:.2f}; arrayio / best peer "
            f"({row['best_peer']}) {row['arrayio_over_best_peer'] or 0:.2f}",
            flush=True,
        )
    return report


if __name__ == "__main__":
    main()
