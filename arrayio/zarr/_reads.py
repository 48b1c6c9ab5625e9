"""Reads of store values, or of byte ranges of them, into the memory zarr asks for.

Every read goes through the dispatcher (:func:`arrayio.dispatch._transfer.read_into`). A read
alone lets it choose the tool; a read in a crowd (:data:`CROWD` reads in flight, as when zarr
fetches the chunks of a selection) already has its parallelism, one chunk per thread, and is
forced to a one-thread tool chosen by the page-cache state of its bytes. GPU reads in a
crowd go through KvikIO when cached, else through the thread's pinned pieces
(:mod:`arrayio.zarr._staging`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, cpu

from .. import config
from ..arrays._buffers import CupyDeviceBuffer, aligned_empty
from ..dispatch import _transfer
from ..dispatch.context import cache_state
from ..dispatch.dispatcher import SMALL_TRANSFER
from ..dispatch.policy import is_tool_failure
from ..errors import ToolUnavailableError
from ..tools._io import BLOCK
from ._keys import CLOEXEC, MISSING, Boundary
from ._staging import PIECE, staging

if TYPE_CHECKING:
    from zarr.core.buffer import BufferPrototype

__all__ = ["CROWD", "byte_span", "read_value"]

logger = logging.getLogger("arrayio")

# At this many reads in flight (the store's, in every thread) a read counts as one of a
# crowd. The dispatcher times each call to learn which tool is fastest, and a call that
# shares the disk and the tools' thread pools with many others measures the crowd, not the
# tool: its choices drift and it keeps exploring. Within a crowd each read needs no threads
# of its own, only the right kind of request.
CROWD = 4
_ONE_DIRECT = "direct(threads=1,task_size=67108864)"  # one O_DIRECT request up to 64 MiB
_in_flight = 0
_in_flight_lock = threading.Lock()
_no_direct: set[int] = set()  # file systems (st_dev) that refused O_DIRECT


@contextlib.contextmanager
def _counted() -> Iterator[int]:
    """Count a read in flight; yield how many are, this one included."""
    global _in_flight
    with _in_flight_lock:
        _in_flight += 1
        count = _in_flight
    try:
        yield count
    finally:
        with _in_flight_lock:
            _in_flight -= 1


def _forget_reads_after_fork() -> None:
    # A forked child has none of the reads its parent's threads had in flight.
    global _in_flight, _in_flight_lock
    _in_flight, _in_flight_lock = 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_reads_after_fork)


def _read_host(
    fd: int, file_offset: int, host: np.ndarray, path: str, crowded: bool, file_system: int
) -> None:
    """Fill ``host`` from the file through the dispatcher.

    Alone, the dispatcher chooses the tool. In a crowd (and unless the user forced a tool),
    the read is forced to one thread: ``O_DIRECT`` for bytes not in the page cache, which
    sends the whole request to the disk at once and leaves the cache to others, one
    ``pread`` for cached bytes; the measurement is still recorded.
    """
    if crowded and host.nbytes >= SMALL_TRANSFER and config.get().tool is None:
        cold = file_system not in _no_direct and cache_state(fd, file_offset, host.nbytes) == "cold"
        if cold:
            try:
                _transfer.read_into(fd, file_offset, host, path=path, tool=_ONE_DIRECT)
                return
            except ToolUnavailableError:
                _no_direct.add(file_system)  # e.g. tmpfs: buffered reads from now on
        _transfer.read_into(fd, file_offset, host, path=path, tool="naive")
        return
    _transfer.read_into(fd, file_offset, host, path=path)


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


def _read_device(
    fd: int, file_offset: int, nbytes: int, path: str, crowded: bool, file_system: int
) -> Any:
    """Read ``nbytes`` at ``file_offset`` into a new CuPy ``uint8`` array on the current
    device.

    Alone, the chunk goes through the dispatcher's device tools, which learn the fastest way
    for its size and cache state. In a crowd, cached bytes go through KvikIO (its thread
    pool splits each chunk into tasks, every chunk in flight at once, which one thread a
    chunk does not match), and bytes that are not, or all of them without
    KvikIO, through this thread's two pinned pieces: while one piece's copy to the device
    runs, the next piece is read into the other (:func:`_read_pieces`).
    """
    import cupy

    stream = staging.stream(cupy.cuda.Device().id)
    with stream:
        out = cupy.empty(nbytes, dtype=cupy.uint8)
    if nbytes >= SMALL_TRANSFER and config.get().tool is None:
        tool = None
        if crowded:
            warm = cache_state(fd, file_offset, nbytes) == "warm"
            tool = _CROWD_KVIKIO if warm and _kvikio_usable() else _PIECES
        if tool is not _PIECES:
            stream.synchronize()  # memory the legacy stream freed is free of its kernels
            try:
                _transfer.read_into(fd, file_offset, CupyDeviceBuffer(out), path=path, tool=tool)
                return out
            except Exception as error:
                if tool is None or not is_tool_failure(error):  # the dispatcher fell back
                    raise  # already, or a data error
                _no_kvikio.set()
                logger.warning(
                    "arrayio: NVMeStore reads cached chunks through its pinned "
                    "pieces from now on: KvikIO failed (%s)",
                    error,
                )
            # Into new memory: a failed KvikIO read may still have tasks writing into the
            # old one (KvikIO reports the first failed task without waiting for the others).
            with stream:
                out = cupy.empty(nbytes, dtype=cupy.uint8)
    return _read_pieces(fd, file_offset, out, path, crowded, file_system, stream)


_CROWD_KVIKIO = "kvikio(threads=16,task_size=4194304)"
_PIECES = "pieces"  # the thread's pinned pieces
_no_kvikio = threading.Event()  # KvikIO failed once here: the pieces from then on


def _kvikio_usable() -> bool:
    from ..tools.kvikio import KvikioTool

    return not _no_kvikio.is_set() and bool(KvikioTool.availability())


def _read_pieces(
    fd: int, file_offset: int, out: Any, path: str, crowded: bool, file_system: int, stream: Any
) -> Any:
    """Fill ``out`` through this thread's two pinned pieces; each thread has its own, so any
    number of chunks move at once, and the dispatcher still chooses how each piece leaves
    the file."""
    nbytes = out.nbytes
    events: list[Any] = [None, None]
    for index, start in enumerate(range(0, nbytes, PIECE)):
        length = min(PIECE, nbytes - start)
        slot = index % 2
        if events[slot] is not None:
            events[slot].synchronize()  # its previous copy has left the piece
        skew = (file_offset + start) % BLOCK
        host = staging.piece(slot, length)[skew : skew + length]
        _read_host(fd, file_offset + start, host, path, crowded, file_system)
        out[start : start + length].set(host, stream=stream)
        events[slot] = stream.record()
    stream.synchronize()
    return out


def _fill(
    fd: int,
    file_offset: int,
    nbytes: int,
    prototype: BufferPrototype,
    path: str,
    crowded: bool,
    file_system: int,
) -> Buffer:
    """Read ``nbytes`` at ``file_offset`` into a new buffer of ``prototype``."""
    memory = _memory_of(prototype)
    if memory == "cuda":
        return prototype.buffer.from_array_like(
            _read_device(fd, file_offset, nbytes, path, crowded, file_system)
        )
    host = _host_for(file_offset, nbytes)
    _read_host(fd, file_offset, host, path, crowded, file_system)
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
        with _counted() as in_flight:
            return _fill(
                fd, file_offset, nbytes, prototype, path, in_flight >= CROWD, status.st_dev
            )
    finally:
        os.close(fd)
