"""The learned table: statistics per arm, JSON persistence that never stops a program."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arrayio.dispatch.table import (
    EXPLOITING,
    EXPLORING,
    FORMAT,
    VERSION,
    WINDOW,
    ArmStats,
    ContextEntry,
    Table,
)

KEY = "read/host/2^20/vda/warm/x1"
WALL = 1_700_000_000.0


def wall_clock() -> float:
    return WALL


def sample_table() -> Table:
    table = Table(clock=wall_clock)
    with table.lock:
        entry = table.entry(KEY, {"direction": "read", "size_class": 20, "checksum": True})
        entry.phase = EXPLOITING
        entry.chosen = "posix(task_size=8388608,threads=16)"
        entry.reexplorations = 2
        fast = entry.arm("posix(task_size=8388608,threads=16)")
        for rate in (5e9, 6e9, 5.5e9):
            fast.add(rate, WALL)
        slow = entry.arm("direct(threads=4)")
        slow.failures = 1
        slow.unavailable = "OSError: [Errno 22] Invalid argument"
        slow.failed_at = WALL - 10
    return table


def warnings_from(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        record
        for record in caplog.records
        if record.name == "arrayio.dispatch" and record.levelno == logging.WARNING
    ]


def temp_files(directory: Path) -> list[Path]:
    return [path for path in directory.iterdir() if ".arrayio-tmp-" in path.name]


# -- statistics -------------------------------------------------------------------------------


def test_window_is_bounded_and_the_estimate_is_its_median():
    stats = ArmStats()
    rates = [float(rate) for rate in range(1, 21)]
    for rate in rates:
        stats.add(rate, WALL)
    assert stats.recent == rates[-WINDOW:]
    assert stats.estimate == (16 + 17) / 2
    assert (stats.count, stats.best, stats.last) == (20, 20.0, 20.0)
    assert stats.first_learned == stats.learned == WALL


def test_the_median_ignores_one_outlier():
    stats = ArmStats()
    for rate in (5.0, 5.0, 0.01):
        stats.add(rate, WALL)
    assert stats.estimate == 5.0


def test_note_counts_without_moving_the_estimate():
    stats = ArmStats()
    stats.add(4.0, WALL)
    stats.note(1.0, WALL + 1)
    assert (stats.estimate, stats.samples, stats.count, stats.last) == (4.0, 1, 2, 1.0)
    assert stats.learned == WALL + 1


def test_forget_recent_keeps_the_history():
    stats = ArmStats()
    stats.add(4.0, WALL)
    stats.pending_bytes = 10
    stats.forget_recent()
    assert (stats.estimate, stats.samples, stats.pending_bytes) == (None, 0, 0)
    assert (stats.count, stats.best, stats.last) == (1, 4.0, 4.0)


def test_entries_are_created_once_with_the_clock():
    table = Table(clock=wall_clock)
    with table.lock:
        entry = table.entry(KEY, {"load": 1})
        assert table.entry(KEY) is entry
        assert table.get("other") is None
    assert (entry.created, entry.updated, entry.phase) == (WALL, WALL, EXPLORING)
    assert KEY in table and len(table) == 1
    table.forget(KEY)
    assert len(table) == 0
    sample_table().forget()


# -- persistence ------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    table = sample_table()
    path = tmp_path / "dispatch.json"
    table.save(path)
    loaded = Table.load(path, clock=wall_clock)
    assert loaded.to_json() == table.to_json()
    assert loaded.clock is wall_clock
    with loaded.lock:
        stats = loaded.get(KEY).arms["posix(task_size=8388608,threads=16)"]
    assert stats.estimate == 5.5e9


def test_the_file_is_readable_json(tmp_path):
    path = tmp_path / "dispatch.json"
    sample_table().save(path)
    text = path.read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=1, sort_keys=True) + "\n"
    assert (data["format"], data["version"]) == (FORMAT, VERSION)
    arm = data["contexts"][KEY]["arms"]["direct(threads=4)"]
    assert arm["unavailable"] == "OSError: [Errno 22] Invalid argument"
    assert data["contexts"][KEY]["arms"]["posix(task_size=8388608,threads=16)"]["recent_bps"] == [
        5e9,
        6e9,
        5.5e9,
    ]


def test_save_creates_the_directory_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "cache" / "arrayio" / "dispatch.json"
    sample_table().save(path)
    assert Table.load(path).to_json() == sample_table().to_json()
    assert temp_files(path.parent) == []


def test_a_failed_save_leaves_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    Table().save(path)
    before = path.read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("arrayio.integrity._atomic.os.fsync", broken_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        sample_table().save(path)
    assert path.read_bytes() == before
    assert temp_files(tmp_path) == []


def test_a_table_that_cannot_be_serialized_does_not_touch_the_file(tmp_path):
    path = tmp_path / "dispatch.json"
    Table().save(path)
    before = path.read_bytes()
    table = sample_table()
    with table.lock:
        table.get(KEY).arm("x").best = math.nan
    with pytest.raises(ValueError):
        table.save(path)
    assert path.read_bytes() == before
    assert temp_files(tmp_path) == []


def test_a_missing_file_gives_an_empty_table_silently(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="arrayio.dispatch"):
        table = Table.load(tmp_path / "absent.json")
    assert len(table) == 0
    assert caplog.records == []


def _valid() -> dict:
    return sample_table().to_json()


def _with(change) -> bytes:
    data = _valid()
    change(data)
    return json.dumps(data).encode()


def _context(data: dict) -> dict:
    return data["contexts"][KEY]


def _arm(data: dict) -> dict:
    return _context(data)["arms"]["posix(task_size=8388608,threads=16)"]


DAMAGED = {
    "empty": b"",
    "truncated": json.dumps(_valid()).encode()[:-40],
    "not utf-8": b"\xff\xfe{}",
    "a list": b"[1, 2, 3]",
    "another format": json.dumps({"format": "something-else", "version": 1}).encode(),
    "no format": json.dumps({"contexts": {}}).encode(),
    "version as text": _with(lambda d: d.update(version="1")),
    "version zero": _with(lambda d: d.update(version=0)),
    "contexts not a dict": _with(lambda d: d.update(contexts=[])),
    "unknown phase": _with(lambda d: _context(d).update(phase="sleeping")),
    "arms not a dict": _with(lambda d: _context(d).update(arms=[1])),
    "attribute not a scalar": _with(lambda d: _context(d).update(attributes={"x": [1]})),
    "negative rate": _with(lambda d: _arm(d).update(best_bps=-1.0)),
    "rate as text": _with(lambda d: _arm(d).update(recent_bps=["fast"])),
    "count as bool": _with(lambda d: _arm(d).update(count=True)),
    "negative count": _with(lambda d: _arm(d).update(failures=-1)),
    "reason not text": _with(lambda d: _arm(d).update(unavailable=22)),
    "nan": json.dumps(_valid()).replace("5500000000.0", "NaN").encode(),
    "infinity": json.dumps(_valid()).replace("5500000000.0", "Infinity").encode(),
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("content", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_or_foreign_file_is_ignored_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / "dispatch.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="arrayio.dispatch"):
        table = Table.load(path)
    assert len(table) == 0
    [record] = warnings_from(caplog)
    assert str(path) in record.getMessage()
    assert "damaged or foreign" in record.getMessage()


def test_a_newer_version_is_ignored_with_a_warning(tmp_path, caplog):
    path = tmp_path / "dispatch.json"
    path.write_text(
        json.dumps(
            {"format": FORMAT, "version": VERSION + 1, "contexts": {"whatever": {"new": "layout"}}}
        )
    )
    with caplog.at_level(logging.WARNING, logger="arrayio.dispatch"):
        table = Table.load(path)
    assert len(table) == 0
    [record] = warnings_from(caplog)
    assert f"version {VERSION + 1}" in record.getMessage()
    assert "newer" in record.getMessage()


def test_an_unreadable_path_is_ignored_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="arrayio.dispatch"):
        table = Table.load(tmp_path)  # a directory
    assert len(table) == 0
    [record] = warnings_from(caplog)
    assert "cannot read" in record.getMessage()


def test_optional_fields_may_be_missing(tmp_path):
    path = tmp_path / "dispatch.json"
    path.write_text(
        json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "contexts": {
                    KEY: {"phase": "exploring", "arms": {"naive": {"recent_bps": [1.0, 3.0]}}}
                },
            }
        )
    )
    table = Table.load(path)
    with table.lock:
        entry = table.get(KEY)
        assert entry.chosen is None and entry.attributes == {}
        assert entry.arms["naive"].estimate == 2.0


def test_an_overlong_window_is_cut_on_load():
    data = _valid()
    _arm(data)["recent_bps"] = [float(i) for i in range(3 * WINDOW)]
    table = Table.from_json(data)
    with table.lock:
        stats = table.get(KEY).arms["posix(task_size=8388608,threads=16)"]
    assert len(stats.recent) == WINDOW


rates = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)
times = st.none() | st.floats(min_value=0, max_value=4e9)
counts = st.integers(min_value=0, max_value=10**9)
labels = st.text(min_size=1, max_size=30)
arm_stats = st.builds(
    ArmStats,
    recent=st.lists(rates, max_size=WINDOW),
    count=counts,
    best=rates,
    last=rates,
    failures=counts,
    unavailable=st.none() | st.text(max_size=40),
    failed_at=times,
    first_learned=times,
    learned=times,
)
entries = st.builds(
    ContextEntry,
    attributes=st.dictionaries(
        st.text(max_size=10),
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        max_size=6,
    ),
    phase=st.sampled_from([EXPLORING, EXPLOITING]),
    chosen=st.none() | labels,
    seed=st.none() | labels,
    drift=st.integers(0, 10),
    held=st.lists(rates, max_size=4),
    reexplorations=counts,
    created=st.floats(0, 4e9),
    updated=st.floats(0, 4e9),
    arms=st.dictionaries(labels, arm_stats, max_size=4),
)


@given(st.dictionaries(st.text(min_size=1, max_size=40), entries, max_size=4))
def test_any_table_round_trips_through_json(contexts):
    table = Table()
    table._entries.update(contexts)
    loaded = Table.from_json(json.loads(table.dumps()))
    assert loaded.to_json() == table.to_json()
    assert loaded.dumps() == table.dumps()


def test_save_is_safe_while_other_threads_learn(tmp_path):
    import threading

    table = sample_table()
    path = tmp_path / "dispatch.json"
    stop = threading.Event()

    def learn() -> None:
        i = 0
        while not stop.is_set():
            with table.lock:
                table.entry(f"key{i % 50}").arm("naive").add(float(i), WALL)
            i += 1

    worker = threading.Thread(target=learn)
    worker.start()
    try:
        for _ in range(20):
            table.save(path)
            assert len(Table.load(path)) >= 1
    finally:
        stop.set()
        worker.join()
    assert sorted(os.listdir(tmp_path)) == ["dispatch.json"]
