"""Pause Python's cyclic garbage collector while arrayio saves or loads many arrays.

A checkpoint's arrays create thousands of container objects, and the collections they set
off in a large heap cost as long as a warm load itself (``docs/design/loads.md``). A
synchronous save or load keeps the collector paused across its transfers; an asynchronous
one only over its object-creating steps (:func:`in_background`), so that the caller's
garbage does not wait for its I/O. The pause nests and is shared by threads;
``ARRAYIO_GC_PAUSE=0`` turns it off.
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
    if not config.get().gc_pause or (across_transfers and getattr(_thread, "background", False)):
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
