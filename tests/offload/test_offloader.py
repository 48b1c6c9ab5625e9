"""The Offloader: put/get/prefetch order, the budget, cleanup (close and after a crash),
errors, frameworks, and many threads at once."""

from __future__ import annotations

import errno
import gc
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import arrayio
from arrayio.dispatch import _transfer
from arrayio.offload import OffloadBudgetError, Offloader, _directory
from arrayio.testing import Framework

KB = 1 << 10
MB = 1 << 20
TIMEOUT = 60


def _array(i: int, nbytes: int = 64 * KB) -> np.ndarray:
    return np.full(nbytes // 4, i, np.float32)


@pytest.fixture
def offloader(tmp_path):
    off = Offloader(tmp_path, device_budget_bytes=4 * 64 * KB, writeback_bytes=0)
    yield off
    off.close()


def _offload_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("arrayio-offload")]


@pytest.fixture(autouse=True)
def no_leftover_threads():
    yield
    gc.collect()
    assert _offload_threads() == []


def test_round_trip_and_lru_order(offloader) -> None:
    handles = [offloader.put(_array(i)) for i in range(6)]  # budget: 4 arrays
    resident = [offloader.resident(h) for h in handles]
    assert resident == [False, False, True, True, True, True]  # the oldest were spilled
    assert offloader.stats().spilled_bytes == 2 * 64 * KB
    # Reading #0 back needs room: the least recently used resident one (#2) goes.
    assert offloader.get(handles[0])[0] == 0
    assert [offloader.resident(h) for h in handles] == [True, False, False, True, True, True]
    # Clean arrays (whose file is complete) go first, since dropping them costs no write:
    # #0, read back, goes before #3, #4 and #5, which were never written.
    offloader.get(handles[1])
    assert [offloader.resident(h) for h in handles] == [False, True, False, True, True, True]
    # #1 is clean now: the next put drops it.
    handles.append(offloader.put(_array(6)))
    assert {i for i, h in enumerate(handles) if offloader.resident(h)} == {3, 4, 5, 6}
    # With no clean array left, the least recently used one is written out: #4, once #3
    # has been used.
    offloader.get(handles[3])
    handles.append(offloader.put(_array(7)))
    assert {i for i, h in enumerate(handles) if offloader.resident(h)} == {3, 5, 6, 7}
    for i, handle in enumerate(handles):
        assert np.array_equal(offloader.get(handle), _array(i))


def test_get_returns_the_same_object_while_resident(offloader) -> None:
    a = _array(1)
    handle = offloader.put(a)
    assert offloader.get(handle) is a


def test_prefetch_then_get_reads_once_and_does_not_wait(offloader, monkeypatch) -> None:
    handles = [offloader.put(_array(i)) for i in range(8)]
    offloader.wait()
    assert offloader.stats().reads == 0
    offloader.free(handles[6])  # room for two (prefetches never write arrays out)
    offloader.free(handles[7])
    offloader.prefetch(handles[:2])
    offloader.wait()
    reads = offloader.stats().reads
    assert reads == 2 and offloader.resident(handles[0]) and offloader.resident(handles[1])

    def no_io(*args, **kwargs):
        raise AssertionError("get() of a prefetched array must not read")

    monkeypatch.setattr(_transfer, "read_into", no_io)
    assert offloader.get(handles[1])[0] == 1 and offloader.get(handles[0])[0] == 0
    assert offloader.stats().reads == reads


def test_prefetch_beyond_the_budget_is_queued_until_room(tmp_path) -> None:
    with Offloader(tmp_path, device_budget_bytes=2 * 64 * KB, writeback_bytes=0) as off:
        handles = [off.put(_array(i), hint="spill") for i in range(4)]
        off.wait()
        kept = off.put(_array(9), hint="keep")
        assert off.stats().resident_bytes == 64 * KB
        off.prefetch(handles)  # one fits; three wait
        off.wait()
        assert [off.resident(h) for h in handles] == [True, False, False, False]
        off.free(handles[0])  # room for the next one in line
        off.wait()
        assert [off.resident(h) for h in handles[1:]] == [True, False, False]
        assert off.stats().resident_bytes <= off.budget
        assert off.get(handles[3])[0] == 3 and off.get(kept)[0] == 9


def test_budget_holds_after_every_put(tmp_path) -> None:
    """Independent of the offloader's own accounting: arrays that nobody but the offloader
    references must be gone (weak references dead) once they exceed the budget."""
    budget = 5 * 64 * KB
    rng = random.Random(0)
    alive: list[weakref.ref] = []
    with Offloader(tmp_path, device_budget_bytes=budget) as off:
        handles = []
        for i in range(40):
            size = rng.choice([16, 64, 128]) * KB
            a = _array(i, size)
            alive.append(weakref.ref(a))
            handles.append(off.put(a))
            del a
            gc.collect()
            held = sum(ref().nbytes for ref in alive if ref() is not None)
            assert held <= budget
            assert off.stats().resident_bytes <= budget
            if rng.random() < 0.3:  # some reads back, which must fit too
                j = rng.randrange(len(handles))
                assert off.get(handles[j])[0] == j
                assert off.stats().resident_bytes <= budget
        assert off.stats().peak_resident_bytes <= budget + 128 * KB  # the array being put


def test_spill_and_keep_hints(offloader) -> None:
    spilled = offloader.put(_array(1), hint="spill")
    kept = [offloader.put(_array(i), hint="keep") for i in range(4)]
    offloader.wait()
    assert not offloader.resident(spilled)
    for i in range(3):
        offloader.put(_array(10 + i))  # every one goes to disk: kept arrays fill the budget
    assert all(offloader.resident(h) for h in kept)
    with pytest.raises(OffloadBudgetError):
        offloader.put(_array(5), hint="keep")
    with pytest.raises(ValueError, match="hint"):
        offloader.put(_array(5), hint="later")


def test_array_larger_than_the_budget(tmp_path) -> None:
    with Offloader(tmp_path, device_budget_bytes=64 * KB) as off:
        big = off.put(_array(3, 256 * KB))
        assert not off.resident(big) and off.stats().resident_bytes == 0
        assert off.get(big)[0] == 3  # read back once nothing else is held


def test_free_and_del_remove_files(offloader) -> None:
    handles = [offloader.put(_array(i)) for i in range(6)]
    offloader.wait()
    assert len([n for n in os.listdir(offloader.directory) if n.endswith(".bin")]) >= 2
    offloader.free(handles[0])
    offloader.free(handles[0])  # twice is fine
    with pytest.raises(ValueError, match="freed"):
        offloader.get(handles[0])
    del handles
    gc.collect()
    offloader.wait()
    assert [n for n in os.listdir(offloader.directory) if n.endswith(".bin")] == []
    stats = offloader.stats()
    assert stats.arrays == 0 and stats.resident_bytes == 0 and stats.disk_bytes == 0


def test_close_removes_the_directory(tmp_path) -> None:
    off = Offloader(tmp_path, device_budget_bytes=64 * KB)
    handles = [off.put(_array(i)) for i in range(4)]
    directory = off.directory
    assert os.path.isdir(directory)
    off.close()
    off.close()
    assert not os.path.exists(directory) and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="closed"):
        off.put(_array(0))
    del handles  # handles outliving their offloader are harmless
    gc.collect()


def test_garbage_offloader_cleans_up(tmp_path) -> None:
    off = Offloader(tmp_path, device_budget_bytes=64 * KB)
    off.put(_array(1))
    off.put(_array(2))
    directory = off.directory
    del off
    gc.collect()
    # The last reference may be a worker's, which drops it once its write is done.
    deadline = time.monotonic() + TIMEOUT
    while os.path.exists(directory) and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert not os.path.exists(directory)
    while _offload_threads() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_dead_owner_directories_are_reclaimed(tmp_path) -> None:
    # A directory left by a process that died: its .lock is held by nobody.
    dead = tmp_path / f"{_directory.PREFIX}999999-deadbeef"
    dead.mkdir()
    (dead / ".lock").write_text(json.dumps({"pid": 999999}))
    (dead / "0.bin").write_bytes(b"x" * 100)
    live = Offloader(tmp_path, device_budget_bytes=MB)
    unrelated = tmp_path / "keep-me"
    unrelated.mkdir()
    with Offloader(tmp_path, device_budget_bytes=MB) as second:
        assert not dead.exists()
        assert os.path.isdir(live.directory)  # its owner is alive (this process)
        assert unrelated.exists()
        assert str(dead) not in (second.directory, live.directory)
    live.close()


def test_directory_of_a_killed_process_is_reclaimed(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import os, numpy as np, arrayio
        off = arrayio.Offloader({str(tmp_path)!r}, device_budget_bytes=1 << 16)
        handles = [off.put(np.ones(1 << 14, np.float32)) for _ in range(4)]
        off.wait()
        print(off.directory, flush=True)
        os._exit(1)  # no close(), no finalizers: as if killed
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    left = result.stdout.strip()
    assert left and os.path.isdir(left) and any(n.endswith(".bin") for n in os.listdir(left))
    with Offloader(tmp_path, device_budget_bytes=MB):
        assert not os.path.exists(left)


def test_directory_that_cannot_be_created(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        Offloader(blocker / "scratch", device_budget_bytes=MB)


def test_write_error_surfaces_and_arrays_stay_usable(offloader, monkeypatch) -> None:
    handles = [offloader.put(_array(i)) for i in range(4)]  # the budget is full

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(_transfer, "write_from", disk_full)
    with pytest.raises(OSError, match="injected"):
        offloader.put(_array(4))  # must spill #0 to make room, and cannot
    monkeypatch.undo()
    for i, handle in enumerate(handles):  # nothing was lost
        assert offloader.get(handle)[0] == i
    later = offloader.put(_array(5))  # the disk works again: spilling resumes
    assert offloader.get(later)[0] == 5 and offloader.stats().spilled_bytes > 0


def test_background_write_error_is_reported_by_the_next_call(tmp_path, monkeypatch) -> None:
    def disk_full(*args, **kwargs):
        raise OSError(errno.EIO, "I/O error (injected)")

    monkeypatch.setattr(_transfer, "write_from", disk_full)
    with Offloader(tmp_path, device_budget_bytes=MB) as off:
        handle = off.put(_array(1), hint="spill")
        with pytest.raises(OSError, match="injected"):
            off.wait()
        assert off.resident(handle) and off.get(handle)[0] == 1


def test_damaged_spill_file_raises_checksum_error(offloader) -> None:
    handle = offloader.put(_array(1), hint="spill")
    offloader.wait()
    path = os.path.join(offloader.directory, f"{handle.id}.bin")
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(arrayio.ChecksumError):
        offloader.get(handle)


def test_every_cpu_framework(tmp_path, xp: Framework) -> None:
    arrays = [np.arange(i, i + 4096, dtype=np.float32).reshape(64, 64) for i in range(5)]
    with Offloader(tmp_path, device_budget_bytes=2 * 16 * KB) as off:
        handles = [off.put(xp.from_numpy(a)) for a in arrays]
        off.prefetch(handles[:1])
        for a, handle in zip(arrays, handles, strict=True):
            got = off.get(handle)
            assert (
                type(got).__module__.split(".")[0]
                == type(xp.from_numpy(a)).__module__.split(".")[0]
                or xp.name == "jax"
            )
            assert tuple(got.shape) == a.shape and xp.dtype_name(got) == "float32"
            assert xp.to_bytes(got) == a.tobytes()
        assert off.stats().reads >= 3


@pytest.mark.parametrize("committed", [False, True])
def test_a_jax_array_comes_back_as_committed_as_it_went(tmp_path, committed) -> None:
    """An array JAX placed by default comes back uncommitted, as it was put: a jitted
    function caches its compilations by committedness, and a backward stage handed arrays
    read back would compile again for them. One the caller placed comes back committed."""
    jax = pytest.importorskip("jax")
    x = jax.numpy.arange(16 * KB, dtype=jax.numpy.float32)
    if committed:
        x = jax.device_put(x, jax.devices()[0])
    assert x.committed is committed
    double = jax.jit(lambda a: a * 2)
    double(x)
    with Offloader(tmp_path, device_budget_bytes=0) as off:
        handle = off.put(x, hint="spill")
        off.wait()
        assert not off.resident(handle)
        got = off.get(handle)
        assert got.committed is committed
        assert np.array_equal(np.asarray(double(got)), np.asarray(double(x)))
    assert double._cache_size() == 1  # no compilation for the array read back


def test_bfloat16_and_empty_arrays(tmp_path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.arange(8192, dtype=np.float32).astype(ml_dtypes.bfloat16)
    with Offloader(tmp_path, device_budget_bytes=0) as off:
        empty = off.put(np.zeros((0, 3), np.int8))
        handle = off.put(a)
        assert off.get(empty).shape == (0, 3)
        got = off.get(handle)
        assert got.dtype == a.dtype and got.tobytes() == a.tobytes()


def test_many_threads_keep_data_apart(tmp_path) -> None:
    """Threads put, prefetch, get and free at once; every array read must hold its values."""
    failures = []
    with Offloader(
        tmp_path, device_budget_bytes=12 * 64 * KB, write_workers=3, read_workers=3
    ) as off:

        def client(k: int) -> None:
            rng = random.Random(k)
            mine: list[tuple[int, object]] = []
            for step in range(60):
                roll = rng.random()
                if roll < 0.45 or not mine:
                    value = k * 1000 + step
                    size = rng.choice([4, 64, 200]) * KB
                    mine.append((value, off.put(_array(value, size))))
                elif roll < 0.6:
                    off.prefetch([h for _, h in rng.sample(mine, min(3, len(mine)))])
                elif roll < 0.9:
                    value, handle = rng.choice(mine)
                    got = off.get(handle)
                    if not (got[0] == value and got[-1] == value):
                        failures.append((k, value, got[0]))
                else:
                    off.free(mine.pop(rng.randrange(len(mine)))[1])
            for value, handle in mine:
                got = off.get(handle)
                if not (got[0] == value and got[-1] == value):
                    failures.append((k, value, got[0]))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        off.wait()
        stats = off.stats()
        assert stats.writes > 0 and stats.reads > 0
        assert stats.resident_bytes <= off.budget
    assert failures == []


@pytest.mark.gpu
def test_gpu_round_trip(tmp_path, gpu_xp: Framework) -> None:
    arrays = [np.arange(i, i + (1 << 18), dtype=np.float32) for i in range(6)]  # 1 MiB each
    with Offloader(tmp_path, device_budget_bytes=2 * MB) as off:
        handles = [off.put(gpu_xp.from_numpy(a)) for a in arrays]
        assert off.stats().resident_bytes <= 2 * MB
        off.prefetch(handles[:2])
        for a, handle in zip(arrays, handles, strict=True):
            got = off.get(handle)
            assert arrayio.arrays._frameworks.placement_of(got).is_cuda
            assert gpu_xp.to_bytes(got) == a.tobytes()
        assert off.stats().writes >= 4 and off.stats().reads >= 4


@pytest.mark.gpu
def test_gpu_concurrent_spills_keep_data_apart(tmp_path, gpu_xp: Framework) -> None:
    """Arrays big enough for the multi-threaded GPU tools, many transfers in flight."""
    arrays = [np.full(1 << 21, i, np.float32) for i in range(12)]  # 8 MiB each
    with Offloader(tmp_path, device_budget_bytes=16 * MB, write_workers=4, read_workers=4) as off:
        handles = [off.put(gpu_xp.from_numpy(a)) for a in arrays]
        off.prefetch(handles)
        for a, handle in zip(arrays, handles, strict=True):
            assert gpu_xp.to_bytes(off.get(handle)) == a.tobytes()
        assert off.stats().writes >= 10


class _WriteGate:
    """Holds every ``_transfer.write_from`` until opened; ``entered`` counts writes started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._real = _transfer.write_from
        self.opened = threading.Event()
        self.entered = threading.Semaphore(0)
        monkeypatch.setattr(_transfer, "write_from", self)

    def __call__(self, *args, **kwargs):
        self.entered.release()
        assert self.opened.wait(TIMEOUT), "gate never opened"
        return self._real(*args, **kwargs)

    def wait_entered(self) -> None:
        assert self.entered.acquire(timeout=TIMEOUT), "no write started"


def _when_shutting_down(off: Offloader) -> threading.Event:
    """An event set once close() has marked ``off`` closed and begun waiting for its I/O."""
    event = threading.Event()
    shutdown = off._writers.shutdown

    def spy(*args, **kwargs):
        event.set()
        return shutdown(*args, **kwargs)

    off._writers.shutdown = spy
    return event


def test_close_wakes_calls_waiting_in_other_threads(tmp_path, monkeypatch) -> None:
    """A put waiting for spills and a wait() in other threads must not hang when close()
    cancels the queued writes they wait for: the put raises, wait() returns."""
    gate = _WriteGate(monkeypatch)
    off = Offloader(tmp_path, device_budget_bytes=2 * 64 * KB, writeback_bytes=0, write_workers=1)
    small = [off.put(_array(i)) for i in range(2)]
    results: dict[str, object] = {}

    def put_big() -> None:  # needs both small arrays out: one write runs, one is queued
        try:
            results["put"] = off.put(_array(9, 128 * KB))
        except BaseException as error:  # noqa: BLE001
            results["put"] = error

    def wait() -> None:
        off.wait()
        results["wait"] = "returned"

    putter = threading.Thread(target=put_big)
    putter.start()
    gate.wait_entered()
    waiter = threading.Thread(target=wait)
    waiter.start()
    shutting_down = _when_shutting_down(off)
    closer = threading.Thread(target=off.close)
    closer.start()
    assert shutting_down.wait(TIMEOUT)
    gate.opened.set()
    for thread in (closer, putter, waiter):
        thread.join(10)
    assert not putter.is_alive() and not waiter.is_alive() and not closer.is_alive()
    assert isinstance(results["put"], ValueError) and "closed" in str(results["put"])
    assert results["wait"] == "returned"
    assert not os.path.exists(off.directory)
    del small


def test_second_close_returns_once_closed(tmp_path, monkeypatch) -> None:
    gate = _WriteGate(monkeypatch)
    off = Offloader(tmp_path, device_budget_bytes=MB)
    handle = off.put(_array(1), hint="spill")
    gate.wait_entered()
    shutting_down = _when_shutting_down(off)
    first = threading.Thread(target=off.close)
    first.start()
    assert shutting_down.wait(TIMEOUT)
    seen = []

    def close_again() -> None:
        off.close()
        seen.append(os.path.exists(off.directory))

    second = threading.Thread(target=close_again)
    second.start()
    second.join(0.2)  # returning now, with the write in flight, would be the bug
    gate.opened.set()
    first.join(TIMEOUT)
    second.join(TIMEOUT)
    assert seen == [False]  # the directory was gone when the second close() returned
    del handle


def test_handles_after_free_and_close_raise_clearly(tmp_path, monkeypatch) -> None:
    gate = _WriteGate(monkeypatch)
    off = Offloader(tmp_path, device_budget_bytes=MB)
    writing = off.put(_array(1), hint="spill")
    gate.wait_entered()
    off.free(writing)  # its write is still in flight
    with pytest.raises(ValueError, match="freed"):
        off.get(writing)
    with pytest.raises(ValueError, match="freed"):
        off.resident(writing)
    gate.opened.set()
    off.wait()
    kept = off.put(_array(2))
    off.close()
    for call in (off.get, off.resident, off.prefetch):
        with pytest.raises(ValueError, match="closed"):
            call(kept)
    assert off.peek(kept) is None


def test_forked_child_closing_leaves_the_parents_directory(tmp_path) -> None:
    """A forked child inherits the offloader; its close() (or its exit handlers) must not
    delete the parent's spill files, nor release the parent's lock."""
    script = textwrap.dedent(f"""
        import os, numpy as np, arrayio
        off = arrayio.Offloader({str(tmp_path)!r}, device_budget_bytes=1 << 16)
        handle = off.put(np.full(1 << 14, 7, np.float32), hint="spill")
        off.wait()
        assert not off.resident(handle)
        pid = os.fork()
        if pid == 0:
            off.close()
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        with arrayio.Offloader({str(tmp_path)!r}, device_budget_bytes=1 << 16):
            pass  # reclaims what is unlocked: not ours
        print(os.path.isdir(off.directory), float(off.get(handle)[0]))
        off.close()
    """)
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.split() == ["True", "7.0"], result.stderr
    assert os.listdir(tmp_path) == []


def test_refused_io_task_leaves_no_entry_stuck(offloader, monkeypatch) -> None:
    """At interpreter exit the executors refuse new tasks: the call fails, and the entry is
    not left marked as being read or written (a later get() waited forever)."""
    handles = [offloader.put(_array(i)) for i in range(5)]  # #0 spilled
    offloader.wait()

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(offloader._readers, "submit", refuse)
    with pytest.raises(RuntimeError, match="shutdown"):
        offloader.get(handles[0])
    monkeypatch.setattr(offloader._writers, "submit", refuse)
    with pytest.raises(RuntimeError, match="shutdown"):
        offloader.put(_array(9), hint="spill")
    monkeypatch.undo()
    result: list = []
    getter = threading.Thread(target=lambda: result.append(offloader.get(handles[0])[0]))
    getter.start()
    getter.join(10)
    assert result == [0]
    assert offloader.stats().resident_bytes <= offloader.budget
    for i, handle in enumerate(handles):
        assert offloader.get(handle)[0] == i
