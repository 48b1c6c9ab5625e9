"""Pause Python's cyclic garbage collector while arrayio creates many objects at once.

Allocating and wrapping the arrays of a checkpoint creates thousands of container objects
(a JAX array, its CuPy buffer and their DLPack capsule per array). Each 700 of them start
a young collection, and every tenth of those an older one; in a process that holds a large
heap (JAX, torch and orbax imported, a model in memory) the full collection that follows
costs 120 to 230 ms. On the H200 VM, such a collection landed inside a warm 8 GiB JAX load
(about 260 ms) and cut it from 31-34 to 19.5 GB/s (probe 26, 2026-11-21). With the
collector paused over these loops, the objects are examined once afterwards instead of
some twenty times, and older collections come an order of magnitude less often.

Only the steps that create objects are paused (a save's preparation; a load's header
parsing, allocation and finishing), not the transfers between them, so the collector is
never off for the seconds a cold read or a write takes. The pause nests and is shared by
threads: the collector is turned back on when the last pause ends, and only if it was on
when the first began. ``config.set(gc_pause=False)`` (``ARRAYIO_GC_PAUSE=0``) turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from . import config

_lock = threading.Lock()
_depth = 0
_restore = False  # whether the collector was on when the outermost pause began


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Keep the cyclic collector off inside the block (see the module docstring)."""
    global _depth, _restore
    if not config.get().gc_pause:
        yield
        return
    with _lock:
        if _depth == 0:
            _restore = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore:
                gc.enable()
