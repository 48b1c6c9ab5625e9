"""Loops around ``os.preadv``/``os.pwritev`` that finish what a single call may leave undone."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["pread_full", "pwrite_full"]


def pread_full(fd: int, view: np.ndarray, file_offset: int) -> int:
    """Read into all of ``view`` from ``file_offset``; return the count (short only at EOF)."""
    done = 0
    memory = memoryview(view)
    while done < view.nbytes:
        got = os.preadv(fd, [memory[done:]], file_offset + done)
        if got == 0:
            break
        done += got
    return done


def pwrite_full(fd: int, view: np.ndarray, file_offset: int) -> int:
    """Write all of ``view`` at ``file_offset``; return the count."""
    done = 0
    memory = memoryview(view)
    while done < view.nbytes:
        done += os.pwritev(fd, [memory[done:]], file_offset + done)
    return done
