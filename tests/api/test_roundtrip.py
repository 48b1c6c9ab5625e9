"""Round trips, bit for bit, over dtypes x shapes x layouts x source and target frameworks.

Arrays are made from arbitrary bytes (NaN payloads, subnormals, negative zeros included) and
compared as bytes, so nothing a framework might normalise goes unnoticed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayio
from arrayio.arrays._dtypes import DTYPES, dtype_of
from arrayio.testing import Framework, random_array, supports
from arrayio.testing.strategies import arrays

SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _assert_same(framework: Framework, loaded, expected: np.ndarray) -> None:
    assert tuple(loaded.shape) == expected.shape
    assert framework.dtype_name(loaded) == expected.dtype.name
    assert framework.to_bytes(loaded) == np.ascontiguousarray(expected).tobytes()


@SETTINGS
@given(data=st.data())
def test_container_round_trip(tmp_path, xp: Framework, xp_target: Framework, data) -> None:
    a = data.draw(arrays())
    b = data.draw(arrays())
    if not (supports(xp, dtype_of(a.dtype)) and supports(xp, dtype_of(b.dtype))):
        return
    tree = {"a": xp.from_numpy(a), "nested": [xp.from_numpy(b), {"c": 3}]}
    path = tmp_path / "tree.safetensors"
    arrayio.save(path, tree)

    loaded = arrayio.load(path, like=xp_target.name)
    _assert_same(xp_target, loaded["a"], a)
    _assert_same(xp_target, loaded["nested"][0], b)
    assert loaded["nested"][1] == {"c": 3}


@SETTINGS
@given(data=st.data())
def test_single_array_and_partial_read(tmp_path, xp: Framework, data) -> None:
    a = data.draw(arrays())
    if not supports(xp, dtype_of(a.dtype)):
        return
    path = tmp_path / "one.safetensors"
    arrayio.save(path, xp.from_numpy(a))
    _assert_same(xp, arrayio.load(path, like=xp.name), a)
    if a.ndim:
        start = data.draw(st.integers(0, a.shape[0]))
        stop = data.draw(st.integers(start, a.shape[0]))
        with arrayio.open(path) as reader:
            _assert_same(xp, reader.read(index=slice(start, stop), like=xp.name), a[start:stop])


@SETTINGS
@given(data=st.data())
def test_npy_round_trip(tmp_path, xp: Framework, data) -> None:
    dtype = data.draw(st.sampled_from([d for d in DTYPES if d.numpy_native]))
    a = data.draw(arrays(dtype=dtype))
    path = tmp_path / "one.npy"
    arrayio.save(path, xp.from_numpy(a))
    assert np.load(path).tobytes() == np.ascontiguousarray(a).tobytes()
    _assert_same(xp, arrayio.load(path, like=xp.name), a)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_read_into_every_dtype(tmp_path, xp: Framework, dtype) -> None:
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable")
    a = random_array(dtype, (3, 5))
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"x": a})
    out = xp.from_numpy(np.zeros_like(a))
    assert arrayio.read_into(path, out, key="x") is out
    _assert_same(xp, out, a)
