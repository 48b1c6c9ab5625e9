"""A base for tools that spread a request over their own pool of threads."""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from .base import IOFuture, Tool

T = TypeVar("T")

__all__ = ["ThreadedTool"]


class ThreadedTool(Tool):
    """A tool with ``threads`` worker threads, started on first use and stopped by
    :meth:`close` (the tool starts them again if used afterwards)."""

    def __init__(self, threads: int, **params: Any) -> None:
        if threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        super().__init__(threads=threads, **params)
        self.threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _live.add(self)

    def _forget_threads(self) -> None:
        """In a forked child: the parent's worker threads do not exist there (a task
        submitted to their pool would wait forever), and a lock one of them held stays held.
        Start afresh on next use."""
        self._pool = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = _Pool(self.threads, thread_name_prefix=f"arrayio-{self.name}")
            return self._pool

    def _one_task(self, task: Callable[[], T]) -> IOFuture[T]:
        """``task`` as one task on the tool's threads (in the caller's thread with one)."""
        if self.threads == 1:
            return IOFuture.completed(task())
        return IOFuture(self._executor().submit(task))

    def prepare(self) -> None:
        """Start every worker thread (a pool starts one per task submitted, as needed)."""
        pool = self._executor()
        started = threading.Barrier(self.threads + 1)
        waits = [pool.submit(started.wait, 10.0) for _ in range(self.threads)]
        started.wait(10.0)
        for wait in waits:
            wait.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _interpreter_exiting() -> bool:
    # concurrent.futures refuses new work once its exit hook has run (before the interpreter
    # joins non-daemon threads, such as the ones finishing queued asynchronous saves).
    return bool(getattr(concurrent.futures.thread, "_shutdown", False)) or sys.is_finalizing()


class _Pool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that, once the interpreter is exiting and refuses to start threads, runs
    each task in the submitting thread instead of failing it: a save still running then
    finishes (serially), and no tool is blamed for the interpreter's state."""

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError:
            if not _interpreter_exiting():
                raise
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - the task's error belongs on its future
            future.set_exception(error)
        return future


_live: weakref.WeakSet[ThreadedTool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for tool in list(_live):
        tool._forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
