"""What a stored shape may be: the limits every framework shares, checked before allocating."""

from __future__ import annotations

__all__ = ["MAX_DIMS", "shape_problem"]

# NumPy's limit (torch and JAX have the same or more); a file may not ask for more.
MAX_DIMS = 64
# The largest extent any array can have in bytes: strides are signed 64-bit products of the
# dimensions (zero-length ones aside), so a larger one cannot even be described empty.
_MAX_BYTES = (1 << 63) - 1


def shape_problem(shape: tuple[int, ...] | list[int], itemsize: int) -> str | None:
    """Why no framework can allocate ``shape`` (non-negative integers), even with no data:
    too many dimensions, or strides beyond 64 bits; None if it can."""
    if len(shape) > MAX_DIMS:
        return f"shape has {len(shape)} dimensions; arrays have at most {MAX_DIMS}"
    extent = itemsize
    for n in shape:
        if n:
            extent *= n
    if extent > _MAX_BYTES:
        return f"shape {list(shape)} is too large for any array"
    return None
