"""Loops around ``os.preadv``/``os.pwritev`` that finish what a single call may leave undone,
the task size tools use for a request, reserving a range's blocks before it is written, and
flushing a written range to the device."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import errno
import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..integrity._checksum import checksum

__all__ = ["batched", "flush_range", "in_batch", "pread_checksummed", "pread_full",
           "preallocate", "pwrite_full", "task_bytes"]

# Below this, per-task costs (a thread hand-off, a CUDA stream wait) eat the gain; measured
# on the H200 machine: 16 threads of 1 MiB tasks read 16 MiB slower than 4 threads of 4 MiB.
_MIN_TASK = 4 << 20


def pread_full(fd: int, view: np.ndarray, file_offset: int) -> int:
    """Read into all of ``view`` from ``file_offset``; return the count (short only at EOF)."""
    done = 0
    memory = memoryview(view)
    while done < view.nbytes:
        got = os.preadv(fd, [memory[done:]], file_offset + done)
        if got == 0:
            break
        done += got
    return done


# Read this much, checksum it, then read on. Measured on the H200 machine, 1 MiB pieces (to
# checksum bytes still in the core's cache) lost more to extra system calls than they saved:
# 24.8 GB/s against 32-39 for whole 8 MiB chunks, 16 threads, page cache to GPU.
_CHECKSUM_PIECE = 8 << 20


def pread_checksummed(fd: int, view: np.ndarray, file_offset: int, crc: int = 0
                      ) -> tuple[int, int]:
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
    """Write all of ``view`` at ``file_offset``; return the count."""
    done = 0
    memory = memoryview(view)
    while done < view.nbytes:
        done += os.pwritev(fd, [memory[done:]], file_offset + done)
    return done


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


def task_bytes(nbytes: int, threads: int, task_size: int, block: int = 4096) -> int:
    """The task size for a request: at most ``task_size``, but small enough that the request
    spreads over every thread (and never under ``_MIN_TASK``, where per-task costs dominate).

    Within a batch (:func:`in_batch`) it is ``task_size``: smaller tasks would only cost
    more (on the H200 VM, O_DIRECT writes of 4 MiB ran at 3/4 the rate of 32 MiB ones).
    """
    if _batched.get():
        size = task_size
    else:
        per_thread = -(-nbytes // max(threads, 1))
        size = min(task_size, max(_MIN_TASK, per_thread))
    return -(-size // block) * block


@functools.cache
def _libc_function(name: str, *argtypes: Any) -> Any:
    """The C library's function ``name`` (returning int), or None where it has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


def _sync_file_range() -> Any:
    return _libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_uint)


def _fallocate() -> Any:
    return _libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                          ctypes.c_int64)


_NO_ROOM = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def preallocate(fd: int, file_offset: int, nbytes: int) -> bool:
    """Reserve the file's blocks for ``nbytes`` at ``file_offset`` before they are written;
    return whether it did.

    Why: ext4 runs an ``O_DIRECT`` write that has to allocate blocks under the file's
    exclusive lock and waits for it there, so the threads of a parallel writer filling a new
    file take turns. On the development VM's ext4 disk, 4 x 64 MiB and 16 x 16 MiB writers
    kept no more requests at the disk than one writer of 64 MiB requests (13 and 3.7 in
    flight on average, against 13, by ``/sys/block/vda/stat``). Into reserved (unwritten)
    blocks the writes are overwrites, run under the shared lock and overlap: 25 and 35 to 42
    in flight.

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
