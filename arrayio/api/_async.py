"""Asynchronous saves and loads: :func:`save_async`, :func:`load_async`, their futures and
:func:`wait`.

A save snapshots mutable arrays in the caller's thread, then writes in the background, as
:func:`arrayio.save` does. Operations on one file run in submission order, on different
files in parallel; queued saves finish before the interpreter exits. ``docs/async.md``
gives the whole contract: snapshots, ordering, cancellation, failures and exit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before ours (see _drain_at_exit)
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import _base
from typing import Any

import numpy as np

from .. import config
from ..arrays._buffers import CupyDeviceBuffer, TorchDeviceBuffer, aligned_empty
from ..arrays._frameworks import Exported
from ..runtime import _gcpause
from . import _load, _save

__all__ = ["AsyncFuture", "load_async", "save_async", "wait"]


class _Stopped(Exception):
    """Raised at a checkpoint of an operation whose future was cancelled while running."""


class AsyncFuture(concurrent.futures.Future):
    """The future of :func:`save_async` or :func:`load_async`.

    A :class:`concurrent.futures.Future` (``result()``, ``exception()``, ``done()``,
    ``add_done_callback()``, usable with :func:`concurrent.futures.wait`), also awaitable in
    asyncio: ``await arrayio.load_async(path)`` waits without blocking the event loop.
    ``cancel()`` also stops a running operation (see the module docstring).

    Attributes
    ----------
    path : str
        The file the operation is on.
    kind : str
        ``"save"`` or ``"load"``.
    """

    def __init__(self, kind: str, path: str) -> None:
        super().__init__()
        self.kind = kind
        self.path = path
        self._op_lock = threading.Lock()
        self._stop = False
        self._committed = False
        self._seen = False  # result() or exception() was asked: its error reached someone

    def result(self, timeout: float | None = None) -> Any:
        self._seen = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._seen = True
        return super().exception(timeout)

    def cancel(self) -> bool:
        """Cancel the operation; return whether it will have no effect.

        Returns
        -------
        bool
            True if the operation had not started, or was running and will stop before it
            takes effect (a save before its rename); False if it is done or committing.
        """
        # concurrent.futures.Future.cancel refuses running futures, and a future it cancels
        # counts as done for concurrent.futures.wait only once its executor has dequeued
        # it. Here both happen at once, under the future's own condition, as the stdlib
        # does in set_running_or_notify_cancel (these internals are stable since 3.2).
        with self._op_lock, self._condition:
            state = self._state
            if state in (_base.CANCELLED, _base.CANCELLED_AND_NOTIFIED):
                return True
            if state == _base.FINISHED or (state == _base.RUNNING and self._committed):
                return False
            self._stop = True
            self._state = _base.CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        self._invoke_callbacks()
        return True

    def _start(self) -> bool:
        """Mark the future running unless it was cancelled."""
        with self._op_lock:
            return not self.cancelled() and self.set_running_or_notify_cancel()

    def _checkpoint(self, final: bool) -> None:
        """Called by the worker between arrays and, with ``final``, before committing."""
        with self._op_lock:
            if self._stop:
                raise _Stopped
            if final:
                self._committed = True

    def _finish(self) -> bool:
        """Commit if not yet committed; return whether the operation was cancelled."""
        with self._op_lock:
            self._committed = True
            return self._stop

    def __await__(self) -> Generator[Any, None, Any]:
        import asyncio  # here: 12 ms that ``import arrayio`` need not pay

        return asyncio.wrap_future(self).__await__()

    def __repr__(self) -> str:
        # In the words of the public API (cancelled(), running(), done(), exception()), not
        # concurrent.futures' internal states (CANCELLED_AND_NOTIFIED).
        with self._condition:
            if self._state in (_base.CANCELLED, _base.CANCELLED_AND_NOTIFIED):
                state = "cancelled"
            elif self._state == _base.FINISHED:
                state = "failed" if self._exception is not None else "finished"
            else:
                state = self._state.lower()  # pending, running
        return f"<arrayio.AsyncFuture {self.kind} {self.path!r} {state}>"


@dataclasses.dataclass(eq=False)
class _Operation:
    key: str
    future: AsyncFuture
    run: Callable[[Callable[[bool], None]], Any]

    def execute(self) -> None:
        future = self.future
        if not future._start():
            return  # cancelled before it started
        try:
            result = self.run(future._checkpoint)
        except _Stopped:
            return  # cancelled while running; the future already says so
        except BaseException as error:  # noqa: BLE001 - every failure belongs on the future
            if not future._finish():
                future.set_exception(error)
                if future.kind == "save":
                    _scheduler.failed(future)
            return
        if not future._finish():  # else a load cancelled while it read: drop the result
            future.set_result(result)


class _Scheduler:
    """Per-path queues feeding a bounded, on-demand set of worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lanes: dict[str, collections.deque[_Operation]] = {}
        self._ready: collections.deque[_Operation] = collections.deque()
        self._threads: set[threading.Thread] = set()
        self._busy = 0  # threads running an operation (the others are about to take one)
        self._idle = threading.Condition(self._lock)
        self._leaving: list[threading.Thread] = []  # done, but perhaps not exited yet
        self._failed: list[AsyncFuture] = []  # failed saves, until wait() or exit reports them

    def submit(self, operation: _Operation) -> None:
        with self._lock:
            lane = self._lanes.setdefault(operation.key, collections.deque())
            lane.append(operation)
            if len(lane) == 1:
                self._ready.append(operation)
                try:
                    self._spawn_locked()
                except BaseException:  # no thread to run it, ever: refuse it
                    self._ready.remove(operation)
                    del self._lanes[operation.key]
                    raise

    def _spawn_locked(self) -> None:
        # Threads busy with an operation cannot take a ready one: count only the others.
        while len(self._threads) < config.get().async_workers and len(
            self._threads
        ) - self._busy < len(self._ready):
            thread = threading.Thread(target=self._work, name="arrayio-async")
            try:
                thread.start()
            except RuntimeError:  # interpreter shutting down: the running threads go on
                if self._threads:
                    return
                raise
            self._threads.add(thread)

    def _work(self) -> None:
        me = threading.current_thread()  # in _threads: _spawn_locked added it
        try:
            while True:
                with self._lock:
                    if not self._ready or len(self._threads) > config.get().async_workers:
                        return
                    operation = self._ready.popleft()
                    self._busy += 1
                try:
                    with _gcpause.in_background():  # the caller's program runs meanwhile
                        operation.execute()
                finally:
                    with self._lock:
                        self._busy -= 1
                        lane = self._lanes[operation.key]
                        lane.popleft()
                        if lane:
                            self._ready.append(lane[0])
                        else:
                            del self._lanes[operation.key]
        finally:
            with self._lock:
                self._threads.discard(me)
                # Kept for wait_idle to join; those already gone are dropped, so that the
                # list stays short in a process that never waits.
                self._leaving = [t for t in self._leaving if t.is_alive()] + [me]
                with contextlib.suppress(RuntimeError):
                    self._spawn_locked()  # what this thread leaves (if it died) goes on
                self._idle.notify_all()

    def failed(self, future: AsyncFuture) -> None:
        with self._lock:
            self._failed.append(future)

    def unseen_failures(self) -> list[AsyncFuture]:
        """The failed saves whose error nobody has asked for; each is returned once."""
        with self._lock:
            failed, self._failed = self._failed, []
        return [future for future in failed if not future._seen]

    def cancel_queued(self) -> int:
        """Cancel every operation that has not started; return how many."""
        with self._lock:
            queued = [op for lane in self._lanes.values() for op in lane]
        return sum(op.future.cancel() for op in queued if not op.future.running())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued operation is done and every worker thread has exited."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if not self._idle.wait_for(lambda: not self._threads and not self._lanes, timeout):
                return False
            leaving, self._leaving = self._leaving, []
        for thread in leaving:  # past its last line under the lock, maybe not yet gone
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in leaving)


_scheduler = _Scheduler()


def wait(timeout: float | None = None) -> bool:
    """Wait until every :func:`save_async` and :func:`load_async` submitted so far is done.

    Parameters
    ----------
    timeout
        Seconds to wait at most (None: as long as it takes).

    Returns
    -------
    bool
        True once nothing is queued or running; False if the timeout passed first.

    Raises
    ------
    Exception
        The error of a save that failed while nobody looked at its future (``result()`` or
        ``exception()``), so that a program that fires saves and forgets them still learns
        of a failure; other such failures are listed in its notes. Each failure is raised
        once.
    """
    if not _scheduler.wait_idle(timeout):
        return False
    failures = _scheduler.unseen_failures()
    if failures:
        error = failures[0].exception()
        for other in failures[1:]:
            error.add_note(
                f"arrayio: save_async of {other.path} also failed: {_describe(other.exception())}"
            )
        raise error
    return True


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}"


def _drain_at_exit() -> None:
    """Finish queued operations before the interpreter shuts thread pools down, then report
    the saves that failed unseen. Ctrl-C while waiting cancels what has not started."""
    try:
        _scheduler.wait_idle()
    except KeyboardInterrupt:
        cancelled = _scheduler.cancel_queued()
        print(
            f"arrayio: interrupted at exit; {cancelled} queued save(s) or load(s) "
            "cancelled (files they would have replaced are intact)",
            file=sys.stderr,
        )
    for future in _scheduler.unseen_failures():
        print(
            f"arrayio: save_async of {future.path} failed: {_describe(future.exception())}",
            file=sys.stderr,
        )


# Before concurrent.futures' own exit hook (the hooks run in reverse order of registration),
# which stops every thread pool, the transfer tools' included.
threading._register_atexit(_drain_at_exit)


def _path_key(path: str) -> str:
    return os.path.realpath(path)


def _snapshot(exported: Exported) -> Exported:
    """A private copy of ``exported``'s bytes, unless they cannot change (JAX)."""
    if exported.framework == "jax":
        return exported
    data = exported.data
    if isinstance(data, np.ndarray):
        copy: Any = aligned_empty(data.nbytes)  # aligned: O_DIRECT tools can write it as is
        np.copyto(copy, data)
    elif isinstance(data, TorchDeviceBuffer):
        copy = TorchDeviceBuffer(data.tensor.clone())  # device to device, on the caller's stream
    elif isinstance(data, CupyDeviceBuffer):
        with data.array.device:
            copy = CupyDeviceBuffer(data.array.copy())
    else:
        raise TypeError(f"cannot snapshot a {type(data).__name__}")
    return dataclasses.replace(exported, data=copy)


def save_async(
    path: str | os.PathLike[str],
    obj: Any,
    *,
    metadata: Any = None,
    tool: Any = None,
    progress: bool | None = False,
) -> AsyncFuture:
    """Save like :func:`arrayio.save`, writing in the background.

    Before it returns, the arrays are checked and the mutable ones (NumPy, torch, CuPy) are
    copied (device data on the device), so that changing them afterwards does not change
    what is written; JAX arrays are not copied.

    Parameters
    ----------
    path, obj, metadata, tool
        As for :func:`arrayio.save`.
    progress
        As for :func:`arrayio.save`, but off by default: a bar drawn from a background
        thread would interleave with the caller's output.

    Returns
    -------
    AsyncFuture
        Done when the file is in place (``result()`` is None); I/O errors are raised by
        ``result()``. Operations on the same path run in submission order.

    Raises
    ------
    UnsupportedObjectError, UnsupportedDtypeError
        At once, for what :func:`arrayio.save` would refuse.
    """
    prepared = _save.prepare_save(path, obj, metadata)
    prepared.arrays = {key: _snapshot(e) for key, e in prepared.arrays.items()}
    future = AsyncFuture("save", prepared.path)
    # Resolved now: a relative path names a file in the caller's working directory at the
    # time of the call, not at the time the worker gets to it.
    prepared.path = os.path.abspath(prepared.path)

    def run(checkpoint: Callable[[bool], None]) -> None:
        _save.write_prepared(prepared, tool=tool, checkpoint=checkpoint, progress=progress)

    _scheduler.submit(_Operation(_path_key(prepared.path), future, run))
    return future


def load_async(
    path: str | os.PathLike[str],
    *,
    like: Any = None,
    device: Any = None,
    keys: str | Sequence[str] | None = None,
    structure: Any = None,
    verify: bool | None = None,
    tool: Any = None,
    progress: bool | None = False,
) -> AsyncFuture:
    """Load like :func:`arrayio.load`, reading in the background.

    Parameters
    ----------
    path, like, device, keys, structure, verify, tool
        As for :func:`arrayio.load`.
    progress
        As for :func:`arrayio.load`, but off by default (see :func:`save_async`).

    Returns
    -------
    AsyncFuture
        ``result()`` is what :func:`arrayio.load` would return, or raises what it would
        raise (``FileNotFoundError``, ``ChecksumError``...). It runs after every operation
        already submitted on the same path.
    """
    future = AsyncFuture("load", os.fspath(path))
    path = os.path.abspath(path)  # resolved now, as in save_async

    def run(checkpoint: Callable[[bool], None]) -> Any:
        checkpoint(False)
        result = _load.load(
            path,
            like=like,
            device=device,
            keys=keys,
            structure=structure,
            verify=verify,
            tool=tool,
            progress=progress,
        )
        checkpoint(True)
        return result

    _scheduler.submit(_Operation(_path_key(path), future, run))
    return future
