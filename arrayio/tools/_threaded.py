"""A base for tools that spread a request over their own pool of threads."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from .base import Tool

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

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix=f"arrayio-{self.name}")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
