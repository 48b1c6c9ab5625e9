"""The lazy reader behind :func:`arrayio.open`, :func:`arrayio.load` and
:func:`arrayio.read_into`.

Opening a file reads and validates only its header; arrays are read when asked for, and a
leading-axis index reads only the rows it needs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import operator
import os
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from .. import config, formats
from ..arrays import _pytree
from ..arrays._buffers import result_empty
from ..arrays._dtypes import DType
from ..arrays._frameworks import Request, Target, allocate, parse_target, writable_view
from ..arrays._shards import block_runs, byte_part
from ..dispatch import _transfer
from ..errors import (
    ArrayioError,
    ChecksumError,
    FormatError,
    KeyNotFoundError,
    MismatchError,
    OutOfMemoryError,
    UnsupportedObjectError,
)
from ..formats._names import Names
from ..integrity import _device_checksum
from ..integrity._checksum import ChecksumParts
from ..runtime import _gcpause, _memory, _progress, _stages
from ..runtime._units import format_bytes
from ..tools import _pinned

__all__ = ["ArrayInfo", "Reader"]

T = TypeVar("T")

_ARRAY = object()  # stands for an array leaf where only constants are wanted


def _shardings_of(structure: Any) -> dict[str, Any] | None:
    """The shardings the ``jax.ShapeDtypeStruct`` leaves of an example carry, by key (as
    orbax's restore takes them); None when none carries one."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    shardings = {
        key: leaf.sharding
        for key, leaf in _pytree.example_leaves(structure).items()
        if isinstance(leaf, jax.ShapeDtypeStruct)
        and isinstance(getattr(leaf, "sharding", None), jax.sharding.Sharding)
    }
    return shardings or None


# Host memory a loaded array takes beyond its data (its objects), for the check before a load.
_OBJECT_BYTES = 512
# Loads smaller than this skip that check (reading what is available costs tens of µs).
_CHECKED_FROM = 64 << 20
# Loads into a GPU of at least this many bytes start pinning staging buffers as they begin.
_PIN_AHEAD_BYTES = 64 << 20
# A load whose results are copies (JAX's device_put of host bytes) reads this much at a time.
COPY_BATCH_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayInfo:
    """What a file says of one array, known without reading its data."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file_offset: int
    crc32c: str | None = None

    def __repr__(self) -> str:
        return f"ArrayInfo({self.key!r}, {self.dtype}{list(self.shape)}, {self.nbytes} bytes)"


@dataclasses.dataclass(frozen=True, slots=True)
class _Stored:
    key: str
    dtype: DType
    shape: tuple[int, ...]  # as the caller sees it
    start: int
    crc32c: int | None
    fortran_order: bool = False
    compressed: formats.npz.Member | None = None  # an .npz member inflated as it is read

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


class Reader:
    """An open arrayio, safetensors or ``.npy`` file; see :func:`arrayio.open`.

    Attributes
    ----------
    path : str
        The file.
    format : str
        ``"safetensors"`` (arrayio's container) or ``"npy"``.
    metadata : dict
        The caller's metadata saved with the file (empty for ``.npy``).
    framework : str or None
        The framework the arrays were saved from, when arrayio wrote the file.
    header_checked : bool
        Whether the header carried its own CRC-32C and it matched (files arrayio writes).
    """

    header_checked = False

    _fd: int | None = None  # until opened: __del__ of a Reader whose open failed is a no-op

    def __init__(
        self, path: str | os.PathLike[str], *, verify: bool | None = None, tool: Any = None
    ) -> None:
        self.path = os.fspath(path)
        self._verify = config.get().verify_checksums if verify is None else verify
        self._tool = tool
        # Non-blocking: a FIFO must be refused, not waited on (regular files ignore the flag).
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            kind = stat.S_IFMT(os.fstat(self._fd).st_mode)
            if kind != stat.S_IFREG:
                what = "a directory" if kind == stat.S_IFDIR else "not a regular file"
                raise FormatError(
                    f"{self.path}: is {what}; arrayio reads .safetensors and .npy "
                    "files (a Zarr store opens with arrayio.zarr)"
                )
            self.format = formats.sniff(self._fd, self.path)
            if self.format == "npy":
                self._open_npy(self._fd)
            elif self.format == "npz":
                self._open_npz(self._fd)
            else:
                with _gcpause.paused():  # objects for every entry of the header
                    self._open_safetensors(self._fd)
        except BaseException:
            self.close()
            raise

    def _open_npy(self, fd: int) -> None:
        header = formats.npy.read_header(fd, self.path)
        key = _pytree.SINGLE_ARRAY_KEY
        self._stored = {
            key: _Stored(
                key, header.dtype, header.shape, header.data_start, None, header.fortran_order
            )
        }
        self._tree: dict[str, Any] = {"leaf": key}
        self._order = [key]
        self._leaf_keys = [key]
        self.metadata: dict[str, Any] = {}
        self.framework: str | None = None

    def _open_npz(self, fd: int) -> None:
        self._stored = {}
        for member in formats.npz.read_members(fd, self.path):
            header = member.header
            self._stored[member.key] = _Stored(
                member.key,
                header.dtype,
                header.shape,
                header.data_start,
                None,
                header.fortran_order,
                member if member.compressed else None,
            )
        self._order = self._leaf_keys = list(self._stored)
        self._tree = {"dict": [[key, {"leaf": key}] for key in self._order]}
        self.metadata = {}
        self.framework = None

    def _open_safetensors(self, fd: int) -> None:
        header = formats.safetensors.read_header(fd, self.path, verify=self._verify)
        self._stored = {
            key: _Stored(key, e.dtype, e.shape, e.start, e.crc32c)
            for key, e in header.entries.items()
        }
        arrayio = header.arrayio
        metadata = dict(header.metadata)
        metadata.pop(formats.safetensors.HEADER_CRC_KEY, None)
        if arrayio is None:
            self._tree = {"dict": [[key, {"leaf": key}] for key in self._stored]}
            self._order = list(self._stored)
            self._leaf_keys = list(self._stored)
            self.framework = None
        else:
            metadata.pop(formats.safetensors.ARRAYIO_KEY)
            self._tree = arrayio.get("tree") or {"dict": []}
            framework = arrayio.get("framework")
            self.framework = framework if isinstance(framework, str) else None
            json_keys = arrayio.get("json_metadata", [])
            if not isinstance(json_keys, list) or not all(isinstance(k, str) for k in json_keys):
                raise FormatError(f"{self.path}: arrayio 'json_metadata' must list strings")
            if len(set(json_keys)) != len(json_keys):
                raise FormatError(f"{self.path}: arrayio 'json_metadata' lists a key twice")
            for key in json_keys:
                if key in metadata:
                    try:
                        metadata[key] = json.loads(metadata[key])
                    except (ValueError, RecursionError):
                        raise FormatError(f"{self.path}: metadata {key!r} is not JSON") from None
            leaf_keys = _pytree.validate(self._tree, where=f"{self.path}: ")
            self._leaf_keys = leaf_keys
            missing = set(leaf_keys) - self._stored.keys()
            listed = set(leaf_keys)  # then any tensor the structure does not name
            self._order = leaf_keys + [key for key in self._stored if key not in listed]
            if missing:
                raise FormatError(
                    f"{self.path}: structure names tensors the file lacks: {sorted(missing)[:5]}"
                )
        self.metadata = metadata
        self.header_checked = header.header_checked

    # ------------------------------------------------------------------ description

    def keys(self) -> list[str]:
        """The keys of the arrays, in the order of the saved structure."""
        return list(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, key: object) -> bool:
        return key in self._stored

    def __getitem__(self, key: str) -> ArrayInfo:
        stored = self._entry(key)
        crc = f"{stored.crc32c:08x}" if stored.crc32c is not None else None
        return ArrayInfo(key, stored.dtype.name, stored.shape, stored.nbytes, stored.start, crc)

    @property
    def arrays(self) -> dict[str, ArrayInfo]:
        """Every array's :class:`ArrayInfo`, by key."""
        return {key: self[key] for key in self.keys()}

    @property
    def structure(self) -> Any:
        """The saved pytree with an :class:`ArrayInfo` in place of each array."""
        return _pytree.unflatten(self._tree, self.__getitem__)

    @property
    def nbytes(self) -> int:
        """Total bytes of array data."""
        return sum(s.nbytes for s in self._stored.values())

    def __repr__(self) -> str:
        from ..runtime._units import format_count

        state = (
            "closed"
            if self._fd is None
            else (f"{format_count(len(self), 'array')}, {format_count(self.nbytes, 'byte')}")
        )
        return f"<arrayio.Reader {self.path!r} ({self.format}, {state})>"

    def _repr_html_(self) -> str:
        from ._html import reader_html

        return reader_html(self)

    def _entry(self, key: str) -> _Stored:
        try:
            return self._stored[key]
        except KeyError:
            close = difflib.get_close_matches(str(key), list(self._stored), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise KeyNotFoundError(f"{self.path}: no array {key!r}{hint}") from None

    def _single_key(self, key: str | None) -> str:
        if key is not None:
            return key
        if len(self._stored) != 1:
            raise KeyNotFoundError(
                f"{self.path} holds {len(self._stored)} arrays: name one with key= "
                f"(keys: {self.keys()[:5]}{'...' if len(self) > 5 else ''})"
            )
        return next(iter(self._stored))

    # ------------------------------------------------------------------ reading

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"I/O on a closed arrayio reader ({self.path})")
        return self._fd

    def read(
        self,
        key: str | None = None,
        index: Any = None,
        *,
        like: Any = None,
        device: Any = None,
    ) -> Any:
        """Read one array, or only the part ``index`` selects: rows along its leading axis,
        and a range along one later axis (a tensor-parallel rank's columns).

        Parameters
        ----------
        key
            The array's key; may be omitted when the file holds one array.
        index
            ``None`` (everything), an ``int``, or a ``slice`` (positive step) along the leading
            axis, optionally in a tuple followed by slices of the later axes, of which one may
            be a range of step 1 (``w[:, 1024:2048]``) and the others whole (``:``, or a
            final ``...``). Only the bytes of the selection are read (a range along a later
            axis as one run per row); checksums are verified only for whole-array reads.
        like, device
            The framework and device of the result, as for :func:`arrayio.load`.

        Raises
        ------
        KeyNotFoundError, IndexError, ChecksumError, TruncatedFileError
        """
        stored = self._entry(self._single_key(key))
        request = parse_target(like, device)
        if index is None or stored.fortran_order or stored.compressed:
            result = self._read_whole(stored, request)
            return result if index is None else result[index]
        return self._read_rows(stored, index, request)

    def _read_whole(self, stored: _Stored, request: Request) -> Any:
        self._check_memory(stored.nbytes, 1, request)
        target = self._allocate(stored, request)
        self._fill(stored, target.data)
        result = target.finish()
        return _transpose(result) if stored.fortran_order else result

    def _fill(self, stored: _Stored, data: Any) -> None:
        if stored.compressed is not None:
            host = data if isinstance(data, np.ndarray) else np.empty(data.nbytes, np.uint8)
            formats.npz.read_compressed(self.fd, self.path, stored.compressed, host)
            if host is not data:
                data.copy_from_host(0, host)
            return
        check = self._verify and stored.crc32c is not None
        crc = _transfer.read_into(
            self.fd, stored.start, data, path=self.path, with_checksum=check, tool=self._tool
        )
        if check:
            self._check(stored, crc)

    def _verifies(self, keys: Sequence[str]) -> bool:
        """Whether a load of ``keys`` verifies a checksum (verification on, one recorded)."""
        return self._verify and any(self._stored[key].crc32c is not None for key in keys)

    def _check(self, stored: _Stored, crc: int | None) -> None:
        if crc != stored.crc32c:
            raise ChecksumError(
                f"{self.path}: array {stored.key!r} has CRC-32C {crc:08x}, the file recorded "
                f"{stored.crc32c:08x}: the data is damaged (verify=False skips this check)"
            )

    def _read_all(self, keys: Sequence[str], request: Request, advance: Any) -> dict[str, Any]:
        """Read whole arrays as batches of transfers (see :meth:`Dispatcher.read_many`): every
        array is allocated, then all of them are read at once, then finished. Where finishing
        copies (host bytes put on a device by JAX) a batch stops at :data:`COPY_BATCH_BYTES`,
        so that the load never holds much more than the result twice."""
        results: dict[str, Any] = {}
        pending = iter(dict.fromkeys(keys))
        with _gcpause.paused(across_transfers=True):
            while True:
                with _gcpause.paused(), _stages.stage("allocate"):  # also in the background
                    arrays = ((stored, stored, request) for stored in map(self._entry, pending))
                    batch = self._allocate_batch(arrays)
                if not batch:
                    return results
                self._read_batch(batch, results, advance)

    def _allocate_batch(
        self, items: Iterator[tuple[T, _Stored, Request]]
    ) -> list[tuple[T, Target]]:
        """Allocate the next results of ``items`` (each a tag, what it reads, its request):
        all of them, or up to :data:`COPY_BATCH_BYTES` of those whose finishing copies."""
        batch: list[tuple[T, Target]] = []
        copied = 0
        for tag, stored, request in items:
            target = self._allocate(stored, request)
            batch.append((tag, target))
            copied += stored.nbytes if target.copies else 0
            if copied >= COPY_BATCH_BYTES:
                break
        return batch

    def _allocate(self, stored: _Stored, request: Request) -> Target:
        shape = stored.shape[::-1] if stored.fortran_order else stored.shape
        try:
            return allocate(request, stored.dtype, shape)
        except MemoryError as error:  # the frameworks' own, for host or device memory
            if isinstance(error, ArrayioError):
                raise
            raise OutOfMemoryError(
                f"{self.path}: no memory for array {stored.key!r} "
                f"({format_bytes(stored.nbytes)} on {request.placement}): {error}"
            ) from None

    def _check_memory(self, nbytes: int, count: int, request: Request) -> None:
        """Refuse, before allocating anything, a load whose results cannot fit in the host
        memory available (results on a GPU pass through bounded staging buffers)."""
        needed = nbytes + count * _OBJECT_BYTES
        if request.placement.is_cuda or needed < _CHECKED_FROM:
            return
        available = _memory.available_host_bytes()
        if available is None or needed <= available:
            return
        message = (
            f"{self.path}: loading needs {format_bytes(needed)} of memory and "
            f"{format_bytes(available)} is available"
        )
        status = os.fstat(self.fd)
        stored_bytes = status.st_blocks * 512
        if stored_bytes < nbytes // 2:
            message += (
                f"; the file stores only {format_bytes(stored_bytes)} on disk (a "
                "sparse file, or a header that claims more than was written)"
            )
        raise OutOfMemoryError(message + "; read fewer arrays (keys=) or rows (Reader.read)")

    def allocated(
        self, keys: Sequence[str], request: Request
    ) -> list[tuple[Reader, _Stored, Target]] | None:
        """The results of ``keys`` (the arrays' names, as :meth:`_select` gives them)
        allocated for :func:`read_targets`, which reads them with other files' (a
        checkpoint's shards); None at the first whose finishing copies it (see
        :data:`COPY_BATCH_BYTES`), which loads in bounded batches instead. Refused as a load
        of them alone is where memory is short (:meth:`_check_memory`)."""
        entries = [self._entry(key) for key in keys]
        self._check_memory(sum(stored.nbytes for stored in entries), len(entries), request)
        batch = []
        with _gcpause.paused(), _stages.stage("allocate"):
            for stored in entries:
                target = self._allocate(stored, request)
                if target.copies:
                    return None
                batch.append((self, stored, target))
        return batch

    def _read_batch(
        self, batch: list[tuple[_Stored, Target]], results: dict[str, Any], advance: Any
    ) -> None:
        read_targets([(self, stored, target) for stored, target in batch], results, advance)

    def _read_rows(self, stored: _Stored, index: Any, request: Request) -> Any:
        if not stored.shape:
            raise IndexError(f"{self.path}: array {stored.key!r} is 0-d and cannot be indexed")
        rows, squeeze, block = _selection(index, stored.shape)
        if block is not None:
            axis, start, stop = block
            if _run_bytes(stored, block) >= MIN_RUN_BYTES:
                result = self._read_block(stored, rows, block, request)
            else:  # runs this small cost more as requests than the bytes between them
                whole = (slice(rows.start, rows.stop, rows.step),)
                within = (slice(None),) * axis + (slice(start, stop),)
                result = _compact(
                    self._read_rows(stored, whole, request)[within], request.framework
                )
            return result[0] if squeeze else result
        row_bytes = stored.nbytes // stored.shape[0] if stored.shape[0] else 0
        first = rows.start if len(rows) else 0
        span = (rows[-1] - rows.start + 1) if len(rows) else 0
        piece = dataclasses.replace(
            stored,
            shape=(span, *stored.shape[1:]),
            start=stored.start + first * row_bytes,
            crc32c=None,
        )
        result = self._read_whole(piece, request)
        if rows.step != 1 and span:
            result = result[:: rows.step]
        return result[0] if squeeze else result

    def _reads_range_alone(self, key: str, index: tuple[Any, ...]) -> bool:
        """Whether :meth:`read` of ``index`` of ``key`` (rows and a range of one later axis)
        reads that range alone, a run per row, rather than the rows whole (runs under
        :data:`MIN_RUN_BYTES`) or the whole array (Fortran order, compressed), or cannot
        read it."""
        stored = self._entry(key)
        if len(stored.shape) < 2 or stored.fortran_order or stored.compressed is not None:
            return False
        try:
            _, _, block = _selection(tuple(index), stored.shape)
        except IndexError:  # more than one later axis sliced, or a step
            return False
        return block is not None and _run_bytes(stored, block) >= MIN_RUN_BYTES

    def _read_block(
        self, stored: _Stored, rows: range, block: tuple[int, int, int], request: Request
    ) -> Any:
        """The rows ``rows`` of ``stored``, sliced to ``start:stop`` along its later axis
        ``axis`` (``block``), every axis after it whole: one contiguous run of the file per
        row (and per index of the axes between, :func:`~arrayio.arrays._shards.block_runs`),
        each read straight into its place in the result, in one batch."""
        axis, start, stop = block
        shape = stored.shape
        index = [slice(None)] * len(shape)
        index[0], index[axis] = slice(rows.start, rows.stop, rows.step), slice(start, stop)
        runs = block_runs(tuple(index), shape, stored.dtype.itemsize)
        assert runs is not None  # (a step on the leading axis only)
        out_shape = (len(rows), *shape[1:axis], stop - start, *shape[axis + 1 :])
        piece = dataclasses.replace(stored, shape=out_shape, crc32c=None)
        self._check_memory(piece.nbytes, 1, request)
        target = self._allocate(piece, request)
        requests = [
            (stored.start + offset, byte_part(target.data, at, at + n)) for offset, at, n in runs
        ]
        if requests:
            _transfer.read_many(self.fd, requests, path=self.path, tool=self._tool)
        return target.finish()

    def read_row_pieces(
        self, pieces: Sequence[tuple[str, range, Request]], advance: Any = None
    ) -> list[Any]:
        """Read the rows ``rows`` (a range of step 1) of the array ``key`` of each piece into
        its request's framework and device; return the results in order. The pieces move
        as one batch of transfers, or, where finishing them copies (host bytes put on a JAX
        device), as batches of up to :data:`COPY_BATCH_BYTES`, as :func:`arrayio.load` does.

        An array whose pieces here tile its leading axis exactly (each row read once) has
        its checksum verified from the pieces' CRC-32Cs, combined in row order. Pieces that
        cover only part of an array (another process reads the rest) cannot be checked
        against its one checksum, and are not.

        Raises
        ------
        KeyNotFoundError, ChecksumError, TruncatedFileError
        IndexError
            For rows outside an array, or a range whose step is not 1 (a 0-d array has
            the one row ``range(0, 1)``, and no other range).
        """
        results: dict[int, Any] = {}
        planned: list[tuple[int, _Stored, _Stored, range, Request]] = []
        wholes: dict[str, np.ndarray] = {}  # arrays whose rows are not byte ranges, on the host
        for i, (key, rows, request) in enumerate(pieces):
            stored = self._entry(key)
            outside = not 0 <= rows.start <= rows.stop <= _rows_of(stored)
            if rows.step != 1 or outside or (not stored.shape and len(rows) != 1):
                raise IndexError(
                    f"{self.path}: rows {rows.start} to {rows.stop} (step {rows.step}) of "
                    f"array {key!r}, which has {_rows_of(stored)}"
                )
            if stored.fortran_order or stored.compressed is not None:  # read whole, sliced
                if key not in wholes:
                    wholes[key] = self._host_items(stored)
                results[i] = self._copied_rows(stored, wholes[key], rows, request)
                if advance is not None:
                    advance(len(rows) * (stored.nbytes // max(1, _rows_of(stored))))
                continue
            row_bytes = stored.nbytes // _rows_of(stored) if _rows_of(stored) else 0
            piece = dataclasses.replace(
                stored,
                shape=(len(rows), *stored.shape[1:]) if stored.shape else (),
                start=stored.start + rows.start * row_bytes,
                crc32c=None,
            )
            planned.append((i, stored, piece, rows, request))
        on_host = [(p.nbytes, q) for _, _, p, _, q in planned if not q.placement.is_cuda]
        if on_host:
            self._check_memory(sum(n for n, _ in on_host), len(on_host), on_host[0][1])
        spans: dict[str, list[range]] = {}
        arrays: dict[str, _Stored] = {}
        for _, stored, _, rows, _ in planned:
            spans.setdefault(stored.key, []).append(rows)
            arrays[stored.key] = stored
        checked = {
            key: stored
            for key, stored in arrays.items()
            if self._verify and stored.crc32c is not None and _tiles(stored, spans[key])
        }
        parts = {key: ChecksumParts(stored.nbytes) for key, stored in checked.items()}
        remaining = ((p, p[2], p[4]) for p in planned)
        with _gcpause.paused(across_transfers=True):
            while True:
                with _gcpause.paused():
                    batch = self._allocate_batch(remaining)
                if not batch:
                    break
                found = _transfer.read_many(
                    self.fd,
                    [(piece.start, target.data) for (_, _, piece, _, _), target in batch],
                    path=self.path,
                    with_checksum=bool(checked),
                    tool=self._tool,
                    done=_reporting(advance, [planned[2].nbytes for planned, _ in batch]),
                )
                for ((i, stored, piece, _, _), target), crc in zip(batch, found, strict=True):
                    if stored.key in parts:
                        if crc is None:  # a forced tool that cannot checksum, as for a
                            del parts[stored.key]  # whole array: left unchecked
                        else:
                            parts[stored.key].add(piece.start - stored.start, piece.nbytes, crc)
                    with _gcpause.paused():
                        results[i] = target.finish()
        for key, collected in parts.items():
            self._check(checked[key], collected.value())
        return [results[i] for i in range(len(pieces))]

    def _host_items(self, stored: _Stored) -> np.ndarray:
        """The whole array ``stored`` read into host memory (checked as a whole read is), as
        opaque items of its size in the caller's shape and order."""
        raw = result_empty(stored.nbytes)
        self._fill(stored, raw)
        items = raw.view(f"V{stored.dtype.itemsize}")
        if stored.fortran_order:
            return items.reshape(stored.shape[::-1]).T
        return items.reshape(stored.shape)

    def _copied_rows(
        self, stored: _Stored, items: np.ndarray, rows: range, request: Request
    ) -> Any:
        """Rows ``rows`` of ``items`` (see :meth:`_host_items`) copied into a new result of
        ``request``'s framework and device."""
        part = items[rows.start : rows.stop] if stored.shape else items
        data = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        piece = dataclasses.replace(
            stored,
            shape=tuple(part.shape),
            crc32c=None,
            fortran_order=False,
            compressed=None,
        )
        target = self._allocate(piece, request)
        if isinstance(target.data, np.ndarray):
            target.data[...] = data
        else:
            target.data.copy_from_host(0, data)
        return target.finish()

    def read_into(self, out: Any, key: str | None = None) -> Any:
        """Fill ``out`` (NumPy, CuPy or torch, contiguous) in place with one array; return it.

        Raises
        ------
        MismatchError
            If ``out`` has another dtype or shape than the stored array.
        """
        stored = self._entry(self._single_key(key))
        dtype, shape, data = writable_view(out)
        if dtype != stored.dtype or shape != stored.shape:
            raise MismatchError(
                f"{self.path}: array {stored.key!r} is {stored.dtype.name}{list(stored.shape)}, "
                f"out is {dtype.name}{list(shape)}"
            )
        if stored.fortran_order:
            raise MismatchError(
                f"{self.path}: Fortran-ordered .npy data cannot fill a C-ordered "
                "array in place; use read() or load()"
            )
        self._fill(stored, data)
        return out

    def load(
        self,
        *,
        keys: str | Sequence[str] | None = None,
        like: Any = None,
        device: Any = None,
        structure: Any = None,
        progress: bool | None = None,
        sharding: Any = None,
    ) -> Any:
        """Read arrays into the saved structure; see :func:`arrayio.load`."""
        chosen = (
            list(self._stored)
            if keys is None
            else self._select([keys] if isinstance(keys, str) else keys)
        )
        total = sum(self._stored[key].nbytes for key in chosen)
        read_all = self._read_all
        if sharding is None and structure is not None and like in (None, "jax") and device is None:
            sharding = _shardings_of(structure)  # placeholders that say where they go
        if sharding is not None:
            if like not in (None, "jax") or device is not None:
                raise UnsupportedObjectError(
                    "sharding= gives jax.Arrays placed by the sharding: pass like='jax' (or "
                    "nothing) and no device"
                )
            like = "jax"
            read_all = functools.partial(self._read_sharded, sharding)
        with _stages.stage("target"):  # the framework and device asked for
            request = parse_target(like, device)
            self._check_memory(total, len(chosen), request)
            ahead_of_gpu_load(request, total, self._verifies(chosen))
        with _progress.bar(total, desc=f"loading {self.path}", progress=progress) as advance:
            return self._load(keys, request, structure, advance, read_all)

    def _read_sharded(
        self, sharding: Any, keys: Sequence[str], request: Request, advance: Any
    ) -> dict[str, Any]:  # see _sharded_load
        from ._sharded_load import read_sharded

        return read_sharded(self, sharding, list(keys), advance)

    def _load(
        self,
        keys: str | Sequence[str] | None,
        request: Request,
        structure: Any,
        advance: Any,
        read_all: Callable[[Sequence[str], Request, Any], dict[str, Any]],
    ) -> Any:
        if keys is not None:
            if isinstance(keys, str):
                if keys in self._stored:
                    return read_all([keys], request, advance)[keys]
                keys = [keys]  # a subtree: a flat dict of the arrays below it
            chosen = self._select(keys)
            return read_all(chosen, request, advance)
        if structure is not None:
            constants = _pytree.leaves_by_key(_pytree.unflatten(self._tree, lambda key: _ARRAY))
            wanted = _pytree.example_keys(structure)
            missing = [
                key
                for key in wanted
                if key not in self._stored and constants.get(key, _ARRAY) is _ARRAY
            ]
            if missing:  # before reading anything
                raise KeyNotFoundError(
                    f"{self.path}: the structure asks for {missing[0]!r}, "
                    f"which the file lacks (keys: {self.keys()[:5]}...)"
                )
            arrays = read_all([key for key in wanted if key in self._stored], request, advance)
            with _stages.stage("results"):
                return _pytree.rebuild_like(
                    structure, lambda key: arrays[key] if key in arrays else constants[key]
                )
        arrays = read_all(self._leaf_keys, request, advance)
        with _stages.stage("results"):  # (the pytree the caller gets)
            return _pytree.unflatten(self._tree, arrays.__getitem__, where=f"{self.path}: ")

    def _select(self, keys: Sequence[str]) -> list[str]:
        """The stored keys each of ``keys`` names (itself, and the keys under it: ``wanted``
        and ``wanted.*``), in the saved order for each, without repeats."""
        chosen: dict[str, None] = {}
        for wanted in keys:
            matches = self._names.below(wanted)
            if not matches:
                self._entry(wanted)  # raises with suggestions
            chosen.update(dict.fromkeys(matches))
        return list(chosen)

    @functools.cached_property
    def _names(self) -> Names:
        """The keys in the saved order, for :meth:`_select`."""
        return Names(self._order)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the file; further reads raise ``ValueError``."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def ahead_of_gpu_load(request: Request, nbytes: int, verifies: bool) -> None:
    """For a load of ``nbytes`` into a GPU, start in the background what its transfers
    would otherwise wait for, while its outputs are allocated: pinning staging buffers (a
    no-op once the pool has spares) and, for a load that ``verifies`` checksums, building
    the checksum kernel and launching it once (:func:`_device_checksum.build_ahead`, once a
    process). Both are a large part of a fresh process's first load."""
    if request.placement.is_cuda and nbytes >= _PIN_AHEAD_BYTES:
        _pinned.pool.pin_ahead()
        if verifies:
            _device_checksum.build_ahead([request.placement.index], beside_python=True)


def read_targets(
    batch: list[tuple[Reader, _Stored, Target]], results: dict[str, Any], advance: Any
) -> None:
    """Fill the allocated ``batch`` (each array's reader, entry and result) from its files,
    verify, and put each finished result in ``results`` by key. Compressed arrays are
    inflated one by one; the others move as one batch of the dispatcher's: of their one
    file (:meth:`~arrayio.dispatch.dispatcher.Dispatcher.read_many`), or of several (a
    checkpoint's shards, :meth:`~arrayio.dispatch.dispatcher.Dispatcher.read_many_files`).
    The results' objects that need none of the bytes are made while the bytes move."""
    for reader, stored, target in batch:  # inflated one by one, not moved by a tool
        if stored.compressed is not None:
            reader._fill(stored, target.data)
            advance(stored.nbytes)
    moved = [
        (reader, stored, target) for reader, stored, target in batch if stored.compressed is None
    ]
    checks = [reader._verify and stored.crc32c is not None for reader, stored, _ in moved]
    finished: dict[int, Any] = {}

    def wrap() -> None:  # while the bytes move: the results' objects need none of them
        with _gcpause.paused():
            for i, (_, _, target) in enumerate(batch):
                if target.wraps:
                    finished[i] = target.finish()

    crcs: list[int | None] = []
    with _stages.stage("transfers"):
        if moved:  # (the first moved array's reader: batch[0]'s arrays may be inflated)
            first = moved[0][0]
            how: dict[str, Any] = {
                "with_checksum": any(checks),
                "tool": first._tool,
                "done": lambda i: advance(moved[i][1].nbytes),
                "meanwhile": wrap,
            }
            if len({reader.fd for reader, _, _ in moved}) > 1:
                crcs = _transfer.read_many_files(
                    [(reader.fd, stored.start, target.data) for reader, stored, target in moved],
                    paths=[reader.path for reader, _, _ in moved],
                    **how,
                )
            else:
                transfers = [(stored.start, target.data) for _, stored, target in moved]
                crcs = _transfer.read_many(first.fd, transfers, path=first.path, **how)
    for (reader, stored, _), check, crc in zip(moved, checks, crcs, strict=True):
        if check:
            reader._check(stored, crc)
    with _gcpause.paused(), _stages.stage("finish"):  # also in the background
        for i, (_, stored, target) in enumerate(batch):
            result = finished.pop(i) if i in finished else target.finish()
            results[stored.key] = _transpose(result) if stored.fortran_order else result


def _reporting(advance: Any, sizes: list[int]) -> Callable[[int], None] | None:
    """``done(k)`` for a batch of transfers of ``sizes`` bytes: ``advance`` by transfer
    ``k``'s bytes (None where there is nothing to advance)."""
    if advance is None:
        return None
    return lambda k: advance(sizes[k])


def _tiles(stored: _Stored, spans: Sequence[range]) -> bool:
    """Whether the row ranges ``spans`` of ``stored`` read each of its rows exactly once."""
    rows = sorted((r.start, r.stop) for r in spans)
    end = 0
    for start, stop in rows:
        if start != end:
            return False
        end = stop
    return end == _rows_of(stored)


def _rows_of(stored: _Stored) -> int:
    """The rows of ``stored`` along its leading axis (a 0-d array: one)."""
    return stored.shape[0] if stored.shape else 1


def _selection(
    index: Any, shape: tuple[int, ...]
) -> tuple[range, bool, tuple[int, int, int] | None]:
    """The rows an index selects along the leading axis, whether that axis is dropped, and
    the one later axis it slices with its bounds (``(axis, start, stop)``), or None where
    every later axis is whole."""
    if not isinstance(index, tuple) or len(index) < 2:
        rows, squeeze = _leading_rows(index, shape[0])
        return rows, squeeze, None
    rest = list(index[1:])
    if Ellipsis in rest:
        if rest.index(Ellipsis) != len(rest) - 1:
            raise IndexError("'...' may only end an index")
        rest.pop()
    if len(rest) > len(shape) - 1:
        raise IndexError(f"too many indices for an array of {len(shape)} dimensions")
    sliced = []
    for axis, part in enumerate(rest, start=1):
        if part == slice(None):
            continue
        if not isinstance(part, slice):
            raise IndexError(f"unsupported index {part!r} on axis {axis}: later axes take slices")
        start, stop, step = part.indices(shape[axis])
        if step != 1:
            raise IndexError(f"axis {axis}: only slices of step 1 are supported on later axes")
        sliced.append((axis, start, max(start, stop)))
    if len(sliced) > 1:
        raise IndexError("only one axis after the leading one can be sliced; read, then slice")
    rows, squeeze = _leading_rows(index[0], shape[0])
    if not sliced or sliced[0][1:] == (0, shape[sliced[0][0]]):
        return rows, squeeze, None
    return rows, squeeze, sliced[0]


def _run_bytes(stored: _Stored, block: tuple[int, int, int]) -> int:
    """The bytes of one run of the file that ``block`` (``(axis, start, stop)`` of a later
    axis) selects: its range times everything after that axis."""
    axis, start, stop = block
    return (stop - start) * stored.dtype.itemsize * math.prod(stored.shape[axis + 1 :])


# A range of a later axis is read as a run per row when each run is at least this long;
# shorter, the rows are read whole and sliced: a request costs microseconds of the batch's
# bookkeeping, as long as tens of kilobytes take from the page cache (50,000 runs of 2 KiB
# took 206 to 334 ms on the development machine, the 200 MB of their rows 74 to 163).
MIN_RUN_BYTES = 64 << 10


def _compact(x: Any, framework: str) -> Any:
    """``x`` (a view of a slice, in ``framework``) in memory of its own, laid out in C
    order: NumPy, CuPy and torch views keep their whole base alive; JAX's slices are new
    arrays already."""
    if framework == "numpy":
        return np.ascontiguousarray(x)
    if framework == "torch":
        return x.contiguous()
    if framework == "cupy":
        return sys.modules["cupy"].ascontiguousarray(x)
    return x


def _leading_rows(index: Any, length: int) -> tuple[range, bool]:
    """The rows an index selects along the leading axis, and whether that axis is dropped."""
    if isinstance(index, tuple):
        first, rest = (index[0], index[1:]) if index else (slice(None), ())
        if any(not (r is Ellipsis or r == slice(None)) for r in rest):
            raise IndexError("only the leading axis can be indexed; later axes must be ':'")
        index = first
    if isinstance(index, slice):
        rows = range(*index.indices(length))
        if rows.step < 0:
            raise IndexError("negative slice steps are not supported; read, then flip")
        return rows, False
    try:
        position = operator.index(index)
    except TypeError:
        raise IndexError(f"unsupported index {index!r}: use an int or a slice") from None
    if not -length <= position < length:
        raise IndexError(f"index {position} is out of bounds for an axis of {length}")
    position %= length
    return range(position, position + 1), True


def _transpose(x: Any) -> Any:
    if isinstance(x, np.ndarray) or not hasattr(x, "permute"):
        return x.T
    return x.permute(*reversed(range(x.ndim)))
