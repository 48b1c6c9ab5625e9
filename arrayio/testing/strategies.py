"""Hypothesis strategies: every dtype arrayio stores, shapes (0-d and empty included), and
arrays filled with arbitrary bit patterns in C, Fortran or strided layouts."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from ..arrays._dtypes import DTYPES, DType, numpy_dtype

__all__ = ["arrays", "dtypes", "shapes"]


def dtypes() -> st.SearchStrategy[DType]:
    return st.sampled_from(DTYPES)


def shapes(max_dims: int = 3, max_side: int = 6) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, max_side), max_size=max_dims).map(tuple)


@st.composite
def arrays(
    draw: st.DrawFn,
    dtype: DType | None = None,
    shape: tuple[int, ...] | None = None,
    layouts: tuple[str, ...] = ("C", "F", "strided"),
) -> np.ndarray:
    """A NumPy array of ``dtype`` with arbitrary bytes (booleans are 0 or 1) in a layout."""
    dtype = dtype or draw(dtypes())
    shape = shape if shape is not None else draw(shapes())
    layout = draw(st.sampled_from(layouts))
    np_dtype = numpy_dtype(dtype)
    # Strided: a view of every other element along the first axis of a larger array.
    base_shape = (2 * shape[0], *shape[1:]) if layout == "strided" and shape else shape
    nbytes = dtype.itemsize * math.prod(base_shape)
    if dtype.name == "bool":
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=nbytes, max_size=nbytes)))
    else:
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    base = np.frombuffer(raw, dtype=np.uint8).copy().view(np_dtype).reshape(base_shape)
    if layout == "F":
        return np.asfortranarray(base)
    if layout == "strided" and shape:
        return base[::2]
    return base
