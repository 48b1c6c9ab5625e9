"""``arrayio.zarr.CodecPipeline``: every read gives what zarr's own pipeline gives, for every
store, codec chain and selection; the chains and stores it handles take its whole-batch
path, the others zarr's."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

zarr = pytest.importorskip("zarr")

from zarr.codecs import (  # noqa: E402
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    GzipCodec,
    ShardingCodec,
    TransposeCodec,
    ZstdCodec,
)
from zarr.storage import LocalStore, MemoryStore  # noqa: E402

import arrayio.zarr  # noqa: E402
from arrayio.errors import ChecksumError  # noqa: E402
from arrayio.zarr import CodecPipeline, NVMeStore, _pipeline  # noqa: E402

OURS = {"codec_pipeline.path": "arrayio.zarr.CodecPipeline"}

CHAINS = {
    "default": {},  # zarr's defaults: bytes, zstd
    "none": {"compressors": None},
    "crc32c": {"compressors": [Crc32cCodec()]},
    "zstd+crc32c": {"compressors": [ZstdCodec(level=3, checksum=True), Crc32cCodec()]},
    "gzip": {"compressors": [GzipCodec()]},
    "blosc+crc32c": {"compressors": [BloscCodec(cname="lz4", clevel=5), Crc32cCodec()]},
    "transpose": {"filters": [TransposeCodec(order=(1, 0))]},  # not handled
}
HANDLED = {"default", "none", "crc32c", "zstd+crc32c", "gzip", "blosc+crc32c"}

SELECTIONS = [
    Ellipsis,
    (slice(3, 40), slice(5, 30)),
    (5, slice(None)),
    (slice(None), 7),
    (slice(1, 45, 3), slice(None, None, 4)),
    (slice(0, 0), Ellipsis),
    (49, 36),
]


def _store(kind: str, path) -> object:
    return (
        {"local": LocalStore, "nvme": NVMeStore}[kind](path) if kind != "memory" else MemoryStore()
    )


@pytest.fixture
def calls(monkeypatch):
    """The reads that took the whole-batch path."""
    made = []
    real = _pipeline._read

    def counting(*args):
        made.append(args[2])
        return real(*args)

    monkeypatch.setattr(_pipeline, "_read", counting)
    return made


def _written(store, chain: str, dtype: str = "float32"):
    """A 50 x 37 array in 8 x 10 chunks, of which those outside [:30, :25] are missing."""
    array = zarr.create_array(
        store, shape=(50, 37), chunks=(8, 10), dtype=dtype, fill_value=-1, **CHAINS[chain]
    )
    data = np.random.default_rng(7).normal(size=(30, 25)).astype(dtype)
    array[:30, :25] = data
    expected = np.full((50, 37), -1, dtype=dtype)
    expected[:30, :25] = data
    return expected


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("kind", ["local", "nvme", "memory"])
def test_every_selection_reads_as_zarr_reads_it(tmp_path, calls, kind, chain):
    store = _store(kind, tmp_path / "store")
    expected = _written(store, chain)
    with zarr.config.set(OURS):
        array = zarr.open_array(store, mode="r")
        pipeline = array._async_array.codec_pipeline
        assert isinstance(pipeline, CodecPipeline)
        for selection in SELECTIONS:
            got = array[selection]
            np.testing.assert_array_equal(got, expected[selection], err_msg=str(selection))
        np.testing.assert_array_equal(
            array.oindex[[1, 9, 33], [0, 36]], expected[[1, 9, 33]][:, [0, 36]]
        )
        np.testing.assert_array_equal(
            array.vindex[[1, 9, 33], [0, 20, 36]], expected[[1, 9, 33], [0, 20, 36]]
        )
    whole_batch = chain in HANDLED and kind != "memory"
    assert bool(calls) is whole_batch
    assert ("whole-batch" in pipeline.explain()) is (chain in HANDLED)


def test_missing_chunks_get_the_fill_value_and_are_said_missing(tmp_path, calls):
    store = LocalStore(tmp_path)
    _written(store, "default")
    with zarr.config.set(OURS):
        array = zarr.open_array(store, mode="r")
        assert (array[40:, 30:] == -1).all()
    assert calls


def test_a_damaged_chunk_fails_its_crc32c(tmp_path, calls):
    store = LocalStore(tmp_path)
    _written(store, "crc32c")
    chunk = tmp_path / "c" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 0x40
    chunk.write_bytes(bytes(raw))
    with zarr.config.set(OURS):
        array = zarr.open_array(store, mode="r")
        with pytest.raises(ChecksumError, match="crc32c"):
            array[...]
        np.testing.assert_array_equal(array[8:, :], _written(MemoryStore(), "crc32c")[8:, :])


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float64", "complex64", "bool"])
def test_dtypes_read_as_zarr_reads_them(tmp_path, dtype):
    store = NVMeStore(tmp_path)
    array = zarr.create_array(store, shape=(20, 9), chunks=(6, 4), dtype=dtype)
    data = (np.arange(180) % 7).reshape(20, 9).astype(dtype)
    array[...] = data
    with zarr.config.set(OURS):
        np.testing.assert_array_equal(zarr.open_array(store, mode="r")[2:19, 1:], data[2:19, 1:])


def test_writes_through_the_pipeline_read_back(tmp_path):
    with zarr.config.set(OURS):
        store = NVMeStore(tmp_path)
        array = zarr.create_array(store, shape=(33, 17), chunks=(8, 8), dtype="int32")
        assert isinstance(array._async_array.codec_pipeline, CodecPipeline)
        data = np.arange(33 * 17, dtype=np.int32).reshape(33, 17)
        array[...] = data
        array[3:5, 2] = -7
        data[3:5, 2] = -7
        np.testing.assert_array_equal(zarr.open_array(store, mode="r")[...], data)
    np.testing.assert_array_equal(zarr.open_array(store, mode="r")[...], data)  # zarr's own


SHARDED_SELECTIONS = [
    Ellipsis,
    (slice(5, 60), slice(3, None)),
    (slice(1, 63, 3), slice(None, None, 5)),
    (slice(40, 41), slice(0, 64)),
    (slice(0, 0), Ellipsis),
]


@pytest.mark.parametrize("inner", ["none", "default", "crc32c", "gzip"])
@pytest.mark.parametrize("index_location", ["end", "start"])
@pytest.mark.parametrize("kind", ["local", "nvme"])
def test_sharded_arrays_read_their_inner_chunks_in_one_batch(
    tmp_path, calls, inner, index_location, kind
):
    # 64 x 64 in shards of 32 x 32 of 8 x 8 inner chunks: every selection's inner chunks are
    # found from the shards' indexes and read as one batch; shard (1, 1) was never written
    # (the fill value), and inner chunks of shard (0, 1) were left out (empty index entries).
    from zarr.codecs import ShardingCodec

    store = _store(kind, tmp_path / "store")
    codecs = dict(CHAINS[inner])
    sharding = ShardingCodec(
        chunk_shape=(8, 8),
        codecs=[zarr.codecs.BytesCodec(), *(codecs.get("compressors") or [])]
        if inner != "default"
        else [zarr.codecs.BytesCodec(), ZstdCodec()],
        index_location=index_location,
    )
    array = zarr.create_array(
        store,
        shape=(64, 64),
        chunks=(32, 32),
        dtype="f4",
        fill_value=-2.0,
        serializer=sharding,
        compressors=None,
    )
    data = np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32)
    array[:32, :] = data[:32, :]
    array[32:, :32] = data[32:, :32]
    array[0:8, 40:48] = -2.0  # an inner chunk of fill values only: zarr leaves it out
    expected = data.copy()
    expected[32:, 32:] = -2.0
    expected[0:8, 40:48] = -2.0
    with zarr.config.set(OURS):
        opened = zarr.open_array(store, mode="r")
        assert "shards of inner chunks" in opened._async_array.codec_pipeline.explain()
        for selection in SHARDED_SELECTIONS:
            np.testing.assert_array_equal(
                opened[selection], expected[selection], err_msg=str(selection)
            )
        np.testing.assert_array_equal(opened[7, 3:9], expected[7, 3:9])  # zarr maps it
    assert calls


def test_a_damaged_shard_index_fails_its_crc32c(tmp_path):
    store = LocalStore(tmp_path)
    array = zarr.create_array(store, shape=(32, 32), chunks=(16, 16), shards=(32, 32), dtype="f4")
    array[...] = 1.0
    shard = tmp_path / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0x01  # in the index, at the file's end
    shard.write_bytes(bytes(raw))
    with zarr.config.set(OURS):
        with pytest.raises(ChecksumError, match="shard index"):
            zarr.open_array(store, mode="r")[...]


def test_a_shard_index_that_points_past_the_file_is_refused(tmp_path):
    from zarr.codecs import ShardingCodec

    store = LocalStore(tmp_path)
    sharding = ShardingCodec(chunk_shape=(16, 16), index_codecs=[zarr.codecs.BytesCodec()])
    array = zarr.create_array(
        store, shape=(32, 32), chunks=(32, 32), dtype="f4", serializer=sharding, compressors=None
    )
    array[...] = 1.0
    shard = tmp_path / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[-16:-8] = (1 << 40).to_bytes(8, "little")  # the last inner chunk's offset
    shard.write_bytes(bytes(raw))
    with zarr.config.set(OURS):
        with pytest.raises(arrayio.errors.FormatError, match="points past its end"):
            zarr.open_array(store, mode="r")[...]


@pytest.mark.parametrize("order", ["C", "F"])
def test_memory_order_reads_as_zarr_reads_it(tmp_path, order):
    # Where a chunk's spec says Fortran order, zarr's pipeline reads it (zarr's versions lay
    # such chunks out differently); zarr 3.1 gives every chunk C order when opened.
    store = LocalStore(tmp_path)
    array = zarr.create_array(
        store, shape=(13, 11, 5), chunks=(4, 3, 5), dtype="i4", config={"order": order}
    )
    data = np.arange(13 * 11 * 5, dtype=np.int32).reshape(13, 11, 5)
    array[...] = data
    with zarr.config.set(OURS):
        opened = zarr.open_array(store, mode="r", config={"order": order})
        np.testing.assert_array_equal(opened[1:12, ::2, 3], data[1:12, ::2, 3])


def _slices(n: int):
    """Slices of an axis of ``n`` (starts, stops past either end, steps)."""
    return st.builds(
        slice,
        st.none() | st.integers(0, n),
        st.none() | st.integers(0, n),
        st.none() | st.integers(1, 3),
    )


def _read_as_written(store, array, written: float, selection, *, seed: int) -> None:
    """Write the leading ``written`` share of every axis of ``array`` (fill value 7), then
    read ``selection`` back through the pipeline: it is what was written."""
    shape = array.shape
    values = np.random.default_rng(seed).normal(size=shape)
    region = tuple(slice(0, max(1, int(n * written))) for n in shape)
    array[region] = values[region]
    expected = np.full(shape, 7.0)
    expected[region] = values[region]
    with zarr.config.set(OURS):
        got = zarr.open_array(store, mode="r")[selection]
    np.testing.assert_array_equal(got, expected[selection])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_arrays_and_selections_read_as_zarr_reads_them(tmp_path_factory, data):
    shape = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=3), label="shape")
    chunks = [data.draw(st.integers(1, n + 2)) for n in shape]
    selection = tuple(data.draw(st.one_of(st.integers(0, n - 1), _slices(n))) for n in shape)
    chain = data.draw(st.sampled_from(["default", "none", "crc32c"]))
    written = data.draw(st.floats(0, 1), label="share written")
    store = LocalStore(tmp_path_factory.mktemp("store"))
    codecs = dict(CHAINS[chain])
    array = zarr.create_array(
        store, shape=shape, chunks=chunks, dtype="f8", fill_value=7.0, **codecs
    )
    _read_as_written(store, array, written, selection, seed=len(shape))


def test_zarr_finds_the_pipeline_by_its_entry_point():
    # Installed, arrayio's pipeline is selectable before anything imports arrayio.
    import importlib.metadata
    import subprocess
    import sys

    if not any(
        e.value == "arrayio.zarr:CodecPipeline"
        for e in importlib.metadata.entry_points(group="zarr.codec_pipeline")
    ):
        pytest.skip("arrayio runs from a source tree here, not installed: no entry points")

    script = (
        "import sys, zarr\n"
        "from zarr.registry import get_pipeline_class\n"
        "with zarr.config.set({'codec_pipeline.path': 'arrayio.zarr.CodecPipeline'}):\n"
        "    print(get_pipeline_class().__module__, get_pipeline_class().__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.split() == ["arrayio.zarr", "CodecPipeline"], done.stderr[-2000:]


def test_arrayio_zarr_read_of_a_directory_takes_the_whole_batch_path(tmp_path, calls):
    expected = _written(NVMeStore(tmp_path), "default")
    np.testing.assert_array_equal(arrayio.zarr.read(tmp_path, (slice(2, 45), 3)), expected[2:45, 3])
    assert calls
    assert zarr.config.get("codec_pipeline.path") != "arrayio.zarr.CodecPipeline"  # restored


@pytest.fixture
def in_place(monkeypatch):
    """Per read, whether each chunk file was read straight into the output."""
    made: list[list[bool]] = []
    real = _pipeline._read_files

    def spying(files, places, staging=None):
        slab, views, placed = real(files, places, staging)
        made.append(placed)
        return slab, views, placed

    monkeypatch.setattr(_pipeline, "_read_files", spying)
    return made


@pytest.mark.parametrize("kind", ["local", "nvme"])
def test_whole_row_chunks_stored_as_is_are_read_into_the_output_in_place(tmp_path, in_place, kind):
    # 60 rows in chunks of 8 full rows: chunks 0 to 6 land whole on contiguous rows of the
    # output (chunk 2 is missing: the fill value); chunk 7 is cut by the array's end (staged).
    store = _store(kind, tmp_path / "store")
    array = zarr.create_array(
        store, shape=(60, 37), chunks=(8, 37), dtype="int32", fill_value=-5, compressors=None
    )
    values = np.arange(60 * 37, dtype=np.int32).reshape(60, 37)
    array[:16] = values[:16]
    array[24:] = values[24:]
    expected = values.copy()
    expected[16:24] = -5
    with zarr.config.set(OURS):
        reopened = zarr.open_array(store, mode="r")
        np.testing.assert_array_equal(reopened[...], expected)
        assert in_place[-1] == [True, True, False, True, True, True, True, False]
        np.testing.assert_array_equal(reopened[3:50], expected[3:50])  # chunks 1 to 5 whole
        assert in_place[-1] == [False, True, False, True, True, True, False]
        np.testing.assert_array_equal(reopened[:, 2:9], expected[:, 2:9])  # never whole
        assert not any(in_place[-1])


def test_tiles_and_checksummed_or_compressed_chunks_are_staged(tmp_path, in_place):
    for chain in ("none", "crc32c", "default"):
        store = LocalStore(tmp_path / chain)
        expected = _written(store, chain)  # 8 x 10 tiles of a 50 x 37 array
        with zarr.config.set(OURS):
            np.testing.assert_array_equal(zarr.open_array(store, mode="r")[...], expected)
        assert not any(in_place[-1]), chain


def test_a_chunk_file_of_the_wrong_size_is_refused_not_read_in_place(tmp_path):
    store = LocalStore(tmp_path)
    array = zarr.create_array(store, shape=(32, 16), chunks=(8, 16), dtype="f4", compressors=None)
    array[...] = 1.0
    chunk = tmp_path / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-4])
    with zarr.config.set(OURS):
        with pytest.raises(arrayio.errors.FormatError, match="expected 512"):
            zarr.open_array(store, mode="r")[...]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_sharded_arrays_and_selections_read_as_zarr_reads_them(tmp_path_factory, data):
    ndim = data.draw(st.integers(1, 3), label="ndim")
    inner = [data.draw(st.integers(1, 4)) for _ in range(ndim)]
    shards = [c * data.draw(st.integers(1, 3)) for c in inner]
    shape = [data.draw(st.integers(1, 2 * s + 1)) for s in shards]
    selection = tuple(data.draw(_slices(n)) for n in shape)
    compressors = data.draw(st.sampled_from([None, "zstd"]), label="inner compressor")
    compressors = [ZstdCodec()] if compressors else None
    written = data.draw(st.floats(0, 1), label="share written")
    store = LocalStore(tmp_path_factory.mktemp("store"))
    array = zarr.create_array(
        store,
        shape=shape,
        chunks=inner,
        shards=shards,
        dtype="f8",
        fill_value=7.0,
        compressors=compressors,
    )
    _read_as_written(store, array, written, selection, seed=ndim)


# ------------------------------------------------------------------ the grouped write


@pytest.fixture
def groups(monkeypatch):
    """The groups NVMeStore.set_many_sync committed: each a dict of key to value or None."""
    made = []
    real = NVMeStore.set_many_sync

    def counting(self, values):
        made.append(dict(values))
        return real(self, values)

    monkeypatch.setattr(NVMeStore, "set_many_sync", counting)
    return made


def _temporaries(root) -> list:
    return [p for p in root.rglob("*") if ".arrayio-tmp-" in p.name]


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_a_write_into_nvmestore_commits_its_chunks_as_one_group(tmp_path, groups, chain):
    # Partial chunks are read, merged and written back; chunks left at the fill value are
    # deleted (zarr's write_empty_chunks=False); all in the one group of each write.
    root = tmp_path / "store"
    with zarr.config.set(OURS):
        array = zarr.create_array(
            NVMeStore(root),
            shape=(50, 37),
            chunks=(8, 10),
            dtype="f4",
            fill_value=-1,
            **CHAINS[chain],
        )
        data = np.random.default_rng(3).normal(size=(50, 37)).astype("f4")
        array[...] = data
        assert len(groups) == 1 and len(groups[0]) == 7 * 4
        array[3:20, 5:12] = -1  # partial chunks, none left all fill value
        data[3:20, 5:12] = -1
        array[8:16, 0:10] = -1  # one whole chunk back to the fill value: deleted
        data[8:16, 0:10] = -1
        assert groups[-1] == {"c/1/0": None}
        assert len(groups) == 3 and set(groups[1]) == {
            f"c/{i}/{j}" for i in (0, 1, 2) for j in (0, 1)
        }
    assert not (root / "c" / "1" / "0").exists()
    np.testing.assert_array_equal(zarr.open_array(NVMeStore(root), mode="r")[...], data)
    np.testing.assert_array_equal(zarr.open_array(LocalStore(root), mode="r")[...], data)
    assert not _temporaries(root)


def test_a_sharded_write_commits_its_shards_as_one_group(tmp_path, groups):
    root = tmp_path / "store"
    data = np.arange(64 * 40, dtype="i4").reshape(64, 40)
    with zarr.config.set(OURS):
        array = zarr.create_array(
            NVMeStore(root), shape=(64, 40), chunks=(8, 10), shards=(32, 20), dtype="i4"
        )
        array[...] = data
        array[5:40, 3:33] = 7  # partial shards: their other inner chunks kept
    data[5:40, 3:33] = 7
    assert [len(g) for g in groups] == [4, 4]
    np.testing.assert_array_equal(zarr.open_array(LocalStore(root), mode="r")[...], data)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_other_stores_get_zarr_s_own_writes(tmp_path, groups, kind):
    store = _store(kind, tmp_path / "store")
    with zarr.config.set(OURS):
        array = zarr.create_array(store, shape=(20, 20), chunks=(8, 8), dtype="i2")
        array[...] = 5
        assert (array[...] == 5).all()
    assert not groups


def test_a_group_that_fails_to_stage_leaves_every_key_as_it_was(tmp_path, monkeypatch):
    from arrayio.zarr import _writes

    store = NVMeStore(tmp_path / "store")
    old = {f"a/{i}": np.full(100, i, np.uint8) for i in range(8)}
    store.set_many_sync({k: _cpu_buffer(v) for k, v in old.items()})
    real = _writes._write_value
    written = []

    def failing(fd, value):
        if len(written) == 5:
            raise OSError(28, "No space left on device")
        written.append(fd)
        real(fd, value)

    monkeypatch.setattr(_writes, "_write_value", failing)
    new = {k: _cpu_buffer(np.full(300, 200, np.uint8)) for k in old}
    with pytest.raises(arrayio.errors.DiskFullError):
        store.set_many_sync({**new, "a/0": None})
    for key, value in old.items():
        np.testing.assert_array_equal(np.fromfile(tmp_path / "store" / key, np.uint8), value)
    assert not _temporaries(tmp_path / "store")


def test_a_group_sets_and_deletes_keys_in_any_folder(tmp_path):
    store = NVMeStore(tmp_path / "store")
    store.set_many_sync(
        {
            "x/y/z": _cpu_buffer(np.arange(5, dtype=np.uint8)),
            "top": _cpu_buffer(np.ones(3, np.uint8)),
        }
    )
    store.set_many_sync({"x/y/z": None, "x/w": _cpu_buffer(np.zeros(2, np.uint8))})
    assert not (tmp_path / "store" / "x" / "y" / "z").exists()
    assert (tmp_path / "store" / "x" / "w").read_bytes() == b"\0\0"
    assert (tmp_path / "store" / "top").read_bytes() == b"\1\1\1"
    with pytest.raises(arrayio.zarr.InvalidKeyError):
        store.set_many_sync({"../out": _cpu_buffer(np.zeros(1, np.uint8))})
    with pytest.raises(ValueError, match="read.only"):
        NVMeStore(tmp_path / "store", read_only=True).set_many_sync({"top": None})


def _cpu_buffer(array: np.ndarray):
    from zarr.core.buffer import cpu

    return cpu.Buffer.from_array_like(array)


def test_a_large_write_commits_in_bounded_groups(tmp_path, groups, monkeypatch):
    from arrayio.zarr import _group_writes

    monkeypatch.setattr(_group_writes, "GROUP_KEYS", 5)
    root = tmp_path / "store"
    data = np.arange(50 * 37, dtype="f4").reshape(50, 37)
    with zarr.config.set(OURS):
        array = zarr.create_array(NVMeStore(root), shape=(50, 37), chunks=(8, 10), dtype="f4")
        array[...] = data
    assert [len(g) for g in groups] == [5, 5, 5, 5, 5, 3]
    np.testing.assert_array_equal(zarr.open_array(LocalStore(root), mode="r")[...], data)


def test_a_write_of_more_chunks_than_open_files_allowed(tmp_path):
    # Each chunk of a group holds a descriptor until it is renamed: groups stay well under
    # a process's limit of open files (often 1024).
    import subprocess
    import sys
    import textwrap

    store = str(tmp_path / "s")
    script = textwrap.dedent(
        f"""
        import resource
        import numpy as np, zarr
        import arrayio.zarr
        from arrayio.zarr import NVMeStore
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        with zarr.config.set({OURS!r}):
            z = zarr.create_array(NVMeStore({store!r}), shape=(600,), chunks=(1,), dtype="i4")
            z[:] = np.arange(600, dtype="i4")
        read = zarr.open_array(NVMeStore({store!r}), mode="r")[:]
        assert (read == np.arange(600)).all()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_groups_committed_from_the_io_pool_s_own_threads_do_not_wait_for_it(tmp_path):
    from arrayio.zarr import _io_pool

    store = NVMeStore(tmp_path / "store")

    def commit(i: int) -> None:
        values = {f"k{i}/{j}": _cpu_buffer(np.full(10, j, np.uint8)) for j in range(4)}
        store.set_many_sync(values)

    # More callers than the pool has threads, each inside the pool: staging on the pool
    # itself would leave every thread waiting for work queued behind them.
    futures = [_io_pool.executor().submit(commit, i) for i in range(_io_pool.IO_THREADS + 4)]
    for future in futures:
        future.result(timeout=60)
    assert (tmp_path / "store" / "k3" / "2").read_bytes() == bytes([2] * 10)


def test_a_rename_that_fails_midway_leaves_no_temporaries(tmp_path):
    root = tmp_path / "store"
    store = NVMeStore(root)
    store.set_many_sync({f"a/{i}": _cpu_buffer(np.full(4, 1, np.uint8)) for i in range(5)})
    (root / "a" / "3").unlink()
    (root / "a" / "3").mkdir()  # a directory where a key's file would go: its rename fails
    with pytest.raises(OSError):
        store.set_many_sync({f"a/{i}": _cpu_buffer(np.full(4, 2, np.uint8)) for i in range(5)})
    assert [(root / "a" / str(i)).read_bytes() for i in (0, 1, 2, 4)] == [b"\2" * 4] * 3 + [
        b"\1" * 4
    ]
    assert not _temporaries(root)


def test_whole_zstd_chunks_decode_into_the_output_on_the_host(tmp_path, monkeypatch):
    # 60 rows in chunks of 8 full rows: chunks 0 to 6 land whole on contiguous rows of the
    # output and are decoded there; chunk 7, cut by the array's end, is decoded aside.
    into_place = []
    real = _pipeline.decode_on_host

    def recording(codec, data, out=None):
        result = real(codec, data, out)
        into_place.append(out is not None and result is out)
        return result

    monkeypatch.setattr(_pipeline, "decode_on_host", recording)
    data = np.random.default_rng(5).normal(size=(60, 16)).astype("f4")
    array = zarr.create_array(LocalStore(tmp_path), shape=(60, 16), chunks=(8, 16), dtype="f4")
    array[...] = data
    with zarr.config.set(OURS):
        got = zarr.open_array(LocalStore(tmp_path), mode="r")[...]
    np.testing.assert_array_equal(got, data)
    assert sorted(into_place) == [False] + [True] * 7


def test_a_read_only_out_is_refused_as_zarr_refuses_it(tmp_path):
    from zarr.core.buffer import cpu

    data = np.arange(32 * 16, dtype="f4").reshape(32, 16)
    zarr.create_array(LocalStore(tmp_path), shape=(32, 16), chunks=(8, 16), dtype="f4")[...] = data
    for config in ({}, OURS):  # zarr's pipeline, then arrayio's
        out = np.zeros((32, 16), "f4")
        out.flags.writeable = False
        with zarr.config.set(config), pytest.raises(ValueError, match="read-only"):
            zarr.open_array(LocalStore(tmp_path), mode="r").get_basic_selection(
                ..., out=cpu.NDBuffer.from_numpy_array(out)
            )
        assert not out.any()


# ---------------------------------------------------------------- reads and decodes in groups


def test_groups_cover_the_batch_in_runs_of_two_chunks_per_core_or_an_eighth():
    assert _pipeline._groups(0, 4) == []
    assert _pipeline._groups(5, 4) == [range(0, 5)]
    assert _pipeline._groups(20, 2) == [
        range(0, 4),
        range(4, 8),
        range(8, 12),
        range(12, 16),
        range(16, 20),
    ]
    groups = _pipeline._groups(1024, 16)
    assert len(groups) == 8 and all(len(g) == 128 for g in groups)
    assert [len(g) for g in _pipeline._groups(64, 16)] == [32, 32]


@pytest.mark.parametrize("chain", ["default", "zstd+crc32c", "gzip", "blosc+crc32c"])
@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
def test_a_chunk_per_group_reads_as_zarr_reads_it(tmp_path, monkeypatch, chain, selection):
    monkeypatch.setattr(
        _pipeline, "_groups", lambda count, cores: [range(i, i + 1) for i in range(count)]
    )
    expected = _written(NVMeStore(tmp_path), chain)
    with zarr.config.set(OURS):
        got = zarr.open_array(NVMeStore(tmp_path, read_only=True), mode="r")[selection]
    np.testing.assert_array_equal(got, expected[selection])


def test_a_group_is_decoded_while_the_next_is_read_and_two_at_most_are_in_hand(
    tmp_path, monkeypatch
):
    import threading

    monkeypatch.setattr(
        _pipeline,
        "_groups",
        lambda count, cores: [range(i, min(i + 4, count)) for i in range(0, count, 4)],
    )
    events: list[str] = []
    lock = threading.Lock()
    read_files, decode = _pipeline._read_files, _pipeline._decode_and_place
    first_decode_started = threading.Event()

    def reading(files, places, staging=None):
        with lock:
            events.append(f"read {len(events)}")
        if len([e for e in events if e.startswith("read")]) == 2:
            # the second group's read waits until the first group's decode runs beside it
            assert first_decode_started.wait(10), "the first decode did not start"
        return read_files(files, places, staging)

    def decoding(*args):
        first_decode_started.set()
        result = decode(*args)
        with lock:
            events.append("decoded")
        return result

    monkeypatch.setattr(_pipeline, "_read_files", reading)
    monkeypatch.setattr(_pipeline, "_decode_and_place", decoding)
    expected = _written(NVMeStore(tmp_path), "default")  # 7 x 4 chunks: 7 groups of 4
    with zarr.config.set(OURS):
        got = zarr.open_array(NVMeStore(tmp_path, read_only=True), mode="r")[...]
    np.testing.assert_array_equal(got, expected)
    reads = [i for i, e in enumerate(events) if e.startswith("read")]
    assert len(reads) == 7 and events.count("decoded") == 7
    for k in range(2, 7):  # before group k is read, group k - 2 has been decoded
        assert events[: reads[k]].count("decoded") >= k - 1


def test_a_damaged_chunk_in_a_middle_group_raises_and_leaves_no_thread(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(
        _pipeline,
        "_groups",
        lambda count, cores: [range(i, min(i + 4, count)) for i in range(0, count, 4)],
    )
    _written(LocalStore(tmp_path), "zstd+crc32c")
    chunk = tmp_path / "c" / "2" / "1"
    damaged = bytearray(chunk.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    chunk.write_bytes(bytes(damaged))
    before = {t.name for t in threading.enumerate()}
    with zarr.config.set(OURS), pytest.raises(ChecksumError):
        zarr.open_array(NVMeStore(tmp_path, read_only=True), mode="r")[...]
    left = {t.name for t in threading.enumerate()} - before
    assert not any(name.startswith("arrayio-zarr-decode") for name in left), left


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_whole_chunk_places_are_the_contiguous_views_of_their_selections(data):
    # The ranges worked out from the selections are exactly the views that indexing the
    # output gives, where those are C-contiguous and of the chunk's shape.
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    target = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    selection = tuple(
        slice(a, a + data.draw(st.integers(0, n - a)))
        for n in shape
        for a in [data.draw(st.integers(0, n - 1))]
    )
    chunk_shape = tuple(s.stop - s.start for s in selection)
    spec = types.SimpleNamespace(
        shape=chunk_shape, dtype=types.SimpleNamespace(to_native_dtype=lambda: np.dtype(np.int32))
    )
    [got] = _pipeline._whole_chunk_outputs(
        [(None, spec, None, selection, True)], target, (), on_gpu=False
    )
    view = target[selection]
    if view.size and view.flags.c_contiguous:
        assert got is not None
        np.testing.assert_array_equal(got.view(np.int32), view.reshape(-1))
        assert got.__array_interface__["data"][0] == view.__array_interface__["data"][0]
    else:
        assert got is None
    # a chunk of another shape, or not complete, gets no place
    other = types.SimpleNamespace(shape=chunk_shape + (1,), dtype=spec.dtype)
    assert _pipeline._whole_chunk_outputs(
        [(None, other, None, selection, True)], target, (), on_gpu=False
    ) == [None]
    assert _pipeline._whole_chunk_outputs(
        [(None, spec, None, selection, False)], target, (), on_gpu=False
    ) == [None]


def test_runs_join_inner_chunks_adjacent_in_their_shard_and_in_the_output():
    files = [
        ("s0", 0, 10),
        ("s0", 10, 10),  # after chunk 0 in the file and in the output: joined
        ("s0", 20, 10),  # after in the file, not in the output: alone
        ("s1", 0, 10),  # another shard: a run of its own
        "c/0",  # a whole file: alone
        ("s1", 10, 10),  # no place in the output: alone
        None,  # missing: alone
    ]
    ranges = [(0, 10), (10, 10), (40, 10), (20, 10), (60, 10), None, None]
    runs = _pipeline._runs(files, ranges)
    assert sorted(runs) == [[0, 1], [2], [3], [4], [5], [6]]
    # the order of the batch does not matter: runs follow the file
    order = [1, 3, 0, 2, 6, 4, 5]
    shuffled = _pipeline._runs([files[i] for i in order], [ranges[i] for i in order])
    assert sorted(sorted(order[i] for i in run) for run in shuffled) == sorted(runs)


def test_a_sharded_array_stored_as_is_is_read_a_request_per_run(tmp_path, monkeypatch):
    # 4 shards of 8 inner chunks of whole rows, one inner chunk never written: a whole read
    # is one request per run of adjacent inner chunks (the missing one splits its shard's);
    # a slab of whole inner chunks fewer; the values are zarr's.
    store = LocalStore(tmp_path)
    array = zarr.create_array(
        store,
        shape=(128, 6),
        chunks=(4, 6),
        shards=(32, 6),
        dtype="int32",
        fill_value=-3,
        compressors=None,
    )
    values = np.arange(128 * 6, dtype=np.int32).reshape(128, 6)
    array[:40] = values[:40]
    array[44:] = values[44:]  # inner chunk 10 (rows 40 to 43) of shard 1 never written
    expected = values.copy()
    expected[40:44] = -3
    requests: list[int] = []
    real = _pipeline._read_files

    def counting(files, places, staging=None):
        requests.append(len(files))
        return real(files, places, staging)

    monkeypatch.setattr(_pipeline, "_read_files", counting)
    with zarr.config.set(OURS):
        reopened = zarr.open_array(store, mode="r")
        np.testing.assert_array_equal(reopened[...], expected)
        assert requests[-1] == 6  # shards 0, 2, 3 whole; shard 1 in two runs; the missing one
        np.testing.assert_array_equal(reopened[8:72], expected[8:72])
        assert requests[-1] == 5  # shard 0 from row 8, shard 1 in two, shard 2 to row 72; missing
        np.testing.assert_array_equal(reopened[5:70, 2:4], expected[5:70, 2:4])  # no place
    with zarr.config.set({"codec_pipeline.path": "zarr.core.codec_pipeline.BatchedCodecPipeline"}):
        np.testing.assert_array_equal(zarr.open_array(store, mode="r")[...], expected)


def test_a_shard_index_whose_lengths_only_add_up_is_refused_not_read_in_place(tmp_path):
    # One shard of three inner chunks of 4 int32, its index unchecksummed and rewritten so
    # that chunk 0 claims 32 bytes and chunk 2 none: the run's total matches the output's,
    # but no chunk's does. zarr's pipeline raises; so must this one, not fill the output
    # with the wrong bytes (and leave chunk 2's rows unwritten).
    store = LocalStore(tmp_path)
    sharding = ShardingCodec(chunk_shape=(4,), codecs=[BytesCodec()], index_codecs=[BytesCodec()])
    array = zarr.create_array(
        store, shape=(12,), chunks=(12,), dtype="int32", serializer=sharding, compressors=None
    )
    array[...] = np.arange(12, dtype=np.int32) + 100
    path = tmp_path / "c" / "0"
    raw = path.read_bytes()
    data = raw[:-48]
    index = np.array([[0, 32], [48, 16], [32, 0]], dtype="<u8")
    junk = np.full(4, -999, dtype=np.int32).tobytes()
    path.write_bytes(data[:16] + junk + data[32:48] + data[16:32] + index.tobytes())
    with zarr.config.set(OURS), pytest.raises(arrayio.errors.FormatError):
        zarr.open_array(store, mode="r")[...]


def test_byte_groups_cut_runs_of_at_most_the_limit():
    assert _pipeline._byte_groups([], 10) == []
    assert _pipeline._byte_groups([4, 4, 4], 10) == [range(0, 2), range(2, 3)]
    assert _pipeline._byte_groups([4, 4, 2, 12, 1], 10) == [
        range(0, 3),
        range(3, 4),  # larger than the limit: alone
        range(4, 5),
    ]
    assert _pipeline._byte_groups([1] * 5, 100) == [range(0, 5)]


@st.composite
def _shard_selections(draw):
    ndim = draw(st.integers(1, 3))
    inner = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    shape = tuple(c * draw(st.integers(1, 4)) for c in inner)
    selection = []
    for length in shape:
        start = draw(st.integers(0, length))
        selection.append(slice(start, draw(st.integers(start, length))))
    out_starts = [draw(st.integers(0, 9)) for _ in shape]
    return shape, inner, tuple(selection), out_starts


@settings(max_examples=300, deadline=None)
@given(_shard_selections())
def test_a_shards_inner_chunks_are_mapped_as_zarrs_indexer_maps_them(case):
    # The per-axis mapping of step-1 slices gives what zarr's indexer gives, chunk for chunk:
    # the row in the shard's index, the part of the chunk, its place in the output, and
    # whether it is the whole chunk.
    shape, inner, selection, out_starts = case
    counts = [n // c for n, c in zip(shape, inner, strict=True)]
    strides = [int(np.prod(counts[axis + 1 :])) for axis in range(len(counts))]
    grid = _pipeline._regular_grid(shape, inner)

    def plain(parts):
        return [
            (at, tuple(s.indices(c) for s, c in zip(part, inner, strict=True)), out, whole)
            for at, part, out, whole in parts
        ]

    fast = _pipeline._slice_parts(selection, shape, inner, strides, out_starts)
    assert fast is not None
    expected = plain(_pipeline._indexed_parts(selection, shape, grid, strides, out_starts))
    assert plain(fast) == expected


def test_slices_with_steps_are_left_to_zarrs_indexer():
    assert _pipeline._slice_parts((slice(0, 8, 2),), (8,), (4,), [1], [0]) is None
    assert _pipeline._slice_parts((slice(0, 8),), (8, 4), (4, 4), [1, 1], [0, 0]) is None


class _FakeDeviceArray(np.ndarray):
    """A host array that answers as a CuPy array does where a span is made of it: its
    address at ``.data.ptr`` and its GPU at ``.device.id``."""

    @property
    def data(self):  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):  # type: ignore[override]
        return types.SimpleNamespace(id=3)


def test_gpu_places_are_spans_of_the_output_at_each_chunks_bytes():
    # On a GPU the places of whole chunks are spans (an address and a size), not CuPy views:
    # each at its chunk's bytes in the output, on the output's device, keeping it alive.
    from arrayio.zarr._kernels import DeviceSpan, address, addresses

    target = np.zeros((8, 4), dtype=np.int32).view(_FakeDeviceArray)
    spec = types.SimpleNamespace(
        shape=(2, 4), dtype=types.SimpleNamespace(to_native_dtype=lambda: np.dtype(np.int32))
    )
    batch = [(None, spec, None, (slice(r, r + 2), slice(0, 4)), True) for r in (0, 2, 6)]
    batch.append((None, spec, None, (slice(4, 6), slice(0, 4)), False))  # not whole: no place
    places = _pipeline._whole_chunk_outputs(batch, target, (), on_gpu=True)
    base = target.__array_interface__["data"][0]
    assert [type(p) for p in places[:3]] == [DeviceSpan] * 3 and places[3] is None
    assert [address(p) for p in places[:3]] == [base, base + 32, base + 96]
    assert list(addresses(places[:3])) == [base, base + 32, base + 96]
    assert [(p.nbytes, p.size, p.device_id) for p in places[:3]] == [(32, 32, 3)] * 3
    assert all(np.shares_memory(p.owner, target) for p in places[:3])
    # as a CuPy array where one is needed (nvCOMP's Python codec, a host decode)
    np.testing.assert_array_equal(places[2].array(), target.reshape(-1).view(np.uint8)[96:128])
