"""Pinned host memory and CUDA streams, per thread, through which GPU values move.

GPU reads and writes go through the host in pieces of :data:`PIECE` bytes, two per thread, so
that a value's next piece is read from the file while the previous one is copied to the
device, and any number of threads move values at once without sharing a buffer.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..tools._io import BLOCK

__all__ = ["PIECE", "Staging", "staging"]

# Big enough for the dispatcher's multi-threaded tools, small enough that 32 threads hold
# 512 MiB of pinned memory at most.
PIECE = 8 << 20


class Staging(threading.local):
    """The calling thread's pinned host pieces and CUDA streams (one per device).

    Per thread, so that any number of threads (the store's I/O pool, zarr's, Dask's) read
    to and write from the GPU at once without sharing a staging buffer.
    """

    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []
        self.streams: dict[int, Any] = {}

    def piece(self, index: int, nbytes: int) -> np.ndarray:
        """Pinned piece ``index`` (0 or 1), at least ``nbytes`` plus a block of slack."""
        from ..tools._pinned import allocate_pinned

        while len(self.pieces) <= index:
            self.pieces.append(np.empty(0, np.uint8))
        need = min(PIECE, -(-nbytes // BLOCK) * BLOCK) + BLOCK
        if self.pieces[index].nbytes < need:
            raw = allocate_pinned(need + BLOCK)
            start = -raw.ctypes.data % BLOCK
            self.pieces[index] = raw[start : start + need]
        return self.pieces[index]

    def stream(self, device: int) -> Any:
        import cupy

        if device not in self.streams:
            # A blocking stream: it waits for work queued on the legacy default stream,
            # where zarr and CuPy run by default, so that memory freed there and reused for
            # a read is not overwritten while a kernel still uses it.
            self.streams[device] = cupy.cuda.Stream(non_blocking=False)
        return self.streams[device]


staging = Staging()
