"""The host tools the benchmarks' disk ceilings are measured with.

A ceiling is the disk's limit for raw bytes from host memory, so it must get every help
arrayio's own writes get: a kind ending in ``+fallocate`` reserves the range before writing
it, as arrayio does before a large write (:func:`arrayio.tools._io.preallocate`). On ext4,
parallel ``O_DIRECT`` writers into a new file otherwise take turns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from arrayio import tools
from arrayio.tools._io import preallocate

__all__ = ["PREALLOCATED", "make"]

PREALLOCATED = "+fallocate"


class _Preallocating:
    """``tool`` with its writes' ranges reserved first (reads untouched)."""

    def __init__(self, tool: Any) -> None:
        self.tool = tool
        self.label = f"{tool.label}{PREALLOCATED}"

    def write(self, fd: int, buffer: np.ndarray, file_offset: int = 0) -> int:
        preallocate(fd, file_offset, buffer.nbytes)
        return self.tool.write(fd, buffer, file_offset)

    def read(self, fd: int, buffer: np.ndarray, file_offset: int = 0) -> int:
        return self.tool.read(fd, buffer, file_offset)

    def close(self) -> None:
        self.tool.close()


def make(kind: str, threads: int, task_size: int) -> Any:
    """``tools.make(kind, ...)``, or for ``"direct+fallocate"`` and the like, that tool with
    its writes preallocated."""
    base, preallocated, rest = kind.partition(PREALLOCATED)
    if rest:
        raise ValueError(f"unknown ceiling tool kind {kind!r}")
    tool = tools.make(base, threads=threads, task_size=task_size)
    return _Preallocating(tool) if preallocated else tool
