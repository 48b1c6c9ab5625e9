"""Reads that many threads ask for one at a time, moved as the dispatcher's batches.

A Zarr store is asked for one chunk at a time, by as many threads as zarr, Dask or the
caller run. Each read a dispatcher call of its own would cost a call's overhead per chunk,
and calls that share the disk and the tools' threads measure the crowd, not the tool. So the
reads wait in one queue, and a thread that finds fewer than :data:`LEADERS` batches moving
leads: it takes everything queued as one batch (:meth:`Dispatcher.read_files
<arrayio.dispatch.dispatcher.Dispatcher.read_files>`: one tool, every read in flight, one
context learned), and the queue again once that batch is done, until it is empty. The reads
asked for while batches move go in the next one; no thread waits for a timer.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence

from ..tools import Buffer
from . import dispatcher

__all__ = ["Coalescer", "read"]


@dataclasses.dataclass
class _Read:
    fd: int
    file_offset: int
    buffer: Buffer
    path: str
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


# Batches moving at once: a reader that finds fewer leads one. A store's callers keep a window
# of reads in flight (zarr's async concurrency) and ask for the next as one lands: with one
# batch at a time, those wait for the whole batch, and the disk's queue drains at the end of
# every batch.
LEADERS = 4


class Coalescer:
    """A queue of reads, moved in batches by whichever waiting thread leads; see the module
    docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[_Read] = []
        self._leaders = 0
        self.batches = 0  # batches moved, for tests

    def read(self, fd: int, file_offset: int, buffer: Buffer, path: str) -> None:
        """Fill ``buffer`` from ``fd`` at ``file_offset``, in the next batch; return once it
        is full.

        Raises
        ------
        TruncatedFileError
            If the file ends before ``buffer`` is full (that read's own error: the batch's
            other reads are unaffected).
        """
        read = _Read(fd, file_offset, buffer, path)
        with self._lock:
            self._queue.append(read)
            lead = self._leaders < LEADERS
            self._leaders += lead
        if lead:
            self._lead()
        read.done.wait()
        if read.error is not None:
            raise read.error

    def _lead(self) -> None:
        """Move the queue's reads, batch after batch, until it is empty."""
        batch: list[_Read] = []
        try:
            while True:
                with self._lock:
                    batch, self._queue = self._queue, []
                    if not batch:
                        self._leaders -= 1
                        return
                for group in _by_placement(batch):
                    _move(group)
                self.batches += 1
        except BaseException as error:  # an interrupt: no read may wait forever
            with self._lock:
                stranded, self._queue = batch + self._queue, []
                self._leaders -= 1
            for read in stranded:
                if not read.done.is_set():
                    read.error = error
                    read.done.set()
            raise


def _by_placement(batch: list[_Read]) -> list[list[_Read]]:
    """The batch's reads by memory kind and device (a dispatcher batch is of one)."""
    groups: dict[tuple[str, int], list[_Read]] = {}
    for read in batch:
        groups.setdefault(dispatcher._placement(read.buffer), []).append(read)
    return list(groups.values())


def _move(group: Sequence[_Read]) -> None:
    """Fill every read of ``group`` (one memory kind and device), each marked done, with its
    own error where it has one."""
    chosen = dispatcher.get()
    nbytes = sum(read.buffer.nbytes for read in group)
    try:
        if len(group) > 1 and nbytes >= dispatcher.SMALL_TRANSFER:
            chosen.read_files(
                [(read.fd, read.file_offset, read.buffer) for read in group],
                paths=[read.path for read in group],
            )
            for read in group:
                read.done.set()
            return
    except Exception:  # noqa: BLE001 - which read failed: each is read again, alone
        pass
    for read in group:
        if read.done.is_set():
            continue
        try:
            chosen.read(read.fd, read.buffer, read.file_offset, path=read.path)
        except Exception as error:  # noqa: BLE001 - the read's own error, raised in its thread
            read.error = error
        read.done.set()


_coalescer = Coalescer()


def read(fd: int, file_offset: int, buffer: Buffer, path: str = "<file>") -> None:
    """Fill ``buffer`` from ``fd`` at ``file_offset`` through the process's queue of reads
    (:class:`Coalescer`), with the reads other threads ask for meanwhile."""
    _coalescer.read(fd, file_offset, buffer, path)


def _after_fork_in_child() -> None:
    # The parent's queue and its leader are not the child's.
    global _coalescer
    _coalescer = Coalescer()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
