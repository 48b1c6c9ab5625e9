"""The lazy reader (``arrayio.open``), key selection, ``read_into`` and pytree round trips.

* Opening a file reads only its header: keys, dtypes, shapes, metadata and structure are known
  without touching array data (proved by making the byte mover raise).
* ``Reader.read(key, index=...)`` reads only the bytes of the rows it returns (proved by
  spying on the byte mover, ``arrayio.dispatch._transfer.read_into``).
* ``read_into`` fills a caller's array in place, and refuses what it cannot fill.
* Saved pytrees (containers, named tuples, constants, JAX custom nodes) come back as saved.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import types
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayio
from arrayio.dispatch import _transfer

# --------------------------------------------------------------------------- helpers


class Point(NamedTuple):
    x: np.ndarray
    y: np.ndarray


Pair = collections.namedtuple("Pair", ["first", "second"])


class DataNotAllowed(AssertionError):
    """Raised by the byte mover where a test forbids reading array data."""


def forbid_data_reads(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise DataNotAllowed("array data was read")

    monkeypatch.setattr(_transfer, "read_into", refuse)
    monkeypatch.setattr(_transfer, "read_many", refuse)


def spy_on_reads(monkeypatch) -> list[tuple[int, int]]:
    """Record ``(file_offset, nbytes)`` of every read the byte mover makes, alone or in a
    batch."""
    calls: list[tuple[int, int]] = []
    real, real_many = _transfer.read_into, _transfer.read_many

    def spy(fd, file_offset, dest, **kwargs):
        calls.append((file_offset, dest.nbytes))
        return real(fd, file_offset, dest, **kwargs)

    def spy_many(fd, requests, **kwargs):
        calls.extend((file_offset, dest.nbytes) for file_offset, dest in requests)
        return real_many(fd, requests, **kwargs)

    monkeypatch.setattr(_transfer, "read_into", spy)
    monkeypatch.setattr(_transfer, "read_many", spy_many)
    return calls


def assert_tree_equal(actual, expected, path="root") -> None:
    """Same container types all the way down, same constants, arrays with the same bytes."""
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), (path, type(actual))
        assert actual.dtype == expected.dtype, path
        assert actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), path
        return
    assert type(actual) is type(expected), (path, type(actual), type(expected))
    if isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_tree_equal(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_tree_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), path
    else:
        assert actual == expected, path
        assert repr(actual) == repr(expected), path  # -0.0 vs 0.0, 1 vs True


def roundtrip(tmp_path, obj, **load_kwargs):
    path = tmp_path / "tree.safetensors"
    arrayio.save(path, obj)
    return arrayio.load(path, **load_kwargs)


@pytest.fixture
def model_file(tmp_path):
    """A small pytree file, its arrays by key, and its metadata."""
    rng = np.random.default_rng(0)
    arrays = {
        "params.w": rng.standard_normal((3, 4)).astype(np.float32),
        "params.b": np.arange(4, dtype=np.int64),
        "params_ema.w": rng.standard_normal((3, 4)).astype(np.float32),
    }
    tree = {
        "params": {"w": arrays["params.w"], "b": arrays["params.b"]},
        "params_ema": {"w": arrays["params_ema.w"]},
        "step": 7,
    }
    metadata = {
        "name": "run-1",
        "looks_like_json": "[1, 2]",  # a str stays a str
        "empty": "",
        "epoch": 3,
        "lr": 0.5,
        "flag": True,
        "nothing": None,
        "sizes": [1, "two", None, 3.5],
        "nested": {"k": [1, 2], "m": {"x": False}},
    }
    path = tmp_path / "model.safetensors"
    arrayio.save(path, tree, metadata=metadata)
    return path, arrays, metadata


@pytest.fixture
def rows_file(tmp_path):
    """A (5000, 64) float32 array under key "x"; 0-d "s" and 1-d "v" arrays beside it."""
    x = np.random.default_rng(1).standard_normal((5000, 64)).astype(np.float32)
    path = tmp_path / "rows.safetensors"
    arrayio.save(path, {"x": x, "s": np.float32(2.5), "v": np.arange(10, dtype=np.int16)})
    return path, x


# --------------------------------------------------------------------------- open without reading


def test_open_describes_file_without_reading_data(monkeypatch, model_file):
    path, arrays, metadata = model_file
    forbid_data_reads(monkeypatch)

    with arrayio.open(path) as reader:
        assert reader.format == "safetensors"
        assert reader.framework == "numpy"
        assert reader.keys() == ["params.w", "params.b", "params_ema.w"]
        assert list(reader) == reader.keys()
        assert len(reader) == 3
        assert "params.w" in reader and "params" not in reader
        for key, array in arrays.items():
            info = reader[key]
            assert isinstance(info, arrayio.ArrayInfo)
            assert info.key == key
            assert info.dtype == array.dtype.name
            assert info.shape == array.shape
            assert info.nbytes == array.nbytes
            assert info.file_offset > 0
            assert isinstance(info.crc32c, str) and len(info.crc32c) == 8
            int(info.crc32c, 16)
        assert reader.arrays == {key: reader[key] for key in arrays}
        structure = reader.structure
        assert structure["step"] == 7
        assert structure["params"]["w"] == reader["params.w"]
        assert structure["params_ema"]["w"] == reader["params_ema.w"]
        assert reader.nbytes == sum(a.nbytes for a in arrays.values())
        # Metadata values come back typed: strings as saved, the rest through JSON.
        assert reader.metadata == metadata
        assert type(reader.metadata["epoch"]) is int
        assert type(reader.metadata["flag"]) is bool
        assert reader.metadata["looks_like_json"] == "[1, 2]"
        # And data reads really go through the byte mover that is refusing here.
        with pytest.raises(DataNotAllowed):
            reader.read("params.w")


def test_open_npy_without_reading_data(monkeypatch, tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((4, 2), dtype=np.float16))
    forbid_data_reads(monkeypatch)
    with arrayio.open(path) as reader:
        assert reader.format == "npy"
        assert reader.keys() == ["array"]
        assert reader["array"].dtype == "float16"
        assert reader["array"].shape == (4, 2)
        assert reader["array"].crc32c is None
        assert reader.metadata == {}
        assert reader.framework is None
        assert reader.structure == reader["array"]


def test_lone_array_is_stored_under_array(tmp_path):
    a = np.arange(6, dtype=np.uint8).reshape(2, 3)
    path = tmp_path / "a.safetensors"
    arrayio.save(path, a)
    with arrayio.open(path) as reader:
        assert reader.keys() == ["array"]
        np.testing.assert_array_equal(reader.read(), a)
    np.testing.assert_array_equal(arrayio.load(path), a)


# --------------------------------------------------------------------------- partial reads


def test_row_slice_reads_only_those_rows(monkeypatch, rows_file):
    path, x = rows_file
    with arrayio.open(path) as reader:
        start = reader["x"].file_offset
        calls = spy_on_reads(monkeypatch)
        rows = reader.read("x", index=slice(1000, 2000))
    np.testing.assert_array_equal(rows, x[1000:2000])
    assert rows.dtype == np.float32
    row_bytes = 64 * 4
    assert calls == [(start + 1000 * row_bytes, 1000 * row_bytes)]


def test_int_index_reads_one_row(monkeypatch, rows_file):
    path, x = rows_file
    with arrayio.open(path) as reader:
        start = reader["x"].file_offset
        calls = spy_on_reads(monkeypatch)
        row = reader.read("x", index=-3)
    np.testing.assert_array_equal(row, x[-3])
    assert row.shape == (64,)
    assert calls == [(start + 4997 * 64 * 4, 64 * 4)]


@pytest.mark.parametrize(
    "index",
    [
        0,
        4999,
        -1,
        -5000,
        np.int64(12),
        slice(None),
        slice(4990, 9000),  # clamped, as NumPy does
        slice(-10, None),
        slice(10, 100, 3),
        slice(None, None, 7),
        slice(10, 10),  # empty
        slice(3000, 1000),  # empty
        (slice(10, 20), slice(None)),
        (5, slice(None)),
        (slice(10, 20), Ellipsis),
        (slice(10, 20),),
        (slice(None), slice(16, 48)),  # a tensor-parallel rank's columns
        (slice(100, 300), slice(0, 32)),
        (slice(10, 100, 3), slice(60, None)),
        (7, slice(5, 6)),
        (slice(None), slice(-8, None)),
        (slice(None), slice(0, 64), Ellipsis),  # whole: read as rows
        (slice(0, 10), slice(40, 20)),  # empty columns
        (slice(None), slice(10, 20), Ellipsis),
    ],
    ids=repr,
)
def test_index_matches_numpy(rows_file, index):
    path, x = rows_file
    with arrayio.open(path) as reader:
        result = reader.read("x", index=index)
    expected = x[index]
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype
    np.testing.assert_array_equal(result, expected)


def test_strided_slice_reads_no_more_than_its_span(monkeypatch, rows_file):
    path, x = rows_file
    with arrayio.open(path) as reader:
        calls = spy_on_reads(monkeypatch)
        result = reader.read("x", index=slice(100, 200, 3))
    np.testing.assert_array_equal(result, x[100:200:3])
    assert sum(n for _, n in calls) <= (199 - 100 + 1) * 64 * 4


@pytest.mark.parametrize("min_run", [64, 1 << 16], ids=["runs", "rows"])
def test_a_column_range_reads_its_columns_or_its_rows(monkeypatch, rows_file, min_run):
    # A tensor-parallel rank's quarter of the columns, 64 bytes a row. Counted long enough
    # to be worth their requests (runs): one run per row, each read into its place in the
    # result, none of the other ranks' bytes asked for. Counted too short (rows, the
    # default): the rows are read as one range and sliced, the result in memory of its own.
    from arrayio.api import _reader

    monkeypatch.setattr(_reader, "MIN_RUN_BYTES", min_run)
    path, x = rows_file
    with arrayio.open(path) as reader:
        start = reader["x"].file_offset
        calls = spy_on_reads(monkeypatch)
        part = reader.read("x", index=(slice(10, 20), slice(16, 32)))
    np.testing.assert_array_equal(part, x[10:20, 16:32])
    owner = part if part.base is None else part.base
    assert part.flags.c_contiguous and owner.nbytes == part.nbytes  # nothing more held
    if min_run <= 64:
        assert calls == [(start + (row * 64 + 16) * 4, 16 * 4) for row in range(10, 20)]
    else:
        assert calls == [(start + 10 * 64 * 4, 10 * 64 * 4)]


def test_a_range_of_a_middle_axis_reads_a_run_per_outer_index(monkeypatch, tmp_path):
    from arrayio.api import _reader

    monkeypatch.setattr(_reader, "MIN_RUN_BYTES", 1)
    cube = np.arange(4 * 5 * 6, dtype=np.int32).reshape(4, 5, 6)
    arrayio.save(tmp_path / "cube.safetensors", {"c": cube})
    with arrayio.open(tmp_path / "cube.safetensors") as reader:
        calls = spy_on_reads(monkeypatch)
        part = reader.read("c", index=(slice(1, 3), slice(2, 4), Ellipsis))
        np.testing.assert_array_equal(part, cube[1:3, 2:4])
        assert len(calls) == 2 and all(n == 2 * 6 * 4 for _, n in calls)  # a run per row
        deep = reader.read("c", index=(slice(None), slice(None), slice(1, 5)))
        np.testing.assert_array_equal(deep, cube[:, :, 1:5])
        torch = pytest.importorskip("torch")
        columns = reader.read("c", index=(0, slice(None), slice(3, 6)), like="torch")
        assert isinstance(columns, torch.Tensor)
        np.testing.assert_array_equal(columns.numpy(), cube[0, :, 3:6])


@pytest.mark.parametrize("min_run", [1, 1 << 20], ids=["runs", "rows"])
def test_a_column_range_reads_into_jax_and_torch(monkeypatch, rows_file, min_run):
    from arrayio.api import _reader

    monkeypatch.setattr(_reader, "MIN_RUN_BYTES", min_run)
    path, x = rows_file
    jax = pytest.importorskip("jax")
    with arrayio.open(path) as reader:
        part = reader.read("x", index=(slice(None), slice(32, 48)), like="jax")
        assert isinstance(part, jax.Array)
        np.testing.assert_array_equal(np.asarray(part), x[:, 32:48])
        torch = pytest.importorskip("torch")
        rows = reader.read("x", index=(slice(5, 900, 7), slice(1, 3)), like="torch")
        assert isinstance(rows, torch.Tensor) and rows.is_contiguous()
        np.testing.assert_array_equal(rows.numpy(), x[5:900:7, 1:3])


def test_index_on_small_arrays(rows_file):
    path, _ = rows_file
    with arrayio.open(path) as reader:
        np.testing.assert_array_equal(reader.read("v", index=slice(2, 5)), np.arange(2, 5))
        assert reader.read("v", index=-1) == 9
        assert reader.read("s").shape == ()
        assert reader.read("s") == np.float32(2.5)


@pytest.mark.parametrize(
    ("key", "index"),
    [
        ("x", 5000),
        ("x", -5001),
        ("v", 10),
        ("s", 0),  # 0-d
        ("s", slice(None)),  # 0-d
        ("x", (slice(None), 3)),  # an int on a later axis
        ("x", (slice(None), slice(0, 8, 2))),  # a later axis's step
        ("x", (slice(None), slice(None), slice(None))),  # too many axes
        ("x", (Ellipsis, slice(0, 2))),  # '...' only at the end
        ("x", slice(None, None, -1)),  # negative step
        ("x", 1.5),
    ],
    ids=repr,
)
def test_bad_index_raises_index_error(rows_file, key, index):
    path, _ = rows_file
    with arrayio.open(path) as reader, pytest.raises(IndexError):
        reader.read(key, index=index)


def test_read_index_as_torch(rows_file):
    torch = pytest.importorskip("torch")
    path, x = rows_file
    with arrayio.open(path) as reader:
        rows = reader.read("x", index=slice(5, 9), like="torch")
    assert isinstance(rows, torch.Tensor)
    np.testing.assert_array_equal(rows.numpy(), x[5:9])


# --------------------------------------------------------------------------- lifetime


def test_context_manager_closes_file(model_file):
    path, _, _ = model_file
    identity = os.stat(path)
    with arrayio.open(path) as reader:
        fd = reader.fd
        assert not reader.closed
        assert reader.read("params.b").shape == (4,)
    assert reader.closed
    # The descriptor is closed (or, if already reused, no longer our file).
    try:
        status = os.fstat(fd)
    except OSError:
        pass
    else:
        assert (status.st_dev, status.st_ino) != (identity.st_dev, identity.st_ino)
    with pytest.raises(ValueError):
        reader.read("params.b")
    with pytest.raises(ValueError):
        reader.load()
    with pytest.raises(ValueError):
        reader.read_into(np.empty(4, np.int64), "params.b")
    reader.close()  # closing twice is harmless


def test_context_manager_closes_on_error(model_file):
    path, _, _ = model_file
    with pytest.raises(RuntimeError), arrayio.open(path) as reader:
        raise RuntimeError
    assert reader.closed


def test_explicit_close(model_file):
    path, _, _ = model_file
    reader = arrayio.open(path)
    reader.close()
    with pytest.raises(ValueError):
        reader.read("params.w")


# --------------------------------------------------------------------------- keys=


def test_load_one_key_returns_the_array(model_file):
    path, arrays, _ = model_file
    result = arrayio.load(path, keys="params.w")
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, arrays["params.w"])
    with arrayio.open(path) as reader:
        np.testing.assert_array_equal(reader.load(keys="params.b"), arrays["params.b"])


def test_load_key_list_returns_flat_dict(model_file):
    path, arrays, _ = model_file
    result = arrayio.load(path, keys=["params_ema.w", "params.b"])
    assert list(result) == ["params_ema.w", "params.b"]
    for key, array in result.items():
        np.testing.assert_array_equal(array, arrays[key])


def test_load_key_list_with_subtree_prefix(model_file):
    path, arrays, _ = model_file
    result = arrayio.load(path, keys=["params"])
    # Everything below "params" and nothing from "params_ema", which merely shares a prefix.
    assert set(result) == {"params.w", "params.b"}
    for key, array in result.items():
        np.testing.assert_array_equal(array, arrays[key])
    # Overlapping selections do not repeat keys.
    assert list(arrayio.load(path, keys=["params", "params.w"])) == ["params.w", "params.b"]


def test_load_key_str_naming_subtree(model_file):
    # The docstring of arrayio.load: 'A key naming a subtree ("params") selects every array
    # below it.' A lone string naming a subtree selects the same arrays as ["params"].
    path, arrays, _ = model_file
    result = arrayio.load(path, keys="params")
    assert isinstance(result, dict)
    assert set(result) == {"params.w", "params.b"}
    for key, array in result.items():
        np.testing.assert_array_equal(array, arrays[key])


def _select_by_scanning(stored: list[str], keys: list[str]) -> list[str] | None:
    """What keys= selects, by its definition: each key itself and the keys under it, in
    the file's order, without repeats (None where a key selects nothing)."""
    chosen: list[str] = []
    for wanted in keys:
        matches = [k for k in stored if k == wanted or k.startswith(wanted + ".")]
        if not matches:
            return None
        chosen.extend(k for k in matches if k not in chosen)
    return chosen


_KEY = st.text(alphabet="ab.-/_", min_size=1, max_size=4)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stored=st.lists(_KEY, min_size=1, max_size=12, unique=True), data=st.data())
def test_keys_select_what_their_definition_says(tmp_path, stored, data):
    # Selection looks keys up in the sorted keys (a shard's load selects all it holds): the
    # same keys in the same order as scanning every key for each, with keys around "." in
    # sort order ("a-", "a/") and keys both stored and a prefix of others ("a", "a.b").
    wanted = data.draw(st.lists(st.one_of(st.sampled_from(stored), _KEY), min_size=1, max_size=5))
    path = str(tmp_path / "keys.safetensors")
    arrayio.save(path, {key: np.full(1, i, np.int16) for i, key in enumerate(stored)})
    expected = _select_by_scanning(stored, wanted)
    if expected is None:
        with pytest.raises(KeyError):
            arrayio.load(path, keys=wanted)
        return
    result = arrayio.load(path, keys=wanted)
    assert list(result) == expected
    assert [int(result[key][0]) for key in expected] == [stored.index(key) for key in expected]


def test_a_subtree_comes_back_in_the_saved_order(tmp_path):
    # A list of 12 layers is stored as layers.0 to layers.11, which sort as strings with
    # layers.10 before layers.2: the selection keeps the saved order.
    path = str(tmp_path / "layers.safetensors")
    arrayio.save(path, {"layers": [np.full(1, i, np.int16) for i in range(12)], "x": np.zeros(1)})
    result = arrayio.load(path, keys=["x", "layers"])
    assert list(result) == ["x"] + [f"layers.{i}" for i in range(12)]
    assert [int(result[f"layers.{i}"][0]) for i in range(12)] == list(range(12))


@pytest.mark.parametrize("keys", ["params.ww", ["params.w", "parms.b"]], ids=repr)
def test_unknown_key_suggests_near_miss(model_file, keys):
    path, _, _ = model_file
    with pytest.raises(arrayio.KeyNotFoundError) as caught:
        arrayio.load(path, keys=keys)
    assert isinstance(caught.value, KeyError)
    assert isinstance(caught.value, arrayio.ArrayioError)
    message = str(caught.value)
    assert "did you mean" in message
    assert "params." in message


def test_unknown_key_far_from_any(model_file):
    path, _, _ = model_file
    with arrayio.open(path) as reader:
        for lookup in (lambda: reader["zzzzzz"], lambda: reader.read("zzzzzz")):
            with pytest.raises(KeyError) as caught:
                lookup()
            assert isinstance(caught.value, arrayio.KeyNotFoundError)
            assert "zzzzzz" in str(caught.value)
            assert "did you mean" not in str(caught.value)


def test_read_without_key_needs_a_single_array(model_file, tmp_path):
    path, _, _ = model_file
    with arrayio.open(path) as reader, pytest.raises(arrayio.KeyNotFoundError):
        reader.read()
    single = tmp_path / "single.safetensors"
    arrayio.save(single, {"only": np.ones(3)})
    with arrayio.open(single) as reader:
        np.testing.assert_array_equal(reader.read(), np.ones(3))


# --------------------------------------------------------------------------- read_into


def test_read_into_numpy_in_place(model_file):
    path, arrays, _ = model_file
    out = np.zeros((3, 4), dtype=np.float32)
    result = arrayio.read_into(path, out, key="params.w")
    assert result is out
    assert np.shares_memory(result, out)
    np.testing.assert_array_equal(out, arrays["params.w"])

    with arrayio.open(path) as reader:
        out = np.zeros(4, dtype=np.int64)
        assert reader.read_into(out, "params.b") is out
        np.testing.assert_array_equal(out, arrays["params.b"])


def test_read_into_torch_in_place(model_file):
    torch = pytest.importorskip("torch")
    path, arrays, _ = model_file
    out = torch.zeros(3, 4, dtype=torch.float32)
    pointer = out.data_ptr()
    result = arrayio.read_into(path, out, key="params.w")
    assert result is out
    assert out.data_ptr() == pointer
    np.testing.assert_array_equal(out.numpy(), arrays["params.w"])


def test_read_into_torch_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.linspace(-2, 2, 12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    path = tmp_path / "bf16.safetensors"
    arrayio.save(path, {"a": a})
    out = torch.empty(3, 4, dtype=torch.bfloat16)
    arrayio.read_into(path, out, key="a")
    assert out.view(torch.int16).numpy().tobytes() == a.tobytes()


@pytest.mark.parametrize(
    "out",
    [
        pytest.param(np.zeros((3, 4), np.float64), id="dtype"),
        pytest.param(np.zeros((4, 3), np.float32), id="shape"),
        pytest.param(np.zeros((12,), np.float32), id="flat"),
        pytest.param(np.zeros((3, 4, 1), np.float32), id="extra-axis"),
    ],
)
def test_read_into_mismatch(model_file, out):
    path, _, _ = model_file
    before = out.copy()
    with pytest.raises(arrayio.MismatchError) as caught:
        arrayio.read_into(path, out, key="params.w")
    assert isinstance(caught.value, ValueError)
    np.testing.assert_array_equal(out, before)  # untouched


def test_read_into_torch_mismatch(model_file):
    torch = pytest.importorskip("torch")
    path, _, _ = model_file
    with pytest.raises(arrayio.MismatchError):
        arrayio.read_into(path, torch.zeros(3, 4, dtype=torch.float16), key="params.w")


@pytest.mark.parametrize(
    "make_out",
    [
        pytest.param(lambda: np.zeros((3, 8), np.float32)[:, ::2], id="strided"),
        pytest.param(lambda: np.asfortranarray(np.zeros((3, 4), np.float32)), id="fortran"),
        pytest.param(lambda: np.zeros((4, 3), np.float32).T, id="transposed"),
    ],
)
def test_read_into_non_contiguous_numpy(model_file, make_out):
    path, _, _ = model_file
    out = make_out()
    assert out.shape == (3, 4) and not out.flags.c_contiguous
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.read_into(path, out, key="params.w")


def test_read_into_read_only_numpy(model_file):
    path, _, _ = model_file
    out = np.zeros((3, 4), np.float32)
    out.flags.writeable = False
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.read_into(path, out, key="params.w")


def test_read_into_non_contiguous_torch(model_file):
    torch = pytest.importorskip("torch")
    path, _, _ = model_file
    out = torch.zeros(4, 3, dtype=torch.float32).T
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.read_into(path, out, key="params.w")


def test_read_into_jax_array(model_file):
    jnp = pytest.importorskip("jax.numpy")
    path, _, _ = model_file
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.read_into(path, jnp.zeros((3, 4), jnp.float32), key="params.w")


def test_read_into_not_an_array(model_file):
    path, _, _ = model_file
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.read_into(path, [0.0] * 12, key="params.w")


def test_read_into_multi_array_file_needs_key(model_file):
    path, _, _ = model_file
    with pytest.raises(arrayio.KeyNotFoundError):
        arrayio.read_into(path, np.zeros((3, 4), np.float32))


def test_read_into_single_array_file_without_key(tmp_path):
    a = np.arange(5, dtype=np.int32)
    path = tmp_path / "a.safetensors"
    arrayio.save(path, a)
    out = np.empty_like(a)
    assert arrayio.read_into(path, out) is out
    np.testing.assert_array_equal(out, a)


def test_read_into_fortran_npy_is_a_mismatch(tmp_path):
    a = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    path = tmp_path / "f.npy"
    np.save(path, a)
    with pytest.raises(arrayio.MismatchError):
        arrayio.read_into(path, np.empty((3, 4), np.float32))


# --------------------------------------------------------------------------- pytrees


def test_nested_containers_and_constants_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    tree = {
        "a": {"b": [x, (x[0].copy(), None)], "c": ()},
        "point": Point(x=np.arange(3), y=np.ones(2, np.float16)),
        "pair": Pair(first=np.zeros(1, np.uint8), second="second"),
        "constants": [
            0,
            -1,
            2**70,
            -(2**70),
            1.5,
            -0.0,
            float("inf"),
            float("nan"),
            1e-300,
            True,
            False,
            "text",
            "",
            "ünïcödé",
            1 + 2j,
            complex(0, -0.5),
            None,
        ],
        "int_keys": {0: np.arange(2), 10: "ten", -3: None},
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
        "nested_empty": [{}, [], ()],
        "tuple_of_arrays": (np.arange(4).reshape(2, 2), np.bool_(True)),
    }
    loaded = roundtrip(tmp_path, tree)
    expected = dict(tree)
    # A NumPy scalar is an array: it comes back as a 0-d array of its dtype.
    expected["tuple_of_arrays"] = (tree["tuple_of_arrays"][0], np.array(True))
    assert_tree_equal(loaded, expected)
    assert type(loaded["point"]) is Point
    assert type(loaded["pair"]) is Pair
    assert list(loaded["int_keys"]) == [0, 10, -3]


def test_leaf_keys_join_paths_with_dots(tmp_path):
    tree = {
        "layers": [{"w": np.zeros(1)}, {"w": np.ones(1)}],
        "p": Point(np.zeros(1), None),
        "t": (None, np.zeros(2)),
        5: np.zeros(3),
    }
    path = tmp_path / "t.safetensors"
    arrayio.save(path, tree)
    with arrayio.open(path) as reader:
        assert reader.keys() == ["layers.0.w", "layers.1.w", "p.x", "t.1", "5"]


@pytest.mark.parametrize(
    "root",
    [None, 5, 2.5, True, "s", 3j, {}, [], (), {"a": None}, [None, [None]]],
    ids=repr,
)
def test_constant_roots_round_trip(tmp_path, root):
    loaded = roundtrip(tmp_path, root)
    assert_tree_equal(loaded, root)
    with arrayio.open(tmp_path / "tree.safetensors") as reader:
        assert reader.keys() == []


def test_namedtuple_of_unimportable_class(tmp_path):
    Local = collections.namedtuple("Local", ["a", "b"])
    loaded = roundtrip(tmp_path, Local(a=np.arange(2), b=3))
    # Not importable by its path: an equivalent namedtuple with the same name and fields.
    assert type(loaded) is not Local
    assert type(loaded).__name__ == "Local"
    assert loaded._fields == ("a", "b")
    np.testing.assert_array_equal(loaded.a, np.arange(2))
    assert loaded.b == 3


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param({"a.b": np.zeros(1), "a": {"b": np.ones(1)}}, id="dotted-vs-nested"),
        pytest.param({"0": np.zeros(1), 0: np.ones(1)}, id="str-vs-int-key"),
        pytest.param({"x": [np.zeros(1), np.ones(1)], "x.1": np.ones(1)}, id="list-index"),
        pytest.param({"__metadata__": np.zeros(1)}, id="reserved-key"),
    ],
)
def test_colliding_or_reserved_keys_are_refused(tmp_path, tree):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.save(path, tree)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param({"a": {"b": np.ones(1)}, "a.b": 1}, id="array-vs-constant"),
        pytest.param({"a": {"b": 2}, "a.b": 1}, id="constant-vs-constant"),
    ],
)
def test_colliding_constant_keys_never_mix_up_values(tmp_path, tree):
    # Refusing the tree (as for two colliding arrays) is fine; loading wrong values is not.
    path = tmp_path / "c.safetensors"
    try:
        arrayio.save(path, tree)
    except arrayio.UnsupportedObjectError:
        return
    assert_tree_equal(arrayio.load(path), tree)
    assert_tree_equal(arrayio.load(path, structure=tree), tree)


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param({"a": object()}, id="object"),
        pytest.param([{1, 2}], id="set"),
        pytest.param({"a": b"bytes"}, id="bytes"),
        pytest.param({(1, 2): np.zeros(1)}, id="tuple-key"),
        pytest.param({True: np.zeros(1)}, id="bool-key"),
        pytest.param({1.5: np.zeros(1)}, id="float-key"),
    ],
)
def test_unsupported_leaves_and_keys_are_refused(tmp_path, tree):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.save(path, tree)
    assert os.listdir(tmp_path) == []


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(arrayio.UnsupportedDtypeError):
        arrayio.save(tmp_path / "bad.safetensors", {"s": np.array(["a", "b"])})
    with pytest.raises(arrayio.UnsupportedDtypeError):
        arrayio.save(tmp_path / "bad.safetensors", {"o": np.array([None], dtype=object)})
    assert os.listdir(tmp_path) == []


def test_jax_dataclass_node(tmp_path):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")

    @functools.partial(
        jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=["name"]
    )
    @dataclasses.dataclass
    class Linear:
        w: object
        b: object
        name: str

    w = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    b = jnp.ones(3, dtype=jnp.bfloat16)
    tree = {"layer": Linear(w=w, b=b, name="dense"), "step": 3}
    path = tmp_path / "jax.safetensors"
    arrayio.save(path, tree)
    with arrayio.open(path) as reader:
        assert reader.keys() == ["layer.w", "layer.b"]
        assert reader.framework == "jax"

    # Without structure=: a dict of the node's children.
    plain = arrayio.load(path)
    assert set(plain) == {"layer", "step"}
    assert set(plain["layer"]) == {"w", "b"}
    np.testing.assert_array_equal(plain["layer"]["w"], np.asarray(w))
    assert plain["layer"]["b"].dtype.name == "bfloat16"
    assert plain["step"] == 3

    # With structure=: the original class, arrays of the requested framework.
    example = {
        "layer": Linear(
            w=jax.ShapeDtypeStruct((2, 3), jnp.float32),
            b=jax.ShapeDtypeStruct((3,), jnp.bfloat16),
            name="dense",
        ),
        "step": 0,
    }
    restored = arrayio.load(path, structure=example, like="jax")
    assert type(restored["layer"]) is Linear
    assert restored["layer"].name == "dense"
    assert isinstance(restored["layer"].w, jax.Array)
    np.testing.assert_array_equal(np.asarray(restored["layer"].w), np.asarray(w))
    assert restored["layer"].b.dtype == jnp.bfloat16
    assert restored["step"] == 3  # constants come from the file, not the example
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(
        {"layer": Linear(w=w, b=b, name="dense"), "step": 3}
    )


def test_jax_pytree_node_class(tmp_path):
    jax = pytest.importorskip("jax")

    class Box:
        def __init__(self, items, label):
            self.items, self.label = items, label

    jax.tree_util.register_pytree_node(
        Box, lambda box: (box.items, box.label), lambda label, items: Box(items, label)
    )
    first, second = np.arange(3, dtype=np.int32), np.ones((2, 2), np.float32)
    path = tmp_path / "box.safetensors"
    arrayio.save(path, Box([first, second], "box"))

    plain = arrayio.load(path)
    assert isinstance(plain, dict) and len(plain) == 2
    values = list(plain.values())
    np.testing.assert_array_equal(values[0], first)
    np.testing.assert_array_equal(values[1], second)

    restored = arrayio.load(path, structure=Box([0, 0], "box"))
    assert type(restored) is Box
    assert restored.label == "box"
    np.testing.assert_array_equal(restored.items[0], first)
    np.testing.assert_array_equal(restored.items[1], second)


def test_structure_for_plain_containers(tmp_path):
    tree = {"a": [np.arange(2), np.ones(3)], "b": Point(np.zeros(1), np.ones(1))}
    path = tmp_path / "t.safetensors"
    arrayio.save(path, tree)
    restored = arrayio.load(path, structure={"a": [0, 0], "b": Point(0, 0)})
    assert_tree_equal(restored, tree)
    # The example may cover part of the file.
    assert_tree_equal(arrayio.load(path, structure={"b": Point(0, 0)}), {"b": tree["b"]})
    with pytest.raises(arrayio.KeyNotFoundError):
        arrayio.load(path, structure={"missing": 0})


def test_jax_64_bit_arrays_need_x64(tmp_path):
    jax = pytest.importorskip("jax")
    a = np.arange(5, dtype=np.int64)
    path = tmp_path / "i64.safetensors"
    arrayio.save(path, {"a": a})
    with jax.enable_x64(False), pytest.raises(arrayio.UnsupportedDtypeError):
        arrayio.load(path, like="jax")
    with jax.enable_x64(True):
        loaded = arrayio.load(path, like="jax")["a"]
        assert isinstance(loaded, jax.Array)
        assert loaded.dtype == np.int64
        np.testing.assert_array_equal(np.asarray(loaded), a)


# --------------------------------------------------------------------------- metadata


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({"arrayio": "mine"}, id="reserved"),
        pytest.param({1: "one"}, id="int-key"),
        pytest.param({("a",): "tuple"}, id="tuple-key"),
        pytest.param({"obj": object()}, id="not-json"),
        pytest.param({"nan": float("nan")}, id="nan"),
        pytest.param({"arr": np.zeros(2)}, id="array"),
        pytest.param([("a", "b")], id="not-a-mapping"),
    ],
)
def test_bad_metadata_is_refused(tmp_path, metadata):
    path = tmp_path / "m.safetensors"
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.save(path, {"x": np.zeros(2)}, metadata=metadata)
    assert os.listdir(tmp_path) == []


def test_metadata_round_trips_through_load_and_open(model_file):
    path, _, metadata = model_file
    assert arrayio.open(path).metadata == metadata
    with arrayio.open(path) as reader:
        assert reader.load(keys="params.b").tolist() == [0, 1, 2, 3]
        assert reader.metadata["nested"] == {"k": [1, 2], "m": {"x": False}}


def test_a_structure_asking_for_a_missing_array_fails_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    arrayio.save(path, {"a": np.arange(3), "n": 7})
    forbid_data_reads(monkeypatch)
    with pytest.raises(arrayio.KeyNotFoundError, match="'b'"):
        arrayio.load(path, structure={"a": 0, "b": 0, "n": 0})


def test_a_structure_reads_only_the_arrays_it_asks_for(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    tree = {"a": np.arange(3), "b": np.ones((2, 2)), "c": {"d": np.zeros(5)}, "n": 7}
    arrayio.save(path, tree)
    calls = spy_on_reads(monkeypatch)
    with arrayio.open(path) as reader:
        wanted = {reader["b"].file_offset, reader["c.d"].file_offset}
    back = arrayio.load(path, structure={"b": 0, "c": {"d": 0}, "n": 0})
    assert {offset for offset, _ in calls} == wanted
    assert_tree_equal(back, {"b": tree["b"], "c": tree["c"], "n": 7})


def test_a_load_whose_results_are_copies_reads_in_bounded_batches(tmp_path, monkeypatch):
    # JAX puts host bytes of a non-NumPy dtype (bfloat16) on its device with a copy: the load
    # must not read everything before finishing anything, or it would hold the file twice.
    jax = pytest.importorskip("jax")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from arrayio.api import _reader

    monkeypatch.setattr(_reader, "COPY_BATCH_BYTES", 3 << 20)
    rng = np.random.default_rng(5)
    tree = {f"w{i}": rng.standard_normal(1 << 20).astype(ml_dtypes.bfloat16) for i in range(5)}
    path = tmp_path / "bf16.safetensors"
    arrayio.save(path, tree)  # five arrays of 2 MiB
    batches = []
    real = _transfer.read_many

    def spy(fd, requests, **kwargs):
        batches.append(len(requests))
        return real(fd, requests, **kwargs)

    monkeypatch.setattr(_transfer, "read_many", spy)
    back = arrayio.load(path, like="jax")
    assert batches == [2, 2, 1]  # a batch ends once it holds 3 MiB or more of copies
    for key, array in tree.items():
        assert isinstance(back[key], jax.Array)
        assert np.asarray(back[key]).tobytes() == array.tobytes()
    batches.clear()
    arrayio.load(path)  # NumPy results are the buffers read into: one batch
    assert batches == [5]


def test_row_pieces_move_in_bounded_batches_and_are_checked_across_them(tmp_path, monkeypatch):
    jax = pytest.importorskip("jax")
    from arrayio.api import _reader
    from arrayio.arrays._frameworks import parse_target

    data = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)  # rows of 1 KiB
    path = tmp_path / "w.safetensors"
    arrayio.save(path, {"w": data})
    batches = []
    real = _reader._transfer.read_many

    def counting(fd, transfers, **kwargs):
        batches.append(len(transfers))
        return real(fd, transfers, **kwargs)

    monkeypatch.setattr(_reader._transfer, "read_many", counting)
    # Pieces put on a JAX device are copied there: at most 16 rows' worth read at a time.
    monkeypatch.setattr(_reader, "COPY_BATCH_BYTES", 16 << 10)
    request = parse_target("jax", jax.devices()[0])
    pieces = [("w", range(start, start + 8), request) for start in range(0, 64, 8)]
    with _reader.Reader(path) as reader:
        got = reader.read_row_pieces(pieces)
    assert batches == [2, 2, 2, 2]
    for (_, rows, _), piece in zip(pieces, got, strict=True):
        np.testing.assert_array_equal(np.asarray(piece), data[rows.start : rows.stop])
    raw = bytearray(path.read_bytes())
    raw[raw.index(data[60].tobytes()) + 3] ^= 0x08  # in the last batch
    path.write_bytes(bytes(raw))
    with _reader.Reader(path) as reader, pytest.raises(arrayio.errors.ChecksumError, match="'w'"):
        reader.read_row_pieces(pieces)
    # Pieces that leave rows to another process cannot be checked against the one CRC.
    with _reader.Reader(path) as reader:
        assert len(reader.read_row_pieces(pieces[4:])) == 4


def test_row_pieces_outside_an_array_are_refused(tmp_path):
    from arrayio.api import _reader
    from arrayio.arrays._frameworks import parse_target

    path = tmp_path / "ab.safetensors"
    arrayio.save(path, {"a": np.zeros((4, 2), np.float32), "b": np.full((4, 2), 7, np.float32)})
    host = parse_target("numpy", None)
    with _reader.Reader(path) as reader:
        for rows in (range(2, 6), range(-1, 1), range(0, 4, 2), range(3, 2)):
            with pytest.raises(IndexError, match="'a'"):
                reader.read_row_pieces([("a", rows, host)])
        assert reader.read_row_pieces([("a", range(4, 4), host)])[0].shape == (0, 2)
    scalars = tmp_path / "s.npz"  # a 0-d member has the one row range(0, 1)
    np.savez(scalars, a=np.arange(3.0), s=np.float32(1.5))
    with _reader.Reader(scalars) as reader:
        for rows in (range(1, 1), range(0, 0), range(0, 2)):
            with pytest.raises(IndexError, match="'s'"):
                reader.read_row_pieces([("s", rows, host)])
        assert float(reader.read_row_pieces([("s", range(0, 1), host)])[0]) == 1.5


def test_sharded_loads_of_compressed_members_and_scalars(tmp_path):
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    path = tmp_path / "c.npz"
    np.savez_compressed(path, s=np.float32(2.5), m=np.arange(12, dtype=np.float32).reshape(4, 3))
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    got = arrayio.load(path, sharding=NamedSharding(mesh, P()))
    assert float(got["s"]) == 2.5 and got["s"].shape == ()
    np.testing.assert_array_equal(np.asarray(got["m"]), np.arange(12).reshape(4, 3))


def test_sharded_loads_read_their_arrays_in_bounded_groups(tmp_path, monkeypatch):
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from arrayio.api import _reader, _sharded_load

    state = {f"w{i}": np.full((8, 256), i, np.float32) for i in range(5)}  # 8 KiB each
    arrayio.save(tmp_path / "w.safetensors", state)
    calls = []
    real = _reader.Reader.read_row_pieces

    def counting(self, pieces, advance=None):
        calls.append(sorted({key for key, _, _ in pieces}))
        return real(self, pieces, advance)

    monkeypatch.setattr(_reader.Reader, "read_row_pieces", counting)
    monkeypatch.setattr(_sharded_load, "GROUP_BYTES", 16 << 10)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    got = arrayio.load(tmp_path / "w.safetensors", sharding=NamedSharding(mesh, P("x")))
    assert calls == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert list(got) == list(state)
    for key, value in state.items():
        np.testing.assert_array_equal(np.asarray(got[key]), value)


def test_row_pieces_of_compressed_and_fortran_arrays_read_them_once(tmp_path, monkeypatch):
    from arrayio.api import _reader
    from arrayio.arrays._frameworks import parse_target

    m = np.arange(24, dtype=np.float32).reshape(6, 4)
    np.savez_compressed(tmp_path / "c.npz", m=m, s=np.int16(-3))
    np.save(tmp_path / "f.npy", np.asfortranarray(m))
    fills = []
    real = _reader.Reader._fill
    monkeypatch.setattr(
        _reader.Reader,
        "_fill",
        lambda self, stored, data: (fills.append(stored.key), real(self, stored, data))[1],
    )
    host = parse_target("numpy", None)
    torch = pytest.importorskip("torch")
    other = parse_target("torch", "cpu")
    for name, key in (("c.npz", "m"), ("f.npy", None)):
        fills.clear()
        with _reader.Reader(tmp_path / name) as reader:
            key = key or reader.keys()[0]
            got = reader.read_row_pieces(
                [(key, range(0, 2), host), (key, range(2, 5), other), (key, range(5, 6), host)]
            )
        assert fills == [key]  # one whole read for the three pieces
        assert isinstance(got[1], torch.Tensor) and got[1].is_contiguous()
        np.testing.assert_array_equal(np.concatenate([np.asarray(g) for g in got]), m)
    with _reader.Reader(tmp_path / "c.npz") as reader:
        assert int(reader.read_row_pieces([("s", range(0, 1), other)])[0]) == -3


@pytest.mark.parametrize("written_by", ["arrayio", "arrayio unverified", "safetensors"])
def test_a_gpu_load_starts_the_checksum_kernel_only_when_it_verifies(
    monkeypatch, tmp_path, written_by
) -> None:
    # A fresh process's first verified load into a GPU would otherwise build and first
    # launch the checksum kernel inside its transfers: it starts as the load starts, beside
    # the outputs' allocation, and only for a load that has checksums to verify.
    from arrayio.api import _reader
    from arrayio.arrays._frameworks import Placement

    path = str(tmp_path / "m.safetensors")
    state = {"a": np.arange(1 << 20, dtype=np.float32), "b": np.ones(3, np.uint8)}
    if written_by == "safetensors":
        from safetensors.numpy import save_file

        save_file(state, path)  # no checksums in the file
    else:
        arrayio.save(path, state)
    built: list[tuple[tuple[object, ...], dict[str, object]]] = []
    pinned: list[bool] = []
    monkeypatch.setattr(
        _reader._device_checksum, "build_ahead", lambda *args, **how: built.append((args, how))
    )
    monkeypatch.setattr(_reader._pinned.pool, "pin_ahead", lambda: pinned.append(True))
    gpu = types.SimpleNamespace(placement=Placement("cuda", 1))
    with arrayio.open(path, verify=written_by != "arrayio unverified") as reader:
        verifies = reader._verifies(reader.keys())
        _reader.ahead_of_gpu_load(gpu, 4 << 20, verifies)  # too small to start anything
        assert (built, pinned) == ([], [])
        _reader.ahead_of_gpu_load(gpu, 64 << 20, verifies)
        host = types.SimpleNamespace(placement=Placement("cpu", 0))
        _reader.ahead_of_gpu_load(host, 64 << 20, verifies)  # nothing for host memory
    assert verifies == (written_by == "arrayio")
    # (beside the allocation, which is the interpreter's work: see build_ahead)
    assert built == ([(([1],), {"beside_python": True})] if written_by == "arrayio" else [])
    assert pinned == [True]
