"""File formats arrayio reads and writes: the safetensors-compatible container, ``.npy`` and
``.npz``."""

from __future__ import annotations

import os

from . import npy, npz, safetensors

__all__ = ["npy", "npz", "safetensors", "sniff"]


def sniff(fd: int, path: str) -> str:
    """Return ``"npy"``, ``"npz"`` or ``"safetensors"`` from a file's first bytes (not its
    name)."""
    head = os.pread(fd, len(npy.MAGIC), 0)
    is_npy = head == npy.MAGIC or (0 < len(head) < len(npy.MAGIC) and npy.MAGIC.startswith(head))
    if is_npy:
        return "npy"
    return "npz" if head.startswith(npz.MAGIC) else "safetensors"
