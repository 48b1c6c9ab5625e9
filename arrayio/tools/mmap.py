"""Reads through memory maps: the file's pages are mapped read-only and copied into the
caller's host buffer by NumPy, in chunks on ``threads`` threads (the copy releases the GIL).

No system call per chunk moves data: page faults do, with the kernel's readahead, which
``MADV_SEQUENTIAL`` and ``MADV_WILLNEED`` widen. That suits data already in the page cache.

Each chunk maps only its own page-aligned range, so a chunk's mapping is released as soon as
its copy ends and no mapping is shared between threads.

Touching a mapped page beyond the end of the file raises SIGBUS, which kills the process and
which no Python code can catch. The range is clamped to the size that ``fstat`` reports, and
each chunk's pages are faulted in by ``MADV_POPULATE_READ`` (Linux 5.14 on), which reports a
file that has shrunk since as an error instead: the read comes up short and the caller
raises :class:`~arrayio.errors.TruncatedFileError`. A file shrunk by another process in the
instant between that and the copy can still kill the reader, so the dispatcher never picks
this tool on its own; it serves only reads that name it (``tool="mmap"``).
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from typing import Any

import numpy as np

from ..errors import ToolUnavailableError
from ..integrity._checksum import ChecksumParts
from ._io import batched
from ._threaded import ThreadedTool
from .base import Buffer, Capabilities, IOFuture

__all__ = ["MmapTool"]

_CHUNK = 8 << 20
_ADVICE = [getattr(mmap, name) for name in ("MADV_SEQUENTIAL", "MADV_WILLNEED")
           if hasattr(mmap, name)]
# Linux's value (the mmap module names it from Python 3.13 on).
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


def _populate(mapped: mmap.mmap) -> bool:
    """Fault every page of ``mapped`` in; False if part of it lies past the end of the file
    (where touching it would raise SIGBUS)."""
    if _POPULATE_READ is None:
        return True
    try:
        mapped.madvise(_POPULATE_READ)
    except OSError as error:
        if error.errno == errno.EFAULT:
            return False
        if error.errno != errno.EINVAL:  # EINVAL: a kernel without it
            raise
    return True


def _copy_mapped(fd: int, view: np.ndarray, file_offset: int) -> int:
    """Copy the ``view.nbytes`` bytes at ``file_offset`` into ``view``; return how many were
    copied: all of them, or none when the file no longer holds them all."""
    base = file_offset - file_offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, file_offset + view.nbytes - base, offset=base,
                           access=mmap.ACCESS_READ)
    except ValueError:  # "mmap length is greater than file size": it shrank since fstat
        return 0
    try:
        for advice in _ADVICE:
            mapped.madvise(advice)
        if not _populate(mapped):
            return 0
        source = np.frombuffer(mapped, np.uint8, count=view.nbytes, offset=file_offset - base)
        try:
            np.copyto(view, source)
        finally:
            # A live view of the map makes close() raise BufferError; the del runs even when
            # the copy fails, so that an exception's traceback does not keep the view alive.
            del source
    finally:
        mapped.close()
    return view.nbytes


class MmapTool(ThreadedTool):
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

    def pread(self, fd: int, buffer: Buffer, file_offset: int, *,
              checksum: ChecksumParts | None = None) -> IOFuture[int]:
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"{self.name} reads into host memory only")
        # Never map past the end of the file: touching such a page raises SIGBUS.
        count = max(0, min(buffer.nbytes, os.fstat(fd).st_size - file_offset))

        def task(start: int) -> int:
            view = buffer[start : min(start + _CHUNK, count)]
            copied = _copy_mapped(fd, view, file_offset + start)
            if checksum is not None and copied:
                checksum.add_data(start, view)
            return copied

        starts = range(0, count, _CHUNK)
        if self.threads == 1 or (len(starts) <= 1 and not batched()):
            return IOFuture.completed(sum(task(start) for start in starts))
        pool = self._executor()
        return IOFuture.gather([IOFuture(pool.submit(task, start)) for start in starts])

    def pwrite(self, fd: int, buffer: Buffer, file_offset: int, *,
               checksum: ChecksumParts | None = None) -> IOFuture[int]:
        """Not supported: the capabilities say reads only, so the dispatcher never asks.

        Raises
        ------
        ToolUnavailableError
            Always.
        """
        raise ToolUnavailableError("mmap reads only")
