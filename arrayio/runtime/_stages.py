"""Where a load's time goes: the named stages of the calling thread's load, kept for the
process's last one.

``arrayio.explain()`` shows the last load's stages, and ``benchmarks.first_calls`` records
them for every call: a fresh process's first load spends time that later loads do not (the
tools' set-up, building the checksum kernel, allocating outputs the first time), and this
says how much of it went where without a profiler.

A stage is timed on the thread that runs it, as part of the load that thread is running
(a ``contextvars`` variable: a tool's worker threads record nothing, and the load's thread
waits for them inside a stage of its own). A stage inside another is counted in both
(``transfers`` holds ``checksums``); a stage entered several times adds up. A load inside
another (a checkpoint's files, each loaded by a reader of its own) belongs to the outer
one. The cost is two clock reads and a dictionary update a stage, a few per load.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["calling", "current", "joined", "last", "stage"]


class _Record:
    def __init__(self, name: str) -> None:
        self.name = name
        self.start = time.perf_counter()
        self.seconds: float | None = None
        self.stages: dict[str, float] = {}
        self.lock = threading.Lock()  # shard loads on pool threads add to one record

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.stages[name] = self.stages.get(name, 0.0) + seconds

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            return {"call": self.name, "seconds": self.seconds, "stages": dict(self.stages)}


_current: contextvars.ContextVar[_Record | None] = contextvars.ContextVar(
    "arrayio_stages", default=None
)
_last: _Record | None = None
_last_lock = threading.Lock()


@contextlib.contextmanager
def calling(name: str) -> Iterator[None]:
    """Record the stages of the call inside (``"load"``); a call already recording on this
    thread records them instead."""
    global _last
    if _current.get() is not None:
        yield
        return
    record = _Record(name)
    token = _current.set(record)
    try:
        yield
    finally:
        _current.reset(token)
        record.seconds = time.perf_counter() - record.start
        with _last_lock:
            _last = record


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the block as stage ``name`` of this thread's call (nothing outside one)."""
    record = _current.get()
    if record is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        record.add(name, time.perf_counter() - start)


def current() -> _Record | None:
    """This thread's call being recorded, to hand to threads that work for it (see
    :func:`joined`)."""
    return _current.get()


@contextlib.contextmanager
def joined(record: _Record | None) -> Iterator[None]:
    """Record this thread's stages in ``record`` (a call another thread is recording)."""
    if record is None or _current.get() is not None:
        yield
        return
    token = _current.set(record)
    try:
        yield
    finally:
        _current.reset(token)


def last() -> dict[str, Any] | None:
    """The last finished call: ``{"call", "seconds", "stages": {name: seconds}}``, or None."""
    with _last_lock:
        record = _last
    return record.as_dict() if record is not None else None
