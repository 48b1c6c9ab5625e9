"""Python's cyclic collector is paused while a save or load creates its arrays, and only then."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import arrayio
from arrayio import config
from arrayio.runtime import _gcpause

MANY = 3000  # arrays: enough objects for a dozen young collections when nothing pauses


@pytest.fixture
def default_thresholds() -> Iterator[None]:
    """CPython's default thresholds, whatever the test run set, and the collector on."""
    before, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(700, 10, 10)
    gc.enable()
    yield
    gc.set_threshold(*before)
    (gc.enable if enabled else gc.disable)()


@pytest.fixture(scope="module")
def many_arrays(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("gc") / "many.safetensors")
    arrayio.save(path, {f"a{i}": np.full(4, i, dtype=np.int32) for i in range(MANY)})
    return path


def young_collections(fn) -> tuple[int, object]:
    """How many generation-0 collections ``fn()`` set off, and what it returned."""
    seen: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 0:
            seen.append(1)

    gc.collect()
    gc.callbacks.append(count)
    try:
        out = fn()
    finally:
        gc.callbacks.remove(count)
    return len(seen), out


@pytest.mark.parametrize("like", ["numpy", "torch", "jax"])
def test_a_load_of_many_arrays_sets_off_few_collections(default_thresholds, many_arrays, like):
    pytest.importorskip(like)
    with config.set(gc_pause=False):
        running, _ = young_collections(lambda: arrayio.load(many_arrays, like=like))
    paused, out = young_collections(lambda: arrayio.load(many_arrays, like=like))
    assert running >= 20, running  # the load creates that many objects...
    assert paused * 4 <= running, (paused, running)  # ...examined a few times, not every 700
    assert len(out) == MANY and int(np.asarray(out["a2999"])[0]) == 2999
    assert gc.isenabled()


def test_a_save_of_many_arrays_sets_off_few_collections(default_thresholds, tmp_path):
    tree = {f"a{i}": np.full(4, i, dtype=np.int32) for i in range(MANY)}
    with config.set(gc_pause=False):
        running, _ = young_collections(lambda: arrayio.save(tmp_path / "a.safetensors", tree))
    paused, _ = young_collections(lambda: arrayio.save(tmp_path / "b.safetensors", tree))
    assert running >= 20, running
    assert paused * 4 <= running, (paused, running)
    assert gc.isenabled()
    assert arrayio.load(tmp_path / "b.safetensors")["a7"][0] == 7


def test_the_collector_is_back_on_after_a_failed_load(default_thresholds, tmp_path):
    path = tmp_path / "damaged.safetensors"
    arrayio.save(path, {"x": np.arange(1000, dtype=np.int64)})
    with open(path, "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    with pytest.raises(arrayio.ChecksumError):
        arrayio.load(path)
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(default_thresholds, many_arrays):
    gc.disable()
    arrayio.load(many_arrays)
    assert not gc.isenabled()


def test_pauses_nest_and_threads_share_them(default_thresholds):
    with _gcpause.paused():
        with _gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()

    entered, first_left = threading.Barrier(2), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with _gcpause.paused():
            entered.wait()
        first_left.set()

    def second() -> None:
        with _gcpause.paused():
            entered.wait()
            first_left.wait()
            seen["after the first left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"after the first left": False}  # off until the last pause ends
    assert gc.isenabled()


def test_the_setting_turns_the_pause_off(default_thresholds, monkeypatch):
    with config.set(gc_pause=False), _gcpause.paused():
        assert gc.isenabled()
    monkeypatch.setenv("ARRAYIO_GC_PAUSE", "0")
    assert config._from_environment().gc_pause is False
    monkeypatch.setenv("ARRAYIO_GC_PAUSE", "1")
    assert config._from_environment().gc_pause is True


def _collector_state_in(monkeypatch, name: str) -> list[bool]:
    """Record whether the collector is on each time ``arrayio.dispatch._transfer.<name>`` runs."""
    from arrayio.dispatch import _transfer

    seen: list[bool] = []
    original = getattr(_transfer, name)

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(_transfer, name, recording)
    return seen


def test_a_synchronous_load_and_save_keep_it_paused_across_their_transfers(
    default_thresholds, monkeypatch, tmp_path
):
    reads = _collector_state_in(monkeypatch, "read_many")
    writes = _collector_state_in(monkeypatch, "write_many")
    tree = {f"a{i}": np.full(4, i, dtype=np.int32) for i in range(8)}
    arrayio.save(tmp_path / "a.safetensors", tree)
    out = arrayio.load(tmp_path / "a.safetensors")
    assert writes == [False] and reads == [False]
    assert gc.isenabled() and int(out["a7"][0]) == 7
    with config.set(gc_pause=False):
        arrayio.save(tmp_path / "b.safetensors", tree)
        arrayio.load(tmp_path / "b.safetensors")
    assert writes == [False, True] and reads == [False, True]


def test_asynchronous_calls_leave_it_running_across_their_transfers(
    default_thresholds, monkeypatch, tmp_path
):
    """The caller's program runs beside them: only their object-creating steps pause."""
    reads = _collector_state_in(monkeypatch, "read_many")
    writes = _collector_state_in(monkeypatch, "write_many")
    tree = {f"a{i}": np.full(4, i, dtype=np.int32) for i in range(MANY)}
    arrayio.save_async(tmp_path / "a.safetensors", tree).result(timeout=60)

    def load() -> object:
        return arrayio.load_async(tmp_path / "a.safetensors").result(timeout=60)

    with config.set(gc_pause=False):
        running, _ = young_collections(load)
    paused, out = young_collections(load)
    assert writes == [True] and reads == [True, True]
    assert paused * 4 <= running, (paused, running)  # allocating and finishing still paused
    assert int(out["a2999"][0]) == 2999
    assert gc.isenabled()


def test_the_background_mark_is_per_thread_and_restored(default_thresholds):
    with _gcpause.in_background():
        with _gcpause.paused(across_transfers=True):
            assert gc.isenabled()
        with _gcpause.paused():
            assert not gc.isenabled()
        seen: list[bool] = []

        def elsewhere() -> None:
            with _gcpause.paused(across_transfers=True):
                seen.append(gc.isenabled())

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        assert seen == [False]  # another thread is not in the background
    with _gcpause.paused(across_transfers=True):
        assert not gc.isenabled()
    assert gc.isenabled()
