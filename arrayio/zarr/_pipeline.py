"""A codec pipeline for zarr-python 3 that reads a whole selection as one batch.

zarr's own pipeline (``BatchedCodecPipeline``) handles a read chunk by chunk: a coroutine, a
store ``get``, a pass through the codec chain and a copy each, about as costly per chunk as
reading a megabyte, and it hands its codecs ``codec_pipeline.batch_size`` chunks at a time
(one by default), so a GPU codec decodes one chunk per call. This pipeline takes the whole
batch zarr gives a read (every chunk the selection touches) at once:

1. every chunk's file is found up front (``LocalStore`` and :class:`~arrayio.zarr.NVMeStore`:
   a key is a file below the root) and read into one host buffer by arrayio's dispatcher
   as one batch of many files (one tool, every read in flight, one decision): a dispatcher
   call per chunk file costs about as much as its read from the page cache;
2. ``crc32c`` codecs are verified there, on the host, as the bytes are in hand;
3. zstd chunks are decoded in one call: bound for the GPU, by nvCOMP in one batch (the GPU
   worker of :mod:`~arrayio.zarr.codecs`) and by numcodecs on the host's cores at once, as
   :mod:`~arrayio.zarr._decode_placement` shares them; bound for the host, by numcodecs on
   the I/O pool;
4. each chunk's part of the selection is copied into the output (missing chunks get the fill
   value).

Chains that decode on the host run these steps in groups of the batch's chunks
(:func:`_groups`), each group decoded while the next is read; zstd chunks bound for a GPU
go in batches of up to :data:`GPU_BATCH_BYTES`, nvCOMP's rate growing with its batches.

A sharded array's inner chunks are the batch: each shard's index is read once (its crc32c
checked), and every inner chunk the selection touches becomes a byte range of its shard's
file, read with the others as one batch. Selections other than plain slices of a sharded
array go to zarr's pipeline.

Chains it does not handle (other codecs, transposes, big-endian bytes, sharding within
sharding), chunks in Fortran order and stores whose keys are not files go to zarr's own
pipeline, which this one wraps: :meth:`CodecPipeline.explain` says which path an array
takes, and why. Writes are zarr's pipeline's; into an :class:`~arrayio.zarr.NVMeStore` it
encodes the chunks in groups, each in one codec call, and each group is committed together
(every file staged and fsynced at once, then each renamed into place) rather than one
durable write per chunk.

Select it with ``zarr.config.set({"codec_pipeline.path": "arrayio.zarr.CodecPipeline"})``
(importing :mod:`arrayio.zarr` registers it; so does its ``zarr.codec_pipeline`` entry point).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from zarr.abc.codec import CodecPipeline as _ZarrCodecPipeline
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec
from zarr.codecs import ZstdCodec as _ZarrZstdCodec
from zarr.core.codec_pipeline import BatchedCodecPipeline

from ..arrays._buffers import CupyDeviceBuffer
from ..dispatch.candidates import usable_cores
from ..errors import ChecksumError, FormatError
from ..integrity._checksum import checksum
from ..tools._pinned import pool as pinned_pool
from . import _group_writes
from ._frames import decode_on_host
from ._gpu_decode import decode_for_gpu, to_device
from ._io_pool import executor
from ._kernels import DeviceSpan

__all__ = ["CodecPipeline"]

try:  # zarr >= 3.4: read() says, per chunk, whether it was there
    from zarr.abc.codec import GetResult as _GetResult  # type: ignore[attr-defined]
except ImportError:
    _GetResult = None


@dataclasses.dataclass(frozen=True)
class _Shards:
    """How the sharding codec lays a shard out: its inner chunks' shape, and where its index
    (an offset and a length per inner chunk, little-endian 64-bit) is kept."""

    inner_shape: tuple[int, ...]
    index_at_end: bool
    index_crc32c: bool


@dataclasses.dataclass(frozen=True)
class _Chain:
    """A codec chain this pipeline decodes itself: bytes (native order), then optionally
    zstd, gzip or blosc, then optionally crc32c; or the sharding codec with such a chain
    inside (``shards``)."""

    zstd: Any  # numcodecs' Zstd for the chain's zstd codec, or None
    crc32c: bool
    # numcodecs' GZip or Blosc for the chain's compressor, decoded on the host (and the
    # chunks then copied to the GPU with one copy), or None
    host_codec: Any = None
    shards: _Shards | None = None

    @classmethod
    def of(cls, pipeline: BatchedCodecPipeline) -> tuple[_Chain | None, str]:
        """The chain of ``pipeline``, or None and why it is not handled here."""
        if pipeline.array_array_codecs:
            names = ", ".join(type(c).__name__ for c in pipeline.array_array_codecs)
            return None, f"array-to-array codecs ({names})"
        array_bytes = pipeline.array_bytes_codec
        if isinstance(array_bytes, ShardingCodec):
            return cls._sharded(array_bytes, pipeline)
        if type(array_bytes) is not BytesCodec:
            return None, f"its array-to-bytes codec is {type(array_bytes).__name__}"
        endian = getattr(array_bytes.endian, "value", array_bytes.endian)
        if endian not in (None, "little") or np.little_endian is False:
            return None, f"{endian}-endian bytes"
        rest = list(pipeline.bytes_bytes_codecs)
        crc = bool(rest) and isinstance(rest[-1], Crc32cCodec)
        if crc:
            rest.pop()
        zstd = host = None
        compressor = ""
        first = rest[0] if rest else None
        if isinstance(first, _ZarrZstdCodec):
            zstd, compressor = first._zstd_codec, ", zstd"
            rest.pop(0)
        elif isinstance(first, (GzipCodec, BloscCodec)):
            host = _numcodecs_of(first)
            if host is None:
                return None, f"its {type(first).__name__} has no numcodecs codec here"
            compressor = ", gzip" if isinstance(first, GzipCodec) else ", blosc"
            rest.pop(0)
        if rest:
            names = ", ".join(type(c).__name__ for c in rest)
            return None, f"bytes-to-bytes codecs ({names})"
        return cls(zstd, crc, host), "bytes" + compressor + (", crc32c" if crc else "")

    @classmethod
    def _sharded(
        cls, sharding: ShardingCodec, pipeline: BatchedCodecPipeline
    ) -> tuple[_Chain | None, str]:
        if pipeline.bytes_bytes_codecs:
            return None, "bytes-to-bytes codecs around the shards"
        index = list(sharding.index_codecs)
        index_crc = bool(index) and isinstance(index[-1], Crc32cCodec)
        if index_crc:
            index.pop()
        endian = getattr(getattr(index[0], "endian", None), "value", None) if index else None
        if len(index) != 1 or type(index[0]) is not BytesCodec or endian not in (None, "little"):
            return None, "a shard index codec other than bytes (and crc32c)"
        inner, why = cls.of(BatchedCodecPipeline.from_codecs(sharding.codecs))
        if inner is None or inner.shards is not None:
            return None, f"inner chunks: {why if inner is None else 'sharded again'}"
        location = getattr(sharding.index_location, "value", sharding.index_location)
        layout = _Shards(tuple(sharding.chunk_shape), location == "end", index_crc)
        return dataclasses.replace(inner, shards=layout), f"shards of inner chunks ({why})"


class CodecPipeline(_ZarrCodecPipeline):
    """zarr's codec pipeline, with whole-batch reads; see the module docstring.

    Parameters
    ----------
    fallback
        zarr's pipeline for the same codecs: what this one does not handle goes to it.
    """

    def __init__(self, fallback: BatchedCodecPipeline) -> None:
        self.fallback = fallback
        self.chain, self.why = _Chain.of(fallback)

    def __repr__(self) -> str:
        return f"arrayio.zarr.CodecPipeline({self.why})"

    def explain(self) -> str:
        """Which path this pipeline's reads take, and why."""
        if self.chain is None:
            return (
                f"zarr's pipeline: not handled here: {self.why} (writes into an NVMeStore "
                "still committed in groups)"
            )
        from ._decode_placement import report

        learned = report()
        return (
            f"whole-batch reads ({self.why}) for chunks that are files (LocalStore, "
            "NVMeStore); zarr's pipeline for other stores; writes into an NVMeStore encoded "
            "and committed in groups"
            + "".join(f"\nzstd into GPU memory, {line}" for line in learned)
        )

    # -------------------------------------------------------------- what zarr asks of it

    @classmethod
    def from_codecs(cls, codecs: Iterable[Any]) -> CodecPipeline:
        return cls(BatchedCodecPipeline.from_codecs(codecs))

    def evolve_from_array_spec(self, array_spec: Any) -> CodecPipeline:
        return type(self)(self.fallback.evolve_from_array_spec(array_spec))

    @property
    def supports_partial_decode(self) -> bool:
        return bool(self.fallback.supports_partial_decode)

    @property
    def supports_partial_encode(self) -> bool:
        return bool(self.fallback.supports_partial_encode)

    def validate(self, **kwargs: Any) -> None:
        self.fallback.validate(**kwargs)

    def compute_encoded_size(self, byte_length: int, array_spec: Any) -> int:
        return int(self.fallback.compute_encoded_size(byte_length, array_spec))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fallback)

    async def decode(self, chunk_bytes_and_specs: Iterable[Any]) -> Iterable[Any]:
        return await self.fallback.decode(chunk_bytes_and_specs)

    async def encode(self, chunk_arrays_and_specs: Iterable[Any]) -> Iterable[Any]:
        return await self.fallback.encode(chunk_arrays_and_specs)

    async def write(
        self, batch_info: Iterable[Any], value: Any, drop_axes: tuple[int, ...] = ()
    ) -> None:
        """Into an :class:`~arrayio.zarr.NVMeStore`, zarr's pipeline encodes the chunks
        in groups of up to :func:`~arrayio.zarr._group_writes.group_keys`, each in one codec
        call (a GPU codec gets the group at once), and each group is committed together
        (:meth:`~arrayio.zarr.NVMeStore.set_many_sync`) rather than one durable write per
        chunk. Other stores get zarr's own writes."""
        batch = list(batch_info)
        store = _group_store(batch)
        if store is None:
            await self.fallback.write(batch, value, drop_axes)
            return
        size = _group_writes.group_keys()
        for start in range(0, len(batch), size):
            group = batch[start : start + size]
            held: dict[str, Any] = {}
            encoder = dataclasses.replace(self.fallback, batch_size=len(group))
            await encoder.write(
                [(_HeldSetter(path, held), *rest) for path, *rest in group], value, drop_axes
            )
            if held:
                await asyncio.to_thread(store.set_many_sync, held)

    async def _zarrs_read(self, batch: list[Any], out: Any, drop_axes: tuple[int, ...]) -> Any:
        """zarr's pipeline, with the whole batch in one codec call."""
        whole = dataclasses.replace(self.fallback, batch_size=max(1, len(batch)))
        return await whole.read(batch, out, drop_axes)

    async def read(
        self, batch_info: Iterable[Any], out: Any, drop_axes: tuple[int, ...] = ()
    ) -> Any:
        batch = list(batch_info)
        # Memory order other than C: zarr's versions lay such chunks out differently.
        ours = self.chain is not None and batch and all(_order(s) == "C" for _, s, *_ in batch)
        files = _files_of(batch) if ours else None
        if files is None:  # not ours to read
            return await self._zarrs_read(batch, out, drop_axes)
        assert self.chain is not None
        if self.chain.shards is not None:
            expanded = await asyncio.to_thread(
                _inner_chunks, self.chain.shards, batch, files, drop_axes
            )
            if expanded is None:  # a selection the inner chunks cannot be mapped for
                return await self._zarrs_read(batch, out, drop_axes)
            inner, ranges, present = expanded
            await asyncio.to_thread(_read, self.chain, inner, ranges, out, drop_axes)
        else:
            present = await asyncio.to_thread(_read, self.chain, batch, files, out, drop_axes)
        if _GetResult is None:
            return None
        return tuple({"status": "present" if p else "missing"} for p in present)


# ------------------------------------------------------------------ the grouped write


def _group_store(batch: Sequence[Any]) -> Any:
    """The one writable :class:`~arrayio.zarr.NVMeStore` every chunk of ``batch`` is a key
    of, or None."""
    from zarr.storage import StorePath

    from ._store import NVMeStore

    paths = [path for path, *_ in batch]
    if not paths or any(type(path) is not StorePath for path in paths):
        return None
    store = paths[0].store
    if any(path.store is not store for path in paths[1:]):
        return None
    return store if isinstance(store, NVMeStore) and not store.read_only else None


class _HeldSetter:
    """A chunk's ``StorePath`` for zarr's write: reads go to the store, ``set`` and
    ``delete`` are held in ``values`` (None: deleted) for the group's commit."""

    def __init__(self, path: Any, values: dict[str, Any]) -> None:
        self._path, self._values = path, values

    def __getattr__(self, name: str) -> Any:
        return getattr(self._path, name)

    def __str__(self) -> str:
        return str(self._path)

    async def set(self, value: Any) -> None:
        self.set_sync(value)

    async def delete(self) -> None:
        self.delete_sync()

    def set_sync(self, value: Any) -> None:
        self._values[self._path.path] = value

    def delete_sync(self) -> None:
        self._values[self._path.path] = None


# ------------------------------------------------------------------ the whole-batch read


def _files_of(batch: Sequence[Any]) -> list[str] | None:
    """The file of every chunk of ``batch``, or None unless every chunk's store keeps its
    keys as files below a root."""
    from zarr.storage import LocalStore

    from ._store import NVMeStore

    files = []
    for byte_getter, *_ in batch:
        store, key = getattr(byte_getter, "store", None), getattr(byte_getter, "path", None)
        if key is None or not isinstance(store, LocalStore | NVMeStore):
            return None
        if isinstance(store, NVMeStore):
            files.append(store._path(key))  # checked: a key cannot leave the root
        else:
            files.append(os.path.join(str(store.root), key))
    return files


# A batch whose chunks are decoded is read and decoded in groups, each group's decode
# running while the next group is read: the disk (or the page cache) and the decoders work
# at once instead of one after the other. At most two groups are in hand at a time. A group
# has at least two chunks per core, so that decoding it on the host keeps every core busy.
DECODE_GROUPS = 8


# zstd chunks bound for a GPU go to nvCOMP in batches as large as this (of decoded bytes):
# its rate grows with the batch, and a read's compressed bytes are staged in pinned memory,
# so a read of many gigabytes is cut into batches of this size, each read while the one
# before decodes (two in hand at most, as for the host's groups).
GPU_BATCH_BYTES = 2 << 30


def _byte_groups(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive runs of ``sizes`` of at most ``limit`` bytes each (a size above it alone)."""
    groups: list[range] = []
    start, total = 0, 0
    for index, nbytes in enumerate(sizes):
        if index > start and total + nbytes > limit:
            groups.append(range(start, index))
            start, total = index, 0
        total += nbytes
    if start < len(sizes):
        groups.append(range(start, len(sizes)))
    return groups


def _groups(count: int, cores: int) -> list[range]:
    """The batch's ``count`` chunks cut into about :data:`DECODE_GROUPS` runs, each of at
    least two chunks per core."""
    size = max(1, 2 * cores, -(-count // DECODE_GROUPS))
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def _read(
    chain: _Chain, batch: list[Any], files: list[str], out: Any, drop_axes: tuple[int, ...]
) -> list[bool]:
    """Fill ``out`` from the chunks of ``batch`` (in ``files``); whether each was present."""
    target = out.as_ndarray_like()
    on_gpu = type(target).__module__.split(".")[0] == "cupy"
    stored_as_is = chain.zstd is None and chain.host_codec is None and not chain.crc32c
    if stored_as_is:  # each chunk's file read into its place in the output
        return _read_as_stored(chain, batch, files, target, drop_axes, on_gpu)
    # zstd chunks decoded straight into their place in the output (by nvCOMP on the GPU)
    destinations = (
        _whole_chunk_outputs(batch, target, drop_axes, on_gpu) if chain.zstd is not None else None
    )

    def read_group(span: range) -> tuple[contextlib.ExitStack, Any]:
        loans = contextlib.ExitStack()
        try:
            staging = _staging(loans, on_gpu)
            return loans, _read_files([files[i] for i in span], [None] * len(span), staging)
        except BaseException:
            loans.close()
            raise

    def decode_group(span: range, loans: contextlib.ExitStack, read: Any) -> list[bool]:
        slab, encoded, in_place = read
        with loans, _on_device_of(target, on_gpu):
            return _decode_and_place(
                chain,
                [batch[i] for i in span],
                [files[i] for i in span],
                target,
                drop_axes,
                on_gpu,
                slab,
                encoded,
                in_place,
                None if destinations is None else [destinations[i] for i in span],
            )

    # zstd chunks bound for a GPU stay in batches as large as GPU_BATCH_BYTES allows: nvCOMP
    # decodes a batch in one launch, so its rate grows with the batch's chunks, and the
    # decode placement learns per batch size.
    if on_gpu and chain.zstd is not None:
        sizes = _decoded_sizes(batch)
        spans = _byte_groups(sizes, GPU_BATCH_BYTES)
    else:
        spans = _groups(len(batch), usable_cores())
    if len(spans) == 1:
        return decode_group(spans[0], *read_group(spans[0]))
    decoded: list[concurrent.futures.Future[list[bool]]] = []
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arrayio-zarr-decode") as pool:
        for span in spans:
            loans, read = read_group(span)
            try:
                decoded.append(pool.submit(decode_group, span, loans, read))
            except BaseException:
                loans.close()
                raise
            if len(decoded) >= 2:
                decoded[-2].result()  # before a third group is read: two in hand at most
        return [flag for future in decoded for flag in future.result()]


def _read_as_stored(
    chain: _Chain,
    batch: list[Any],
    files: list[Any],
    target: Any,
    drop_axes: tuple[int, ...],
    on_gpu: bool,
) -> list[bool]:
    """:func:`_read` of chunks stored as they are: each chunk's bytes read into its place in
    the output where it has one (runs of a shard's inner chunks as one request each, see
    :func:`_runs`), the others into one buffer and copied into place."""
    flat, ranges = _whole_chunk_ranges(batch, target, drop_axes)
    runs = _runs(files, ranges)
    run_files: list[Any] = []
    run_places: list[Any] = []
    for run in runs:
        first, where = files[run[0]], ranges[run[0]]
        if len(run) == 1:
            run_files.append(first)
        else:
            run_files.append((first[0], first[1], sum(files[i][2] for i in run)))
        if where is None:
            run_places.append(None)
        else:
            nbytes = sum(part[1] for part in (ranges[i] for i in run) if part is not None)
            view = flat[where[0] : where[0] + nbytes]
            run_places.append(CupyDeviceBuffer(view) if on_gpu else view)
    with contextlib.ExitStack() as loans:
        slab, views, placed = _read_files(run_files, run_places, _staging(loans, on_gpu))
        encoded: list[np.ndarray | None] = [None] * len(batch)
        in_place = [False] * len(batch)
        for run, view, run_placed in zip(runs, views, placed, strict=True):
            at = 0
            for i in run:
                if run_placed:
                    in_place[i] = True
                elif view is not None:
                    size = files[i][2] if len(run) > 1 else view.nbytes
                    encoded[i] = view[at : at + size]
                    at += size
        with _on_device_of(target, on_gpu):
            return _decode_and_place(
                chain, batch, files, target, drop_axes, on_gpu, slab, encoded, in_place
            )


def _staging(loans: contextlib.ExitStack, on_gpu: bool) -> Callable[[int], np.ndarray]:
    """Where a read stages the chunks that are not read into their place: bytes bound for
    the GPU in pinned memory lent by the shared pool until ``loans`` closes (copied at the
    link's rate, and pinned once for the process, not per read), others in a new array."""

    def staging(nbytes: int) -> np.ndarray:
        if on_gpu and nbytes:
            return loans.enter_context(pinned_pool.lend(nbytes))[:nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    return staging


@contextlib.contextmanager
def _on_device_of(target: Any, on_gpu: bool) -> Iterator[None]:
    """``target``'s GPU current in this thread (a decoding thread's is the first GPU)."""
    if not on_gpu:
        yield
        return
    import cupy

    with cupy.cuda.Device(target.device.id):
        yield


def _decode_and_place(
    chain: _Chain,
    batch: list[Any],
    files: list[str],
    target: Any,
    drop_axes: tuple[int, ...],
    on_gpu: bool,
    slab: np.ndarray,
    encoded: list[np.ndarray | None],
    in_place: list[bool],
    destinations: list[Any] | None = None,
) -> list[bool]:
    """The chunks read into ``slab`` decoded and copied into ``target`` (those decoded into
    their ``destinations`` there already); whether each chunk was present."""
    present = [data is not None or placed for data, placed in zip(encoded, in_place, strict=True)]
    if chain.crc32c:
        encoded = [
            None if data is None else _without_crc(data, _name(chunk))
            for data, chunk in zip(encoded, files, strict=True)
        ]
    if chain.zstd is not None:
        if on_gpu:
            sizes = _decoded_sizes(batch)
            decoded = decode_for_gpu(chain.zstd, slab, encoded, sizes, target, destinations)
        else:
            decoded = _decode_host(chain.zstd, encoded, destinations)
    elif chain.host_codec is not None:
        decoded = _decode_host(chain.host_codec, encoded)
        if on_gpu:  # one copy of all the decoded chunks
            decoded = to_device(*_joined(decoded), target)
    elif on_gpu:
        decoded = to_device(slab, encoded, target)
    else:
        decoded = encoded
    for index, ((_, spec, chunk_selection, out_selection, _), data, placed) in enumerate(
        zip(batch, decoded, in_place, strict=True)
    ):
        if placed or (destinations is not None and data is destinations[index] is not None):
            continue
        if data is None:
            target[out_selection] = _fill_value(spec)
            continue
        dtype = spec.dtype.to_native_dtype()
        expected = _decoded_bytes(spec)
        if data.nbytes != expected:
            raise FormatError(f"a chunk decoded to {data.nbytes} bytes, expected {expected}")
        chunk = data.view(dtype).reshape(spec.shape)
        part = chunk[chunk_selection]
        if drop_axes:
            part = part.squeeze(axis=drop_axes)
        target[out_selection] = part
    return present


_EMPTY = 2**64 - 1  # an index entry of an inner chunk never written


@dataclasses.dataclass(frozen=True)
class _InnerSpec:
    """An inner chunk's spec, as the read needs it (its shard's dtype and fill value)."""

    shape: tuple[int, ...]
    dtype: Any
    fill_value: Any


def _regular_grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Any:
    """zarr's grid of ``chunk_shape`` chunks over an array of ``shape``, as this zarr spells
    it: ``RegularChunkGrid`` up to zarr 3.3, ``ChunkGrid.from_sizes`` from 3.4 on."""
    from zarr.core import chunk_grids

    regular = getattr(chunk_grids, "RegularChunkGrid", None)
    if regular is not None:
        return regular(chunk_shape=tuple(chunk_shape))
    grid: Any = chunk_grids.ChunkGrid
    return grid.from_sizes(shape, tuple(chunk_shape))


def _inner_chunks(
    shards: _Shards, batch: list[Any], files: list[str], drop_axes: tuple[int, ...]
) -> tuple[list[Any], list[Any], list[bool]] | None:
    """The inner chunks that ``batch`` (shards) touches, as a batch of their own, each with
    its byte range in its shard's file (from the shard's index, read once, its crc32c
    checked), and whether each shard is present; None where the selection is not made of
    plain slices (zarr's pipeline maps those)."""
    if drop_axes:
        return None
    inner: list[Any] = []
    ranges: list[Any] = []
    present: list[bool] = []
    grid = None
    for (_, spec, chunk_selection, out_selection, complete), path in zip(batch, files, strict=True):
        chunk_part = chunk_selection if isinstance(chunk_selection, tuple) else (chunk_selection,)
        out_part = out_selection if isinstance(out_selection, tuple) else (out_selection,)
        if not all(isinstance(s, slice) for s in chunk_part) or not all(
            isinstance(s, slice) and s.step in (None, 1) for s in out_part
        ):
            return None
        counts = [-(-n // c) for n, c in zip(spec.shape, shards.inner_shape, strict=True)]
        index = _shard_index(path, shards, counts)
        present.append(index is not None)
        if index is None:  # no shard: the fill value over its part
            inner.append((None, spec, chunk_selection, out_selection, complete))
            ranges.append(None)
            continue
        inner_spec = _InnerSpec(shards.inner_shape, spec.dtype, spec.fill_value)
        # Per inner chunk, plain Python: a read may map thousands, and NumPy's scalar calls
        # (ravel_multi_index, an index row) cost microseconds each.
        rows = index.tolist()
        strides = [int(np.prod(counts[axis + 1 :])) for axis in range(len(counts))]
        starts = [o.start or 0 for o in out_part]
        parts = _slice_parts(chunk_part, tuple(spec.shape), shards.inner_shape, strides, starts)
        if parts is None:  # slices with steps: zarr's indexer maps them
            grid = grid or _regular_grid(tuple(spec.shape), shards.inner_shape)
            parts = _indexed_parts(chunk_part, tuple(spec.shape), grid, strides, starts)
        for at, chunk_part_selection, composed, complete_chunk in parts:
            offset, length = rows[at]
            inner.append((None, inner_spec, chunk_part_selection, composed, complete_chunk))
            empty = offset == _EMPTY and length == _EMPTY
            ranges.append(None if empty else (path, offset, length))
    return inner, ranges, present


# An inner chunk a shard's selection touches: its row in the shard's index, its part's
# selection within it, that part's place in the output, and whether it is the whole chunk.
_Part = tuple[int, tuple[slice, ...], tuple[slice, ...], bool]


def _slice_parts(
    selection: tuple[Any, ...],
    shape: tuple[int, ...],
    inner_shape: tuple[int, ...],
    strides: list[int],
    out_starts: list[int],
) -> Iterator[_Part] | None:
    """The inner chunks a selection of step-1 slices of one shard (of ``shape``) touches,
    in C order, as zarr's indexer would give them (see :data:`_Part`); None for other
    selections. Worked out per axis once, then combined: zarr's indexer costs several
    microseconds per chunk, and a read may touch thousands."""
    if len(selection) != len(shape):
        return None
    axes: list[list[tuple[int, slice, slice, bool]]] = []
    for part, length, inner, stride, out_start in zip(
        selection, shape, inner_shape, strides, out_starts, strict=True
    ):
        start, stop, step = part.indices(length)
        if step != 1:
            return None
        along = []
        for coord in range(start // inner, -(-stop // inner)) if stop > start else ():
            low, high = max(start, coord * inner), min(stop, (coord + 1) * inner)
            along.append(
                (
                    coord * stride,
                    slice(low - coord * inner, high - coord * inner, 1),
                    slice(out_start + low - start, out_start + high - start),
                    high - low == inner,
                )
            )
        axes.append(along)
    return (
        (
            sum(a[0] for a in combo),
            tuple(a[1] for a in combo),
            tuple(a[2] for a in combo),
            all(a[3] for a in combo),
        )
        for combo in itertools.product(*axes)
    )


def _indexed_parts(
    selection: tuple[Any, ...],
    shape: tuple[int, ...],
    grid: Any,
    strides: list[int],
    out_starts: list[int],
) -> Iterator[_Part]:
    """:func:`_slice_parts` of any selection of slices, by zarr's indexer."""
    from zarr.core.indexing import get_indexer

    for part in get_indexer(selection, shape=shape, chunk_grid=grid):
        inner_out: Any = part.out_selection
        chunk_selection: Any = part.chunk_selection
        yield (
            sum(c * k for c, k in zip(part.chunk_coords, strides, strict=True)),
            chunk_selection,
            tuple(
                slice(start + i.start, start + i.stop)
                for start, i in zip(out_starts, inner_out, strict=True)
            ),
            part.is_complete_chunk,
        )


def _shard_index(path: str, shards: _Shards, counts: list[int]) -> np.ndarray | None:
    """The shard's index (an (offset, length) row for each of its ``counts`` inner chunks
    along each axis), or None where there is no shard file."""
    count = int(np.prod(counts))
    size = 16 * count + (4 if shards.index_crc32c else 0)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        length = os.fstat(fd).st_size
        if length < size:
            raise FormatError(f"{path}: a shard of {length} bytes cannot hold its index")
        raw = os.pread(fd, size, length - size if shards.index_at_end else 0)
    finally:
        os.close(fd)
    if len(raw) != size:
        raise FormatError(f"{path}: the shard's index is cut short")
    body = np.frombuffer(raw, dtype=np.uint8)
    if shards.index_crc32c:
        body = _without_crc(body, f"{path} (shard index)")
    index = body.view("<u8").reshape(count, 2)
    written = index[:, 0] != _EMPTY
    ends = index[written, 0] + index[written, 1]
    if ends.size and int(ends.max()) > length:
        raise FormatError(f"{path}: the shard's index points past its end")
    return index


def _whole_chunk_outputs(
    batch: list[Any], target: Any, drop_axes: tuple[int, ...], on_gpu: bool
) -> list[Any]:
    """Each chunk's place in the output as flat bytes, where the chunk lands there whole on
    one C-contiguous range (else None), for a compressed chunk to be decoded there. A
    whole-array read of an array chunked along its first axis places every chunk so: no
    staging, no copy, no placement. On a GPU the places are spans
    (:class:`~arrayio.zarr._kernels.DeviceSpan`), not CuPy views, which cost microseconds
    each to make."""
    flat, ranges = _whole_chunk_ranges(batch, target, drop_axes)
    if on_gpu and flat is not None:
        base, device_id = flat.data.ptr, flat.device.id
        return [
            None if where is None else DeviceSpan(flat, base + where[0], where[1], device_id)
            for where in ranges
        ]
    return [None if where is None else flat[where[0] : where[0] + where[1]] for where in ranges]


def _whole_chunk_ranges(
    batch: list[Any], target: Any, drop_axes: tuple[int, ...]
) -> tuple[Any, list[tuple[int, int] | None]]:
    """The output as flat bytes, and the range of it (start, bytes) each chunk lands on whole
    (see :func:`_whole_chunk_outputs`), or None.

    The ranges are worked out from the selections, and places are cut from one flat view:
    indexing a CuPy array costs tens of microseconds, and a read may have thousands of
    chunks."""
    if (
        drop_axes
        or not target.flags.c_contiguous
        # a read-only out must raise, as zarr's pipeline does (CuPy's are writable)
        or not getattr(target.flags, "writeable", True)
    ):
        return None, [None] * len(batch)
    shape = tuple(target.shape)
    itemsize = target.dtype.itemsize
    flat = target.reshape(-1).view(np.uint8)
    checked_dtype: Any = None  # the chunks share their spec's dtype: compared once
    same_dtype = False
    ranges: list[tuple[int, int] | None] = []
    for _, spec, _, out_selection, complete in batch:
        selection = out_selection if isinstance(out_selection, tuple) else (out_selection,)
        where = _contiguous_range(selection, shape) if complete else None
        if where is not None and where[2] == tuple(spec.shape):
            if spec.dtype is not checked_dtype:
                checked_dtype = spec.dtype
                same_dtype = target.dtype == spec.dtype.to_native_dtype()
            if same_dtype:
                ranges.append((where[0] * itemsize, where[1] * itemsize))
                continue
        ranges.append(None)
    return flat, ranges


def _runs(files: list[Any], ranges: list[tuple[int, int] | None]) -> list[list[int]]:
    """The chunks (indices) in runs read as one request each: inner chunks of one shard file
    that lie one after another both in the file and in the output (a whole-array read of a
    sharded array chunked along its first axis), else each chunk alone. A sharded array's
    inner chunks would otherwise be a request each, thousands for one read.

    Only chunks whose stored length is their size in the output join a run: a run is checked
    as a whole, and a damaged index whose lengths only add up must still be refused chunk by
    chunk."""
    joinable = sorted(
        (
            i
            for i, (chunk, where) in enumerate(zip(files, ranges, strict=True))
            if isinstance(chunk, tuple) and where is not None and chunk[2] == where[1]
        ),
        key=lambda i: (files[i][0], files[i][1]),
    )
    runs: list[list[int]] = []
    for i in joinable:
        if runs:
            last = runs[-1][-1]
            (path, offset, nbytes), (place, _) = files[last], ranges[last]  # type: ignore[misc]
            if (
                files[i][0] == path
                and files[i][1] == offset + nbytes
                and ranges[i][0] == place + nbytes  # type: ignore[index]
            ):
                runs[-1].append(i)
                continue
        runs.append([i])
    alone = set(joinable)
    runs.extend([i] for i in range(len(files)) if i not in alone)
    return runs


def _contiguous_range(
    selection: tuple[Any, ...], shape: tuple[int, ...]
) -> tuple[int, int, tuple[int, ...]] | None:
    """Where ``selection`` (slices) of a C-contiguous array of ``shape`` is one range of its
    elements: (first element, count, the selection's shape); None where it is not, or
    where it is not all slices of step 1."""
    if len(selection) > len(shape):
        return None
    extents = [0] * len(shape)
    first, count, stride = 0, 1, 1
    partial = False
    # From the last axis: contiguous where every axis after the last partial one is whole,
    # and every axis before it is one index.
    for axis in range(len(shape) - 1, -1, -1):
        part = selection[axis] if axis < len(selection) else _WHOLE
        if part.__class__ is not slice:
            return None
        length = shape[axis]
        start, stop, step = part.indices(length)
        extent = stop - start
        if step != 1 or extent <= 0 or (partial and extent != 1):
            return None
        partial = partial or extent != length
        extents[axis] = extent
        first += start * stride
        count *= extent
        stride *= length
    return first, count, tuple(extents)


_WHOLE = slice(None)


def _read_files(
    files: list[Any], places: list[Any], staging: Any = None
) -> tuple[np.ndarray, list[np.ndarray | None], list[bool]]:
    """Every chunk read as one batch by the dispatcher
    (:meth:`~arrayio.dispatch.dispatcher.Dispatcher.read_files`): a whole file (its path),
    a byte range of one (``(path, offset, nbytes)``: an inner chunk of a shard), or nothing
    (None: known to be missing). Into its place in the output where it has one and the chunk
    is its size, else into one host buffer (from ``staging(nbytes)``, default a new NumPy
    array). Returns the host buffer, each chunk's bytes in it (None for a missing chunk or
    one read in place), and whether each was read in place."""
    from ..dispatch import _transfer

    sizes: list[int | None] = []
    fds: list[int | None] = []
    offsets = [0 if isinstance(chunk, str) or chunk is None else chunk[1] for chunk in files]
    opened: dict[str, int | None] = {}
    try:
        for chunk in files:
            if chunk is None:
                fds.append(None)
                sizes.append(None)
                continue
            path, length = (chunk, None) if isinstance(chunk, str) else (chunk[0], chunk[2])
            if path not in opened:
                try:
                    opened[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except (FileNotFoundError, NotADirectoryError):
                    opened[path] = None
            fd = opened[path]
            fds.append(fd)
            if fd is None:
                sizes.append(None)
            else:
                sizes.append(os.fstat(fd).st_size if length is None else length)
        in_place = [
            place is not None and size == place.nbytes
            for place, size in zip(places, sizes, strict=True)
        ]
        # Each chunk starts on a 256-byte boundary of the buffer: nvCOMP reads a chunk only
        # at an aligned address, and a chunk packed at any offset would be copied first.
        total = sum(
            _aligned(s) for s, placed in zip(sizes, in_place, strict=True) if s and not placed
        )
        slab = staging(total) if staging is not None else np.empty(total, dtype=np.uint8)
        views: list[np.ndarray | None] = []
        staged: list[tuple[int, int, Any]] = []
        direct: list[tuple[int, int, Any]] = []
        staged_paths: list[str] = []
        direct_paths: list[str] = []
        at = 0
        for handle, size, chunk, offset, place, placed in zip(
            fds, sizes, files, offsets, places, in_place, strict=True
        ):
            if handle is None or size is None:
                views.append(None)
            elif placed:
                views.append(None)
                direct.append((handle, offset, place))
                direct_paths.append(_name(chunk))
            else:
                view = slab[at : at + size]
                at += _aligned(size)
                views.append(view)
                staged.append((handle, offset, view))
                staged_paths.append(_name(chunk))
        for requests, paths in ((direct, direct_paths), (staged, staged_paths)):
            if requests:
                _transfer.read_files(requests, paths=paths)
        return slab, views, in_place
    finally:
        for handle in opened.values():
            if handle is not None:
                os.close(handle)


_CHUNK_ALIGNMENT = 256


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`_CHUNK_ALIGNMENT`."""
    return -(-nbytes // _CHUNK_ALIGNMENT) * _CHUNK_ALIGNMENT


def _name(chunk: Any) -> str:
    """What an error names a chunk by: its file, and the range of an inner chunk."""
    if chunk is None or isinstance(chunk, str):
        return str(chunk)
    path, offset, length = chunk
    return f"{path} (bytes {offset} to {offset + length})"


def _without_crc(data: np.ndarray, path: str) -> np.ndarray:
    """``data`` less its crc32c codec's trailing checksum, verified."""
    if data.nbytes < 4:
        raise FormatError(f"{path}: a chunk of {data.nbytes} bytes cannot hold its crc32c")
    body, stored = data[:-4], int.from_bytes(data[-4:].tobytes(), "little")
    if checksum(body) != stored:
        raise ChecksumError(f"{path}: the chunk's crc32c does not match its bytes")
    return body


def _decode_host(
    codec: Any, encoded: list[np.ndarray | None], destinations: list[Any] | None = None
) -> list[np.ndarray | None]:
    """Each chunk decoded by ``codec`` (numcodecs') on the I/O pool; a zstd chunk with a
    destination (its place in the output, flat host bytes) is decoded there, and its
    result is that destination."""
    zstd = getattr(codec, "codec_id", None) == "zstd"

    def one(index: int) -> np.ndarray | None:
        data = encoded[index]
        if data is None:
            return None
        if not zstd:
            return np.frombuffer(codec.decode(data), dtype=np.uint8)
        place: np.ndarray | None = destinations[index] if destinations is not None else None
        result = decode_on_host(codec, data, place)
        if place is not None and result is place:
            return place
        return np.frombuffer(result, dtype=np.uint8)

    return list(executor().map(one, range(len(encoded))))


def _joined(chunks: list[np.ndarray | None]) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """The chunks copied into one host buffer, and each one's view of it."""
    slab = np.empty(sum(c.nbytes for c in chunks if c is not None), dtype=np.uint8)
    views: list[np.ndarray | None] = []
    at = 0
    for chunk in chunks:
        if chunk is None:
            views.append(None)
            continue
        view = slab[at : at + chunk.nbytes]
        view[...] = chunk
        views.append(view)
        at += chunk.nbytes
    return slab, views


def _numcodecs_of(codec: Any) -> Any:
    """numcodecs' codec for zarr's gzip or blosc codec (as zarr decodes with), or None."""
    if isinstance(codec, GzipCodec):
        made = getattr(codec, "_gzip_codec", None)
        if made is not None:
            return made
        from numcodecs import GZip  # type: ignore[import-untyped]

        return GZip(codec.level)
    return getattr(codec, "_blosc_codec", None)


def _decoded_bytes(spec: Any) -> int:
    """The bytes a chunk of ``spec`` decodes to."""
    return int(np.prod(spec.shape)) * spec.dtype.to_native_dtype().itemsize


def _decoded_sizes(batch: Sequence[Any]) -> list[int]:
    """:func:`_decoded_bytes` of each chunk of ``batch``, worked out once per spec: a
    sharded array's inner chunks share one, and each costs microseconds."""
    known: dict[int, int] = {}
    sizes = []
    for _, spec, *_ in batch:
        size = known.get(id(spec))
        if size is None:
            size = known[id(spec)] = _decoded_bytes(spec)
        sizes.append(size)
    return sizes


def _order(spec: Any) -> str:
    """The memory order of a chunk spec (an attribute of its config in some zarr versions)."""
    order = getattr(spec, "order", None) or getattr(getattr(spec, "config", None), "order", "C")
    return str(getattr(order, "value", order))


def _fill_value(spec: Any) -> Any:
    fill = spec.fill_value
    if fill is None:
        fill = spec.dtype.default_scalar()
    return fill


def register() -> None:
    """Make the pipeline selectable by its path, ``arrayio.zarr.CodecPipeline``."""
    from zarr.registry import register_pipeline

    register_pipeline(CodecPipeline)


CodecPipeline.__module__ = "arrayio.zarr"  # its registered name: arrayio.zarr.CodecPipeline
