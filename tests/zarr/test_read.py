"""``arrayio.zarr.read``: a Zarr array (or a region) as a NumPy, JAX or torch array on the
CPU, filled in place in memory the framework then owns without a copy."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

import arrayio  # noqa: E402
from arrayio.arrays import _frameworks  # noqa: E402
from arrayio.zarr import NVMeStore, read  # noqa: E402

SELECTIONS = [
    Ellipsis,
    (slice(3, 17), slice(None)),
    (5, slice(2, 9)),
    (slice(1, 20, 3), 4),
    (4, 7),
    (slice(0, 0), Ellipsis),
]


@pytest.fixture
def stored(tmp_path):
    data = np.random.default_rng(3).normal(size=(23, 11)).astype(np.float32)
    z = zarr.create_array(NVMeStore(tmp_path), shape=data.shape, chunks=(5, 4), dtype=data.dtype)
    z[...] = data
    return tmp_path, data


@pytest.fixture
def allocations(monkeypatch):
    """The targets arrayio allocated during the test."""
    made = []
    real = _frameworks.allocate

    def allocate(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(_frameworks, "allocate", allocate)
    return made


@pytest.mark.parametrize("selection", SELECTIONS, ids=repr)
def test_numpy_regions(stored, selection):
    root, data = stored
    got = read(root, selection)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, data[selection])
    assert got.shape == data[selection].shape


def test_sources_path_store_and_array(stored):
    root, data = stored
    z = zarr.open_array(NVMeStore(root, read_only=True), mode="r")
    for source in (str(root), root, NVMeStore(root, read_only=True), z):
        np.testing.assert_array_equal(read(source), data)


def test_array_inside_a_group(tmp_path):
    group = zarr.open_group(NVMeStore(tmp_path), mode="w")
    group.create_array("deep/x", shape=(6,), chunks=(4,), dtype="i2")[...] = np.arange(6)
    np.testing.assert_array_equal(read(tmp_path, path="deep/x"), np.arange(6))


def test_jax_on_the_cpu_without_a_copy(stored, allocations):
    jax = pytest.importorskip("jax")
    root, data = stored
    got = read(root, (slice(2, 20), Ellipsis), like="jax")
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), data[2:20])
    # The memory zarr filled is the memory JAX holds.
    assert got.unsafe_buffer_pointer() == allocations[-1].data.ctypes.data


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_on_the_cpu_without_a_copy(stored, allocations):
    import torch

    root, data = stored
    got = read(root, like="torch", device="cpu")
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), data)
    assert got.data_ptr() == allocations[-1].data.ctypes.data


def test_like_an_example_array(stored):
    root, data = stored
    got = read(root, like=np.zeros(1, np.int8))
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, data)


def test_bad_requests_get_clear_errors(tmp_path, stored):
    root, _ = stored
    with pytest.raises(TypeError, match="zarr.Array, a zarr store or a directory"):
        read(42)
    with pytest.raises(ValueError, match="path="):
        read(zarr.open_array(NVMeStore(root), mode="r"), path="x")
    with pytest.raises(arrayio.DeviceError):
        read(root, like="numpy", device="cuda")
    strings = zarr.create_array(NVMeStore(tmp_path / "s"), shape=(3,), dtype=str)
    with pytest.raises(arrayio.UnsupportedDtypeError):
        read(strings)


@pytest.mark.parametrize("like", ["jax", "torch", "cupy", None])
def test_a_gpu_read_without_cupy_says_what_is_missing(stored, monkeypatch, like):
    # zarr's GPU buffers are CuPy arrays: a machine with a GPU and JAX or torch but no CuPy
    # gets arrayio's error naming it, before anything is opened or allocated (not a raw
    # ModuleNotFoundError from inside the read).
    from arrayio.zarr import _read

    root, _ = stored
    gpu = _frameworks.Request(like or "cupy", _frameworks.Placement("cuda", 0))
    monkeypatch.setattr(_read._frameworks, "parse_target", lambda like, device: gpu)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails, as where it is absent
    monkeypatch.setattr(_read, "_open", lambda *a: pytest.fail("opened without CuPy"))
    with pytest.raises(
        arrayio.FrameworkNotAvailableError, match="reading Zarr into GPU memory needs cupy"
    ):
        read(root, like=like, device="cuda")


def test_jax_refuses_to_narrow_64_bit_types(tmp_path):
    jax = pytest.importorskip("jax")
    if jax.config.jax_enable_x64:
        pytest.skip("jax_enable_x64 is on")
    zarr.create_array(NVMeStore(tmp_path), shape=(4,), dtype="f8")[...] = np.arange(4.0)
    with pytest.raises(arrayio.UnsupportedDtypeError, match="jax_enable_x64"):
        read(tmp_path, like="jax")


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">u2", ">c8"])
def test_big_endian_zarr_v2_arrays_read_in_native_order(tmp_path, dtype):
    # Zarr v2 stores the byte order in the dtype; zarr itself reads these arrays, so read()
    # must too (the values, in native order, as zarr v3's big-endian bytes codec gives them).
    data = np.arange(-7, 23).reshape(5, 6).astype(dtype)
    z = zarr.create_array(
        NVMeStore(tmp_path), shape=data.shape, chunks=(2, 4), dtype=dtype, zarr_format=2
    )
    z[...] = data
    for selection in (Ellipsis, (slice(1, 4), 3), (2, 5)):
        got = read(tmp_path, selection)
        assert got.dtype == data.dtype.newbyteorder("=")
        np.testing.assert_array_equal(got, data[selection])
