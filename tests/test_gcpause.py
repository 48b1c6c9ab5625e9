"""Python's cyclic collector is paused while a save or load creates its arrays, and only then."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import arrayio
from arrayio import _gcpause, config

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
