"""Reads through memory maps: each chunk of the file is mapped read-only and copied into the
caller's host buffer, in chunks on ``threads`` threads.

Touching a mapped page past the end of the file raises SIGBUS, which kills the process and
no Python code can catch, and another process may shrink the file at any moment. So the
copy out of the map is made by the kernel (``process_vm_readv`` on this very process),
which reports such a page as a short copy instead: the read comes up short and the caller
raises :class:`~arrayio.errors.TruncatedFileError`. Where that call is refused (some
sandboxes forbid it), the chunk is read with ``preadv`` instead, which is as safe. The
dispatcher never picks this tool on its own; it serves reads that name it (``tool="mmap"``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Any

import numpy as np

from ..integrity._checksum import ChecksumParts
from ._io import batched, libc_function, pread_full
from ._threaded import ThreadedTool
from .base import Buffer, Capabilities, IOFuture, ReadsOnly

__all__ = ["MmapTool"]

_CHUNK = 8 << 20
_ADVICE = [
    getattr(mmap, name) for name in ("MADV_SEQUENTIAL", "MADV_WILLNEED") if hasattr(mmap, name)
]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_refused = False  # process_vm_readv was refused once: preadv from then on


def _kernel_copy(destination: int, source: int, nbytes: int) -> int | None:
    """Copy ``nbytes`` from address ``source`` to ``destination`` of this process through the
    kernel, which turns a fault into a short count instead of a signal; None if refused."""
    global _refused
    function = libc_function(
        "process_vm_readv",
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
        restype=ctypes.c_ssize_t,
    )
    if function is None or _refused:
        return None
    local, remote = _IoVec(destination, nbytes), _IoVec(source, nbytes)
    copied = function(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if copied >= 0:
        return int(copied)
    code = ctypes.get_errno()
    if code == errno.EFAULT:  # the first page already lay past the end of the file
        return 0
    _refused = True  # ENOSYS, EPERM (seccomp): refused here, for good
    return None


def _copy_mapped(fd: int, view: np.ndarray, file_offset: int) -> int:
    """Copy the ``view.nbytes`` bytes at ``file_offset`` into ``view``; return how many were
    copied (fewer when the file no longer holds them all)."""
    if not view.flags.writeable:  # the kernel's copy would not ask
        raise ValueError("assignment destination is read-only")
    base = file_offset - file_offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(
            fd, file_offset + view.nbytes - base, offset=base, access=mmap.ACCESS_READ
        )
    except ValueError:  # "mmap length is greater than file size": it shrank since fstat
        return 0
    try:
        for advice in _ADVICE:
            mapped.madvise(advice)
        source = np.frombuffer(mapped, np.uint8, count=view.nbytes, offset=file_offset - base)
        try:
            copied = _kernel_copy(view.ctypes.data, source.ctypes.data, view.nbytes)
        finally:
            # A live view of the map makes close() raise BufferError; the del runs even when
            # the copy fails, so that an exception's traceback does not keep the view alive.
            del source
    finally:
        mapped.close()
    if copied is None:
        return pread_full(fd, view, file_offset)
    return copied


class MmapTool(ReadsOnly, ThreadedTool):
    """Parallel copies out of read-only memory maps; see the module docstring.

    Parameters
    ----------
    threads
        Worker threads (1 copies every chunk in the caller's thread).

    Raises
    ------
    ValueError
        If ``threads`` is not positive.
    """

    name = "mmap"
    capabilities = Capabilities(frozenset({"host"}), directions=frozenset({"read"}))

    def __init__(self, threads: int = 4, **params: Any) -> None:
        super().__init__(threads, **params)

    def pread(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"{self.name} reads into host memory only")
        # Never map past the end of the file: touching such a page raises SIGBUS.
        count = max(0, min(buffer.nbytes, os.fstat(fd).st_size - file_offset))

        def task(start: int) -> int:
            view = buffer[start : min(start + _CHUNK, count)]
            copied = _copy_mapped(fd, view, file_offset + start)
            # A file cut inside the page a copy ends in reads as zeros past its new end, not
            # as a fault: what the file no longer holds was not read, whatever the copy says.
            copied = min(copied, max(0, os.fstat(fd).st_size - (file_offset + start)))
            if checksum is not None and copied:
                checksum.add_data(start, view[:copied])
            return copied

        starts = range(0, count, _CHUNK)
        if self.threads == 1 or (len(starts) <= 1 and not batched()):
            return IOFuture.completed(sum(task(start) for start in starts))
        pool = self._executor()
        return IOFuture.gather([IOFuture(pool.submit(task, start)) for start in starts])
