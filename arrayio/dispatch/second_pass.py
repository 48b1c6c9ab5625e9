"""A second read of what a cold read keeps in the page cache, in the background.

The kernel puts a page read from the disk on its inactive list and moves it to its active
list at the page's second read. Whoever reads the page next pays that move, under a lock the
readers share: the first reload after a cold load runs below the page cache's rate, the
more so the more threads and processes move pages at once, and every later one at it
(``docs/design/measurement.md``, "Warm loads follow two passes").
The dispatcher keeps a cold read's bytes in the page cache when the file is expected to be
read again (``keep`` in its context), so right after such a read a thread of its own reads
the same ranges once more: the moves are paid between the caller's loads, not inside the
next one.

The second pass never slows a transfer and never reads the disk:

* it waits while any transfer of the dispatcher is in flight (a reload that comes first
  pays for the pages left, as without the pass);
* a piece is read only where ``cachestat`` finds all of it in the page cache (pages evicted
  since are skipped, not read back), with ``RWF_NOWAIT``, through a file description of its
  own with readahead off; without ``cachestat`` there is no second pass;
* it stops when the process's exit begins.

A page the pass is reading cannot be evicted at that moment: :func:`evict`, which
``tune()``, the sweep and the benchmarks use for their cold reads, lets the passes end
first.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Sequence

from ..runtime import _background
from .context import wholly_cached

__all__ = ["MAX_WAITING", "PIECE", "SecondPass", "evict", "wait_all"]

PIECE = 4 << 20  # bytes a read of the pass takes: one scratch buffer's worth
# Passes waiting at most: each holds a file description open until it runs, and a program
# reading thousands of files cold in a row must not run out of descriptors for them (the
# reads beyond it get no pass: their next load pays the moves, as without one).
MAX_WAITING = 64
_WAIT = 0.002  # seconds between looks at whether the dispatcher's transfers are done


def _open_again(fd: int) -> int | None:
    """A new read-only description of ``fd``'s file (its own offset and readahead state:
    the caller's are left alone), with readahead off; None where there is none."""
    try:
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.posix_fadvise(own, 0, 0, os.POSIX_FADV_RANDOM)
    except (OSError, AttributeError):
        pass
    return own


def _read_cached(fd: int, buffer: memoryview, offset: int) -> int:
    """``buffer``'s length of bytes at ``offset`` where the page cache holds all of them
    (else 0, read nothing): a read of a page not there would start I/O, even with
    ``RWF_NOWAIT`` (which only does not wait for it)."""
    if not wholly_cached(fd, offset, len(buffer)):
        return 0
    try:
        return os.preadv(fd, [buffer], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return 0


class SecondPass:
    """Reads, on one background thread, the ranges :meth:`after_cold_read` is given.

    ``busy()`` says whether a transfer is under way (the pass waits until it is not);
    ``read`` reads a piece as :func:`_read_cached` does (replaced in tests)."""

    def __init__(
        self,
        busy: Callable[[], bool],
        read: Callable[[int, memoryview, int], int] = _read_cached,
    ) -> None:
        self._busy = busy
        self._read = read
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[int, list[tuple[int, int]]]] = collections.deque()
        self._running = False
        self._stopped = False
        self._done = threading.Event()
        self._done.set()
        _passes.add(self)

    def after_cold_read(self, fd: int, ranges: Sequence[tuple[int, int]]) -> None:
        """Read ``ranges`` (``(offset, nbytes)`` of ``fd``'s file) once more, soon."""
        ranges = [(offset, nbytes) for offset, nbytes in ranges if nbytes > 0]
        if not ranges or not hasattr(os, "RWF_NOWAIT") or _background.exiting():
            return
        if len(self._jobs) >= MAX_WAITING:  # (read unlocked: a bound, not an exact count)
            return
        own = _open_again(fd)
        if own is None:
            return
        if self._read is _read_cached and wholly_cached(own, *ranges[0]) is None:
            os.close(own)  # nothing can tell what is cached: no pass (it might read the disk)
            return
        with self._lock:
            if self._stopped:
                os.close(own)
                return
            self._jobs.append((own, sorted(ranges)))
            self._done.clear()
            if self._running:
                return
            self._running = True
        thread = _background.start(self._run, name="arrayio-second-pass")
        if thread.ident is None:  # the exit has begun: nothing will run
            self._drop(stop=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every pass given so far has ended, waiting up to ``timeout`` seconds."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop: the pass under way ends at its next piece, the others are dropped."""
        self._drop(stop=True)

    def _drop(self, stop: bool) -> None:
        """Drop the passes not begun; ``stop``: and end the one under way, else no thread of
        this process runs them (none could start, or the process is a fork's child)."""
        with self._lock:
            self._stopped = self._stopped or stop
            jobs, self._jobs = list(self._jobs), collections.deque()
            if not stop:
                self._running = False
            if not self._running:
                self._done.set()
        for fd, _ in jobs:
            os.close(fd)

    def _run(self) -> None:
        buffer = memoryview(bytearray(PIECE))
        while True:
            with self._lock:
                if not self._jobs or self._stopped:
                    self._running = False
                    self._done.set()
                    return
                fd, ranges = self._jobs.popleft()
            try:
                self._pass(fd, ranges, buffer)
            finally:
                os.close(fd)

    def _pass(self, fd: int, ranges: list[tuple[int, int]], buffer: memoryview) -> None:
        for offset, nbytes in ranges:
            end = offset + nbytes
            while offset < end:
                while self._busy():
                    if _background.exiting() or self._stopped:
                        return
                    _background.sleep(_WAIT)
                if _background.exiting() or self._stopped:
                    return
                view = buffer[: min(len(buffer), end - offset)]
                try:
                    got = self._read(fd, view, offset)
                except OSError:
                    return
                # Pages no longer cached (or the file's end): the rest of this piece is
                # skipped, as the pass reads only what the page cache holds.
                offset += len(view) if got < len(view) else got


_passes: weakref.WeakSet[SecondPass] = weakref.WeakSet()


def wait_all(timeout: float = 30.0) -> bool:
    """Whether every pass of every dispatcher in this process has ended, waiting up to
    ``timeout`` seconds for each."""
    return all(passes.wait(timeout) for passes in list(_passes))


def evict(fd: int) -> None:
    """Push ``fd``'s file out of the page cache (``posix_fadvise(DONTNEED)``), once this
    process's second passes have ended: a page a pass is reading cannot be evicted, so a
    cold measurement right after a cold read would find part of its file still cached."""
    wait_all()
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _after_fork_in_child() -> None:
    # The parent's thread is not the child's (nor its lock, which it may have held): the
    # passes it had queued are dropped, and the child's next pass starts a thread of its own.
    for passes in list(_passes):
        passes._lock = threading.Lock()
        passes._done = threading.Event()
        passes._drop(stop=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
