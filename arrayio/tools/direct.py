"""Parallel ``O_DIRECT`` reads and writes between files and host memory, bypassing the page
cache: what reads a file larger than memory at the disk's speed, and what writes one without
evicting everything else.

A request of any shape is cut at block boundaries (:data:`~arrayio.tools._io.BLOCK`): the
aligned interior moves straight between the disk and the caller's buffer where the buffer's
address and the file offset agree modulo a block, through an aligned bounce buffer
otherwise; a partial block at either end is read whole through the bounce buffer, and
written with a plain buffered ``pwrite``, since ``O_DIRECT`` writes whole blocks only. The
tool opens its own ``O_DIRECT`` descriptor of the caller's file for each call. A file system
that refuses ``O_DIRECT`` raises :class:`~arrayio.errors.ToolUnavailableError`: the dispatcher
falls back, and records why. ``docs/design/tools.md`` says more.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..arrays._buffers import aligned_empty
from ..integrity._checksum import ChecksumParts
from ._io import (
    BLOCK,
    align_down,
    align_up,
    batched,
    open_direct,
    pread_direct,
    pwrite_direct,
    pwrite_full,
)
from ._lending import BufferPool
from ._threaded import ThreadedTool
from .base import Availability, Buffer, Capabilities, IOFuture

__all__ = ["DirectTool"]


def _pieces(file_offset: int, nbytes: int, task_size: int) -> list[tuple[int, int]]:
    """Cut ``[file_offset, file_offset + nbytes)`` into ``(start, end)`` file ranges.

    A range within at most two blocks and no whole block is one piece; otherwise a partial
    head block, ``task_size`` pieces of the aligned interior, and a partial tail block.
    """
    end = file_offset + nbytes
    low, high = align_up(file_offset), align_down(end)
    if low >= high:
        return [(file_offset, end)]
    pieces = [(file_offset, low)] if file_offset < low else []
    pieces += [(start, min(start + task_size, high)) for start in range(low, high, task_size)]
    if high < end:
        pieces.append((high, end))
    return pieces


def _whole_blocks(start: int, end: int) -> bool:
    return start % BLOCK == 0 and end % BLOCK == 0


def _fan_out(
    pool: concurrent.futures.Executor,
    jobs: Sequence[Callable[[], int]],
    cleanup: Callable[[], None],
) -> concurrent.futures.Future[int]:
    """Run ``jobs`` (at least one) on ``pool``; a future for the sum of their counts that
    completes only after every job has ended and ``cleanup`` has run, whatever failed."""
    outcome: concurrent.futures.Future[int] = concurrent.futures.Future()
    lock = threading.Lock()
    state: dict[str, Any] = {"left": len(jobs), "total": 0, "error": None}

    def finished(job: concurrent.futures.Future[int]) -> None:
        with lock:
            if job.exception() is None:
                state["total"] += job.result()
            elif state["error"] is None:
                state["error"] = job.exception()
            state["left"] -= 1
            if state["left"]:
                return
        try:
            cleanup()
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            state["error"] = state["error"] or exc
        if state["error"] is not None:
            outcome.set_exception(state["error"])
        else:
            outcome.set_result(state["total"])

    for job in jobs:
        try:
            submitted = pool.submit(job)
        except BaseException as exc:  # noqa: BLE001 - a shut-down pool: the job failed
            submitted = concurrent.futures.Future()
            submitted.set_exception(exc)
        submitted.add_done_callback(finished)
    return outcome


@functools.cache
def _availability() -> Availability:
    if not getattr(os, "O_DIRECT", 0):
        return Availability(False, "O_DIRECT does not exist on this platform")
    if not os.path.isdir("/proc/self/fd"):
        return Availability(False, "no /proc/self/fd to reopen files with O_DIRECT")
    return Availability(True)


class DirectTool(ThreadedTool):
    """Parallel ``O_DIRECT`` ``pread``/``pwrite`` on host buffers; see the module docstring.

    Parameters
    ----------
    threads
        Worker threads (1 runs every task in the caller's thread).
    task_size
        Bytes per task, rounded up to a multiple of 4096.

    Raises
    ------
    ValueError
        If ``threads`` or ``task_size`` is not positive.
    """

    name = "direct"
    capabilities = Capabilities(frozenset({"host"}), alignment=BLOCK, checksums=True)

    def __init__(self, threads: int = 8, task_size: int = 8 << 20, **params: Any) -> None:
        if threads < 1 or task_size < 1:
            raise ValueError(f"threads and task_size must be positive, got {threads}, {task_size}")
        task_size = align_up(task_size)
        super().__init__(threads, task_size=task_size, **params)
        self.task_size = task_size
        self._spare = BufferPool(keep=threads)

    @classmethod
    def availability(cls) -> Availability:
        return _availability()

    def _bounce(self) -> Any:
        """Lend an aligned buffer of ``task_size`` (at least two blocks) to one task."""
        return self._spare.lend(None, lambda: aligned_empty(max(self.task_size, 2 * BLOCK), BLOCK))

    def _run(
        self,
        task: Callable[[int, int], int],
        pieces: list[tuple[int, int]],
        nbytes: int,
        direct_fd: int | None,
    ) -> IOFuture[int]:
        def cleanup() -> None:
            if direct_fd is not None:
                os.close(direct_fd)

        if self.threads == 1 or (nbytes <= self.task_size and not batched()):
            try:
                return IOFuture.completed(sum(task(start, end) for start, end in pieces))
            finally:
                cleanup()
        try:
            pool = self._executor()
        except BaseException:
            cleanup()
            raise
        jobs = [functools.partial(task, start, end) for start, end in pieces]
        return IOFuture(_fan_out(pool, jobs, cleanup))

    def pread(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"{self.name} reads into host memory only")
        if buffer.nbytes == 0:
            return IOFuture.completed(0)
        congruent = (buffer.__array_interface__["data"][0] - file_offset) % BLOCK == 0
        pieces = _pieces(file_offset, buffer.nbytes, self.task_size)
        direct_fd = open_direct(fd, os.O_RDONLY)

        def task(start: int, end: int) -> int:
            at = start - file_offset
            if congruent and _whole_blocks(start, end):
                count = pread_direct(direct_fd, buffer[at : at + end - start], start)
            else:
                first = align_down(start)
                with self._bounce() as bounce:
                    got = pread_direct(direct_fd, bounce[: align_up(end) - first], first)
                    count = min(max(first + got - start, 0), end - start)
                    buffer[at : at + count] = bounce[start - first : start - first + count]
            if checksum is not None:
                checksum.add_data(at, buffer[at : at + count])
            return count

        return self._run(task, pieces, buffer.nbytes, direct_fd)

    def pwrite(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"{self.name} writes from host memory only")
        if buffer.nbytes == 0:
            return IOFuture.completed(0)
        congruent = (buffer.__array_interface__["data"][0] - file_offset) % BLOCK == 0
        pieces = _pieces(file_offset, buffer.nbytes, self.task_size)
        whole = any(_whole_blocks(start, end) for start, end in pieces)
        direct_fd = open_direct(fd, os.O_WRONLY) if whole else None

        def task(start: int, end: int) -> int:
            at = start - file_offset
            view = buffer[at : at + end - start]
            if checksum is not None:
                checksum.add_data(at, view)
            if not _whole_blocks(start, end):
                # O_DIRECT writes whole blocks only; see the module docstring.
                return pwrite_full(fd, view, start)
            assert direct_fd is not None
            if congruent:
                return pwrite_direct(direct_fd, fd, view, start)
            with self._bounce() as bounce:
                staged = bounce[: view.nbytes]
                staged[...] = view
                return pwrite_direct(direct_fd, fd, staged, start)

        return self._run(task, pieces, buffer.nbytes, direct_fd)

    def close(self) -> None:
        super().close()
        self._spare.clear()
