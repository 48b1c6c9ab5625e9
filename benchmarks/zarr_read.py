"""Reading a Zarr v3 array from local disk into GPU (or host) memory: arrayio against peers.

arrayio's store and its ``arrayio.zarr.read`` into JAX against zarr's LocalStore, KvikIO's
GDSStore, zarrs-python and tensorstore, beside the disk's ceiling, in one run.

``python -m benchmarks.zarr_read --out DIR [--size 2G] [--chunk 16M] [--memory cuda|host]
[--repeats 3] [--drop-caches] [--codecs none,zstd] [--decoders arrayio,zarr]
[--layouts chunked,sharded] [--shard 64M] [--selections whole,slab] [--stores NAMES]
[--pipeline batched|fused|arrayio|users] [--concurrency N] [--batch-size N] [--dir DIR]``

In one run, on files in ``--dir``:

* the data: an int32 random walk (zstd compresses it about 4 times) of ``--size`` bytes,
  2-D with rows of 4 KiB, written by ``zarr.storage.LocalStore`` (plain Zarr) once per
  layout in ``--layouts`` and codec in ``--codecs``: ``chunked`` in chunks of ``--chunk``
  bytes; ``sharded`` with zarr's sharding codec, shards of ``--shard`` bytes holding inner
  chunks of ``--chunk`` bytes. The codec (none, or zarr's CPU ``ZstdCodec``) compresses
  each (inner) chunk;
* ceilings on the same files: a parallel ``O_DIRECT`` read of all of them into host
  memory after evicting them from the page cache (best of 8, 16 and 32 threads: the disk),
  a parallel buffered read of them warm (the page cache), and a pinned host-to-device copy;
* the selections in ``--selections``: ``whole`` is ``array[...]``; ``slab`` is 10% of the
  rows, a contiguous block of the leading axis at a fixed offset, 45% of the way in. The
  same rows for every reader and round, so that rounds and readers compare like with like
  (a varying offset would change how many chunks each round touches); at that offset the
  slab starts and ends inside a chunk and inside a shard, as a user's slab would. GB/s are
  of the selection's bytes (10^9 per second), decompressed;
* the readers in ``--stores``, each of them once in every round, one after the other:

  - ``arrayio``, ``zarr.LocalStore``, ``kvikio.GDSStore``: zarr stores, ``array[selection]``
    into GPU memory under ``zarr.config.enable_gpu()`` (``--memory cuda``) or into NumPy
    (``--memory host``). GDSStore runs twice: with the KvikIO thread pool the process
    started with (KvikIO's default, or ``KVIKIO_NTHREADS``), and as
    ``kvikio.GDSStore(threads=16)``. The pool is process-wide and arrayio's KvikIO tool
    resizes it, so each is set again before every read (``gds_kvikio_threads``); the
    target of 1.2x GDSStore is judged against the faster of the two;
  - ``zarrs``: zarrs-python's Rust codec pipeline (``codec_pipeline.path``
    ``zarrs.ZarrsCodecPipeline``, with ``codec_pipeline.strict`` so that it cannot fall back
    to zarr's pipeline unnoticed) over a LocalStore, into host memory as zarrs requires,
    then ``cupy.asarray`` on GPU runs, timed: its users have to make that copy;
  - ``tensorstore``: the ``zarr3`` driver over the ``file`` kvstore, ``read()`` into NumPy,
    then ``cupy.asarray`` on GPU runs (timed); no chunk cache (``cache_pool`` of 0 bytes),
    so that warm means the page cache, as for every other reader;
  - ``arrayio.zarr.read(jax)``: arrayio's front door, ``arrayio.zarr.read(array,
    selection, like="jax", device="cuda")`` (``"cpu"`` on host runs), the array opened as
    ``read()`` opens a directory (NVMeStore, arrayio's pipeline);

  every reader opens the array before its clock starts (the peers' files are the same).
  Threads: zarrs's Rust pool gets ``threading.max_workers`` = the cores this process may
  run on; tensorstore gets ``data_copy_concurrency`` = those cores and
  ``file_io_concurrency`` = max(4, cores) (its defaults, written out); zarr's stores keep
  zarr's ``async.concurrency`` unless ``--concurrency`` sets it. A reader that cannot run
  here (not installed, no GPU for JAX) is listed under ``peers_unavailable`` with the
  reason, and its rows are marked skipped;
* each reader reads cold (the files evicted with ``posix_fadvise``, and all caches dropped
  with ``--drop-caches``, root only) and warm (the files read into the page cache just
  before), readers interleaved in each round; the figure is the median of ``--repeats``
  rounds, and every round's seconds are in the JSON. Before the timed rounds of each cache
  state, ``--learn`` untimed rounds let every reader settle (arrayio's dispatcher learns
  its tools on the first transfers of a context and keeps what it learned for later
  processes);
* zstd arrays are read once per decoder in ``--decoders``: ``arrayio`` selects
  ``arrayio.zarr.codecs.ZstdCodec`` for zarr's ``zstd`` name (GPU decode with nvCOMP) when
  it imports, ``zarr`` keeps zarr's CPU codec; the JSON records the class that decoded
  (zarrs and tensorstore decode with their own codecs whatever the decoder).

Every reader's every result is checked against the data (the exact sum of the selection,
and sample rows); a reader that returns wrong values stops the run with an error. Results
go to ``DIR/zarr_read.json`` (written after every case) and ``DIR/zarr_read.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import queue
import shutil
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

GDS = "kvikio.GDSStore"
# KvikIO's thread pool is process-wide, and arrayio's KvikIO tool sizes it for its own arm:
# GDSStore runs once with the pool KvikIO starts with (its default, or KVIKIO_NTHREADS: what
# its users have) and once with the pool arrayio's tool uses (what a user who tunes it has).
GDS_TUNED_THREADS = 16
GDS_TUNED = f"{GDS}(threads={GDS_TUNED_THREADS})"
GDS_STORES = (GDS, GDS_TUNED)
STORES = ("arrayio", "zarr.LocalStore", *GDS_STORES)
ARRAYIO_JAX = "arrayio.zarr.read(jax)"
READERS = (*STORES, "zarrs", "tensorstore", ARRAYIO_JAX)
PEERS = ("zarr.LocalStore", *GDS_STORES, "zarrs", "tensorstore")
# Peers whose reads and decoding run on the CPU into host memory (copied to the GPU after);
# KvikIO's GDSStore reads into GPU memory.
CPU_PEERS = ("zarr.LocalStore", "zarrs", "tensorstore")
LAYOUTS = ("chunked", "sharded")
SELECTIONS = ("whole", "slab")
ARRAYIO_ZSTD = "arrayio.zarr.codecs.ZstdCodec"
FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"
ARRAYIO_PIPELINE = "arrayio.zarr.CodecPipeline"
ZARRS_PIPELINE = "zarrs.ZarrsCodecPipeline"
_BLOCK = 4096
_ROW = 1024  # int32 elements per row: rows of 4 KiB
_SLAB_FRACTION = 10  # a slab is 1/10 of the rows...
_SLAB_AT = 0.45  # ...starting this far into the array


class WrongData(AssertionError):
    """A reader returned values other than the array's: never recorded and skipped over."""


# --------------------------------------------------------------------------- data


def make_data(
    root: str, nbytes: int, chunk_bytes: int, codec: str, shard_bytes: int | None = None
) -> dict[str, Any]:
    """Write the array with LocalStore, in shards of ``shard_bytes`` if given; return its
    shape, chunks, shards, per-row sums and sample rows (the reference for every read)."""
    import zarr

    rows = max(1, nbytes // (4 * _ROW))
    chunk_rows = max(1, chunk_bytes // (4 * _ROW))
    shard_rows = None
    if shard_bytes is not None:  # a whole number of inner chunks per shard
        shard_rows = max(1, shard_bytes // (4 * _ROW) // chunk_rows) * chunk_rows
    compressors = zarr.codecs.ZstdCodec(level=3) if codec == "zstd" else None
    z = zarr.create_array(
        zarr.storage.LocalStore(root),
        shape=(rows, _ROW),
        chunks=(chunk_rows, _ROW),
        shards=(shard_rows, _ROW) if shard_rows else None,
        dtype="int32",
        compressors=compressors,
        fill_value=0,
    )
    rng = np.random.default_rng(0)
    level = 0
    row_sums = np.empty(rows, dtype=np.int64)
    samples = {}
    sample_rows = reference_rows(rows)
    # Written in blocks of whole shards (whole chunks when not sharded): a partial shard
    # would be read back and rewritten.
    outer = shard_rows or chunk_rows
    step = max(outer, (256 << 20) // (4 * _ROW) // outer * outer)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        walk = np.cumsum(rng.integers(-2, 3, (stop - start) * _ROW, dtype=np.int32)) + level
        block = walk.astype(np.int32).reshape(stop - start, _ROW)
        level = int(walk[-1])
        z[start:stop] = block
        row_sums[start:stop] = block.sum(axis=1, dtype=np.int64)
        for row in sample_rows:
            if start <= row < stop:
                samples[row] = block[row - start].copy()
    os.sync()
    files = chunk_files(root)
    return {
        "shape": (rows, _ROW),
        "chunks": (chunk_rows, _ROW),
        "shards": (shard_rows, _ROW) if shard_rows else None,
        "row_sums": row_sums,
        "samples": samples,
        "files": files,
        "codec": codec,
        "chunk_bytes": chunk_rows * _ROW * 4,
        "chunks_per_shard": shard_rows // chunk_rows if shard_rows else None,
        "stored_bytes": sum(os.path.getsize(f) for f in files),
        "array_bytes": rows * _ROW * 4,
    }


@dataclasses.dataclass(frozen=True)
class Selection:
    """A block of rows of the array: ``whole`` (all of them) or ``slab``."""

    name: str
    start: int
    stop: int

    @property
    def index(self) -> Any:
        """The index as users write it: ``array[...]`` for the whole array."""
        return Ellipsis if self.name == "whole" else (slice(self.start, self.stop),)

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * _ROW * 4


def selection(name: str, rows: int) -> Selection:
    if name == "whole":
        return Selection(name, 0, rows)
    if name == "slab":
        length = max(1, rows // _SLAB_FRACTION)
        start = min(int(rows * _SLAB_AT), rows - length)
        return Selection(name, start, start + length)
    raise ValueError(f"unknown selection {name!r}; expected one of {SELECTIONS}")


def reference_rows(rows: int) -> list[int]:
    """The rows kept as samples: some of the array's, and the first, middle and last of
    every selection's."""
    picked = {0, rows // 3, rows // 2, rows - 1}
    for name in SELECTIONS:
        chosen = selection(name, rows)
        picked |= {chosen.start, (chosen.start + chosen.stop) // 2, chosen.stop - 1}
    return sorted(picked)


def chunk_files(root: str) -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        for name in names
        if name != "zarr.json"
    )


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


# --------------------------------------------------------------------------- cache state


class FileReads:
    """Every file read whole into host memory by ``threads`` threads (a share of the files
    each), each into a buffer of its own made once (aligned for ``O_DIRECT``, as large as
    the largest file) and reused by every read: a ceiling times the reads, not the
    allocation and first touch of a buffer per file."""

    def __init__(self, files: list[str], threads: int) -> None:
        self.files, self.threads = files, threads
        largest = max((os.path.getsize(f) for f in files), default=1)
        self._buffers: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(threads):
            buffer = aligned_empty(-(-max(largest, 1) // _BLOCK) * _BLOCK)
            buffer[::_BLOCK] = 0  # touched now, not during a timed read
            self._buffers.put(buffer)

    def read(self, direct: bool) -> int:
        """Read every file; return the bytes read."""
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

        def one(path: str, view: memoryview) -> int:
            fd = os.open(path, flags)
            try:
                done, size = 0, os.fstat(fd).st_size
                while done < size:
                    got = os.preadv(fd, [view[done:]], done)
                    if got == 0:
                        break
                    done += got
                return done
            finally:
                os.close(fd)

        # Each thread reads a share of the files in a loop, one task each: a task per file
        # costs about as much as a small file's copy from the page cache.
        def share(k: int) -> int:
            buffer = self._buffers.get()
            try:
                view = memoryview(buffer)
                return sum(one(path, view) for path in self.files[k :: self.threads])
            finally:
                self._buffers.put(buffer)

        with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
            return sum(pool.map(share, range(self.threads)))


def read_files(files: list[str], threads: int, direct: bool) -> int:
    """Read every file whole into host memory with ``threads`` threads; return bytes."""
    return FileReads(files, threads).read(direct)


def compressed_chunks(data: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    """Every stored (inner) chunk's bytes, as the codec reads them, and the bytes they decode
    to. A shard's inner chunks are found through its index (zarr's default: at the end,
    little-endian offset and length per chunk, then its crc32c)."""
    frames: list[np.ndarray] = []
    per_shard = data["chunks_per_shard"]
    for path in data["files"]:
        with open(path, "rb") as f:
            raw = np.frombuffer(f.read(), dtype=np.uint8)
        if per_shard is None:
            frames.append(raw)
            continue
        index = raw[raw.size - 16 * per_shard - 4 : raw.size - 4].view("<u8").reshape(-1, 2)
        for offset, length in index.tolist():
            if offset != 2**64 - 1:
                frames.append(raw[offset : offset + length])
    return frames, len(frames) * data["chunk_bytes"]


def host_decode_rate(frames: list[np.ndarray], decoded_bytes: int, repeats: int) -> float:
    """GB/s of decoded bytes for numcodecs' zstd (zarr's own CPU codec, which releases the
    GIL) decoding every chunk on one thread per core, into buffers made beforehand."""
    from numcodecs import Zstd  # type: ignore[import-untyped]

    codec = Zstd()
    size = decoded_bytes // max(1, len(frames))
    outputs = [np.empty(size, dtype=np.uint8) for _ in frames]
    for out in outputs:
        out[::_BLOCK] = 0
    seconds = []
    with concurrent.futures.ThreadPoolExecutor(cores()) as pool:
        for _ in range(repeats + 1):  # the first round warms the pool
            start = time.perf_counter()
            list(pool.map(codec.decode, frames, outputs))
            seconds.append(time.perf_counter() - start)
    return decoded_bytes / statistics.median(seconds[1:]) / 1e9


def nvcomp_decode_rate(
    frames: list[np.ndarray], decoded_bytes: int, repeats: int
) -> dict[str, float]:
    """nvCOMP's own batched zstd decode of every chunk at once, the chunks already in GPU
    memory (one ``Codec.decode`` of the batch, then a synchronize): the decoder's rate on
    these chunks, without arrayio (``nvcomp_decode_GBps``). Also the seconds of a batch of
    every chunk and of a sixteenth of them, in turn: nvCOMP decodes each chunk in one
    unit of the GPU's work, so a batch takes about as long as its slowest chunk, whatever
    their number; a decode cannot start before its batch is read, and a read cut into
    batches pays that time again per batch."""
    import cupy
    from nvidia import nvcomp  # type: ignore[import-not-found]

    codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW)
    whole = nvcomp.as_arrays([cupy.asarray(frame) for frame in frames])
    part = nvcomp.as_arrays([cupy.asarray(frame) for frame in frames[: max(1, len(frames) // 16)]])
    seconds: dict[str, list[float]] = {"whole": [], "sixteenth": []}
    for _ in range(repeats + 1):  # the first round lets nvCOMP set up
        for name, batch in (("whole", whole), ("sixteenth", part)):
            cupy.cuda.Device().synchronize()
            start = time.perf_counter()
            decoded = codec.decode(batch)
            cupy.cuda.Device().synchronize()
            seconds[name].append(time.perf_counter() - start)
            del decoded
    whole_seconds = statistics.median(seconds["whole"][1:])
    return {
        "nvcomp_decode_GBps": decoded_bytes / whole_seconds / 1e9,
        "nvcomp_batch_seconds": whole_seconds,
        "nvcomp_sixteenth_batch_seconds": statistics.median(seconds["sixteenth"][1:]),
    }


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

    def cold(reads: FileReads) -> float:
        return rate(lambda: evict(files, args.drop_caches), lambda: reads.read(direct=True))

    def warm(reads: FileReads) -> float:
        return rate(lambda: reads.read(direct=False), lambda: reads.read(direct=False))

    try:
        out["cold_direct_read_GBps"] = max(cold(FileReads(files, t)) for t in (8, 16, 32))
    except OSError as error:  # O_DIRECT refused (tmpfs): reported, not fatal
        out["cold_direct_read_error"] = f"{type(error).__name__}: {error}"
    out["warm_read_GBps"] = max(warm(FileReads(files, t)) for t in (16, 32))
    if data["codec"] == "zstd":
        frames, decoded_bytes = compressed_chunks(data)
        out["host_decode_GBps"] = host_decode_rate(frames, decoded_bytes, args.repeats)
        if args.memory == "cuda":
            out.update(nvcomp_decode_rate(frames, decoded_bytes, args.repeats))
        del frames
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


# --------------------------------------------------------------------------- readers


def make_store(name: str, root: str) -> Any:
    """The store, or raise ImportError with the reason it cannot run here."""
    if name == "arrayio":
        from arrayio.zarr import NVMeStore

        return NVMeStore(root, read_only=True)
    if name == "zarr.LocalStore":
        import zarr

        return zarr.storage.LocalStore(root, read_only=True)
    if name in GDS_STORES:
        import kvikio.defaults
        from kvikio.zarr import GDSStore

        # Before every open: arrayio's reads in the same process resize the shared pool.
        kvikio.defaults.set("num_threads", gds_threads(name))
        return GDSStore(root, read_only=True)
    raise ValueError(f"unknown store {name!r}; expected one of {STORES}")


_kvikio_start_threads: int | None = None


def gds_threads(name: str) -> int:
    """The KvikIO threads GDSStore reader ``name`` runs with: the tuned count, or the pool
    KvikIO had when this run first asked (before arrayio's tool resized it)."""
    if name == GDS_TUNED:
        return GDS_TUNED_THREADS
    global _kvikio_start_threads
    if _kvikio_start_threads is None:
        import kvikio.defaults

        _kvikio_start_threads = int(kvikio.defaults.get("num_threads"))
    return _kvikio_start_threads


def require(name: str, memory: str) -> None:
    """Raise, with the reason, if reader ``name`` cannot run here."""
    needs = {  # the module and what the reader takes from it
        "arrayio": ("arrayio.zarr", "NVMeStore"),
        "zarr.LocalStore": ("zarr.storage", "LocalStore"),
        GDS: ("kvikio.zarr", "GDSStore"),
        GDS_TUNED: ("kvikio.zarr", "GDSStore"),
        "zarrs": ("zarrs", "ZarrsCodecPipeline"),
        "tensorstore": ("tensorstore", "open"),
    }
    if name in needs:
        module, attribute = needs[name]
        getattr(importlib.import_module(module), attribute)
        if name in GDS_STORES:
            gds_threads(name)  # KvikIO's own pool, noted before any of arrayio's reads
    elif name == ARRAYIO_JAX:
        from arrayio.arrays import _frameworks

        importlib.import_module("arrayio.zarr")
        # JAX installed, and (on GPU runs) a JAX that can place arrays on the GPU.
        _frameworks.parse_target("jax", "cuda" if memory == "cuda" else "cpu")
    else:
        raise ValueError(f"unknown reader {name!r}; expected one of {READERS}")


def unavailable(names: list[str], memory: str) -> dict[str, str]:
    """The readers that cannot run here, with the reason: skipped, never fatal."""
    reasons = {}
    for name in names:
        try:
            require(name, memory)
        except Exception as error:  # noqa: BLE001 - any failure to import means "not here"
            reasons[name] = f"{type(error).__name__}: {error}"
    return reasons


def decoder_config(decoder: str) -> tuple[dict[str, Any], str | None]:
    """The zarr config that selects ``decoder`` for zstd, or a reason it cannot run."""
    if decoder == "zarr":
        return {"codecs.zstd": "zarr.codecs.zstd.ZstdCodec"}, None
    try:
        importlib.import_module("arrayio.zarr.codecs")
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return {}, f"{ARRAYIO_ZSTD} does not import: {type(error).__name__}: {error}"
    return {"codecs.zstd": ARRAYIO_ZSTD}, None


def codec_classes(codecs: Any) -> str:
    """The classes of a codec chain, the sharding codec's inner chain in brackets."""
    names = []
    for codec in codecs:
        name = f"{type(codec).__module__}.{type(codec).__qualname__}"
        inner = getattr(codec, "codecs", None)  # ShardingCodec's chain for its inner chunks
        if inner:
            name += f"[{codec_classes(inner)}]"
        names.append(name)
    return ", ".join(names)


def pipeline_class(array: Any) -> str:
    kind = type(array.async_array.codec_pipeline)
    return f"{kind.__module__}.{kind.__qualname__}"


def synchronize(memory: str) -> None:
    if memory == "cuda":
        import cupy

        cupy.cuda.Device().synchronize()


def to_device(host: np.ndarray, memory: str) -> Any:
    """A host result as the run's memory holds it: copied to the GPU on GPU runs, as the
    users of a reader that only fills host memory must."""
    if memory != "cuda":
        return host
    import cupy

    return cupy.asarray(host)


def release_device_memory(memory: str) -> None:
    if memory == "cuda":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


def verify(name: str, result: Any, chosen: Selection, data: dict[str, Any], memory: str) -> None:
    """Raise WrongData unless ``result`` holds the selection's values in the run's memory:
    its shape, its exact sum and every sample row inside it."""
    where = "GPU" if memory == "cuda" else "host"
    if memory == "cuda":
        import cupy

        if not isinstance(result, cupy.ndarray):
            raise WrongData(f"{name} returned {type(result).__name__}, not CuPy memory")
        total = int(cupy.sum(result, dtype=cupy.int64))
        take = cupy.asnumpy
    else:
        if not isinstance(result, np.ndarray):
            raise WrongData(f"{name} returned {type(result).__name__}, not NumPy memory")
        total = int(np.sum(result, dtype=np.int64))
        take = np.asarray
    expected_shape = (chosen.stop - chosen.start, _ROW)
    if tuple(result.shape) != expected_shape:
        raise WrongData(f"{name} read shape {tuple(result.shape)}, not {expected_shape}")
    rows = {
        r: take(result[r - chosen.start])
        for r in data["samples"]
        if chosen.start <= r < chosen.stop
    }
    expected_total = int(data["row_sums"][chosen.start : chosen.stop].sum())
    if total != expected_total or not all(
        np.array_equal(row, data["samples"][r]) for r, row in rows.items()
    ):
        raise WrongData(
            f"{name} read wrong values into {where} memory "
            f"(rows {chosen.start}:{chosen.stop}, sum {total} for {expected_total})"
        )


class Reader:
    """One reader of the array: opens it (untimed), reads a selection (timed) into the run's
    memory, and verifies what it read. Subclasses say how to open and read."""

    def __init__(
        self, name: str, root: str, data: dict[str, Any], args: argparse.Namespace
    ) -> None:
        self.name, self.root, self.data, self.args = name, root, data, args
        require(name, args.memory)  # fails here, before timing, if it cannot run

    def __call__(self, chosen: Selection) -> tuple[float, str]:
        """Seconds for the read (opening excluded), and what decoded."""
        opened = self.open()
        synchronize(self.args.memory)
        start = time.perf_counter()
        result = self.read(opened, chosen)
        synchronize(self.args.memory)
        seconds = time.perf_counter() - start
        verify(self.name, self.as_checked(result), chosen, self.data, self.args.memory)
        decoded_by = self.decoded_by(opened)
        del result
        release_device_memory(self.args.memory)
        return seconds, decoded_by

    def settings(self) -> dict[str, Any]:
        """Settings of this reader beyond the case's zarr config, recorded in its rows."""
        return {}

    def open(self) -> Any:
        raise NotImplementedError

    def read(self, opened: Any, chosen: Selection) -> Any:
        raise NotImplementedError

    def as_checked(self, result: Any) -> Any:
        """The result as NumPy (host) or CuPy (GPU) memory, for ``verify``."""
        return result

    def decoded_by(self, opened: Any) -> str:
        return codec_classes(opened.metadata.codecs)


class StoreReader(Reader):
    """A zarr store under zarr-python: ``zarr.open_array`` then ``array[selection]``, into
    GPU memory under ``enable_gpu`` (set for the whole case on GPU runs)."""

    def open(self) -> Any:
        import zarr

        with zarr.config.set(self.settings()):
            return zarr.open_array(make_store(self.name, self.root), mode="r")

    def read(self, opened: Any, chosen: Selection) -> Any:
        return opened[chosen.index]

    def settings(self) -> dict[str, Any]:
        """With ``--pipeline users``, arrayio's store takes arrayio's pipeline and GPU zstd
        codec, each peer zarr's own defaults (what their users have); otherwise the run's
        config throughout."""
        if self.args.pipeline != "users" or self.name != "arrayio":
            return {}
        importlib.import_module("arrayio.zarr")  # registers the pipeline
        config = {"codec_pipeline.path": ARRAYIO_PIPELINE}
        if self.args.memory == "cuda":
            config.update(decoder_config("arrayio")[0])
        return config


class ZarrsReader(Reader):
    """zarrs-python's pipeline over a LocalStore. zarrs decodes into host memory only, so
    its reads run with zarr's CPU buffers even on GPU runs, and are then copied."""

    def settings(self) -> dict[str, Any]:
        return {
            "codec_pipeline.path": ZARRS_PIPELINE,
            "codec_pipeline.strict": True,  # an unsupported array fails, not falls back
            "threading.max_workers": cores(),  # the size of zarrs's Rust thread pool
            "buffer": "zarr.buffer.cpu.Buffer",
            "ndbuffer": "zarr.buffer.cpu.NDBuffer",
        }

    def open(self) -> Any:
        import zarr

        with zarr.config.set(self.settings()):
            array = zarr.open_array(zarr.storage.LocalStore(self.root, read_only=True), mode="r")
        import zarrs

        if not isinstance(array.async_array.codec_pipeline, zarrs.ZarrsCodecPipeline):
            raise RuntimeError(f"zarrs's pipeline was not selected: {pipeline_class(array)}")
        return array

    def read(self, opened: Any, chosen: Selection) -> Any:
        import zarr

        with zarr.config.set(self.settings()):
            host = opened[chosen.index]
        return to_device(host, self.args.memory)

    def decoded_by(self, opened: Any) -> str:
        return f"{ZARRS_PIPELINE} (zarrs's Rust codecs)"


class TensorstoreReader(Reader):
    """tensorstore's ``zarr3`` driver over its ``file`` kvstore, read into NumPy. One
    context for the reader's life (its thread pools live as long as a user's would), with
    no chunk cache."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import tensorstore

        self.context = tensorstore.Context(self.settings()["tensorstore_context"])

    def settings(self) -> dict[str, Any]:
        return {
            "tensorstore_context": {
                "data_copy_concurrency": {"limit": cores()},
                "file_io_concurrency": {"limit": max(4, cores())},
                "cache_pool": {"total_bytes_limit": 0},
            }
        }

    def open(self) -> Any:
        import tensorstore

        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": self.root}}
        return tensorstore.open(spec, read=True, context=self.context).result()

    def read(self, opened: Any, chosen: Selection) -> Any:
        host = opened[chosen.start : chosen.stop].read().result()
        return to_device(host, self.args.memory)

    def decoded_by(self, opened: Any) -> str:
        return "tensorstore zarr3 driver (tensorstore's C++ codecs)"


class ArrayioJaxReader(Reader):
    """``arrayio.zarr.read`` into a JAX array on the run's device. The array is opened
    before the clock starts, as ``read()`` opens a directory (NVMeStore, arrayio's
    pipeline), so that opening is excluded as it is for every other reader."""

    def settings(self) -> dict[str, Any]:
        importlib.import_module("arrayio.zarr")  # registers the pipeline
        config: dict[str, Any] = {"codec_pipeline.path": ARRAYIO_PIPELINE}
        if self.args.pipeline == "users" and self.args.memory == "cuda":
            config.update(decoder_config("arrayio")[0])  # arrayio's users get its GPU codec
        return config

    def open(self) -> Any:
        import zarr

        from arrayio.zarr import NVMeStore

        with zarr.config.set(self.settings()):
            return zarr.open_array(NVMeStore(self.root, read_only=True), mode="r")

    def read(self, opened: Any, chosen: Selection) -> Any:
        import arrayio.zarr

        device = "cuda" if self.args.memory == "cuda" else "cpu"
        result = arrayio.zarr.read(opened, chosen.index, like="jax", device=device)
        return result.block_until_ready()

    def as_checked(self, result: Any) -> Any:
        import jax

        if not isinstance(result, jax.Array):
            raise WrongData(f"{self.name} returned {type(result).__name__}, not a jax.Array")
        placed = {device.platform for device in result.devices()}
        expected = "gpu" if self.args.memory == "cuda" else "cpu"
        if placed != {expected}:
            raise WrongData(f"{self.name} placed its array on {placed}, not {expected}")
        if self.args.memory == "cuda":
            import cupy

            return cupy.from_dlpack(result)  # the same memory, to sum it in int64
        return np.asarray(result)

    def decoded_by(self, opened: Any) -> str:
        return f"{ARRAYIO_PIPELINE}: {codec_classes(opened.metadata.codecs)}"


def make_reader(name: str, root: str, data: dict[str, Any], args: argparse.Namespace) -> Reader:
    kind = {"zarrs": ZarrsReader, "tensorstore": TensorstoreReader, ARRAYIO_JAX: ArrayioJaxReader}
    return kind.get(name, StoreReader)(name, root, data, args)


# --------------------------------------------------------------------------- rounds


def case_config(args: argparse.Namespace, codec: str, decoder: str) -> tuple[dict, str | None]:
    """The zarr config of a case (the decoder, the pipeline, zarr's knobs), or the reason
    no reader can run it."""
    config: dict[str, Any] = {}
    skip_all = None
    if codec == "zstd":
        config, skip_all = decoder_config("zarr" if args.pipeline == "users" else decoder)
    if args.pipeline == "users":
        pass  # zarr's defaults; arrayio's readers open with their own (Reader.settings)
    elif args.pipeline == "fused":
        config["codec_pipeline.path"] = FUSED
    elif args.pipeline == "arrayio":
        importlib.import_module("arrayio.zarr")  # registers it
        config["codec_pipeline.path"] = ARRAYIO_PIPELINE
    if args.concurrency:
        config["async.concurrency"] = args.concurrency
    if args.batch_size:
        config["codec_pipeline.batch_size"] = args.batch_size
    return config, skip_all


def prepare_cache(cache: str, data: dict[str, Any], args: argparse.Namespace) -> bool | None:
    """Put the files in the cache state; for cold, return whether all caches were dropped."""
    if cache == "cold":
        return evict(data["files"], args.drop_caches)
    read_files(data["files"], 16, direct=False)
    return None


@dataclasses.dataclass
class Rounds:
    """What the rounds of one selection and cache state measured, per reader."""

    seconds: dict[str, list[float]]
    decoded_by: dict[str, str]
    failed: dict[str, str]
    caches_dropped: bool | None


def run_rounds(
    args: argparse.Namespace,
    readers: dict[str, Reader],
    chosen: Selection,
    cache: str,
    data: dict[str, Any],
) -> Rounds:
    """``--learn`` untimed then ``--repeats`` timed rounds, every reader once per round, the
    cache state prepared before each read. A reader that fails is recorded and left out of
    the later rounds; one that reads wrong values stops the run (WrongData)."""
    done = Rounds({name: [] for name in readers}, {}, {}, None)
    for round_ in range(args.learn + args.repeats):
        for name, reader in readers.items():
            if name in done.failed:
                continue
            dropped = prepare_cache(cache, data, args)
            done.caches_dropped = dropped if cache == "cold" else None
            try:
                took, done.decoded_by[name] = reader(chosen)
            except WrongData:
                raise
            except Exception as error:  # noqa: BLE001 - a failing peer is reported
                done.failed[name] = f"{type(error).__name__}: {error}"
                continue
            if round_ >= args.learn:
                done.seconds[name].append(took)
    return done


def measured_row(base: dict[str, Any], name: str, done: Rounds, chosen: Selection) -> dict:
    """A reader's row for one selection and cache state: its rounds' seconds and rates."""
    if name in done.failed:
        return {**base, "failed": done.failed[name]}
    median = statistics.median(done.seconds[name])
    return {
        **base,
        "seconds": done.seconds[name],
        "median_s": median,
        "GBps": chosen.nbytes / median / 1e9,
        # The stored bytes of a slab are not known to the byte (partial chunks, shard indexes).
        "stored_GBps": base["stored_bytes"] / median / 1e9 if chosen.name == "whole" else None,
        "decoded_by": done.decoded_by[name],
        "verified": True,
        "caches_dropped": done.caches_dropped,
    }


def print_row(row: dict[str, Any]) -> None:
    keys = ("layout", "codec", "decoder", "selection", "store", "cache", "GBps")
    print(json.dumps({k: row.get(k) for k in (*keys, "skipped", "failed")}), flush=True)


def run_case(
    args: argparse.Namespace,
    layout: str,
    codec: str,
    decoder: str,
    root: str,
    data: dict[str, Any],
) -> list[dict[str, Any]]:
    """Every reader, every selection, cold and warm, interleaved in ``--repeats`` rounds."""
    import zarr

    config, skip_all = case_config(args, codec, decoder)
    base = {
        "layout": layout,
        "codec": codec,
        "decoder": decoder if codec == "zstd" else None,
        "chunk_bytes": data["chunks"][0] * _ROW * 4,
        "shard_bytes": data["shards"][0] * _ROW * 4 if data["shards"] else None,
        "array_bytes": data["array_bytes"],
        "stored_bytes": data["stored_bytes"],
        "memory": args.memory,
        "zarr_config": dict(config),
    }
    rows: list[dict[str, Any]] = []
    readers: dict[str, Reader] = {}
    skipped: dict[str, str] = {}
    for name in args.stores:
        if skip_all is not None:
            skipped[name] = skip_all
            continue
        try:
            readers[name] = make_reader(name, root, data, args)
        except Exception as error:  # noqa: BLE001 - cannot run here: reported, not fatal
            skipped[name] = f"{type(error).__name__}: {error}"
    gpu = zarr.config.enable_gpu() if args.memory == "cuda" else _nothing()
    with gpu, zarr.config.set(config):
        for chosen in (selection(name, data["shape"][0]) for name in args.selections):
            where = {
                "selection": chosen.name,
                "rows": [chosen.start, chosen.stop],
                "selection_bytes": chosen.nbytes,
            }
            for cache in args.cache:
                for name, reason in skipped.items():
                    rows.append({**base, **where, "store": name, "cache": cache, "skipped": reason})
                    print_row(rows[-1])
                done = run_rounds(args, readers, chosen, cache, data)
                for name, reader in readers.items():
                    row_base = {
                        **base,
                        **where,
                        "store": name,
                        "cache": cache,
                        "reader_settings": reader.settings(),
                    }
                    rows.append(measured_row(row_base, name, done, chosen))
                    print_row(rows[-1])
    return rows


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --------------------------------------------------------------------------- report


def case_of(row: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """A row's case: layout, codec, decoder ("-" uncompressed), selection, cache."""
    return (row["layout"], row["codec"], row["decoder"] or "-", row["selection"], row["cache"])


def fastest(rates: dict[str, float]) -> str | None:
    return max(rates, key=rates.__getitem__) if rates else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def summarize(
    rows: list[dict[str, Any]],
    ceilings_by_data: dict[str, Any],
    stored_bytes: dict[str, int] | None = None,
    array_bytes: int | None = None,
) -> dict[str, Any]:
    """Per case (layout/codec/decoder/selection/cache): arrayio's store and its JAX front
    door against every peer, the best peer and the best CPU peer, and, for whole reads, the
    issue's targets against the ceilings of the same data set (a zstd array's ceilings of
    stored bytes scaled by its compression ratio)."""
    out: dict[str, Any] = {}
    for key in sorted({case_of(r) for r in rows}):
        mine = {r["store"]: r for r in rows if case_of(r) == key}
        rate = {n: r["GBps"] for n, r in mine.items() if isinstance(r.get("GBps"), float)}
        ours, front_door = rate.get("arrayio"), rate.get(ARRAYIO_JAX)
        peers = {name: rate[name] for name in PEERS if name in rate}
        cpu_peers = {name: peers[name] for name in CPU_PEERS if name in peers}
        best, best_cpu = fastest(peers), fastest(cpu_peers)
        entry: dict[str, Any] = {
            "arrayio_GBps": ours,
            "arrayio_read_jax_GBps": front_door,
            "peers_GBps": peers,
            "best_peer": best,
            "ratio_to_best_peer": ratio(ours, peers.get(best)),
            "best_cpu_peer": best_cpu,
            "ratio_to_best_cpu_peer": ratio(ours, cpu_peers.get(best_cpu)),
            "arrayio_read_jax_ratio_to_best_cpu_peer": ratio(front_door, cpu_peers.get(best_cpu)),
        }
        layout, codec, _, chosen, cache = key
        name = f"{layout}/{codec}"
        ceiling = ceilings_by_data.get(name, {})
        stored = (stored_bytes or {}).get(name)
        compression = array_bytes / stored if array_bytes and stored else None
        if chosen == "whole" and ours is not None:
            entry["targets"] = targets(
                codec, cache, ours, front_door, peers, cpu_peers, ceiling, compression
            )
            if cache == "cold" and isinstance(ceiling.get("cold_direct_read_GBps"), float):
                stored_rate = mine.get("arrayio", {}).get("stored_GBps")
                entry["arrayio_stored_GBps_over_disk_ceiling"] = ratio(
                    stored_rate, ceiling["cold_direct_read_GBps"]
                )
        out["/".join(key)] = entry
    return out


def targets(
    codec: str,
    cache: str,
    ours: float,
    front_door: float | None,
    peers: dict[str, float],
    cpu_peers: dict[str, float],
    ceiling: dict[str, Any],
    compression: float | None,
) -> dict[str, Any]:
    """The issue's targets for a whole read: each ``{"bound": GB/s, "ratio": ours / bound,
    "line": the ratio to reach, "met": bool}``, where the run sampled what it needs."""
    out: dict[str, Any] = {}

    def judge(name: str, bound: float | None, line: float) -> None:
        if isinstance(bound, float) and bound > 0:
            out[name] = {
                "bound": bound,
                "ratio": ours / bound,
                "line": line,
                "met": ours / bound >= line,
            }

    scale = compression if codec == "zstd" else 1.0
    disk, cache_rate = ceiling.get("cold_direct_read_GBps"), ceiling.get("warm_read_GBps")
    if cache == "cold" and isinstance(disk, float) and scale:
        judge("disk_ceiling" if codec == "none" else "disk_ceiling_times_ratio", disk * scale, 0.9)
    if cache == "warm" and codec == "none":
        judge("page_cache_ceiling", cache_rate, 0.9)
        gds = {name: peers[name] for name in GDS_STORES if name in peers}
        if gds:  # the faster of KvikIO's default pool and the tuned one
            faster = max(gds, key=gds.__getitem__)
            judge(GDS, gds[faster], 1.2)
            out[GDS]["which"] = faster
    if cache == "warm" and codec == "zstd" and scale:
        rates = {
            "page_cache_times_ratio": cache_rate * scale if isinstance(cache_rate, float) else None,
            "host_to_device_times_ratio": (
                ceiling["pinned_host_to_device_GBps"] * scale
                if isinstance(ceiling.get("pinned_host_to_device_GBps"), float)
                else None
            ),
            "nvcomp_decode": ceiling.get("nvcomp_decode_GBps"),
        }
        sampled = {k: v for k, v in rates.items() if isinstance(v, float)}
        if sampled:
            lowest = min(sampled, key=sampled.__getitem__)
            judge("lowest_of_three", sampled[lowest], 0.8)
            out["lowest_of_three"]["which"] = lowest
            out["lowest_of_three"]["sampled"] = sampled
        if len(sampled) == 3:
            # The target proposed in its place: nvCOMP's batch takes about as long as its
            # slowest chunk (nvcomp_sixteenth_batch_seconds beside nvcomp_batch_seconds), so
            # the decode cannot overlap the read of its own batch: the three in turn.
            judge("read_then_decode", 1 / sum(1 / rate for rate in sampled.values()), 0.8)
        best_cpu = fastest(cpu_peers)
        if best_cpu is not None:
            judge("best_cpu_peer", cpu_peers[best_cpu], 2.0)
            out["best_cpu_peer"]["which"] = best_cpu
    decode = ceiling.get("nvcomp_decode_GBps")
    if cache == "cold" and codec == "zstd" and isinstance(disk, float) and scale:
        if isinstance(decode, float):  # proposed likewise: the disk's read, then the decode
            judge("disk_then_decode", 1 / (1 / (disk * scale) + 1 / decode), 0.9)
    if front_door is not None:
        out["read_jax_at_the_store_rate"] = {
            "bound": ours,
            "ratio": front_door / ours,
            "line": 1.0,
            "met": front_door >= ours,
        }
    return out


def plot(report: dict[str, Any], path: str) -> None:
    """One panel per layout and selection; in each, a group of bars (one per reader) per
    codec, decoder and cache state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if isinstance(r.get("GBps"), float)]
    panels = sorted(
        {(r["layout"], r["selection"]) for r in rows},
        key=lambda panel: (LAYOUTS.index(panel[0]), SELECTIONS.index(panel[1])),
    ) or [("chunked", "whole")]
    readers = [s for s in READERS if any(r["store"] == s for r in rows)]
    cases = sorted({(r["codec"], r["decoder"] or "-", r["cache"]) for r in rows})
    width = 0.8 / max(1, len(readers))
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(max(6.0, 1.2 * len(readers) * max(1, len(cases)) / 3 + 3), 3.6 * len(panels)),
        squeeze=False,
    )
    for ax, (layout, chosen) in zip(axes[:, 0], panels, strict=True):
        for i, reader in enumerate(readers):
            values = [
                next(
                    (
                        r["GBps"]
                        for r in rows
                        if r["store"] == reader
                        and case_of(r) == (layout, case[0], case[1], chosen, case[2])
                    ),
                    0.0,
                )
                for case in cases
            ]
            offsets = [c + (i - (len(readers) - 1) / 2) * width for c in range(len(cases))]
            ax.bar(offsets, values, width, label=reader)
        ceiling = report["ceilings"].get(f"{layout}/none", {}).get("cold_direct_read_GBps")
        if isinstance(ceiling, float) and chosen == "whole":
            ax.axhline(ceiling, linestyle="--", color="gray", linewidth=1)
            ax.annotate("disk ceiling (cold O_DIRECT)", (-0.4, ceiling), fontsize=7, color="gray")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{c}\n{d if d != '-' else ''}\n{k}" for c, d, k in cases], fontsize=8)
        ax.set_ylabel("GB/s (selection bytes)")
        ax.set_title(f"{layout_label(report, layout)}, {chosen}", fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"Zarr read of {report['array_bytes'] / 2**30:.2f} GiB into {report['memory']}, "
        f"{report['date'][:10]}, {report['machine']['summary']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def layout_label(report: dict[str, Any], layout: str) -> str:
    """``chunked, 1 MiB chunks`` or ``sharded, 64 MiB shards of 1 MiB chunks``."""
    shape = report["layouts"][layout]
    chunk = f"{shape['chunk_bytes'] / 2**20:g} MiB chunks"
    if shape.get("shard_bytes"):
        return f"{layout}, {shape['shard_bytes'] / 2**20:g} MiB shards of {chunk}"
    return f"{layout}, {chunk}"


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in (
        "arrayio",
        "zarr",
        "numcodecs",
        "numpy",
        "kvikio",
        "cupy",
        "nvidia.nvcomp",
        "zarrs",
        "tensorstore",
        "jax",
    ):
        found[name] = version_of(name)
    return found


def version_of(name: str) -> str | None:
    """The module's ``__version__``, else its distribution's (tensorstore has no
    ``__version__``); None when it does not import."""
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not installed here
        return None
    found = getattr(module, "__version__", None)
    if found is None:
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found = "unknown"
    return str(found)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON and the PNG")
    parser.add_argument("--dir", default=None, help="where the arrays are written")
    parser.add_argument("--size", default="2G")
    parser.add_argument("--chunk", default="16M", help="chunk (inner chunk when sharded) bytes")
    parser.add_argument("--memory", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--learn", type=int, default=1, help="untimed rounds per cache state before the timed ones"
    )
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--codecs", default="none,zstd")
    parser.add_argument("--decoders", default="arrayio,zarr")
    parser.add_argument(
        "--layouts",
        default="chunked",
        help="chunked (one file per chunk) and/or sharded (zarr's sharding codec: shards of "
        "--shard bytes holding chunks of --chunk bytes)",
    )
    parser.add_argument("--shard", default="64M", help="shard bytes of the sharded layout")
    parser.add_argument(
        "--selections",
        default="whole",
        help="whole (array[...]) and/or slab (10%% of the rows, a contiguous block of the "
        "leading axis starting 45%% of the way in)",
    )
    parser.add_argument(
        "--stores",
        default=",".join(READERS),
        help=f"the readers, some of {', '.join(READERS)} (default: all; those that cannot "
        "run here are reported under peers_unavailable)",
    )
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
    args.size, args.chunk, args.shard = (parse_size(v) for v in (args.size, args.chunk, args.shard))
    for listed, allowed in (
        ("codecs", ("none", "zstd")),
        ("decoders", ("arrayio", "zarr")),
        ("layouts", LAYOUTS),
        ("selections", SELECTIONS),
        ("stores", READERS),
        ("cache", ("cold", "warm")),
    ):
        values = getattr(args, listed).split(",")
        for value in values:
            if value not in allowed:
                parser.error(f"--{listed}: unknown {value!r}; expected some of {allowed}")
        setattr(args, listed, values)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # JAX would otherwise take 75% of the GPU's memory at its first array, leaving CuPy (zarr's
    # GPU buffers, every other reader) too little. Set before anything imports JAX.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
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
        "cores": cores(),
        "peers_unavailable": unavailable(args.stores, args.memory),
        "gds_kvikio_threads": {},
        "scratch": scratch,
        "layouts": {},
        "ceilings": {},
        "rows": [],
    }
    report["gds_kvikio_threads"] = {
        name: gds_threads(name)
        for name in GDS_STORES
        if name in args.stores and name not in report["peers_unavailable"]
    }
    print(json.dumps({"peers_unavailable": report["peers_unavailable"]}), flush=True)
    try:
        for layout in args.layouts:
            for codec in args.codecs:
                run_data_set(args, report, scratch, layout, codec, json_path)
                # one data set on the disk at a time
                shutil.rmtree(os.path.join(scratch, f"{layout}-{codec}"), ignore_errors=True)
    finally:  # the data sets are gigabytes: none is left in --dir
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(report.get("summary"), indent=1), flush=True)
    plot(report, os.path.join(args.out, "zarr_read.png"))
    return report


def run_data_set(
    args: argparse.Namespace,
    report: dict[str, Any],
    scratch: str,
    layout: str,
    codec: str,
    json_path: str,
) -> None:
    """Write one layout and codec's array, sample its ceilings, run its cases; the JSON is
    rewritten after every case, so that a run cut short keeps what it measured."""
    name = f"{layout}/{codec}"
    root = os.path.join(scratch, f"{layout}-{codec}")
    data = make_data(
        root, args.size, args.chunk, codec, args.shard if layout == "sharded" else None
    )
    rows = data["shape"][0]
    report.update(array_bytes=data["array_bytes"], shape=data["shape"], chunks=data["chunks"])
    report["selections"] = {
        s: [selection(s, rows).start, selection(s, rows).stop] for s in args.selections
    }
    report["layouts"][layout] = {
        "chunks": data["chunks"],
        "chunk_bytes": data["chunks"][0] * _ROW * 4,
        "shards": data["shards"],
        "shard_bytes": data["shards"][0] * _ROW * 4 if data["shards"] else None,
    }
    report.setdefault("stored_bytes", {})[name] = data["stored_bytes"]
    report["ceilings"][name] = ceilings(data, args)
    print(json.dumps({name: report["ceilings"][name]}), flush=True)
    decoders = ["users"] if args.pipeline == "users" else args.decoders
    for decoder in decoders if codec == "zstd" else ["-"]:
        report["rows"] += run_case(args, layout, codec, decoder, root, data)
        # Where arrayio's pipeline decoded zstd chunks bound for the GPU, and why.
        from arrayio.zarr import _decode_placement

        report["decode_placement"] = _decode_placement.report()
        # Which tools the dispatcher chose for the stores' and the pipeline's batches, and
        # what it measured of each: where a store's rate comes from.
        import arrayio

        report["dispatcher"] = str(arrayio.explain())
        report["summary"] = summarize(
            report["rows"], report["ceilings"], report["stored_bytes"], report["array_bytes"]
        )
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, default=_plain)


def _plain(value: Any) -> Any:
    if isinstance(value, np.integer | np.floating):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


if __name__ == "__main__":
    main()
