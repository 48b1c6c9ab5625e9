"""The system calls the tools share: loops around ``os.preadv``/``os.pwritev`` that finish
what a single call may leave undone, buffered or ``O_DIRECT``; the task size for a request;
reserving a range's blocks before it is written, and flushing a written range to the device.
``docs/design/tools.md`` gives the reasons for the sizes."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import errno
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import ToolUnavailableError
from ..integrity._checksum import checksum

__all__ = [
    "BLOCK",
    "align_down",
    "align_up",
    "batched",
    "flush_range",
    "in_batch",
    "open_direct",
    "pread_checksummed",
    "pread_direct",
    "pread_full",
    "preallocate",
    "pwrite_direct",
    "pwrite_full",
    "start_writeback",
    "task_bytes",
]

BLOCK = 4096
"""What ``O_DIRECT`` needs file offsets, lengths and memory addresses to be multiples of:
the logical block size of every common device, or a multiple of it."""

# Below this, per-task costs (a thread hand-off, a CUDA stream wait) eat the gain: 16 threads
# of 1 MiB tasks read 16 MiB slower than 4 threads of 4 MiB.
_MIN_TASK = 4 << 20


def pread_full(fd: int, view: np.ndarray, file_offset: int) -> int:
    """Read into all of ``view`` from ``file_offset``; return the count (short only at EOF)."""
    done = 0
    memory = view.data
    while done < view.nbytes:
        got = os.preadv(fd, [memory[done:]], file_offset + done)
        if got == 0:
            break
        done += got
    return done


# Buffers one preadv call takes at most (Linux's IOV_MAX).
_IOV_MAX = 1024


def pread_scattered(
    fd: int, offsets: Sequence[int], views: Sequence[np.ndarray], scratch: np.ndarray
) -> bool:
    """Read each of ``views`` (C-contiguous host arrays) from its file offset in ``offsets``
    (in file order, none overlapping, the gaps between them at most ``scratch``'s size)
    with as few ``preadv`` calls as the kernel takes: straight into the views, the gaps
    into ``scratch``. Whether every view was filled (False where the file ends first: the
    caller reads them one by one to say which). The arrays themselves are the call's
    buffers: no object the collector tracks is made per view (a load of thousands of small
    arrays runs this with the collector on)."""
    if not views:
        return True
    vectors: list[np.ndarray] = []
    at = offsets[0]
    for offset, view in zip(offsets, views, strict=True):
        if offset < at or offset - at > scratch.nbytes:
            raise ValueError("pieces overlap, are out of order, or leave a gap past the scratch")
        if offset > at:
            vectors.append(scratch[: offset - at])
        vectors.append(view)
        at = offset + view.nbytes
    start, offset = 0, offsets[0]
    while start < len(vectors):
        batch = vectors[start : start + _IOV_MAX]
        want = sum(vector.nbytes for vector in batch)
        got = os.preadv(fd, batch, offset)  # type: ignore[arg-type]  # (arrays are buffers)
        if got < want and not _finish_short(fd, batch, offset, got):
            return False
        offset += want
        start += _IOV_MAX
    return True


def _finish_short(fd: int, vectors: list[np.ndarray], offset: int, got: int) -> bool:
    """Read what a short ``preadv`` of ``vectors`` at ``offset`` left (``got`` bytes came:
    a signal, or the file's end), one vector at a time; whether all of it came."""
    for vector in vectors:
        flat = vector.reshape(-1).view(np.uint8)
        if got < flat.nbytes:
            rest = flat[got:]
            if pread_full(fd, rest, offset + got) != rest.nbytes:
                return False
        got = max(0, got - flat.nbytes)
        offset += flat.nbytes
    return True


# Read this much, checksum it, then read on: smaller pieces (to checksum bytes still in the
# core's cache) lose more to the extra system calls than they save.
_CHECKSUM_PIECE = 8 << 20


def pread_checksummed(fd: int, view: np.ndarray, file_offset: int, crc: int = 0) -> tuple[int, int]:
    """:func:`pread_full` that also extends the CRC-32C ``crc`` with the bytes read, piece
    by piece while each piece is in cache; returns (bytes read, CRC)."""
    done = 0
    while done < view.nbytes:
        piece = view[done : done + _CHECKSUM_PIECE]
        got = pread_full(fd, piece, file_offset + done)
        crc = checksum(piece[:got], crc)
        done += got
        if got < piece.nbytes:
            break
    return done, crc


def pwrite_full(fd: int, view: np.ndarray, file_offset: int) -> int:
    """Write all of ``view`` at ``file_offset``; return the count. A write of
    :data:`WRITEBACK_FROM` bytes or more starts its pages' writeback (:func:`start_writeback`)."""
    done = 0
    memory = view.data
    while done < view.nbytes:
        done += os.pwritev(fd, [memory[done:]], file_offset + done)
    if done >= WRITEBACK_FROM:
        start_writeback(fd, file_offset, done)
    return done


# Buffered writes of at least this many bytes start their writeback at once. Every write of
# arrayio's is flushed before the call returns (its durability); left to the kernel, the
# pages wait in the page cache until that flush, so the disk idles while the bytes are
# copied and the copy waits while the disk writes. Started as each piece is written, the
# disk works from the first piece on: buffered saves ran at about twice the rate on the
# development machine (docs/design/tools.md).
WRITEBACK_FROM = 1 << 20

_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; wait for nothing


def start_writeback(fd: int, file_offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``file_offset`` back to the device now,
    not waiting for them (a hint: where ``sync_file_range`` is missing or refused, nothing
    happens; the flush that follows the write does the job)."""
    function = _sync_file_range()
    if function is not None:
        function(fd, file_offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_batched: contextvars.ContextVar[bool] = contextvars.ContextVar("arrayio_batched", default=False)


@contextlib.contextmanager
def in_batch() -> Iterator[None]:
    """Requests a tool is handed (in this thread) within are parts of a batch, whose other
    requests keep its threads busy: :func:`task_bytes` does not spread them."""
    token = _batched.set(True)
    try:
        yield
    finally:
        _batched.reset(token)


def batched() -> bool:
    """Whether the request being handed to a tool is part of a batch (:func:`in_batch`):
    then even a request of one task goes to the tool's threads, so that the batch's
    requests run side by side instead of one after another in the caller's thread."""
    return _batched.get()


def task_bytes(nbytes: int, threads: int, task_size: int, block: int = BLOCK) -> int:
    """The task size for a request: at most ``task_size``, but small enough that the request
    spreads over every thread (and never under ``_MIN_TASK``, where per-task costs dominate).

    Within a batch (:func:`in_batch`) it is ``task_size``: the batch's other requests keep
    the threads busy, and smaller requests only cost more (small ``O_DIRECT`` writes leave
    a disk's queue short of its rate).
    """
    if _batched.get():
        size = task_size
    else:
        per_thread = -(-nbytes // max(threads, 1))
        size = min(task_size, max(_MIN_TASK, per_thread))
    return -(-size // block) * block


@functools.cache
def libc_function(name: str, *argtypes: Any, restype: Any = ctypes.c_int) -> Any:
    """The C library's function ``name``, or None where it has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = restype
    return function


def _sync_file_range() -> Any:
    return libc_function(
        "sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
    )


def _fallocate() -> Any:
    return libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


_NO_ROOM = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def preallocate(fd: int, file_offset: int, nbytes: int) -> bool:
    """Reserve the file's blocks for ``nbytes`` at ``file_offset`` before they are written;
    return whether it did.

    Why: ext4 runs an ``O_DIRECT`` write that has to allocate blocks under the file's
    exclusive lock and waits for it there, so the threads of a parallel writer filling a new
    file take turns, keeping no more requests at the disk than one writer would. Into
    reserved (unwritten) blocks the writes are overwrites, run under the shared lock and
    overlap (``docs/design/tools.md`` has the figures).

    ``fallocate`` (mode 0) also extends the file's size to the range's end, as the write
    would. Nothing happens where the file already reaches that far (an overwrite, or a
    range reserved before), nor where the platform or file system has no ``fallocate``
    (``posix_fallocate`` is not used: without file-system support it writes zeros over the
    whole range). A disk without room for the range raises ``OSError`` (``ENOSPC``) before
    anything is written.
    """
    if nbytes <= 0:
        return False
    function = _fallocate()
    if function is None or os.fstat(fd).st_size >= file_offset + nbytes:
        return False
    if function(fd, 0, file_offset, nbytes) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_ROOM:
        raise OSError(code, os.strerror(code))
    return False  # not supported here (a pipe, a file system without it): write anyway


_WAIT_WRITE_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER


def flush_range(fd: int, file_offset: int, nbytes: int) -> None:
    """Wait until ``nbytes`` at ``file_offset`` are on the device (data only, no metadata).

    ``sync_file_range`` flushes just that range, without the journal commit ``fdatasync``
    would force; where it is missing, ``fdatasync`` does the job for the whole file.
    """
    function = _sync_file_range()
    if function is None or function(fd, file_offset, nbytes, _WAIT_WRITE_WAIT) != 0:
        os.fdatasync(fd)


# ---- O_DIRECT ----------------------------------------------------------------------------


def align_down(n: int) -> int:
    """``n`` rounded down to a multiple of :data:`BLOCK`."""
    return n - n % BLOCK


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`BLOCK`."""
    return -(-n // BLOCK) * BLOCK


# Errors with which a file system refuses O_DIRECT: no tool bug, no data error.
_REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP})


def open_direct(fd: int, flags: int) -> int:
    """Open the file behind ``fd`` again (through ``/proc/self/fd``), with ``O_DIRECT`` and
    ``flags``.

    Raises
    ------
    ToolUnavailableError
        If the platform has no ``O_DIRECT`` or the file system refuses it (tmpfs before
        Linux 6.6, some FUSE and network file systems).
    """
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        raise ToolUnavailableError("O_DIRECT does not exist on this platform")
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | direct)
    except OSError as exc:
        if exc.errno in _REFUSALS:
            raise _refused(fd, exc, "open") from exc
        raise


def pread_direct(direct_fd: int, view: np.ndarray, file_offset: int) -> int:
    """Read whole blocks into ``view`` (block-aligned, as ``file_offset``) from an
    :func:`open_direct` descriptor; return the count, short only at the end of the file.

    Raises
    ------
    ToolUnavailableError
        If the device refuses the request (it wants more than :data:`BLOCK` alignment).
    """
    done = 0
    memory = view.data
    while done < view.nbytes:
        try:
            got = os.preadv(direct_fd, [memory[done:]], file_offset + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise _refused(direct_fd, exc, "read") from exc
            raise
        done += got
        # O_DIRECT returns the exact count at the end of the file, after which the next
        # offset is no longer aligned: stop there rather than loop.
        if got == 0 or done % BLOCK:
            break
    return done


def pwrite_direct(direct_fd: int, fd: int, view: np.ndarray, file_offset: int) -> int:
    """Write all of ``view`` (whole blocks, block-aligned, as ``file_offset``) through an
    :func:`open_direct` descriptor; a short write that ends within a block is finished
    through ``fd``, the file's own descriptor, since ``O_DIRECT`` cannot resume there.
    Return the count.

    Raises
    ------
    ToolUnavailableError
        If the device refuses the request (it wants more than :data:`BLOCK` alignment).
    """
    done = 0
    memory = view.data
    while done < view.nbytes:
        if done % BLOCK:
            return done + pwrite_full(fd, view[done:], file_offset + done)
        try:
            done += os.pwritev(direct_fd, [memory[done:]], file_offset + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise _refused(direct_fd, exc, "write") from exc
            raise
    return done


def _refused(fd: int, exc: OSError, what: str) -> ToolUnavailableError:
    path, kind = _file_system(fd)
    return ToolUnavailableError(
        f"O_DIRECT {what} refused for {path} on its {kind} file system "
        f"([Errno {exc.errno}] {exc.strerror})"
    )


def _file_system(fd: int) -> tuple[str, str]:
    """The path of ``fd`` and the type of the file system holding it (for error messages)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>", "unknown"
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return path, kind
