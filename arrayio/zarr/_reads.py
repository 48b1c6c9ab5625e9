"""Reads of store values, or of byte ranges of them, into the memory zarr asks for.

Every read joins the dispatcher's queue of reads (:func:`arrayio.dispatch._transfer.read_queued`):
the chunks that zarr, Dask or the caller ask for at once, from any number of threads, move as
the dispatcher's batches, each with the tool it learned for the batch's size and page-cache
state, into host memory or straight into device memory.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, cpu

from ..arrays._buffers import CupyDeviceBuffer, aligned_empty
from ..dispatch import _transfer
from ..tools._io import BLOCK
from ._keys import CLOEXEC, MISSING, Boundary

if TYPE_CHECKING:
    from zarr.core.buffer import BufferPrototype

__all__ = ["byte_span", "read_value"]


def byte_span(byte_range: ByteRequest | None, size: int) -> tuple[int, int]:
    """The ``(file_offset, nbytes)`` a byte range selects in a file of ``size`` bytes.

    As for LocalStore, a range that starts past the end is empty and one that ends past it
    stops at the end; as for zarr's memory store (and zarr's store tests, which slice the
    value), a range that ends before it starts is empty.

    Raises
    ------
    TypeError
        For something that is not a byte request.
    ValueError
        For negative offsets or lengths.
    """
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        start, end = byte_range.start, byte_range.end
        if start < 0 or end < 0:
            raise ValueError(f"invalid byte range [{start}, {end}): need 0 <= start and end")
        start = min(start, size)
        return start, max(0, min(end, size) - start)  # one that ends before it starts: empty
    if isinstance(byte_range, OffsetByteRequest):
        if byte_range.offset < 0:
            raise ValueError(f"invalid byte offset {byte_range.offset}: need 0 or more")
        start = min(byte_range.offset, size)
        return start, size - start
    if isinstance(byte_range, SuffixByteRequest):
        if byte_range.suffix < 0:
            raise ValueError(f"invalid suffix length {byte_range.suffix}: need 0 or more")
        start = max(0, size - byte_range.suffix)
        return start, size - start
    raise TypeError(f"Unexpected byte_range, got {byte_range!r}")


def _memory_of(prototype: BufferPrototype) -> str:
    """``"cuda"`` for zarr's GPU buffers, ``"host"`` for its CPU buffers, else ``"other"``."""
    buffer_class = prototype.buffer
    # A GPU buffer class can only come from an imported zarr.core.buffer.gpu: looking it up in
    # sys.modules keeps CuPy unimported on CPU paths.
    gpu = sys.modules.get("zarr.core.buffer.gpu")
    if gpu is not None and issubclass(buffer_class, gpu.Buffer):
        return "cuda"
    if issubclass(buffer_class, cpu.Buffer):
        return "host"
    return "other"


def _host_for(file_offset: int, nbytes: int) -> np.ndarray:
    """An uninitialised host buffer at the same phase in a 4096-byte block as
    ``file_offset`` is in the file, so that an ``O_DIRECT`` read needs no bounce buffer."""
    skew = file_offset % BLOCK
    return aligned_empty(nbytes + skew)[skew:]


def _read_device(fd: int, file_offset: int, nbytes: int, path: str) -> Any:
    """``nbytes`` at ``file_offset``, read into a new CuPy ``uint8`` array on the current
    device."""
    import cupy

    out = cupy.empty(nbytes, dtype=cupy.uint8)
    # The tools copy on streams of their own: memory that the current stream's kernels used
    # and freed must be free of them before a tool overwrites it.
    cupy.cuda.get_current_stream().synchronize()
    _transfer.read_queued(fd, file_offset, CupyDeviceBuffer(out), path=path)
    return out


def _fill(fd: int, file_offset: int, nbytes: int, prototype: BufferPrototype, path: str) -> Buffer:
    """Read ``nbytes`` at ``file_offset`` into a new buffer of ``prototype``."""
    memory = _memory_of(prototype)
    if memory == "cuda":
        return prototype.buffer.from_array_like(_read_device(fd, file_offset, nbytes, path))
    host = _host_for(file_offset, nbytes)
    _transfer.read_queued(fd, file_offset, host, path=path)
    if memory == "host":
        return prototype.buffer.from_array_like(host)  # zero-copy
    return prototype.buffer.from_bytes(host)  # a buffer class we do not know: its own copy


def read_value(
    path: str,
    prototype: BufferPrototype,
    byte_range: ByteRequest | None,
    boundary: Boundary,
    key: str,
) -> Buffer | None:
    """The value at ``path`` (or part of it), or None if there is no such file.

    Raises
    ------
    InvalidKeyError
        If the file is outside ``boundary``.
    """
    byte_span(byte_range, 0)  # a malformed byte range fails on every path, present key or not
    try:
        fd, _ = boundary.open(key, os.O_RDONLY | CLOEXEC, key)
    except MISSING:
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            return None  # a directory: a prefix, not a key
        file_offset, nbytes = byte_span(byte_range, status.st_size)
        return _fill(fd, file_offset, nbytes, prototype, path)
    finally:
        os.close(fd)
