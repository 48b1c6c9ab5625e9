"""File formats arrayio reads and writes: the safetensors-compatible container and ``.npy``."""

from __future__ import annotations

import os

from . import npy, safetensors

__all__ = ["npy", "safetensors", "sniff"]


def sniff(fd: int, path: str) -> str:
    """Return ``"npy"`` or ``"safetensors"`` from a file's first bytes (not its name)."""
    head = os.pread(fd, len(npy.MAGIC), 0)
    is_npy = head == npy.MAGIC or (0 < len(head) < len(npy.MAGIC) and npy.MAGIC.startswith(head))
    return "npy" if is_npy else "safetensors"
