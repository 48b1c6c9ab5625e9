"""The bytes of a sharded ``jax.Array``, each unique shard where its device holds it.

Exporting a ``jax.Array`` spread over several devices (``np.asarray``) gathers it on the
host first: every byte crosses to one place before any is written. But an array sharded
along its leading axis is, in C order, its shards' bytes laid end to end, so each unique
shard (``replica_id == 0``: replicas are written once) can be written from its own device
to its own range of the file, all in the save's one batch, and the file is the same
standard safetensors tensor. A shard split along a later axis (tensor-parallel columns)
goes in one run per index of the axes before that one (per row, for columns), interleaved
with other shards' runs in the same tensor. An array that would take more runs than a copy
to the host costs is gathered as before (within one process).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np

from ._buffers import DeviceBuffer

__all__ = ["MAX_RUNS", "Pieces", "block_runs", "byte_part", "local_pieces", "sharded_pieces"]


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


def local_pieces(
    x: Any, export_one: Any, max_runs: int | None = None
) -> list[tuple[int, Any]] | None:
    """The unique shards of ``x`` this process holds, as ``(offset in the array's bytes,
    data)`` runs in order of offset (:func:`block_runs`): one per shard that holds whole rows;
    for a shard split along a later axis, one per index of the axes before it (its parts
    interleave with other shards' in the array). None for more than ``max_runs`` runs.
    ``export_one`` as for :func:`sharded_pieces`."""
    shape = tuple(x.shape)
    pieces: list[tuple[int, Any]] = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        runs = block_runs(shard.index, shape, x.dtype.itemsize)
        if runs is None or (max_runs is not None and len(pieces) + len(runs) > max_runs):
            return None
        if not runs:
            continue
        data = export_one(shard.data).data
        if len(runs) == 1:
            pieces.append((runs[0][0], data))
        else:
            pieces += [(offset, byte_part(data, at, at + n)) for offset, at, n in runs]
    return sorted(pieces, key=lambda piece: piece[0])


def block_runs(
    index: tuple[slice, ...], shape: tuple[int, ...], itemsize: int
) -> list[tuple[int, int, int]] | None:
    """Where a block's C-order bytes (a shard's, or a selection read into its own array) go
    in the array's: ``(offset in the array, offset in the block, length)`` per contiguous
    run, in order. A block split along axis ``k`` (its last split axis) is contiguous along
    ``k`` and the axes after it, so it has one run per index of the axes before ``k``,
    which may take steps. None where axis ``k`` takes steps, or any axis a negative one."""
    if not shape:
        return [(0, 0, itemsize)]
    ranges = [s.indices(n) for s, n in zip(index, shape, strict=True)]
    if any(step < 1 for _, _, step in ranges):
        return None
    if any(stop <= start for start, stop, _ in ranges):
        return []
    split = [
        k
        for k, ((start, stop, step), n) in enumerate(zip(ranges, shape, strict=True))
        if (start, stop, step) != (0, n, 1)
    ]
    k = split[-1] if split else 0
    start_k, stop_k, step_k = ranges[k]
    if step_k != 1:
        return None
    inner = math.prod(shape[k + 1 :]) * itemsize  # bytes of one index of axis k
    width = (stop_k - start_k) * inner
    strides = [math.prod(shape[j + 1 :]) * itemsize for j in range(len(shape))]
    runs = []
    outer = itertools.product(*(range(*bounds) for bounds in ranges[:k]))
    for i, position in enumerate(outer):
        offset = sum(p * stride for p, stride in zip(position, strides, strict=False))
        runs.append((offset + start_k * strides[k], i * width, width))
    return runs


def byte_part(data: Any, start: int, stop: int) -> Any:
    """Bytes ``start`` to ``stop`` of flat bytes, host (NumPy) or device."""
    return data[start:stop] if isinstance(data, np.ndarray) else data.part(start, stop)


# A save gathers an array whose shards split rows into more runs than this: one request per
# run costs more than the copy to the host.
MAX_RUNS = 4096


def sharded_pieces(x: Any, export_one: Any) -> Pieces | None:
    """The unique shards of ``x`` as :class:`Pieces` when ``x`` is a ``jax.Array`` on several
    devices, in at most :data:`MAX_RUNS` runs (:func:`local_pieces`); None for anything
    else (the caller gathers it).
    ``export_one(shard_data)`` exports one device's array (its ``data`` attribute is the
    bytes)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or len(getattr(sharding, "device_set", ())) < 2:
        return None
    if not getattr(x, "is_fully_addressable", False) or x.ndim == 0:
        return None
    shape = tuple(x.shape)
    pieces = local_pieces(x, export_one, MAX_RUNS)
    if pieces is None:
        return None
    at = 0
    for start, data in pieces:  # unique shards tile the array: check, never assume
        if start != at:
            return None
        at += data.nbytes
    if at != math.prod(shape) * x.dtype.itemsize:
        return None
    return Pieces(tuple(pieces), at)
