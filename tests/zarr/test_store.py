"""NVMeStore beyond zarr's conformance suite: keys that try to leave the root, atomic writes,
many reads in flight at once, byte ranges as LocalStore serves them, the synchronous path
of zarr's fused codec pipeline, and Dask."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import pickle
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

zarr = pytest.importorskip("zarr")

from zarr.abc.store import (  # noqa: E402
    OffsetByteRequest,
    RangeByteRequest,
    SuffixByteRequest,
)
from zarr.core.buffer import cpu  # noqa: E402
from zarr.core.sync import _collect_aiterator  # noqa: E402
from zarr.storage import LocalStore  # noqa: E402

import arrayio  # noqa: E402
from arrayio.dispatch import _transfer  # noqa: E402
from arrayio.integrity import _atomic  # noqa: E402
from arrayio.zarr import InvalidKeyError, NVMeStore  # noqa: E402
from arrayio.zarr import _store as store_module  # noqa: E402

CPU = cpu.buffer_prototype
FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"
HAS_FUSED = hasattr(zarr.core.codec_pipeline, "FusedCodecPipeline")


def buffer(data: bytes) -> cpu.Buffer:
    return cpu.Buffer.from_bytes(data)


def payload(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest.fixture
def store(tmp_path) -> NVMeStore:
    return NVMeStore(tmp_path / "root")


# --------------------------------------------------------------------------- keys

BAD_KEYS = [
    "../outside/victim",
    "a/../../outside/victim",
    "/etc/passwd",
    "a\\b",
    "a\x00b",
    "./zarr.json",
    "c/./0",
    "c/..",
]


def _calls(store: NVMeStore, key: str):
    """Every store entry point that takes a key or prefix, as zero-argument callables."""
    value = buffer(b"evil")
    return {
        "get": lambda: asyncio.run(store.get(key, CPU)),
        "get_sync": lambda: store.get_sync(key),
        "exists": lambda: asyncio.run(store.exists(key)),
        "getsize": lambda: asyncio.run(store.getsize(key)),
        "set": lambda: asyncio.run(store.set(key, value)),
        "set_sync": lambda: store.set_sync(key, value),
        "set_if_not_exists": lambda: asyncio.run(store.set_if_not_exists(key, value)),
        "delete": lambda: asyncio.run(store.delete(key)),
        "delete_sync": lambda: store.delete_sync(key),
        "delete_dir": lambda: asyncio.run(store.delete_dir(key)),
        "get_partial_values": lambda: asyncio.run(store.get_partial_values(CPU, [(key, None)])),
        "get_ranges_sync": lambda: store.get_ranges_sync(key, [None], prototype=CPU),
        "list_prefix": lambda: asyncio.run(_collect_aiterator(store.list_prefix(key))),
        "list_dir": lambda: asyncio.run(_collect_aiterator(store.list_dir(key))),
        "getsize_prefix": lambda: asyncio.run(store.getsize_prefix(key)),
    }


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_keys_that_leave_the_root_are_refused_everywhere(tmp_path, store, key):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    store.set_sync("zarr.json", buffer(b"{}"))
    for name, call in _calls(store, key).items():
        with pytest.raises(InvalidKeyError) as caught:
            call()
        assert isinstance(caught.value, ValueError), name
        assert isinstance(caught.value, arrayio.ArrayioError), name
        assert repr(key) in str(caught.value), name
    assert (outside / "victim").read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["outside", "root"]
    assert os.listdir(store.root) == ["zarr.json"]


@pytest.mark.parametrize("key", ["", "c/", "c/0/"])
def test_directory_keys_cannot_be_written_or_deleted(store, key):
    store.set_sync("c/0/1", buffer(b"x"))
    for call in (
        lambda: store.set_sync(key, buffer(b"y")),
        lambda: store.delete_sync(key),
        lambda: asyncio.run(store.delete(key)),
    ):
        with pytest.raises(InvalidKeyError, match="directory"):
            call()
    assert store.get_sync("c/0/1").to_bytes() == b"x"


def test_keys_must_be_strings(store):
    with pytest.raises(TypeError, match="strings"):
        store.get_sync(b"zarr.json")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="root"):
        NVMeStore(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- atomic writes


def _fail_halfway(fd, file_offset, src, **_):
    """A write_from that writes half of the bytes, then fails as a full disk would."""
    half = memoryview(np.ascontiguousarray(src)).cast("B")[: src.nbytes // 2]
    os.pwrite(fd, half, file_offset)
    raise OSError(errno.ENOSPC, "No space left on device (simulated)")


@pytest.mark.parametrize("how", ["set", "set_sync"])
def test_a_failed_write_leaves_the_previous_value(monkeypatch, store, how):
    old, new = payload(3 << 20, 1), payload(3 << 20, 2)
    store.set_sync("c/0", buffer(old))
    monkeypatch.setattr(_transfer, "write_from", _fail_halfway)
    with pytest.raises(OSError, match="simulated"):
        if how == "set":
            asyncio.run(store.set("c/0", buffer(new)))
        else:
            store.set_sync("c/0", buffer(new))
    assert (store.root / "c" / "0").read_bytes() == old
    assert os.listdir(store.root / "c") == ["0"]  # the temporary file is gone
    monkeypatch.undo()
    store.set_sync("c/0", buffer(new))
    assert store.get_sync("c/0").to_bytes() == new


def test_a_failed_create_leaves_no_key(monkeypatch, store):
    monkeypatch.setattr(_transfer, "write_from", _fail_halfway)
    with pytest.raises(OSError, match="simulated"):
        asyncio.run(store.set_if_not_exists("c/0", buffer(payload(10_000, 3))))
    assert not asyncio.run(store.exists("c/0"))
    assert os.listdir(store.root / "c") == []


def test_temporary_files_of_interrupted_writes_are_no_keys(store):
    store.set_sync("c/0", buffer(b"done"))
    # What a write killed outright (SIGKILL, power loss) leaves behind.
    (store.root / "c" / f".1{_atomic.TEMP_MARKER}0123456789ab").write_bytes(b"partial")
    assert asyncio.run(_collect_aiterator(store.list())) == ("c/0",)
    assert asyncio.run(_collect_aiterator(store.list_dir("c"))) == ("0",)
    assert asyncio.run(_collect_aiterator(store.list_prefix("c/"))) == ("c/0",)
    assert asyncio.run(store.getsize_prefix("c")) == 4


def test_the_first_write_into_a_directory_removes_dead_writers_temporaries(store):
    # What writes killed outright left in two chunk directories: temporaries nobody holds.
    for directory in ("c/0", "c/1"):
        (store.root / directory).mkdir(parents=True)
        (store.root / directory / f".0{_atomic.TEMP_MARKER}4242-0123456789ab").write_bytes(b"x")
    with _atomic.atomic_write(store.root / "c" / "1" / "9") as live_fd:  # a live writer's
        os.write(live_fd, b"writing")
        store.set_sync("c/0/0", buffer(b"new"))
        store.set_sync("c/1/0", buffer(b"new"))
        assert os.listdir(store.root / "c" / "0") == ["0"]
        (live,) = [n for n in os.listdir(store.root / "c" / "1") if _atomic.TEMP_MARKER in n]
        assert f"{_atomic.TEMP_MARKER}{os.getpid()}-" in live
    assert sorted(os.listdir(store.root / "c" / "1")) == ["0", "9"]


def test_set_if_not_exists_has_exactly_one_winner(store):
    values = [payload(200_000, seed) for seed in range(12)]

    async def race():
        await asyncio.gather(*(store.set_if_not_exists("c/0", buffer(v)) for v in values))

    asyncio.run(race())
    assert store.get_sync("c/0").to_bytes() in values
    assert os.listdir(store.root / "c") == ["0"]


def test_writes_reach_the_disk_through_fsync(monkeypatch, store):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    store.set_sync("c/0", buffer(b"durable"))
    assert len(synced) >= 2  # the file, then its directory


# --------------------------------------------------------------------------- concurrency

SIZES = [0, 1, 4095, 4097, 100_000, 1 << 20, (1 << 20) + 123, 3 << 20]


@pytest.fixture
def filled(store):
    """A store with 32 keys of varied sizes (some large enough for the learned tools)."""
    values = {f"c/{i}/{i % 3}": payload(SIZES[i % len(SIZES)], i) for i in range(32)}
    for key, value in values.items():
        store.set_sync(key, buffer(value))
    return store, values


def test_many_concurrent_gets_give_the_right_bytes(filled):
    store, values = filled
    keys = list(values)

    async def everything():
        gathered = await asyncio.gather(*(store.get(k, CPU) for k in keys))
        partial = await store.get_partial_values(CPU, [(k, None) for k in keys])
        many = await _collect_aiterator(store._get_many((k, CPU, None) for k in keys))
        return gathered, partial, dict(many)

    gathered, partial, many = asyncio.run(everything())
    assert [b.to_bytes() for b in gathered] == [values[k] for k in keys]
    assert [b.to_bytes() for b in partial] == [values[k] for k in keys]
    assert {k: b.to_bytes() for k, b in many.items()} == values
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        threaded = list(pool.map(lambda k: store.get_sync(k).to_bytes(), keys * 3))
    assert threaded == [values[k] for k in keys * 3]


@pytest.mark.parametrize("entry", ["gather", "get_partial_values", "_get_many", "get_ranges_sync"])
def test_reads_asked_together_move_together(monkeypatch, filled, entry):
    """Eight reads asked at once reach the dispatcher together: while the first batch moves
    (held here for a moment), the others queue and move as the next batch. A store that
    serialised its reads would hand them over one at a time."""
    from arrayio.dispatch import coalesce

    store, values = filled
    monkeypatch.setattr(coalesce, "LEADERS", 1)  # one batch at a time: the rest queue
    sizes: list[int] = []
    real = coalesce._move

    def move(group):
        sizes.append(len(group))
        if len(sizes) == 1:
            time.sleep(0.2)  # the rest are asked for meanwhile
        return real(group)

    monkeypatch.setattr(coalesce, "_move", move)
    keys = [k for k, v in values.items() if v][:8]

    async def read_all():
        if entry == "gather":
            return await asyncio.gather(*(store.get(k, CPU) for k in keys))
        if entry == "get_partial_values":
            return await store.get_partial_values(CPU, [(k, None) for k in keys])
        got = dict(await _collect_aiterator(store._get_many((k, CPU, None) for k in keys)))
        return [got[k] for k in keys]

    if entry == "get_ranges_sync":
        key = max(values, key=lambda k: len(values[k]))
        # Ranges far apart: zarr >= 3.4 would merge near ones into one read.
        ranges = [RangeByteRequest(i * 300_000, i * 300_000 + 1000) for i in range(8)]
        got = dict(store.get_ranges_sync(key, ranges, prototype=CPU, max_gap_bytes=0))
        assert [got[i].to_bytes() for i in range(8)] == [
            values[key][r.start : r.end] for r in ranges
        ]
    else:
        got = asyncio.run(read_all())
        assert [b.to_bytes() for b in got] == [values[k] for k in keys]
    assert sum(sizes) == 8 and max(sizes) >= 2, sizes


def test_get_ranges_sync_merges_and_splits_correctly(filled):
    store, values = filled
    key = max(values, key=lambda k: len(values[k]))
    data = values[key]
    ranges = [
        RangeByteRequest(0, 10),
        RangeByteRequest(10, 20),
        RangeByteRequest(5, 4000),
        None,
        OffsetByteRequest(len(data) - 7),
        SuffixByteRequest(100),
        RangeByteRequest(2 << 20, (2 << 20) + 4096),
    ]
    got = dict(store.get_ranges_sync(key, ranges, prototype=CPU))
    expected = [
        data[0:10],
        data[10:20],
        data[5:4000],
        data,
        data[-7:],
        data[-100:],
        data[2 << 20 : (2 << 20) + 4096],
    ]
    assert [got[i].to_bytes() for i in range(len(ranges))] == expected
    with pytest.raises(BaseExceptionGroup) as caught:  # noqa: F821 - zarr needs 3.11
        store.get_ranges_sync("c/missing", [None], prototype=CPU)
    assert caught.group_contains(FileNotFoundError)


def test_get_ranges_sync_splits_merged_groups_in_any_order(filled, monkeypatch):
    # zarr < 3.4 has no range coalescing, so the merged path runs only with this stand-in:
    # overlapping and adjacent ranges in one group, listed out of order, and one past the end.
    import sys
    import types

    store, values = filled
    key = max(values, key=lambda k: len(values[k]))
    data = values[key]
    ranges = [
        RangeByteRequest(300, 900),
        RangeByteRequest(0, 10),
        RangeByteRequest(5, 400),
        RangeByteRequest(len(data) - 5, len(data) + 50),
        SuffixByteRequest(3),
    ]

    def coalesce_ranges(byte_ranges, *, max_gap_bytes, max_coalesced_bytes):
        return (
            [
                [(0, byte_ranges[0]), (2, byte_ranges[2]), (1, byte_ranges[1])],
                [(3, byte_ranges[3])],
            ],
            [(4, byte_ranges[4])],
        )

    fake = types.ModuleType("zarr.core._coalesce")
    fake.coalesce_ranges = coalesce_ranges
    monkeypatch.setitem(sys.modules, "zarr.core._coalesce", fake)
    got = dict(store.get_ranges_sync(key, ranges, prototype=CPU))
    assert [got[i].to_bytes() for i in range(len(ranges))] == [
        data[300:900],
        data[0:10],
        data[5:400],
        data[-5:],
        data[-3:],
    ]


# --------------------------------------------------------------------------- byte ranges


def byte_requests(size_limit: int = 300):
    return st.one_of(
        st.none(),
        st.tuples(st.integers(0, size_limit), st.integers(0, size_limit)).map(
            lambda se: RangeByteRequest(min(se), max(se))
        ),
        st.integers(0, size_limit).map(OffsetByteRequest),
        st.integers(0, size_limit).map(SuffixByteRequest),
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(size=st.integers(0, 256), request=byte_requests())
def test_byte_ranges_match_local_store(tmp_path, size, request):
    data = payload(size, size)
    (tmp_path / "c").mkdir(exist_ok=True)
    (tmp_path / "c" / "0").write_bytes(data)
    ours = NVMeStore(tmp_path, read_only=True).get_sync("c/0", byte_range=request)
    theirs = LocalStore(tmp_path, read_only=True).get_sync("c/0", byte_range=request)
    assert ours.to_bytes() == theirs.to_bytes()


@pytest.mark.parametrize(
    "request_, error",
    [
        (RangeByteRequest(-1, 2), ValueError),
        (RangeByteRequest(2, -1), ValueError),
        (OffsetByteRequest(-1), ValueError),
        (SuffixByteRequest(-3), ValueError),
        ((0, 2), TypeError),
    ],
)
def test_malformed_byte_ranges_are_refused(store, request_, error):
    store.set_sync("c/0", buffer(b"0123456789"))
    with pytest.raises(error):
        store.get_sync("c/0", byte_range=request_)
    with pytest.raises(error):  # also for a key that does not exist
        asyncio.run(store.get("c/missing", CPU, byte_range=request_))
    # ... on every read path, as get() does
    with pytest.raises(error):
        store.get_sync("c/missing", byte_range=request_)
    with pytest.raises(error):
        asyncio.run(store.get_partial_values(CPU, [("c/missing", request_)]))


def test_a_range_that_ends_before_it_starts_is_empty(store):
    # As zarr's memory store answers, and zarr's store tests expect (they slice the value).
    store.set_sync("c/0", buffer(b"0123456789"))
    assert store.get_sync("c/0", byte_range=RangeByteRequest(3, 2)).to_bytes() == b""
    [part] = asyncio.run(store.get_partial_values(CPU, [("c/0", RangeByteRequest(5, 2))]))
    assert part is not None and part.to_bytes() == b""


def test_missing_keys_read_as_none(store):
    store.set_sync("c/0", buffer(b"x"))
    assert store.get_sync("c/1") is None
    assert store.get_sync("c/0/deeper") is None  # a key below a file
    assert store.get_sync("c") is None  # a directory
    assert asyncio.run(store.get_partial_values(CPU, [("c/1", None), ("c/0", None)]))[0] is None
    with pytest.raises(FileNotFoundError):
        asyncio.run(store.getsize("c"))
    for below_a_file in ("c/0/", "c/0/deeper"):  # NotADirectoryError from the OS
        with pytest.raises(FileNotFoundError):
            asyncio.run(store.getsize(below_a_file))


@pytest.mark.parametrize("prefix", ["c//", "c//0", "c/0//", "c//0/1"])
def test_list_prefix_yields_only_keys_that_exist(store, prefix):
    # Keys are listed as list() spells them ("c/0/1"), and none starts with a double slash.
    store.set_sync("c/0/1", buffer(b"x"))
    listed = asyncio.run(_collect_aiterator(store.list_prefix(prefix)))
    assert all(store.get_sync(key) is not None for key in listed)
    assert listed == ()


# --------------------------------------------------------------------------- zarr pipelines


def test_fused_pipeline_reads_and_writes_through_the_sync_surface(tmp_path, monkeypatch):
    if not HAS_FUSED:
        pytest.skip(f"zarr {zarr.__version__} has no FusedCodecPipeline (zarr >= 3.4)")
    calls: dict[str, list[str]] = {"get": [], "get_sync": [], "set": [], "set_sync": []}
    for name in calls:
        real = getattr(NVMeStore, name)
        if asyncio.iscoroutinefunction(real):

            async def spy(self, key, *args, _real=real, _name=name, **kwargs):
                calls[_name].append(key)
                return await _real(self, key, *args, **kwargs)
        else:

            def spy(self, key, *args, _real=real, _name=name, **kwargs):
                calls[_name].append(key)
                return _real(self, key, *args, **kwargs)

        monkeypatch.setattr(NVMeStore, name, spy)
    data = np.arange(64 * 48, dtype=np.int32).reshape(64, 48)
    with zarr.config.set({"codec_pipeline.path": FUSED}):
        z = zarr.create_array(
            NVMeStore(tmp_path), shape=data.shape, chunks=(16, 16), dtype=data.dtype
        )
        z[:] = data
        np.testing.assert_array_equal(zarr.open_array(NVMeStore(tmp_path), mode="r")[:], data)
    chunk_keys = {f"c/{i}/{j}" for i in range(4) for j in range(3)}
    assert set(calls["set_sync"]) == chunk_keys
    assert set(calls["get_sync"]) == chunk_keys
    assert not chunk_keys & set(calls["get"] + calls["set"])  # no chunk went around


@pytest.mark.parametrize("pipeline", ["batched", "fused"])
def test_sharded_partial_reads(tmp_path, pipeline):
    if pipeline == "fused" and not HAS_FUSED:
        pytest.skip(f"zarr {zarr.__version__} has no FusedCodecPipeline (zarr >= 3.4)")
    config = {"codec_pipeline.path": FUSED} if pipeline == "fused" else {}
    data = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    with zarr.config.set(config):
        z = zarr.create_array(
            NVMeStore(tmp_path), shape=data.shape, shards=(32, 32), chunks=(8, 8), dtype=data.dtype
        )
        z[:] = data
        reader = zarr.open_array(NVMeStore(tmp_path, read_only=True), mode="r")
        np.testing.assert_array_equal(reader[3:29, 10:50], data[3:29, 10:50])
        np.testing.assert_array_equal(reader[:], data)
    local = zarr.open_array(LocalStore(tmp_path, read_only=True), mode="r")
    np.testing.assert_array_equal(local[:], data)


def test_pickled_store_reads_the_same_array(tmp_path):
    data = np.arange(100, dtype=np.int16)
    zarr.create_array(NVMeStore(tmp_path), data=data, chunks=(7,))
    copy = pickle.loads(pickle.dumps(NVMeStore(tmp_path, read_only=True)))
    assert copy.read_only and copy == NVMeStore(tmp_path)
    np.testing.assert_array_equal(zarr.open_array(copy, mode="r")[:], data)


def test_dask_reads_through_the_store(tmp_path, monkeypatch):
    da = pytest.importorskip("dask.array")
    data = np.random.default_rng(1).normal(size=(50, 30))
    z = zarr.create_array(
        NVMeStore(tmp_path / "a"), shape=data.shape, chunks=(7, 8), dtype=data.dtype
    )
    z[:] = data
    reads = []
    real = store_module.read_value
    monkeypatch.setattr(
        store_module, "read_value", lambda path, *a: (reads.append(path), real(path, *a))[1]
    )
    x = da.from_zarr(zarr.open_array(NVMeStore(tmp_path / "a", read_only=True), mode="r"))
    assert x.chunks == ((7,) * 7 + (1,), (8, 8, 8, 6))
    np.testing.assert_array_equal(x.compute(scheduler="threads"), data)
    np.testing.assert_allclose((x[10:40] * 2).sum(axis=0).compute(), 2 * data[10:40].sum(0))
    assert sum("/c/" in path for path in reads) >= 32  # every chunk came through the store
    da.to_zarr(x + 1, NVMeStore(tmp_path / "b"))
    np.testing.assert_array_equal(
        zarr.open_array(LocalStore(tmp_path / "b"), mode="r")[:], data + 1
    )


# --------------------------------------------------------------------------- tool choice


@pytest.fixture
def tool_requests(monkeypatch):
    """The ``tool=`` of every single read the store's queue hands to the dispatcher."""
    from arrayio.dispatch.dispatcher import Dispatcher

    requests: list[object] = []
    real = Dispatcher.read

    def read(self, fd, buffer, file_offset, **kwargs):
        requests.append(kwargs.get("tool"))
        return real(self, fd, buffer, file_offset, **kwargs)

    monkeypatch.setattr(Dispatcher, "read", read)
    return requests


def test_a_read_alone_lets_the_dispatcher_choose(store, tool_requests):
    store.set_sync("c/0", buffer(payload(2 << 20, 0)))
    assert store.get_sync("c/0").to_bytes() == payload(2 << 20, 0)
    assert tool_requests == [None]


def test_a_forced_tool_is_respected(store, tool_requests):
    from arrayio.dispatch import dispatcher

    store.set_sync("c/0", buffer(payload(2 << 20, 6)))
    with arrayio.config.set(tool="posix(threads=2)"):
        assert store.get_sync("c/0").to_bytes() == payload(2 << 20, 6)
        assert dispatcher.get().last[1].name == "posix"  # the dispatcher applied it
    assert tool_requests == [None]  # the store names no tool of its own


def test_a_store_moves_its_directory_and_works_there(tmp_path):
    store = NVMeStore(tmp_path / "a")
    store.set_sync("c/0", buffer(b"0123"))
    asyncio.run(store.move(tmp_path / "deeper" / "b"))
    assert store.root == tmp_path / "deeper" / "b"
    assert not (tmp_path / "a").exists()
    assert store.get_sync("c/0").to_bytes() == b"0123"
    store.set_sync("c/1", buffer(b"45"))
    assert sorted(asyncio.run(_keys(store))) == ["c/0", "c/1"]
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        asyncio.run(store.move(tmp_path / "taken"))
    with pytest.raises(ValueError):
        asyncio.run(NVMeStore(store.root, read_only=True).move(tmp_path / "c"))
    assert store.get_sync("c/1").to_bytes() == b"45"


async def _keys(store: NVMeStore) -> list[str]:
    return [key async for key in store.list()]


def test_a_prefix_of_slashes_lists_the_root(store):
    # As LocalStore answers (zarr's stateful tests ask is_empty("/") of a cleared store).
    assert asyncio.run(store.is_empty("/"))
    store.set_sync("c/0", buffer(b"x"))
    assert not asyncio.run(store.is_empty("/"))
    listed = asyncio.run(_collect(store.list_prefix("/")))
    assert listed == ["c/0"]
    assert asyncio.run(_collect(store.list_dir("/"))) == ["c"]
    with pytest.raises(InvalidKeyError):
        asyncio.run(_collect(store.list_prefix("/etc")))


async def _collect(iterator) -> list[str]:
    return [item async for item in iterator]
