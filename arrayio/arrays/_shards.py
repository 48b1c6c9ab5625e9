"""The bytes of a sharded ``jax.Array``, each unique shard where its device holds it.

Exporting a ``jax.Array`` spread over several devices (``np.asarray``) gathers it on the
host first: every byte crosses to one place before any is written. But an array sharded
along its leading axis is, in C order, its shards' bytes laid end to end, so each unique
shard (``replica_id == 0``: replicas are written once) can be written from its own device
to its own range of the file, all in the save's one batch, and the file is the same
standard safetensors tensor. Other layouts (shards that split a row) are gathered as
before: their bytes interleave in the file, and writing them in place would take a request
per row of every shard.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ._buffers import DeviceBuffer

__all__ = ["Pieces", "local_pieces", "sharded_pieces"]


@dataclasses.dataclass(frozen=True, slots=True)
class Pieces:
    """One array's C-order bytes held in pieces: ``(offset in the array's bytes, data)``,
    in order of offset, covering all of it once."""

    pieces: tuple[tuple[int, np.ndarray | DeviceBuffer], ...]
    nbytes: int

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.nbytes`` of the array's bytes from ``offset`` into ``dst``."""
        end = offset + dst.nbytes
        for start, data in self.pieces:
            first, last = max(offset, start), min(end, start + data.nbytes)
            if first >= last:
                continue
            out = dst[first - offset : last - offset]
            if isinstance(data, np.ndarray):
                out[...] = data[first - start : last - start]
            else:
                data.copy_to_host(first - start, out)


def local_pieces(x: Any, export_one: Any) -> list[tuple[int, Any]] | None:
    """The unique shards of ``x`` this process holds, ``(offset in the array's bytes,
    data)``, when every shard holds whole rows; None when one splits rows. ``export_one``
    as for :func:`sharded_pieces`."""
    shape = tuple(x.shape)
    row_bytes = math.prod(shape[1:]) * x.dtype.itemsize if shape else x.dtype.itemsize
    pieces = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        first = _first_row(shard.index, shape)
        if first is None:
            return None
        pieces.append((first * row_bytes, export_one(shard.data).data))
    return sorted(pieces, key=lambda piece: piece[0])


def _first_row(index: tuple[slice, ...], shape: tuple[int, ...]) -> int | None:
    """The first row of a shard's ``index`` if it holds whole rows (every other axis whole,
    rows a plain range); else None."""
    if not shape:
        return 0
    rows, *rest = index
    if any(
        (s.start or 0) != 0 or (s.stop if s.stop is not None else n) != n
        for s, n in zip(rest, shape[1:], strict=True)
    ):
        return None
    first, _, step = rows.indices(shape[0])
    return first if step == 1 else None


def sharded_pieces(x: Any, export_one: Any) -> Pieces | None:
    """The unique shards of ``x`` as :class:`Pieces` when ``x`` is a ``jax.Array`` on several
    devices whose shards each hold whole rows (split along the leading axis, or replicated);
    None for anything else (the caller gathers it). ``export_one(shard_data)`` exports one
    device's array (its ``data`` attribute is the bytes)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or len(getattr(sharding, "device_set", ())) < 2:
        return None
    if not getattr(x, "is_fully_addressable", False) or x.ndim == 0:
        return None
    shape = tuple(x.shape)
    pieces = local_pieces(x, export_one)
    if pieces is None:
        return None  # a shard splits rows: its bytes interleave with others'
    at = 0
    for start, data in pieces:  # unique shards tile the array: check, never assume
        if start != at:
            return None
        at += data.nbytes
    if at != math.prod(shape) * x.dtype.itemsize:
        return None
    return Pieces(tuple(pieces), at)
