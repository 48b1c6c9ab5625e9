"""save_async / load_async: two-phase saves, per-path order, parallelism, errors, cancellation
and asyncio."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest

import arrayio
from arrayio.api import _async
from arrayio.dispatch import _transfer
from arrayio.testing import Framework

TIMEOUT = 60


class Gate:
    """Wraps ``arrayio.dispatch._transfer.write_from`` and ``write_many``: counts writers in flight
    and, while closed, holds each write until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, closed: bool = True) -> None:
        self._real = {name: getattr(_transfer, name) for name in ("write_from", "write_many")}
        self._open = threading.Event()
        if not closed:
            self._open.set()
        self._lock = threading.Lock()
        self.active = 0
        self.most_active = 0
        self.entered = threading.Semaphore(0)
        for name in self._real:  # one array (.npy) or a container's batch
            monkeypatch.setattr(_transfer, name, functools.partial(self, name))

    def __call__(self, name, *args, **kwargs):
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.entered.release()
        try:
            assert self._open.wait(TIMEOUT), "gate never opened"
            return self._real[name](*args, **kwargs)
        finally:
            with self._lock:
                self.active -= 1

    def wait_entered(self, count: int = 1) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=TIMEOUT), "no write started"

    def open(self) -> None:
        self._open.set()


@pytest.fixture(autouse=True)
def no_leftover_threads():
    yield
    assert _async._scheduler.wait_idle(TIMEOUT), "async operations still queued"
    _async._scheduler.unseen_failures()  # a test's failed saves are not the next one's
    assert not [t for t in threading.enumerate() if t.name == "arrayio-async"]


def _tmp_files(directory) -> list[str]:
    return [name for name in os.listdir(directory) if ".arrayio-tmp-" in name]


def test_round_trip_every_cpu_framework(tmp_path, xp: Framework) -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    tree = {"a": xp.from_numpy(a), "n": [xp.from_numpy(a[:, :2].copy()), 7]}
    future = arrayio.save_async(tmp_path / "t.safetensors", tree, metadata={"run": 1})
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(TIMEOUT) is None
    loaded = arrayio.load_async(tmp_path / "t.safetensors", like=xp.name).result(TIMEOUT)
    assert xp.to_bytes(loaded["a"]) == a.tobytes()
    assert loaded["n"][1] == 7
    npy = arrayio.save_async(tmp_path / "a.npy", xp.from_numpy(a))
    npy.result(TIMEOUT)
    assert np.array_equal(np.load(tmp_path / "a.npy"), a)


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_mutating_after_save_async_returns_does_not_change_the_file(
    tmp_path, monkeypatch, name
) -> None:
    if name == "torch":
        torch = pytest.importorskip("torch")
        small, big = torch.zeros(1000), torch.zeros(1 << 19)  # 4 KB and 2 MiB
    else:
        small, big = np.zeros(1000, np.float32), np.zeros(1 << 19, np.float32)
    gate = Gate(monkeypatch)
    future = arrayio.save_async(tmp_path / "m.safetensors", {"small": small, "big": big})
    small += 1  # in place, after save_async returned and before anything was written
    big[:] = 5
    gate.open()
    future.result(TIMEOUT)
    loaded = arrayio.load(tmp_path / "m.safetensors")
    assert not loaded["small"].any() and not loaded["big"].any()


def test_jax_arrays_are_not_copied(tmp_path, monkeypatch) -> None:
    jnp = pytest.importorskip("jax.numpy")
    copies = []
    real = _async.aligned_empty

    def spy(nbytes):
        copies.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(_async, "aligned_empty", spy)
    arrayio.save_async(tmp_path / "j.safetensors", {"x": jnp.ones(1000)}).result(TIMEOUT)
    assert copies == []
    arrayio.save_async(tmp_path / "n.safetensors", {"x": np.ones(1000)}).result(TIMEOUT)
    assert copies == [8000]
    assert np.array_equal(arrayio.load(tmp_path / "j.safetensors")["x"], np.ones(1000))


def test_argument_errors_raise_at_once(tmp_path) -> None:
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.save_async(tmp_path / "x.safetensors", {"x": object()})
    with pytest.raises(arrayio.UnsupportedObjectError):
        arrayio.save_async(tmp_path / "x.npy", {"x": np.ones(2)})


def test_io_errors_surface_on_the_future(tmp_path, monkeypatch) -> None:
    missing = arrayio.load_async(tmp_path / "missing.safetensors")
    assert isinstance(missing.exception(TIMEOUT), FileNotFoundError)
    no_directory = arrayio.save_async(tmp_path / "no" / "x.safetensors", {"x": np.ones(3)})
    with pytest.raises(FileNotFoundError):
        no_directory.result(TIMEOUT)

    path = tmp_path / "full.safetensors"
    arrayio.save(path, {"x": np.ones(3)})

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(_transfer, "write_from", disk_full)
    monkeypatch.setattr(_transfer, "write_many", disk_full)
    failed = arrayio.save_async(path, {"x": np.zeros(3)})
    with pytest.raises(OSError, match="injected"):
        failed.result(TIMEOUT)
    assert np.array_equal(arrayio.load(path)["x"], np.ones(3))  # the old file is intact
    assert _tmp_files(tmp_path) == []


def test_wait_returns_once_every_queued_save_is_done(tmp_path, monkeypatch) -> None:
    gate = Gate(monkeypatch)
    futures = [
        arrayio.save_async(tmp_path / f"{i}.safetensors", {"x": np.full(3, i)}) for i in range(6)
    ]
    gate.wait_entered()
    assert arrayio.wait(0.05) is False  # held at the gate
    gate.open()
    assert arrayio.wait(TIMEOUT) is True
    assert all(future.done() for future in futures)
    assert [int(arrayio.load(tmp_path / f"{i}.safetensors")["x"][0]) for i in range(6)] == list(
        range(6)
    )


def test_wait_raises_each_failed_save_nobody_looked_at_once(tmp_path) -> None:
    first = tmp_path / "no" / "x.safetensors"
    second = tmp_path / "gone" / "y.safetensors"
    arrayio.save_async(first, {"x": np.ones(3)})
    arrayio.save_async(second, {"x": np.ones(3)})
    arrayio.save_async(tmp_path / "fine.safetensors", {"x": np.ones(3)})
    with pytest.raises(FileNotFoundError) as raised:
        arrayio.wait(TIMEOUT)
    failed = {
        raised.value.filename,
        *(
            path
            for path in (str(first), str(second))
            if any(path in note for note in getattr(raised.value, "__notes__", []))
        ),
    }
    assert failed == {str(first), str(second)}
    assert arrayio.wait(TIMEOUT) is True  # reported once
    assert (tmp_path / "fine.safetensors").exists()


def test_wait_leaves_alone_a_failure_the_caller_has_seen(tmp_path) -> None:
    failed = arrayio.save_async(tmp_path / "no" / "x.safetensors", {"x": np.ones(3)})
    with pytest.raises(FileNotFoundError):
        failed.result(TIMEOUT)
    assert arrayio.wait(TIMEOUT) is True


# Queues saves and returns without waiting: the interpreter's exit must finish them.
EXIT_WITH_QUEUED_SAVES = """
import sys
import numpy as np
import arrayio
directory = sys.argv[1]
for i in range(16):
    arrayio.save_async(f"{directory}/{i}.safetensors", {"x": np.full(1 << 20, i, np.float64)})
arrayio.save_async(f"{directory}/missing/lost.safetensors", {"x": np.ones(3)})
"""


@pytest.mark.parametrize("tool", ["posix", "direct", "naive"])
def test_queued_saves_finish_at_exit_and_a_failure_is_reported(tmp_path, tool) -> None:
    env = {**os.environ, "ARRAYIO_TOOL": tool, "ARRAYIO_CACHE_DIR": "none"}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_QUEUED_SAVES, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    lost = [i for i in range(16) if not (tmp_path / f"{i}.safetensors").exists()]
    assert lost == [], f"saves queued at exit were lost: {lost}"
    for i in range(16):
        assert arrayio.load(tmp_path / f"{i}.safetensors")["x"][0] == i
    assert f"save_async of {tmp_path}/missing/lost.safetensors failed" in done.stderr
    assert "Traceback" not in done.stderr


def test_same_path_keeps_submission_order(tmp_path) -> None:
    path = tmp_path / "p.safetensors"
    futures = []
    for i in range(12):
        # Sizes vary so that a reordering would show: big writes take longer.
        futures.append(
            ("save", i, arrayio.save_async(path, {"x": np.full(1 + 50_000 * (i % 3), i, np.int32)}))
        )
        futures.append(("load", i, arrayio.load_async(path, keys="x")))
    for kind, i, future in futures:
        result = future.result(TIMEOUT)
        if kind == "load":
            assert result[0] == i and result.size == 1 + 50_000 * (i % 3)
    assert arrayio.load(path)["x"][0] == 11  # of many saves, the last wins


def test_different_paths_run_in_parallel_up_to_the_limit(tmp_path, monkeypatch) -> None:
    gate = Gate(monkeypatch)
    with arrayio.config.set(async_workers=3):
        futures = [
            arrayio.save_async(tmp_path / f"{i}.safetensors", {"x": np.ones(10)}) for i in range(6)
        ]
        gate.wait_entered(3)
        assert gate.active == 3  # three at once: the limit
        gate.open()
        concurrent.futures.wait(futures, TIMEOUT)
    assert gate.most_active == 3
    assert all(f.exception() is None for f in futures)


def test_same_path_never_runs_in_parallel(tmp_path, monkeypatch) -> None:
    gate = Gate(monkeypatch, closed=False)
    futures = [
        arrayio.save_async(tmp_path / "same.safetensors", {"x": np.full(10, i)}) for i in range(10)
    ]
    concurrent.futures.wait(futures, TIMEOUT)
    assert gate.most_active == 1
    assert arrayio.load(tmp_path / "same.safetensors")["x"][0] == 9


def test_cancel_before_start(tmp_path, monkeypatch) -> None:
    gate = Gate(monkeypatch)
    with arrayio.config.set(async_workers=1):
        first = arrayio.save_async(tmp_path / "a.safetensors", {"x": np.ones(10)})
        gate.wait_entered()
        second = arrayio.save_async(tmp_path / "b.safetensors", {"x": np.ones(10)})
        assert second.cancel()
        assert second.cancelled() and second.done()
        with pytest.raises(concurrent.futures.CancelledError):
            second.result()
        gate.open()
        first.result(TIMEOUT)
    assert _async._scheduler.wait_idle(TIMEOUT)
    assert not (tmp_path / "b.safetensors").exists()


def test_cancel_running_save_keeps_the_previous_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.safetensors"
    arrayio.save(path, {"a": np.ones(100), "b": np.ones(100)})
    gate = Gate(monkeypatch)
    future = arrayio.save_async(path, {"a": np.zeros(100), "b": np.zeros(100)})
    gate.wait_entered()  # writing its first array
    callbacks = []
    future.add_done_callback(callbacks.append)
    assert future.cancel()
    assert future.cancelled() and callbacks == [future]
    done, _ = concurrent.futures.wait([future], TIMEOUT)
    assert future in done
    later = arrayio.load_async(path)  # queued behind the cancelled save
    gate.open()
    loaded = later.result(TIMEOUT)
    assert np.array_equal(loaded["a"], np.ones(100)) and np.array_equal(loaded["b"], np.ones(100))
    assert _tmp_files(tmp_path) == []


def test_cancel_after_done_is_refused(tmp_path) -> None:
    future = arrayio.save_async(tmp_path / "d.safetensors", {"x": np.ones(3)})
    future.result(TIMEOUT)
    assert not future.cancel() and not future.cancelled()


def test_cancel_running_load_drops_its_result(tmp_path, monkeypatch) -> None:
    path = tmp_path / "l.safetensors"
    arrayio.save(path, {"x": np.ones(3)})
    started, release = threading.Event(), threading.Event()
    real = {name: getattr(_transfer, name) for name in ("read_into", "read_many")}

    def slow_read(*args, **kwargs):
        started.set()
        assert release.wait(TIMEOUT)
        many = isinstance(args[1], list)  # read_many(fd, requests) or read_into(fd, offset...)
        return real["read_many" if many else "read_into"](*args, **kwargs)

    monkeypatch.setattr(_transfer, "read_into", slow_read)
    monkeypatch.setattr(_transfer, "read_many", slow_read)
    future = arrayio.load_async(path)
    assert started.wait(TIMEOUT)
    assert future.cancel() and future.cancelled()
    release.set()
    assert _async._scheduler.wait_idle(TIMEOUT)
    assert future.cancelled()


def test_await_does_not_block_the_event_loop(tmp_path, monkeypatch) -> None:
    path = tmp_path / "aw.safetensors"
    arrayio.save(path, {"x": np.arange(5)})
    gate = Gate(monkeypatch)

    async def main():
        ticks = 0
        saving = arrayio.save_async(path, {"x": np.arange(5) * 2})
        loading = arrayio.load_async(path)
        for _ in range(5):  # the loop runs while the save is held at the gate
            await asyncio.sleep(0.001)
            ticks += 1
        gate.open()
        await saving
        return ticks, await loading

    ticks, loaded = asyncio.run(main())
    assert ticks == 5
    assert np.array_equal(loaded["x"], np.arange(5) * 2)


def test_cancelling_the_awaiting_task_cancels_the_operation(tmp_path, monkeypatch) -> None:
    path = tmp_path / "t.safetensors"
    arrayio.save(path, {"x": np.ones(4)})
    gate = Gate(monkeypatch)
    future = arrayio.save_async(path, {"x": np.zeros(4)})

    async def main():
        task = asyncio.ensure_future(future)
        await asyncio.sleep(0)
        gate.wait_entered()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert future.cancelled()
    gate.open()
    assert _async._scheduler.wait_idle(TIMEOUT)
    assert np.array_equal(arrayio.load(path)["x"], np.ones(4))


def test_many_concurrent_operations_keep_data_apart(tmp_path) -> None:
    """Eight threads submit saves and loads on their own paths (and some shared ones) at once;
    each load must see the latest save its thread submitted before it."""
    failures = []

    def client(k: int) -> None:
        rng = random.Random(k)
        paths = [tmp_path / f"c{k}-{j}.safetensors" for j in range(3)]
        latest: dict = {}
        pending = []
        for step in range(40):
            path = rng.choice(paths)
            if path in latest and rng.random() < 0.4:
                pending.append((arrayio.load_async(path, keys="x"), latest[path]))
            else:
                size = rng.choice([7, 3000, 300_000])  # 300_000 int32 > 1 MiB: dispatcher tools
                value = np.full(size, k * 1000 + step, np.int32)
                arrayio.save_async(path, {"x": value, "tag": f"{k}-{step}"})
                latest[path] = value
        for future, expected in pending:
            got = future.result(TIMEOUT)
            if not np.array_equal(got, expected):
                failures.append((k, got[:3], expected[:3]))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert failures == []


@pytest.mark.gpu
def test_gpu_snapshot_is_taken_before_returning(tmp_path, monkeypatch, gpu_xp) -> None:
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    x = gpu_xp.from_numpy(a)
    gate = Gate(monkeypatch)
    future = arrayio.save_async(tmp_path / "g.safetensors", {"x": x})
    if gpu_xp.name != "jax":  # JAX arrays are immutable
        x += 1
    gate.open()
    future.result(TIMEOUT)
    loaded = arrayio.load(tmp_path / "g.safetensors", like=gpu_xp.name, device="cuda")
    assert gpu_xp.to_bytes(loaded["x"]) == a.tobytes()


@pytest.mark.gpu
def test_gpu_concurrent_saves_and_loads(tmp_path, gpu_xp) -> None:
    arrays = [np.full(1 << 21, i, np.float32) for i in range(6)]  # 8 MiB each
    saves = [
        arrayio.save_async(tmp_path / f"{i}.safetensors", {"x": gpu_xp.from_numpy(a)})
        for i, a in enumerate(arrays)
    ]
    loads = [
        arrayio.load_async(tmp_path / f"{i}.safetensors", like=gpu_xp.name, device="cuda")
        for i in range(len(arrays))
    ]
    for future in saves:
        future.result(TIMEOUT)
    for a, future in zip(arrays, loads, strict=True):
        assert gpu_xp.to_bytes(future.result(TIMEOUT)["x"]) == a.tobytes()


def test_a_path_does_not_wait_for_another_paths_running_save(tmp_path, monkeypatch) -> None:
    """Submitted one at a time, each after the previous one started: the first worker is
    busy, so the second save needs a thread of its own (it used to wait for the first)."""
    gate = Gate(monkeypatch)
    first = arrayio.save_async(tmp_path / "a.safetensors", {"x": np.ones(10)})
    gate.wait_entered()
    second = arrayio.save_async(tmp_path / "b.safetensors", {"x": np.ones(10)})
    gate.wait_entered()  # both writing at once
    assert gate.active == 2
    gate.open()
    first.result(TIMEOUT)
    second.result(TIMEOUT)


def test_relative_paths_are_resolved_when_submitted(tmp_path, monkeypatch) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    monkeypatch.chdir(tmp_path / "one")
    gate = Gate(monkeypatch)
    held = arrayio.save_async("r.safetensors", {"x": np.zeros(3)})
    gate.wait_entered()
    saved = arrayio.save_async("r.safetensors", {"x": np.ones(3)})  # queued behind it
    loaded = arrayio.load_async("r.safetensors")
    monkeypatch.chdir(tmp_path / "two")  # before either runs
    gate.open()
    held.result(TIMEOUT)
    saved.result(TIMEOUT)
    assert saved.path == "r.safetensors"
    assert np.array_equal(loaded.result(TIMEOUT)["x"], np.ones(3))
    assert os.listdir(tmp_path / "two") == []
    assert np.array_equal(arrayio.load(tmp_path / "one" / "r.safetensors")["x"], np.ones(3))


def test_cancelling_a_save_mid_batch_blames_no_tool(tmp_path, monkeypatch, fresh) -> None:
    # The cancellation surfaces inside the batch (at an array's completion): the tool that
    # was writing must not be marked unavailable, nor the batch written again by another.
    from arrayio import tools
    from arrayio.dispatch import Arm, dispatcher

    monkeypatch.setattr(
        dispatcher, "candidate_arms", lambda context: [Arm.of("posix", threads=2), Arm("naive")]
    )
    posix = tools.tool_class("posix")
    real = posix.pwrite
    started, release = threading.Event(), threading.Event()
    writes = []

    def held(self, fd, buffer, file_offset, **kwargs):
        writes.append(file_offset)
        started.set()
        assert release.wait(TIMEOUT)
        return real(self, fd, buffer, file_offset, **kwargs)

    path = tmp_path / "big.safetensors"
    old = {k: np.ones(1 << 18) for k in "abcd"}  # four arrays of 2 MiB
    arrayio.save(path, old)
    monkeypatch.setattr(posix, "pwrite", held)
    future = arrayio.save_async(path, {k: np.zeros(1 << 18) for k in "abcd"})
    assert started.wait(TIMEOUT)
    assert future.cancel()
    release.set()
    assert _async._scheduler.wait_idle(TIMEOUT)
    assert len(writes) <= 4  # no second pass over the batch
    back = arrayio.load(path)
    assert all(np.array_equal(back[k], old[k]) for k in old)
    assert all(not e.unavailable for e in arrayio.explain().explanations)
    assert _tmp_files(tmp_path) == []
