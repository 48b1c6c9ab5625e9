"""The zarr store's I/O threads: one pool per process, shared by every store.

Stores are cheap objects that zarr, Dask and pickling copy freely, and a pool each would
multiply threads (zarr shares its event loop and thread pool the same way). The pool holds
nothing but threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["IO_THREADS", "executor", "in_io_thread", "in_pool"]

T = TypeVar("T")

_THREAD_PREFIX = "arrayio-zarr"
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
# Enough requests in flight to keep an NVMe queue busy and to overlap the copies to the GPU.
IO_THREADS = min(64, max(16, 2 * (os.cpu_count() or 8)))


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of I/O threads, started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                IO_THREADS, thread_name_prefix=_THREAD_PREFIX
            )
        return _pool


def in_io_thread() -> bool:
    """Whether the calling thread is one of the pool's."""
    return threading.current_thread().name.startswith(_THREAD_PREFIX)


def _forget_pool_after_fork() -> None:
    # A forked child inherits the pool object but none of its threads.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


async def in_pool(function: Callable[..., T], *args: Any) -> T:
    """Await ``function(*args)`` run on the pool."""
    return await asyncio.get_running_loop().run_in_executor(executor(), function, *args)
