"""Staging buffers lent to one call (or one worker) at a time.

A tool is shared by every thread that transfers through it, so a buffer it keeps between
calls must never be in two calls at once: two concurrent reads into GPU memory through one
shared staging buffer mix their bytes. A :class:`BufferPool` lends each caller a buffer of
its own (a spare one, or a new one when all are out) and keeps up to ``keep`` spares per key.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["BufferPool"]

B = TypeVar("B")


class BufferPool:
    """Spare buffers per key (a device, say), each lent to one borrower at a time."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._spare: dict[Any, list[Any]] = {}
        self._lock = threading.Lock()
        _pools.add(self)

    @contextlib.contextmanager
    def lend(
        self, key: Any, make: Callable[[], B], fits: Callable[[B], bool] = lambda _: True
    ) -> Iterator[B]:
        """A buffer for ``key`` that ``fits``, made by ``make`` if no spare one does."""
        buffer = None
        with self._lock:
            spare = self._spare.get(key, [])
            for index in range(len(spare) - 1, -1, -1):
                if fits(spare[index]):
                    buffer = spare.pop(index)
                    break
        if buffer is None:
            buffer = make()
        try:
            yield buffer
        finally:
            with self._lock:
                spare = self._spare.setdefault(key, [])
                if len(spare) >= self.keep:
                    spare.pop(0)  # the oldest goes: a grown buffer replaces a small one
                spare.append(buffer)

    def clear(self) -> None:
        with self._lock:
            self._spare.clear()


_pools: weakref.WeakSet[BufferPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A lock a parent's thread held at the fork stays held in the child.
    for pool in list(_pools):
        pool._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
