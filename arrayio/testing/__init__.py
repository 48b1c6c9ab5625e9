"""Test kit for arrayio and for code built on it: hypothesis strategies, framework adapters
that make and inspect arrays bit-exactly, and GPU detection for skipping cleanly.

Importing this package needs hypothesis only for :mod:`arrayio.testing.strategies`.
"""

from __future__ import annotations

from .damage import damage_array, flip_byte, seal_header
from .frameworks import FRAMEWORK_PARAMS, Framework, gpu_available, random_array, supports

__all__ = [
    "FRAMEWORK_PARAMS",
    "Framework",
    "damage_array",
    "flip_byte",
    "gpu_available",
    "random_array",
    "seal_header",
    "supports",
]
