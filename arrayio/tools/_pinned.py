"""Pinned (page-locked) host memory, lent from one pool shared by every tool of the process.

Pinning costs about as much time per byte as reading the bytes from the page cache (the
kernel faults in, locks and maps every page), so a first call that pins everything a
pipeline might use spends more time pinning than moving data, and an exploration that tries
a new arm pins its buffers all over again. So:

- one pool serves every tool and every call: a spare buffer of one arm is lent to another
  that it fits;
- buffers are cut from slabs of at least :data:`SLAB_BYTES` pinned at once: the workers of a
  pipeline that each want a first buffer wait for one pinning instead of contending for the
  driver with one each;
- sizes are rounded up to a power of two (1 MiB at least) plus a little slack, so that a
  spare fits the next request of a similar size instead of growing a few kilobytes at a time;
- borrowers take a buffer when they need it, not before (a pipeline worker takes its second
  buffer for its second chunk), so a transfer pins no more than it uses;
- the spares kept are bounded in bytes (:data:`KEEP_BYTES`), the oldest dropped first.

A buffer is lent to one borrower at a time: two concurrent transfers through one staging
buffer would mix their bytes.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["KEEP_BYTES", "SLAB_BYTES", "Borrowed", "PinnedPool", "allocate_pinned", "pool"]

BLOCK = 4096
SLACK = 2 * BLOCK  # room for a block-aligned O_DIRECT span around an unaligned range
MIN_CLASS = 1 << 20
# Spares kept between calls. It covers the largest candidate pipeline's buffers (16 workers,
# two 16 MiB buffers each), so that steady calls never pin again.
KEEP_BYTES = 1 << 30
# Pinned at once, for the buffers cut from it: a pipeline's first buffers (8 workers of 4 MiB)
# from one pinning. A slab stays pinned while any buffer cut from it is alive.
SLAB_BYTES = 32 << 20

Allocate = Callable[[int], np.ndarray]


def size_class(nbytes: int) -> int:
    """The payload size a buffer for ``nbytes`` gets: a power of two, 1 MiB at least, such
    that the payload plus :data:`SLACK` holds ``nbytes``."""
    payload = max(nbytes - SLACK, 1)
    return max(MIN_CLASS, 1 << (payload - 1).bit_length())


def allocate_pinned(nbytes: int) -> np.ndarray:
    """``nbytes`` of pinned host memory as a NumPy byte array, from the CUDA driver (no
    framework imported for it)."""
    from ..arrays import _cuda

    return _cuda.alloc_pinned(nbytes)


class PinnedPool:
    """Block-aligned pinned buffers, lent one borrower at a time; see the module docstring.

    Parameters
    ----------
    keep_bytes
        The most bytes of spare buffers kept between loans.
    allocate
        Makes ``n`` bytes of pinned host memory (default :func:`allocate_pinned`).
    slab_bytes
        The least bytes pinned at once, cut into buffers as they are asked for.
    """

    def __init__(
        self,
        keep_bytes: int = KEEP_BYTES,
        allocate: Allocate = allocate_pinned,
        slab_bytes: int = SLAB_BYTES,
    ) -> None:
        self.keep_bytes = keep_bytes
        self.slab_bytes = slab_bytes
        self._allocate = allocate
        self._spare: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._spare_bytes = 0
        self._lock = threading.Lock()
        # The slab buffers are cut from, and its first byte not yet lent; its own lock, so
        # that a pinning never holds up loans of spares.
        self._slab: np.ndarray | None = None
        self._slab_used = 0
        self._slab_lock = threading.Lock()
        self._pinning_ahead = False
        self.allocated = 0  # buffers made, for tests and explain
        self.slabs = 0  # pinnings, for tests

    def _take(self, nbytes: int) -> np.ndarray | None:
        """The smallest spare that holds ``nbytes``, taken out of the pool; lock held."""
        best_key, best = None, None
        for key, buffer in self._spare.items():
            if buffer.nbytes >= nbytes and (best is None or buffer.nbytes < best.nbytes):
                best_key, best = key, buffer
        if best_key is None or best is None:
            return None
        del self._spare[best_key]
        self._spare_bytes -= best.nbytes
        return best

    def _make(self, nbytes: int, allocate: Allocate | None) -> np.ndarray:
        size = size_class(nbytes) + SLACK
        if allocate is not None:  # the caller's own memory: one allocation of its own
            raw = allocate(size + BLOCK)
            start = -raw.ctypes.data % BLOCK
            self.allocated += 1
            return raw[start : start + size]
        with self._slab_lock:
            if self._slab_room() < size:
                self._new_slab(size)
            slab, used = self._slab, self._slab_used
            assert slab is not None
            self._slab_used = used + size + (-size % BLOCK)  # the next buffer block-aligned
            self.allocated += 1
            return slab[used : used + size]

    def _slab_room(self) -> int:
        """The bytes left in the slab (slab lock held)."""
        return 0 if self._slab is None else self._slab.nbytes - self._slab_used

    def _new_slab(self, nbytes: int) -> None:
        """Pin a slab of at least ``nbytes`` (slab lock held)."""
        slab = self._allocate(max(self.slab_bytes, nbytes) + BLOCK)
        self._slab = slab
        self._slab_used = -slab.ctypes.data % BLOCK  # pinned memory is page-aligned; be sure
        self.slabs += 1

    def pin_ahead(self) -> None:
        """Start pinning a slab on a thread of its own where the pool has no spare and its
        slab little room: a fresh process's first load into a GPU, calling this as it
        starts, finds its staging buffers pinned while it allocated its outputs, instead of
        pinning them once its transfers start."""
        with self._lock:
            # (The slab's room read without its lock: a hint, checked again under it.)
            if self._spare or self._pinning_ahead or self._slab_room() >= self.slab_bytes // 2:
                return
            self._pinning_ahead = True
        from ..runtime import _background

        _background.start(self._pin_slab_ahead, name="arrayio-pin-ahead")

    def _pin_slab_ahead(self) -> None:
        try:
            with self._slab_lock:
                if self._slab_room() < self.slab_bytes // 2:
                    self._new_slab(self.slab_bytes)
        except Exception:  # noqa: BLE001 - the first transfer pins, and says why not
            pass
        finally:
            self._pinning_ahead = False

    @contextlib.contextmanager
    def lend(self, nbytes: int, allocate: Allocate | None = None) -> Iterator[np.ndarray]:
        """A block-aligned pinned buffer of at least ``nbytes``, for the ``with`` block;
        ``allocate`` makes a new one (default: the pool's)."""
        with self._lock:
            buffer = self._take(nbytes)
        if buffer is None:
            buffer = self._make(nbytes, allocate)
        try:
            yield buffer
        finally:
            self._give_back(buffer)

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._spare[id(buffer)] = buffer
            self._spare_bytes += buffer.nbytes
            while self._spare_bytes > self.keep_bytes and self._spare:
                _, oldest = self._spare.popitem(last=False)
                self._spare_bytes -= oldest.nbytes

    def keep_more(self, nbytes: int) -> Callable[[], None]:
        """Keep up to ``nbytes`` more of spares, until the function returned is called.

        A host tier that stores a step's tensors gives its buffers back every step and takes
        them again the next: with only :data:`KEEP_BYTES` kept, every step would pin its
        tensors' bytes anew, which takes longer than copying them."""
        with self._lock:
            self.keep_bytes += nbytes
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if not done:
                    done = True
                    self.keep_bytes -= nbytes

        return release

    def clear(self) -> None:
        """Drop every spare buffer."""
        with self._lock:
            self._spare.clear()
            self._spare_bytes = 0

    @property
    def spare_bytes(self) -> int:
        return self._spare_bytes


pool = PinnedPool()
"""The process's pool."""


class Borrowed:
    """A worker's buffers of ``nbytes`` each, borrowed from ``source`` on first use (index 0,
    1...) and all given back when the ``with`` block ends."""

    def __init__(self, nbytes: int, source: PinnedPool | None = None) -> None:
        self.nbytes = nbytes
        self._source = source if source is not None else pool
        self._loans = contextlib.ExitStack()
        self._buffers: list[np.ndarray] = []

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        self._buffers.clear()
        self._loans.close()

    def __getitem__(self, index: int) -> np.ndarray:
        while len(self._buffers) <= index:
            self._buffers.append(self._loans.enter_context(self._source.lend(self.nbytes)))
        return self._buffers[index]


def _after_fork_in_child() -> None:
    # A lock a parent's thread held at the fork stays held in the child; and pinned memory
    # is the parent's CUDA context's, of no use to the child.
    pool._lock = threading.Lock()
    pool._spare = collections.OrderedDict()
    pool._spare_bytes = 0
    pool._slab_lock = threading.Lock()
    pool._slab = None
    pool._pinning_ahead = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
