"""``.npz``: arrayio writes real NumPy archives, reads NumPy's (stored and compressed), and
never writes a container under another format's extension."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

import arrayio

ARRAYS = {
    "w": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.arange(5, dtype=np.int16),
    "f": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "e": np.zeros((0, 3)),
    "s": np.array(3.5),
    "c": np.array([1 + 2j], np.complex128),
}


def assert_same(loaded: dict, expected: dict) -> None:
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
        np.testing.assert_array_equal(loaded[key], value)


def test_save_writes_an_npz_that_numpy_reads(tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    arrayio.save(path, ARRAYS)
    assert zipfile.is_zipfile(path)
    with np.load(path) as archive:
        assert_same({key: archive[key] for key in archive.files}, ARRAYS)
    assert_same(arrayio.load(path), ARRAYS)


@pytest.mark.parametrize("writer", [np.savez, np.savez_compressed], ids=["stored", "compressed"])
def test_numpys_archives_load_whole_and_by_rows(tmp_path: Path, writer) -> None:
    path = tmp_path / "n.npz"
    writer(path, **ARRAYS)
    assert_same(arrayio.load(path), ARRAYS)
    with arrayio.open(path) as reader:
        assert reader.format == "npz" and reader.keys() == list(ARRAYS)
        np.testing.assert_array_equal(reader.read("w", index=slice(1, 3)), ARRAYS["w"][1:3])
        out = np.empty((3, 4), np.float32)
        np.testing.assert_array_equal(reader.read_into(out, "w"), ARRAYS["w"])
    torch = pytest.importorskip("torch")
    assert isinstance(arrayio.load(path, like="torch")["w"], torch.Tensor)


def test_save_async_writes_an_npz_too(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    arrayio.save_async(path, ARRAYS).result(60)
    assert_same(arrayio.load(path), ARRAYS)


@pytest.mark.parametrize(
    ("obj", "metadata"),
    [
        ({"nested": {"w": np.ones(2)}}, None),
        ({"w": np.ones(2), "step": 3}, None),
        (np.ones(2), None),
        ({"w": np.ones(2)}, {"run": "a"}),
    ],
    ids=["nested", "constant", "lone-array", "metadata"],
)
def test_what_an_npz_cannot_hold_is_refused_before_writing(tmp_path: Path, obj, metadata) -> None:
    path = tmp_path / "x.npz"
    with pytest.raises(arrayio.UnsupportedObjectError, match="safetensors"):
        arrayio.save(path, obj, metadata=metadata)
    assert list(tmp_path.iterdir()) == []


def test_bfloat16_is_refused_for_npz(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(arrayio.UnsupportedDtypeError, match="safetensors"):
        arrayio.save(tmp_path / "x.npz", {"w": np.ones(2, ml_dtypes.bfloat16)})


@pytest.mark.parametrize(
    "name",
    [
        "model.pt",
        "model.pth",
        "weights.bin",
        "x.h5",
        "x.pkl",
        "x.ckpt",
        "x.ZARR",
        "x.json",
        "x.msgpack",
    ],
)
def test_no_container_is_written_under_another_formats_extension(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    for save in (arrayio.save, arrayio.save_async):
        with pytest.raises(arrayio.UnsupportedFormatError) as raised:
            save(path, {"w": np.ones(3)})
        message = str(raised.value)
        assert str(path) in message and ".safetensors" in message
    assert isinstance(raised.value, ValueError)
    assert list(tmp_path.iterdir()) == []


def test_a_torch_name_is_pointed_to_arrayio_convert(tmp_path: Path) -> None:
    with pytest.raises(arrayio.UnsupportedFormatError, match="arrayio convert"):
        arrayio.save(tmp_path / "model.pt", {"w": np.ones(3)})


# --------------------------------------------------------------------------- damaged archives


def _archive(tmp_path: Path, writer=np.savez) -> tuple[Path, bytes]:
    path = tmp_path / "d.npz"
    writer(path, w=np.arange(4096, dtype=np.float32))
    return path, path.read_bytes()


def test_a_damaged_compressed_member_is_a_format_error(tmp_path: Path) -> None:
    path, blob = _archive(tmp_path, np.savez_compressed)
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0xFF  # inside the deflate stream
    path.write_bytes(damaged)
    with pytest.raises(arrayio.FormatError):
        arrayio.load(path)


@pytest.mark.parametrize("keep", [0.2, 0.6, 0.99])
@pytest.mark.parametrize("writer", [np.savez, np.savez_compressed], ids=["stored", "compressed"])
def test_a_cut_archive_is_a_format_error(tmp_path: Path, keep: float, writer) -> None:
    path, blob = _archive(tmp_path, writer)
    path.write_bytes(blob[: int(len(blob) * keep)])
    with pytest.raises(arrayio.FormatError):
        arrayio.load(path)


def test_a_member_that_is_not_an_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(arrayio.FormatError, match="notes.txt"):
        arrayio.open(path)


def test_a_member_claiming_more_than_it_holds_is_refused_before_allocating(tmp_path: Path) -> None:
    path = tmp_path / "bomb.npz"
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,), }"
    npy = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("big.npy", npy + b"\0" * 64)
    with pytest.raises(arrayio.FormatError):
        arrayio.open(path)
