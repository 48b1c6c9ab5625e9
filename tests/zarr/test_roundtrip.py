"""Round trips and cross-compatibility with ``zarr.storage.LocalStore`` and zarr's CPU
``ZstdCodec``: arrays of every dtype zarr and arrayio share, any shape and chunk shape,
written by one store and read by the other, and the very same files on disk."""

from __future__ import annotations

import itertools
import math
import os
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

zarr = pytest.importorskip("zarr")

from zarr.storage import LocalStore  # noqa: E402

from arrayio.arrays._dtypes import by_name  # noqa: E402
from arrayio.testing.strategies import arrays  # noqa: E402
from arrayio.zarr import NVMeStore  # noqa: E402

DTYPES = [
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
    "complex128",
]
STORES = {"nvme": NVMeStore, "local": LocalStore}
FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"


def compressors(codec: str):
    # zarr's own CPU zstd (not whatever the zarr config maps "zstd" to).
    return None if codec == "none" else zarr.codecs.ZstdCodec(level=3)


@st.composite
def cases(draw: st.DrawFn):
    """(array, chunk shape, codec): up to 3 dimensions of up to 10, at most 4 chunks a
    side, arbitrary bit patterns."""
    shape = tuple(draw(st.lists(st.integers(0, 10), min_size=1, max_size=3)))
    chunks = tuple(
        draw(st.integers(max(1, math.ceil(side / 4)), max(side, 1) + 2)) for side in shape
    )
    data = draw(arrays(by_name(draw(st.sampled_from(DTYPES))), shape, layouts=("C",)))
    return data, chunks, draw(st.sampled_from(["none", "zstd"]))


def write(store_class, root: str, data: np.ndarray, chunks, codec: str):
    z = zarr.create_array(
        store_class(root),
        shape=data.shape,
        chunks=chunks,
        dtype=data.dtype,
        compressors=compressors(codec),
        fill_value=0,
    )
    z[...] = data
    return z


# zarr's empty-chunk check compares arbitrary bit patterns (signalling NaNs) with the fill
# value, which newer NumPy warns about; it happens on write, whichever the store.
ARBITRARY_BITS = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in equal:RuntimeWarning"
)


def assert_same(got, expected: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # Values, not bits: zarr skips chunks equal to the fill value (so -0.0 reads as 0.0).
    np.testing.assert_array_equal(got, expected)


@ARBITRARY_BITS
@settings(max_examples=60, deadline=None)
@given(case=cases(), writer=st.sampled_from(sorted(STORES)), reader=st.sampled_from(sorted(STORES)))
def test_written_by_one_store_read_by_the_other(case, writer, reader):
    data, chunks, codec = case
    with tempfile.TemporaryDirectory() as root:
        write(STORES[writer], root, data, chunks, codec)
        assert_same(zarr.open_array(STORES[reader](root, read_only=True), mode="r")[...], data)


def _files(root: str) -> dict[str, bytes]:
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


@ARBITRARY_BITS
@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_both_stores_write_the_same_files(case):
    data, chunks, codec = case
    with tempfile.TemporaryDirectory() as ours, tempfile.TemporaryDirectory() as theirs:
        write(NVMeStore, ours, data, chunks, codec)
        write(LocalStore, theirs, data, chunks, codec)
        assert _files(ours) == _files(theirs)


@pytest.mark.parametrize("pipeline", ["batched", "fused"])
@pytest.mark.parametrize(("writer", "reader"), list(itertools.permutations(STORES, 2)))
def test_groups_and_pipelines(tmp_path, pipeline, writer, reader):
    if pipeline == "fused" and not hasattr(zarr.core.codec_pipeline, "FusedCodecPipeline"):
        pytest.skip(f"zarr {zarr.__version__} has no FusedCodecPipeline (zarr >= 3.4)")
    config = {"codec_pipeline.path": FUSED} if pipeline == "fused" else {}
    rng = np.random.default_rng(7)
    a = rng.normal(size=(33, 17)).astype(np.float32)
    b = rng.integers(-5, 5, size=(100,), dtype=np.int64)
    with zarr.config.set(config):
        group = zarr.open_group(STORES[writer](tmp_path), mode="w")
        group.create_array(
            "x/a", shape=a.shape, chunks=(8, 8), dtype=a.dtype, compressors=compressors("zstd")
        )[...] = a
        group.create_array("b", shape=b.shape, chunks=(30,), dtype=b.dtype, compressors=None)[
            ...
        ] = b
        group.attrs["note"] = "hello"
        opened = zarr.open_group(STORES[reader](tmp_path, read_only=True), mode="r")
        assert opened.attrs["note"] == "hello"
        assert_same(opened["x/a"][...], a)
        assert_same(opened["b"][5:95], b[5:95])
        assert sorted(opened.group_keys()) == ["x"]
