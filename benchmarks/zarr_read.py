"""Reading a Zarr v3 array from local disk into GPU (or host) memory: arrayio's NVMeStore
against zarr's LocalStore and KvikIO's GDSStore, beside the disk's ceiling, in one run.

``python -m benchmarks.zarr_read --out DIR [--size 2G] [--chunk 16M] [--memory cuda|host]
[--repeats 3] [--drop-caches] [--codecs none,zstd] [--decoders arrayio,zarr]
[--pipeline batched|fused|arrayio|users] [--concurrency N] [--batch-size N] [--dir DIR]``

In one run, on files in ``--dir``:

* the data: an int32 random walk (zstd compresses it about 4 times) of ``--size`` bytes,
  2-D, chunks of ``--chunk`` bytes, written by ``zarr.storage.LocalStore`` (plain Zarr)
  once uncompressed and once with zarr's CPU ``ZstdCodec``;
* ceilings on the same chunk files: a parallel ``O_DIRECT`` read of all of them into host
  memory after evicting them from the page cache (best of 8, 16 and 32 threads: the disk),
  a parallel buffered read of them warm (the page cache), and a pinned host-to-device copy;
* each store reads the whole array (``array[...]``) into GPU memory under
  ``zarr.config.enable_gpu()`` (``--memory cuda``) or into NumPy (``--memory host``), cold
  (the chunk files evicted with ``posix_fadvise``, and all caches dropped with
  ``--drop-caches``, root only) and warm (the files read into the page cache just before),
  stores interleaved in each round; the figure is the median of ``--repeats`` rounds, in
  GB/s of array bytes (10^9 per second). Before the timed rounds of each cache state,
  ``--learn`` untimed rounds let every store settle (arrayio's dispatcher learns its tools
  on the first transfers of a context and keeps what it learned for later processes);
* zstd arrays are read once per decoder in ``--decoders``: ``arrayio`` selects
  ``arrayio.zarr.codecs.ZstdCodec`` for zarr's ``zstd`` name (GPU decode with nvCOMP) when
  it imports, ``zarr`` keeps zarr's CPU codec; the JSON records the class that decoded.

Every store's result is checked against the data (its exact sum, and a sample of rows).
Results go to ``DIR/zarr_read.json`` (written after every case) and ``DIR/zarr_read.png``.
A peer that cannot run (KvikIO not installed, no GPU) is recorded with the reason.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from arrayio.arrays._buffers import aligned_empty
from benchmarks._pagecache import evict
from benchmarks.sweep import machine, parse_size

STORES = ("arrayio", "zarr.LocalStore", "kvikio.GDSStore")
PEERS = STORES[1:]
ARRAYIO_ZSTD = "arrayio.zarr.codecs.ZstdCodec"
FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"
ARRAYIO_PIPELINE = "arrayio.zarr.CodecPipeline"
_BLOCK = 4096
_ROW = 1024  # int32 elements per row: rows of 4 KiB


# --------------------------------------------------------------------------- data


def make_data(root: str, nbytes: int, chunk_bytes: int, codec: str) -> dict[str, Any]:
    """Write the array with LocalStore; return its shape, chunks, sum and sample rows."""
    import zarr

    rows = max(1, nbytes // (4 * _ROW))
    chunk_rows = max(1, chunk_bytes // (4 * _ROW))
    compressors = zarr.codecs.ZstdCodec(level=3) if codec == "zstd" else None
    z = zarr.create_array(
        zarr.storage.LocalStore(root),
        shape=(rows, _ROW),
        chunks=(chunk_rows, _ROW),
        dtype="int32",
        compressors=compressors,
        fill_value=0,
    )
    rng = np.random.default_rng(0)
    total, level = 0, 0
    samples = {}
    sample_rows = sorted({0, rows // 3, rows // 2, rows - 1})
    step = max(chunk_rows, (256 << 20) // (4 * _ROW) // chunk_rows * chunk_rows)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        walk = np.cumsum(rng.integers(-2, 3, (stop - start) * _ROW, dtype=np.int32)) + level
        block = walk.astype(np.int32).reshape(stop - start, _ROW)
        level = int(walk[-1])
        z[start:stop] = block
        total += int(block.sum(dtype=np.int64))
        for row in sample_rows:
            if start <= row < stop:
                samples[row] = block[row - start].copy()
    os.sync()
    files = chunk_files(root)
    return {
        "shape": (rows, _ROW),
        "chunks": (chunk_rows, _ROW),
        "sum": total,
        "samples": samples,
        "files": files,
        "stored_bytes": sum(os.path.getsize(f) for f in files),
        "array_bytes": rows * _ROW * 4,
    }


def chunk_files(root: str) -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        for name in names
        if name != "zarr.json"
    )


# --------------------------------------------------------------------------- cache state


def read_files(files: list[str], threads: int, direct: bool) -> int:
    """Read every file whole into host memory with ``threads`` threads; return bytes."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def one(path: str) -> int:
        size = os.path.getsize(path)
        buffer = aligned_empty(-(-max(size, 1) // _BLOCK) * _BLOCK)
        fd = os.open(path, flags)
        try:
            done, view = 0, memoryview(buffer)
            while done < size:
                got = os.preadv(fd, [view[done:]], done)
                if got == 0:
                    break
                done += got
            return done
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, files))


def ceilings(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    files, nbytes = data["files"], data["stored_bytes"]
    out: dict[str, Any] = {}

    def rate(prepare: Callable[[], Any], run: Callable[[], Any]) -> float:
        seconds = []
        for _ in range(args.repeats):
            prepare()
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        return nbytes / statistics.median(seconds) / 1e9

    try:
        out["cold_direct_read_GBps"] = max(
            rate(
                lambda: evict(files, args.drop_caches),
                lambda t=t: read_files(files, t, direct=True),
            )
            for t in (8, 16, 32)
        )
    except OSError as error:  # O_DIRECT refused (tmpfs): reported, not fatal
        out["cold_direct_read_error"] = f"{type(error).__name__}: {error}"
    out["warm_read_GBps"] = max(
        rate(
            lambda: read_files(files, 16, direct=False),
            lambda t=t: read_files(files, t, direct=False),
        )
        for t in (16, 32)
    )
    if args.memory == "cuda":
        import cupy
        import cupyx

        size = min(nbytes, 1 << 30)
        pinned = cupyx.empty_pinned((size,), dtype=np.uint8)
        pinned[:] = 1
        device = cupy.empty(size, dtype=cupy.uint8)
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            device.set(pinned)
            cupy.cuda.Device().synchronize()
            seconds.append(time.perf_counter() - start)
        out["pinned_host_to_device_GBps"] = size / statistics.median(seconds) / 1e9
        del device, pinned
    return out


# --------------------------------------------------------------------------- stores


def make_store(name: str, root: str) -> Any:
    """The store, or raise ImportError with the reason it cannot run here."""
    if name == "arrayio":
        from arrayio.zarr import NVMeStore

        return NVMeStore(root, read_only=True)
    if name == "zarr.LocalStore":
        import zarr

        return zarr.storage.LocalStore(root, read_only=True)
    if name == "kvikio.GDSStore":
        from kvikio.zarr import GDSStore

        return GDSStore(root, read_only=True)
    raise ValueError(f"unknown store {name!r}; expected one of {STORES}")


def decoder_config(decoder: str) -> tuple[dict[str, Any], str | None]:
    """The zarr config that selects ``decoder`` for zstd, or a reason it cannot run."""
    if decoder == "zarr":
        return {"codecs.zstd": "zarr.codecs.zstd.ZstdCodec"}, None
    try:
        importlib.import_module("arrayio.zarr.codecs")
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return {}, f"{ARRAYIO_ZSTD} does not import: {type(error).__name__}: {error}"
    return {"codecs.zstd": ARRAYIO_ZSTD}, None


class Reader:
    """Reads one store's array whole, in the requested memory, and checks the result."""

    def __init__(
        self, store_name: str, root: str, data: dict[str, Any], args: argparse.Namespace
    ) -> None:
        self.name, self.root, self.data, self.args = store_name, root, data, args
        make_store(store_name, root)  # fails here, before timing, if it cannot run

    def __call__(self) -> tuple[float, str]:
        """Seconds for ``array[...]`` (opening excluded), and the class that decoded."""
        import zarr

        with zarr.config.set(self.opening()):
            array = zarr.open_array(make_store(self.name, self.root), mode="r")
        decoded_by = ", ".join(
            f"{type(c).__module__}.{type(c).__qualname__}" for c in array.metadata.codecs
        )
        if self.args.memory == "cuda":
            import cupy

            cupy.cuda.Device().synchronize()
            start = time.perf_counter()
            result = array[...]
            cupy.cuda.Device().synchronize()
            seconds = time.perf_counter() - start
        else:
            start = time.perf_counter()
            result = array[...]
            seconds = time.perf_counter() - start
        self.check(result)
        del result
        if self.args.memory == "cuda":
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        return seconds, decoded_by

    def opening(self) -> dict[str, Any]:
        """The zarr config this store's array is opened with: with ``--pipeline users``,
        arrayio's store takes arrayio's pipeline and GPU zstd codec, each peer zarr's own
        defaults (what their users have); otherwise the run's config throughout."""
        if self.args.pipeline != "users" or self.name != "arrayio":
            return {}
        importlib.import_module("arrayio.zarr")  # registers the pipeline
        config = {"codec_pipeline.path": ARRAYIO_PIPELINE}
        if self.args.memory == "cuda":
            config.update(decoder_config("arrayio")[0])
        return config

    def check(self, result: Any) -> None:
        where = "GPU" if self.args.memory == "cuda" else "host"
        if self.args.memory == "cuda":
            import cupy

            if not isinstance(result, cupy.ndarray):
                raise AssertionError(
                    f"{self.name} returned {type(result).__name__}, not CuPy memory"
                )
            total = int(cupy.sum(result, dtype=cupy.int64))
            rows = {r: cupy.asnumpy(result[r]) for r in self.data["samples"]}
        else:
            total = int(np.sum(result, dtype=np.int64))
            rows = {r: result[r] for r in self.data["samples"]}
        if total != self.data["sum"] or not all(
            np.array_equal(rows[r], v) for r, v in self.data["samples"].items()
        ):
            raise AssertionError(f"{self.name} read wrong values into {where} memory")


def run_case(
    args: argparse.Namespace, codec: str, decoder: str, root: str, data: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every store, cold and warm, interleaved in ``--repeats`` rounds."""
    import zarr

    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    skip_all = None
    if codec == "zstd":
        config, skip_all = decoder_config("zarr" if args.pipeline == "users" else decoder)
    if args.pipeline == "users":
        pass  # zarr's defaults; arrayio's store opens with its own (Reader.opening)
    elif args.pipeline == "fused":
        config["codec_pipeline.path"] = FUSED
    elif args.pipeline == "arrayio":
        importlib.import_module("arrayio.zarr")  # registers it
        config["codec_pipeline.path"] = ARRAYIO_PIPELINE
    if args.concurrency:
        config["async.concurrency"] = args.concurrency
    if args.batch_size:
        config["codec_pipeline.batch_size"] = args.batch_size
    base = {
        "codec": codec,
        "decoder": decoder if codec == "zstd" else None,
        "array_bytes": data["array_bytes"],
        "stored_bytes": data["stored_bytes"],
        "memory": args.memory,
        "zarr_config": dict(config),
    }
    readers: dict[str, Reader] = {}
    for name in args.stores:
        if skip_all is not None:
            rows += [{**base, "store": name, "cache": c, "skipped": skip_all} for c in args.cache]
            continue
        try:
            readers[name] = Reader(name, root, data, args)
        except ImportError as error:
            rows += [
                {**base, "store": name, "cache": c, "skipped": f"{type(error).__name__}: {error}"}
                for c in args.cache
            ]
    gpu = zarr.config.enable_gpu() if args.memory == "cuda" else _nothing()
    with gpu, zarr.config.set(config):
        for cache in args.cache:
            seconds: dict[str, list[float]] = {name: [] for name in readers}
            decoded: dict[str, str] = {}
            failed: dict[str, str] = {}
            dropped = False
            for round_ in range(args.learn + args.repeats):
                for name, reader in readers.items():
                    if name in failed:
                        continue
                    if cache == "cold":
                        dropped = evict(data["files"], args.drop_caches)
                    else:
                        read_files(data["files"], 16, direct=False)
                    try:
                        took, decoded[name] = reader()
                    except Exception as error:  # noqa: BLE001 - a failing peer is reported
                        failed[name] = f"{type(error).__name__}: {error}"
                        continue
                    if round_ >= args.learn:
                        seconds[name].append(took)
            for name in readers:
                row = {**base, "store": name, "cache": cache}
                if name in failed:
                    row["failed"] = failed[name]
                else:
                    median = statistics.median(seconds[name])
                    row.update(
                        seconds=seconds[name],
                        median_s=median,
                        GBps=data["array_bytes"] / median / 1e9,
                        stored_GBps=data["stored_bytes"] / median / 1e9,
                        decoded_by=decoded[name],
                        verified=True,
                        caches_dropped=dropped if cache == "cold" else None,
                    )
                rows.append(row)
                print(
                    json.dumps(
                        {
                            k: row.get(k)
                            for k in (
                                "codec",
                                "decoder",
                                "store",
                                "cache",
                                "GBps",
                                "skipped",
                                "failed",
                            )
                        }
                    ),
                    flush=True,
                )
    return rows


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --------------------------------------------------------------------------- report


def summarize(rows: list[dict[str, Any]], ceilings_by_codec: dict[str, Any]) -> dict[str, Any]:
    """Per case (codec, decoder, cache): arrayio against the better peer; uncompressed cold
    reads against the disk ceiling. Targets from issue 4."""
    out: dict[str, Any] = {}
    for key in sorted({(r["codec"], r["decoder"] or "-", r["cache"]) for r in rows}):
        mine = {r["store"]: r for r in rows if (r["codec"], r["decoder"] or "-", r["cache"]) == key}
        ours = mine.get("arrayio", {}).get("GBps")
        peers = {
            name: mine[name]["GBps"]
            for name in PEERS
            if name in mine and isinstance(mine[name].get("GBps"), float)
        }
        best = max(peers, key=peers.__getitem__) if peers else None
        entry: dict[str, Any] = {
            "arrayio_GBps": ours,
            "peers_GBps": peers,
            "best_peer": best,
            "ratio_to_best_peer": ours / peers[best] if ours and best else None,
        }
        codec, _, cache = key
        ceiling = ceilings_by_codec.get(codec, {})
        if cache == "cold" and isinstance(ceiling.get("cold_direct_read_GBps"), float):
            stored = mine.get("arrayio", {}).get("stored_GBps")
            entry["arrayio_stored_GBps_over_disk_ceiling"] = (
                stored / ceiling["cold_direct_read_GBps"] if stored else None
            )
        if cache == "warm":
            entry["target_2x_best_peer_met"] = (entry["ratio_to_best_peer"] or 0) >= 2
        if cache == "cold" and codec == "none":
            ratio = entry.get("arrayio_stored_GBps_over_disk_ceiling")
            entry["target_0.9x_disk_ceiling_met"] = ratio is not None and ratio >= 0.9
        out["/".join(key)] = entry
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if isinstance(r.get("GBps"), float)]
    cases = sorted({(r["codec"], r["decoder"] or "-", r["cache"]) for r in rows})
    stores = [s for s in STORES if any(r["store"] == s for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cases) + 2), 4.8))
    width = 0.8 / max(1, len(stores))
    for i, store in enumerate(stores):
        values = [
            next(
                (
                    r["GBps"]
                    for r in rows
                    if r["store"] == store and (r["codec"], r["decoder"] or "-", r["cache"]) == case
                ),
                0.0,
            )
            for case in cases
        ]
        ax.bar(
            [c + (i - (len(stores) - 1) / 2) * width for c in range(len(cases))],
            values,
            width,
            label=store,
        )
    for codec, ceiling in report["ceilings"].items():
        value = ceiling.get("cold_direct_read_GBps")
        if isinstance(value, float) and codec == "none":
            ax.axhline(value, linestyle="--", color="gray", linewidth=1)
            ax.annotate("disk ceiling (cold O_DIRECT)", (-0.4, value), fontsize=7, color="gray")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{c}\n{d if d != '-' else ''}\n{k}" for c, d, k in cases], fontsize=8)
    ax.set_ylabel("GB/s (array bytes)")
    ax.set_title(
        f"Zarr read of {report['array_bytes'] / 2**30:.2f} GiB into "
        f"{report['memory']}, {report['date'][:10]}, "
        f"{report['machine']['summary']}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("arrayio", "zarr", "numcodecs", "numpy", "kvikio", "cupy", "nvidia.nvcomp"):
        try:
            module = importlib.import_module(name)
            found[name] = getattr(module, "__version__", "unknown")
        except Exception:  # noqa: BLE001 - not installed here
            found[name] = None
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON and the PNG")
    parser.add_argument("--dir", default=None, help="where the arrays are written")
    parser.add_argument("--size", default="2G")
    parser.add_argument("--chunk", default="16M")
    parser.add_argument("--memory", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--learn", type=int, default=1, help="untimed rounds per cache state before the timed ones"
    )
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--codecs", default="none,zstd")
    parser.add_argument("--decoders", default="arrayio,zarr")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--cache", default="cold,warm")
    parser.add_argument(
        "--pipeline",
        default="batched",
        choices=("batched", "fused", "arrayio", "users"),
        help="zarr's codec pipeline: its default (batched), its fused one (zarr >= 3.4), "
        "arrayio.zarr.CodecPipeline (whole-batch reads), or 'users': arrayio's store with "
        "arrayio's pipeline and GPU codec, each peer with zarr's defaults, in one run",
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="zarr's async.concurrency (default: zarr's)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="zarr's codec_pipeline.batch_size (default: zarr's)",
    )
    args = parser.parse_args(argv)
    args.size, args.chunk = parse_size(args.size), parse_size(args.chunk)
    args.codecs = args.codecs.split(",")
    args.decoders = args.decoders.split(",")
    args.stores = args.stores.split(",")
    args.cache = args.cache.split(",")
    for name in args.stores:
        if name not in STORES:
            parser.error(f"unknown store {name!r}; expected some of {STORES}")
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "zarr_read.json")

    import zarr

    scratch = tempfile.mkdtemp(prefix="arrayio-zarr-read-", dir=args.dir)
    report: dict[str, Any] = {
        "benchmark": "zarr_read",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            ["python", "-m", "benchmarks.zarr_read", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine(),
        "versions": versions(),
        "memory": args.memory,
        "repeats": args.repeats,
        "learn_rounds": args.learn,
        "drop_caches": args.drop_caches,
        "pipeline": args.pipeline,
        "zarr_defaults": {
            "async.concurrency": zarr.config.get("async.concurrency"),
            "codec_pipeline.batch_size": zarr.config.get("codec_pipeline.batch_size"),
        },
        "scratch": scratch,
        "ceilings": {},
        "rows": [],
    }
    for codec in args.codecs:
        root = os.path.join(scratch, codec)
        data = make_data(root, args.size, args.chunk, codec)
        report.update(array_bytes=data["array_bytes"], shape=data["shape"], chunks=data["chunks"])
        report.setdefault("stored_bytes", {})[codec] = data["stored_bytes"]
        report["ceilings"][codec] = ceilings(data, args)
        print(json.dumps({codec: report["ceilings"][codec]}), flush=True)
        decoders = ["users"] if args.pipeline == "users" else args.decoders
        for decoder in decoders if codec == "zstd" else ["-"]:
            report["rows"] += run_case(args, codec, decoder, root, data)
            report["summary"] = summarize(report["rows"], report["ceilings"])
            with open(json_path, "w") as f:  # after every case: a cut-short run keeps it
                json.dump(report, f, indent=1, default=_plain)
    print(json.dumps(report.get("summary"), indent=1), flush=True)
    plot(report, os.path.join(args.out, "zarr_read.png"))
    return report


def _plain(value: Any) -> Any:
    if isinstance(value, np.integer | np.floating):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


if __name__ == "__main__":
    main()
