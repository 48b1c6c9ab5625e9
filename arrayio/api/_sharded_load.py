"""``load(..., sharding=...)``: global ``jax.Array``s built from the pieces this process's
devices hold, each piece read from the file on its own (only the rows it covers), placed on
its device, and joined with ``jax.make_array_from_single_device_arrays``.

Rows are the unit of a partial read (see :meth:`Reader.read <arrayio.Reader.read>`): a
sharding along the leading axis reads each device's bytes only; a sharding along another
axis reads the rows its piece spans and slices them on the device. Devices that hold the
same rows (replicas) share one read, copied from device to device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedObjectError

if TYPE_CHECKING:
    from ._reader import Reader

__all__ = ["read_sharded", "sharding_for"]


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
    docstring."""
    import jax

    results: dict[str, Any] = {}
    for key in keys:
        info = reader[key]
        shape = tuple(info.shape)
        target = sharding_for(sharding, key)
        if target is None:
            results[key] = reader.read(key, like="jax")
            advance(info.nbytes)
            continue
        pieces = []
        read: dict[tuple[Any, ...], Any] = {}  # rows -> the first device's piece
        for device, index in target.addressable_devices_indices_map(shape).items():
            rows, rest = _rows(index, len(shape))
            rows_key = (None,) if rows is None else rows.indices(shape[0])
            first = read.get(rows_key)
            if first is None:
                whole = rows is None or rows.indices(shape[0]) == (0, shape[0], 1)
                first = reader.read(key, None if whole else rows, like="jax", device=device)
                read[rows_key] = first
                piece = first
            else:
                piece = jax.device_put(first, device)
            if any(part != slice(None) for part in rest):
                piece = piece[(slice(None),) + rest]
            pieces.append(piece)
        results[key] = jax.make_array_from_single_device_arrays(shape, target, pieces)
        advance(info.nbytes)
    return results
