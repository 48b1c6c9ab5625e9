"""Pause Python's cyclic garbage collector while arrayio saves or loads many arrays.

Allocating and wrapping the arrays of a checkpoint creates thousands of container objects
(a JAX array, its CuPy buffer and their DLPack capsule per array). Each 700 of them start
a young collection, and every tenth of those an older one; in a process that holds a large
heap (JAX, torch and orbax imported, a model in memory) the full collection that follows
costs 120 to 230 ms. On the H200 VM, such a collection landed inside a warm 8 GiB JAX load
(about 260 ms) and cut it from 31-34 to 19.5 GB/s (probe 26, 2026-11-21). With the
collector paused over these loops, the objects are examined once afterwards instead of
some twenty times, and older collections come an order of magnitude less often.

A synchronous save or load keeps the collector paused across its transfers too: the caller
waits for it anyway, and a full collection that lands between two transfers stalls the
threads that wait for the interpreter to hand them the next one. A collection that falls
due meanwhile runs once the call returns. :func:`arrayio.save_async` and
:func:`arrayio.load_async` pause only their object-creating steps (their worker threads run
:func:`in_background`): the caller's program runs beside their transfers, and its garbage
must not wait for seconds of I/O.

The pause nests and is shared by threads: the collector is turned back on when the last
pause ends, and only if it was on when the first began. ``config.set(gc_pause=False)``
(``ARRAYIO_GC_PAUSE=0``) turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from .. import config

_lock = threading.Lock()
_depth = 0
_restore = False  # whether the collector was on when the outermost pause began
_thread = threading.local()  # .background: this thread runs arrayio beside the caller


@contextlib.contextmanager
def in_background() -> Iterator[None]:
    """Mark the calls this thread makes inside the block as running beside the caller's
    program (the asynchronous saves and loads): no pause spans their transfers."""
    before = getattr(_thread, "background", False)
    _thread.background = True
    try:
        yield
    finally:
        _thread.background = before


@contextlib.contextmanager
def paused(*, across_transfers: bool = False) -> Iterator[None]:
    """Keep the cyclic collector off inside the block (see the module docstring).

    ``across_transfers``: the block holds a call's transfers, and is not paused in a thread
    marked :func:`in_background`.
    """
    global _depth, _restore
    if not config.get().gc_pause or (across_transfers
                                      and getattr(_thread, "background", False)):
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
