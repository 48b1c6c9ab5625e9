"""Work on threads of their own that a process which exits meanwhile waits for.

A background set-up (a tool's import and pinned buffers, a kernel's build) still running at
exit would race the teardown: the exit handlers free pinned memory, streams and libraries
(``weakref.finalize``'s, KvikIO's) under a thread still using them, which killed processes
with a segmentation fault. So every such thread starts here, and the interpreter's exit
waits for them (a while) before any ``atexit`` handler runs.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["exiting", "join", "sleep", "start", "start_untracked"]

_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_lock = threading.Lock()
_exit = threading.Event()


def exiting() -> bool:
    """Whether the process's exit has begun: a set-up that would start now should not."""
    return _exit.is_set()


def sleep(seconds: float) -> None:
    """Wait ``seconds``, or until the process's exit begins (which then waits for no one)."""
    _exit.wait(seconds)


def start(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Run ``target(*args)`` on a daemon thread that the process's exit waits for; once the
    exit has begun, nothing starts (the thread returned is never started)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _lock:  # (started under the lock: the exit's wait sees it started, or not at all)
        if not _exit.is_set():
            _threads.add(thread)
            thread.start()
    return thread


def start_untracked(target: Callable[[], Any], *, name: str) -> None:
    """Run ``target()`` on a daemon thread the exit does not wait for: work that only waits,
    then maybe has :func:`start` run what must be waited for."""
    threading.Thread(target=target, name=name, daemon=True).start()


def join(timeout: float = 10.0) -> None:
    """Wait, at most ``timeout`` seconds in all, for the threads :func:`start` started."""
    deadline = time.monotonic() + timeout
    with _lock:
        threads = list(_threads)
    for thread in threads:
        if thread.ident is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


# Run at the interpreter's exit before every ``atexit`` handler, as ``concurrent.futures``
# joins its workers (handlers run last registered first, and those registered by what a
# set-up imports would otherwise run before this one); a bounded wait, unlike a non-daemon
# thread, which a hung set-up would keep alive forever.
def _join_at_exit() -> None:
    with _lock:
        _exit.set()
    join()


_register_at_exit = getattr(threading, "_register_atexit", atexit.register)
try:
    _register_at_exit(_join_at_exit)
except RuntimeError:  # (threading shuts down already: an import during the exit)
    atexit.register(_join_at_exit)


def _after_fork_in_child() -> None:
    # The parent's threads: in the child they never finish.
    global _lock
    _lock = threading.Lock()
    _threads.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
