"""Interoperability with the real ``safetensors`` package and with NumPy's ``.npy``.

Files arrayio writes must be plain safetensors files (readable bit-exactly by
``safetensors.numpy``, ``safetensors.safe_open`` and ``safetensors.torch``) and plain ``.npy``
files (readable by ``numpy.load``); files those tools write must load bit-exactly with arrayio.
The container also lays its data out for direct I/O: the data section, and every tensor whose
size is a multiple of 4096 bytes, start on a 4096-byte boundary.

Arrays are compared through their raw bytes (plus dtype and shape), so NaN payloads, signed
zeros and every bit of bfloat16/float8 values count.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest

import arrayio

# --------------------------------------------------------------------------- helpers

NUMPY_NATIVE = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
]
ML_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
SHAPES = [(), (0,), (3, 0), (7,), (2, 3, 5)]
ALIGNMENT = 4096


def np_dtype(name: str) -> np.dtype:
    """NumPy's dtype called ``name``; bfloat16 and float8 come from ml_dtypes."""
    if name in ML_DTYPES:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def random_array(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """An array of random bits (valid 0/1 for bool): NaN payloads and odd floats included."""
    dtype = np_dtype(name)
    rng = np.random.default_rng(seed)
    count = math.prod(shape)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype, same shape, same bytes (in C order)."""
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes()


def torch_bytes(tensor) -> bytes:
    """The bytes of a CPU torch tensor in C order, for any dtype (bfloat16 and float8 too)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def header_of(path) -> tuple[int, dict]:
    """The data start and the parsed JSON header of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def sample_arrays(dtypes: list[str]) -> dict[str, np.ndarray]:
    """One array per dtype and shape, keyed ``"<dtype>_<ndim>d_<n>"``."""
    return {
        f"{name}_{len(shape)}d_{i}": random_array(name, shape, seed=i)
        for name in dtypes
        for i, shape in enumerate(SHAPES)
    }


# --------------------------------------------------------------------------- arrayio -> safetensors


def test_safetensors_numpy_load_file_reads_arrayio_file(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    # safetensors.numpy has no float8 (NumPy has none without ml_dtypes, and safetensors looks
    # for np.float8_*): float8 is checked through torch and safe_open("pt") below.
    arrays = sample_arrays(NUMPY_NATIVE + ["bfloat16"])
    path = tmp_path / "all.safetensors"
    arrayio.save(path, arrays)

    loaded = safetensors_numpy.load_file(str(path))
    assert loaded.keys() == arrays.keys()
    for key, expected in arrays.items():
        assert_same(loaded[key], expected)


def test_safe_open_numpy_reads_arrayio_file(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    arrays = sample_arrays(NUMPY_NATIVE + ["bfloat16"])
    path = tmp_path / "all.safetensors"
    arrayio.save(path, arrays, metadata={"a": "b", "n": 3})

    with safetensors.safe_open(str(path), "np") as f:
        assert set(f.keys()) == set(arrays)
        for key, expected in arrays.items():
            assert_same(f.get_tensor(key), expected)
        metadata = f.metadata()
    # Every value is a string to safetensors; arrayio's own facts sit under "arrayio", and the
    # header's CRC under its own key.
    assert metadata["a"] == "b"
    assert metadata["n"] == "3"
    assert set(metadata) == {"a", "n", "arrayio", "arrayio_header_crc32c"}


def test_safe_open_slices_arrayio_file(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    a = random_array("float32", (50, 8))
    path = tmp_path / "a.safetensors"
    arrayio.save(path, {"a": a})
    with safetensors.safe_open(str(path), "np") as f:
        assert_same(f.get_slice("a")[10:20], a[10:20])


def test_safetensors_torch_reads_arrayio_file(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    names = NUMPY_NATIVE + ML_DTYPES  # torch has every one of them, float8 included
    arrays = sample_arrays(names)
    path = tmp_path / "all.safetensors"
    arrayio.save(path, arrays)

    loaded = safetensors_torch.load_file(str(path))
    assert loaded.keys() == arrays.keys()
    for key, expected in arrays.items():
        tensor = loaded[key]
        assert isinstance(tensor, torch.Tensor)
        assert str(tensor.dtype).removeprefix("torch.") == expected.dtype.name
        assert tuple(tensor.shape) == expected.shape
        assert torch_bytes(tensor) == expected.tobytes()


def test_safe_open_torch_reads_float8(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    pytest.importorskip("torch")
    arrays = sample_arrays(["float8_e4m3fn", "float8_e5m2"])
    path = tmp_path / "f8.safetensors"
    arrayio.save(path, arrays)
    with safetensors.safe_open(str(path), "pt") as f:
        for key, expected in arrays.items():
            tensor = f.get_tensor(key)
            assert str(tensor.dtype).removeprefix("torch.") == expected.dtype.name
            assert torch_bytes(tensor) == expected.tobytes()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_complex128_is_float64_pairs_to_safetensors(tmp_path, shape):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    z = random_array("complex128", shape)
    path = tmp_path / "z.safetensors"
    arrayio.save(path, {"z": z})

    seen = safetensors_numpy.load_file(str(path))["z"]
    assert seen.dtype == np.float64
    assert seen.shape == (*shape, 2)
    assert seen.tobytes() == z.tobytes()
    assert seen.tobytes() == np.stack((z.real, z.imag), axis=-1).tobytes()  # (re, im) pairs

    _, header = header_of(path)
    assert header["z"]["dtype"] == "F64"
    assert header["z"]["shape"] == [*shape, 2]

    assert_same(arrayio.load(path)["z"], z)
    with arrayio.open(path) as reader:
        assert reader["z"].dtype == "complex128"
        assert reader["z"].shape == shape
        assert reader["z"].nbytes == z.nbytes


# --------------------------------------------------------------------------- safetensors -> arrayio


def test_arrayio_loads_safetensors_numpy_file(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    arrays = sample_arrays(NUMPY_NATIVE + ["bfloat16"])
    path = tmp_path / "np.safetensors"
    safetensors_numpy.save_file(arrays, str(path), metadata={"a": "b"})

    loaded = arrayio.load(path)
    assert isinstance(loaded, dict)
    assert loaded.keys() == arrays.keys()
    for key, expected in arrays.items():
        assert_same(loaded[key], expected)
    with arrayio.open(path) as reader:
        assert reader.metadata == {"a": "b"}
        assert reader.framework is None
        assert reader.format == "safetensors"
        assert set(reader.keys()) == set(arrays)
        # No arrayio checksums in a foreign file.
        assert all(info.crc32c is None for info in reader.arrays.values())


def test_arrayio_loads_safetensors_torch_file(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.weight": torch.randn(16, 8, generator=generator),
        "model.layers.0.bias": torch.randn(16, generator=generator).to(torch.bfloat16),
        "model.embed": torch.randn(4, 3, generator=generator).to(torch.float16),
        "f8_e4m3": torch.randn(5, generator=generator).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(2, 2, generator=generator).to(torch.float8_e5m2),
        "ids": torch.arange(-5, 5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "z": torch.randn(3, dtype=torch.complex64, generator=generator),
    }
    path = tmp_path / "torch.safetensors"
    safetensors_torch.save_file(tensors, str(path), metadata={"a": "b"})

    loaded = arrayio.load(path)
    assert isinstance(loaded, dict)
    assert set(loaded) == set(tensors)  # dotted keys stay flat: the file has no structure
    for key, tensor in tensors.items():
        array = loaded[key]
        assert array.dtype.name == str(tensor.dtype).removeprefix("torch.")
        assert array.shape == tuple(tensor.shape)
        assert array.tobytes() == torch_bytes(tensor)
    assert arrayio.open(path).metadata == {"a": "b"}

    as_torch = arrayio.load(path, like="torch")
    for key, tensor in tensors.items():
        assert as_torch[key].dtype == tensor.dtype
        assert torch_bytes(as_torch[key]) == torch_bytes(tensor)

    # Prefix selection works on dotted keys of foreign files too.
    layer = arrayio.load(path, keys=["model.layers.0"])
    assert set(layer) == {"model.layers.0.weight", "model.layers.0.bias"}


# --------------------------------------------------------------------------- alignment


def test_data_and_aligned_tensors_start_on_4096(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    arrays = {
        "odd_a": np.arange(3, dtype=np.float32),  # 12 bytes
        "page": np.arange(1024, dtype=np.float32),  # 4096 bytes
        "odd_b": np.arange(5, dtype=np.int8),  # 5 bytes
        "three_pages": np.ones((3, 1024), dtype=np.float32),  # 12288 bytes
        "scalar": np.float64(1.5),  # 8 bytes
        "bytes_page": np.zeros(8192, dtype=np.uint8),  # 8192 bytes
        "empty": np.zeros((0, 4), dtype=np.float32),  # 0 bytes
        "odd_c": np.ones((7, 3), dtype=np.float16),  # 42 bytes
    }
    path = tmp_path / "aligned.safetensors"
    arrayio.save(path, arrays, metadata={"note": "x" * 5000})  # header longer than a page

    data_start, header = header_of(path)
    assert data_start % ALIGNMENT == 0
    assert data_start >= 8192
    with arrayio.open(path) as reader:
        for key, array in arrays.items():
            info = reader[key]
            assert info.nbytes == array.nbytes
            # arrayio's offset agrees with the safetensors header.
            assert info.file_offset == data_start + header[key]["data_offsets"][0]
            if array.nbytes % ALIGNMENT == 0:
                assert info.file_offset % ALIGNMENT == 0, key
    # No gaps (safetensors forbids them) and nothing after the last tensor.
    assert os.path.getsize(path) == data_start + sum(a.nbytes for a in arrays.values())
    loaded = safetensors_numpy.load_file(str(path))
    for key, array in arrays.items():
        assert_same(loaded[key], np.asarray(array))


# --------------------------------------------------------------------------- .npy


def npy_cases():
    for name in NUMPY_NATIVE + ["complex128"]:
        for shape in SHAPES:
            yield pytest.param(name, shape, id=f"{name}-{shape}")


@pytest.mark.parametrize(("name", "shape"), list(npy_cases()))
def test_npy_written_by_arrayio_reads_with_numpy(tmp_path, name, shape):
    a = random_array(name, shape)
    path = tmp_path / "a.npy"
    arrayio.save(path, a)
    assert_same(np.load(path), a)
    assert_same(arrayio.load(path), a)
    # The header is padded so that the data starts on the alignment.
    assert os.path.getsize(path) == ALIGNMENT + a.nbytes


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda a: np.asfortranarray(a), id="fortran"),
        pytest.param(lambda a: a[::2, 1:], id="strided"),
        pytest.param(lambda a: a.T, id="transposed"),
        pytest.param(lambda a: a[:, ::-1], id="reversed"),
    ],
)
def test_npy_from_non_c_contiguous_input(tmp_path, make):
    a = make(random_array("float32", (6, 5)))
    assert not a.flags.c_contiguous
    path = tmp_path / "a.npy"
    arrayio.save(path, a)
    assert_same(np.load(path), np.ascontiguousarray(a))


@pytest.mark.parametrize("version", [(1, 0), (2, 0)], ids=["v1", "v2"])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("name", ["bool", "int16", "uint64", "float32", "complex128"])
def test_npy_written_by_numpy_loads_with_arrayio(tmp_path, version, order, name):
    a = np.asarray(random_array(name, (10, 3, 4)), order=order)
    path = tmp_path / "a.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, a, version=version)

    loaded = arrayio.load(path)
    assert_same(loaded, a)  # tobytes() is C order whatever the layout
    with arrayio.open(path) as reader:
        assert reader.format == "npy"
        assert reader.keys() == ["array"]
        assert reader["array"].shape == a.shape
        assert reader["array"].dtype == name
        assert reader.metadata == {}
        assert_same(reader.read(), a)
        assert_same(np.ascontiguousarray(reader.read(index=slice(2, 7))), a[2:7])
        assert_same(np.ascontiguousarray(reader.read(index=4)), a[4])


@pytest.mark.parametrize("shape", [(), (0,), (5,)], ids=str)
def test_np_save_loads_with_arrayio(tmp_path, shape):
    a = random_array("float64", shape)
    path = tmp_path / "a.npy"
    np.save(path, a)
    assert_same(arrayio.load(path), a)


def test_npy_index_reads_rows_of_c_ordered_file(tmp_path):
    a = random_array("int32", (100, 7))
    path = tmp_path / "a.npy"
    np.save(path, a)
    with arrayio.open(path) as reader:
        assert_same(reader.read(index=slice(30, 45)), a[30:45])
        assert_same(reader.read("array", index=slice(90, 200)), a[90:])
        assert_same(reader.read(index=-1), a[-1])


def test_read_into_from_npy(tmp_path):
    a = random_array("uint16", (4, 9))
    path = tmp_path / "a.npy"
    np.save(path, a)
    out = np.empty_like(a)
    assert arrayio.read_into(path, out) is out
    assert_same(out, a)


@pytest.mark.parametrize("name", ML_DTYPES)
def test_npy_refuses_ml_dtypes(tmp_path, name):
    a = random_array(name, (4,))
    path = tmp_path / "a.npy"
    with pytest.raises(arrayio.UnsupportedDtypeError):
        arrayio.save(path, a)
    assert os.listdir(tmp_path) == []  # nothing, not even a temporary file, is left


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param({"a": np.zeros(2)}, id="dict"),
        pytest.param([np.zeros(2)], id="list"),
        pytest.param(3.0, id="python-float"),
        pytest.param(None, id="none"),
    ],
)
def test_npy_refuses_non_arrays(tmp_path, obj):
    path = tmp_path / "a.npy"
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.save(path, obj)
    assert os.listdir(tmp_path) == []


def test_npy_refuses_metadata(tmp_path):
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.save(tmp_path / "a.npy", np.zeros(2), metadata={"a": "b"})


def test_big_endian_input_is_refused(tmp_path):
    a = np.arange(4, dtype=">i4")
    for name in ("a.npy", "a.safetensors"):
        with pytest.raises(arrayio.UnsupportedDtypeError):
            arrayio.save(tmp_path / name, a)
    assert os.listdir(tmp_path) == []
