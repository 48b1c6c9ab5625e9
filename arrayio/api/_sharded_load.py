"""``load(..., sharding=...)``: global ``jax.Array``s built from the pieces this process's
devices hold, each piece read from the file straight onto its device (only the rows it
covers), and joined with ``jax.make_array_from_single_device_arrays``.

Rows are the unit of a partial read: a sharding along the leading axis reads each device's
bytes only; a sharding along another axis reads the rows its piece spans and slices them on
the device (on CPU devices, the rows are read once into host memory and each device copies
its part). Devices that hold the same rows (replicas) share one read, copied from device to
device. Where this process's pieces of an array do not cover all of it (``jax.distributed``:
the other processes hold the rest), a piece that is a range of one later axis is read as
that range alone (:meth:`Reader.read <arrayio.Reader.read>`: a run per row), so that each
process reads only its own columns, not every row of them; unless its runs would be short
(under 64 KiB: the rows are read once and sliced, as they cost less than that many
requests) or the array is not stored as rows (Fortran order, compressed). Every other
distinct piece of every array moves in one batch of transfers
(:meth:`Reader.read_row_pieces <arrayio.Reader.read_row_pieces>`): read one after the other,
pieces of a few megabytes each leave the tools' threads idle between them. An array whose
pieces here cover all of its rows is checked against its checksum, the pieces' CRC-32Cs
combined in row order; a process that holds only some rows (``jax.distributed``) cannot
check the array's one checksum, and does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedObjectError

if TYPE_CHECKING:
    from ._reader import Reader

__all__ = ["GROUP_BYTES", "read_sharded", "sharding_for"]

# The bytes of arrays read in one group: pieces wait for their assembly, on the devices (or
# in host memory) they were read into, only a group at a time.
GROUP_BYTES = 1 << 30


def sharding_for(sharding: Any, key: str) -> Any:
    """The sharding of the array ``key``: ``sharding`` itself, or its entry for ``key`` (a
    mapping; None where it has none: the array goes whole to the default device), or what
    it returns for ``key`` (a function).

    Raises
    ------
    UnsupportedObjectError
        For anything else given as ``sharding``.
    """
    import jax

    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if isinstance(sharding, Mapping):
        return sharding.get(key)  # None: read whole onto the default device
    if callable(sharding):
        return sharding(key)
    raise UnsupportedObjectError(
        "sharding= takes a jax.sharding.Sharding, a mapping from keys to them, or a function "
        f"of the key, got {type(sharding).__name__}"
    )


def _rows(index: tuple[Any, ...], ndim: int) -> tuple[slice | None, tuple[Any, ...]]:
    """The leading-axis slice of a device's index and the rest of it (None rows: a
    0-d array, read whole)."""
    full = tuple(index) + (slice(None),) * (ndim - len(index))
    if ndim == 0:
        return None, ()
    return full[0], full[1:]


def read_sharded(
    reader: Reader, sharding: Any, keys: list[str], advance: Callable[[int], None]
) -> dict[str, Any]:
    """Each array of ``keys`` as a global ``jax.Array`` with its sharding; see the module
    docstring. The arrays are read in groups of about :data:`GROUP_BYTES`, every distinct
    piece of a group in one call, and each group's pieces are let go once its arrays are
    assembled: a checkpoint's pieces never all wait at once (on one GPU, where a sharding
    along a later axis reads whole rows)."""
    results: dict[str, Any] = {}
    group: list[tuple[str, Any]] = []
    group_bytes = 0
    for key in keys:
        info = reader[key]
        target = sharding_for(sharding, key)
        if target is None:  # whole onto the default device
            results[key] = reader.read(key, like="jax")
            advance(info.nbytes)
            continue
        group.append((key, target))
        group_bytes += info.nbytes
        if group_bytes >= GROUP_BYTES:
            results.update(_read_group(reader, group, advance))
            group, group_bytes = [], 0
    if group:
        results.update(_read_group(reader, group, advance))
    return {key: results[key] for key in keys}


def _read_group(
    reader: Reader, group: list[tuple[str, Any]], advance: Callable[[int], None]
) -> dict[str, Any]:
    """The arrays of ``group`` (each key with its sharding), their distinct pieces read in
    one call of :meth:`Reader.read_row_pieces <arrayio.Reader.read_row_pieces>`."""
    import jax

    from ..arrays._frameworks import parse_target

    wanted: list[tuple[str, range, Any]] = []  # the reads: key, rows, request
    first_read: dict[tuple[str, tuple[int, ...]], int] = {}  # (key, rows) -> its read
    layouts: dict[str, list[tuple[Any, tuple[int, ...], tuple[Any, ...]]]] = {}
    blocks: dict[str, list[tuple[Any, tuple[Any, ...]]]] = {}  # key -> (device, index) read alone
    for key, target in group:
        shape = tuple(reader[key].shape)
        placements = target.addressable_devices_indices_map(shape)
        if not _covered(placements.values(), shape):
            alone = {
                device: index
                for device, index in placements.items()
                if reader._reads_range_alone(key, index)
            }
            if alone:
                blocks[key] = list(alone.items())
                placements = {d: i for d, i in placements.items() if d not in alone}
        layout = layouts[key] = []
        # On CPU devices, rows that several devices slice (a sharding along a later axis)
        # are read once into host memory, and each device copies only its part of them:
        # read onto one device, they would be copied whole to the others, then sliced.
        sliced = any(
            part != slice(None)
            for index in placements.values()
            for part in _rows(index, len(shape))[1]
        )
        via_host = sliced and all(device.platform == "cpu" for device in placements)
        for device, index in placements.items():
            rows, rest = _rows(index, len(shape))
            span = range(0, 1) if rows is None else range(*rows.indices(shape[0])[:2])
            if (key, (span.start, span.stop)) not in first_read:
                first_read[(key, (span.start, span.stop))] = len(wanted)
                request = parse_target("numpy" if via_host else "jax", None if via_host else device)
                wanted.append((key, span, request))
            layout.append((device, (span.start, span.stop), rest))
    pieces = reader.read_row_pieces(wanted, advance)
    alone_read = _read_blocks(reader, blocks, advance)
    results: dict[str, Any] = {}
    for key, target in group:
        shape = tuple(reader[key].shape)
        placed = list(alone_read.get(key, []))
        for device, rows_read, rest in layouts[key]:
            piece = pieces[first_read[(key, rows_read)]]
            if not isinstance(piece, jax.Array):  # host rows: this device's part, copied
                placed.append(jax.device_put(piece[(slice(None),) + rest], device))
                continue
            if next(iter(piece.devices())) != device:  # a replica: copied device to device
                piece = jax.device_put(piece, device)
            if any(part != slice(None) for part in rest):
                piece = piece[(slice(None),) + rest]
            placed.append(piece)
        results[key] = jax.make_array_from_single_device_arrays(shape, target, placed)
    return results


def _bounds(index: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` of a device's index on every axis (its slices have step 1)."""
    full = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(part.indices(size)[:2] for part, size in zip(full, shape, strict=True))


def _covered(indices: Any, shape: tuple[int, ...]) -> bool:
    """Whether the distinct pieces of ``indices`` (a sharding's, which do not overlap) hold
    every element of an array of ``shape``."""
    distinct = {_bounds(index, shape) for index in indices}
    held = sum(math.prod(stop - start for start, stop in piece) for piece in distinct)
    return held >= math.prod(shape)


def _read_blocks(
    reader: Reader, blocks: dict[str, list[tuple[Any, tuple[Any, ...]]]], advance: Any
) -> dict[str, list[Any]]:
    """Each device's piece of ``blocks`` read as its own range (replicas of a piece share
    one read; on CPU devices it is read into host memory and put on each), by key."""
    import jax

    out: dict[str, list[Any]] = {}
    for key, placed in blocks.items():
        shape = tuple(reader[key].shape)
        read: dict[tuple[tuple[int, int], ...], Any] = {}
        for device, index in placed:
            bounds = _bounds(index, shape)
            piece = read.get(bounds)
            if piece is None:
                on_host = device.platform == "cpu"
                piece = reader.read(
                    key,
                    tuple(index),
                    like="numpy" if on_host else "jax",
                    device=None if on_host else device,
                )
                read[bounds] = piece
                if advance is not None:
                    advance(int(piece.nbytes))
            out.setdefault(key, []).append(jax.device_put(piece, device))
    return out
