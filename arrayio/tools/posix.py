"""Threaded ``pread``/``pwrite`` into host memory: the range is cut into tasks of at most
``task_size`` bytes (smaller for requests that would not keep every thread busy, see
:func:`~arrayio.tools._io.task_bytes`), run on ``threads`` threads (``os.preadv`` releases
the GIL), each task checksumming its own bytes while they are in cache.

Many threads pay off when the page cache holds the data (memory bandwidth, not the disk, is
the limit) or when the device needs a deep queue; one thread is best for small ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..integrity._checksum import ChecksumParts
from ._io import (
    batched,
    pread_checksummed,
    pread_full,
    pread_scattered,
    pwrite_full,
    task_bytes,
)
from ._threaded import ThreadedTool
from .base import Buffer, Capabilities, IOFuture

__all__ = ["PosixTool"]

_NO_GAPS = np.empty(0, dtype=np.uint8)  # preadv_host's requests touch: no bytes to drop


class PosixTool(ThreadedTool):
    """Parallel ``pread``/``pwrite`` on host buffers; see the module docstring.

    Parameters
    ----------
    threads
        Worker threads (1 runs every task in the caller's thread).
    task_size
        Bytes per task.
    """

    name = "posix"
    capabilities = Capabilities(frozenset({"host"}))

    def __init__(self, threads: int = 8, task_size: int = 4 << 20, **params: Any) -> None:
        if threads < 1 or task_size < 1:
            raise ValueError(f"threads and task_size must be positive, got {threads}, {task_size}")
        super().__init__(threads, task_size=task_size, **params)
        self.task_size = task_size

    def _run(self, task: Callable[[int], int], buffer: np.ndarray, size: int) -> IOFuture[int]:
        starts = range(0, buffer.nbytes, size)
        if self.threads == 1 or (len(starts) <= 1 and not batched()):
            return IOFuture.completed(sum(task(start) for start in starts))
        pool = self._executor()
        return IOFuture.gather([IOFuture(pool.submit(task, start)) for start in starts])

    def pread(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"{self.name} reads into host memory only")

        size = task_bytes(buffer.nbytes, self.threads, self.task_size)

        def task(start: int) -> int:
            view = buffer[start : start + size]
            if checksum is None:
                return pread_full(fd, view, file_offset + start)
            got, crc = pread_checksummed(fd, view, file_offset + start)
            checksum.add(start, got, crc)
            return got

        return self._run(task, buffer, size)

    def preadv_host(self, fd: int, requests: Sequence[tuple[int, np.ndarray]]) -> IOFuture[int]:
        """Start filling the host buffers of ``requests`` (``(file_offset, buffer)``, in file
        order, each starting where the one before ends) as one range, with as few
        ``preadv`` calls as the kernel takes, as one task on the tool's threads: a shard's
        inner chunks read one request each cost a task and a system call apiece. The future
        gives the bytes of the range read: all of it, or up to the end of the file."""
        offsets = [offset for offset, _ in requests]
        views = [buffer for _, buffer in requests]
        if any(not isinstance(view, np.ndarray) for view in views):
            raise TypeError(f"{self.name} reads into host memory only")
        wanted = sum(view.nbytes for view in views)

        def task() -> int:
            if pread_scattered(fd, offsets, views, _NO_GAPS):
                return wanted
            # The file ended first: count what the buffers got, one by one, up to the first
            # short one (the run's range is read from its start up to there).
            got = 0
            for offset, view in zip(offsets, views, strict=True):
                count = pread_full(fd, view, offset)
                got += count
                if count < view.nbytes:
                    break
            return got

        return self._one_task(task)

    def pread_each_host(
        self, requests: Sequence[tuple[int, int, np.ndarray]]
    ) -> IOFuture[list[int]]:
        """Start filling the host buffers of ``requests`` (``(fd, file_offset, buffer)``, of
        any files) one after another, as one task on the tool's threads: a Zarr array's
        chunk files, read as a task each, cost more in tasks than in copies. The future
        gives each buffer's count (short only where its file ends)."""
        if any(not isinstance(buffer, np.ndarray) for _, _, buffer in requests):
            raise TypeError(f"{self.name} reads into host memory only")

        def task() -> list[int]:
            return [pread_full(fd, buffer, offset) for fd, offset, buffer in requests]

        return self._one_task(task)

    def pwrite(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"{self.name} writes from host memory only")

        size = task_bytes(buffer.nbytes, self.threads, self.task_size)

        def task(start: int) -> int:
            view = buffer[start : start + size]
            if checksum is not None:
                checksum.add_data(start, view)
            return pwrite_full(fd, view, file_offset + start)

        return self._run(task, buffer, size)
