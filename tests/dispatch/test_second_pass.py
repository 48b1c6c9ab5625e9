"""The second pass over what a cold read keeps in the page cache (arrayio.dispatch.second_pass).

It reads exactly the ranges it is given, in pieces, only while no transfer is under way,
never reads the disk, stops when told; and the dispatcher gives it every kept cold read,
and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import arrayio
from arrayio.dispatch import second_pass
from arrayio.dispatch.context import cache_state
from arrayio.dispatch.second_pass import MAX_WAITING, PIECE, SecondPass
from benchmarks import _pagecache as pagecache

MiB = 1 << 20

needs_nowait = pytest.mark.skipif(
    not hasattr(os, "RWF_NOWAIT") or not os.path.exists("/proc/self/fd"),
    reason="needs preadv's RWF_NOWAIT and /proc/self/fd",
)


def write_file(path: Path, nbytes: int) -> bytes:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


class Spy:
    """A piece reader that records what it reads (and reads it, from the page cache)."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, fd: int, buffer: memoryview, offset: int) -> int:
        with self.lock:
            self.pieces.append((offset, len(buffer)))
        return os.preadv(fd, [buffer], offset)


def waiting_pass(spy: Spy) -> tuple[SecondPass, threading.Event]:
    """A second pass whose transfers are under way until the event is cleared."""
    busy = threading.Event()
    busy.set()
    return SecondPass(busy=busy.is_set, read=spy), busy


@needs_nowait
def test_it_reads_exactly_the_ranges_given_in_pieces(tmp_path):
    path = tmp_path / "f.bin"
    write_file(path, 3 * PIECE + 5)
    spy = Spy()
    passes = SecondPass(busy=lambda: False, read=spy)
    fd = os.open(path, os.O_RDONLY)
    try:
        passes.after_cold_read(fd, [(PIECE + 5, 2 * PIECE), (0, 100), (7, 0)])
    finally:
        os.close(fd)  # the pass reads through a description of its own
    assert passes.wait(10)
    assert spy.pieces == [(0, 100), (PIECE + 5, PIECE), (2 * PIECE + 5, PIECE)]


@dataclasses.dataclass
class Held:
    """A 2 MiB file open, and a second pass over it that waits until ``busy`` is cleared."""

    path: Path
    fd: int
    spy: Spy
    passes: SecondPass
    busy: threading.Event


@pytest.fixture
def held(tmp_path):
    path = tmp_path / "f.bin"
    write_file(path, 2 * MiB)
    spy = Spy()
    passes, busy = waiting_pass(spy)
    fd = os.open(path, os.O_RDONLY)
    yield Held(path, fd, spy, passes, busy)
    busy.clear()
    with contextlib.suppress(OSError):  # a test may have closed it
        os.close(fd)


@needs_nowait
def test_it_waits_while_a_transfer_is_under_way(held):
    held.passes.after_cold_read(held.fd, [(0, 2 * MiB)])
    assert not held.passes.wait(0.2) and held.spy.pieces == []  # nothing read while busy
    held.busy.clear()
    assert held.passes.wait(10) and held.spy.pieces == [(0, 2 * MiB)]


@needs_nowait
def test_closing_stops_the_pass_under_way_and_drops_the_others(held):
    passes = held.passes
    passes.after_cold_read(held.fd, [(0, MiB)])
    passes.after_cold_read(held.fd, [(0, MiB)])
    passes.close()
    assert passes.wait(10)
    held.busy.clear()
    passes.after_cold_read(held.fd, [(0, MiB)])  # closed: nothing more is taken
    assert passes.wait(1)
    os.close(held.fd)
    assert held.spy.pieces == []
    # Every description the passes opened was closed.
    assert not any(
        os.path.realpath(f"/proc/self/fd/{name}") == str(held.path)
        for name in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{name}")
    )


@needs_nowait
def test_passes_waiting_are_bounded_and_hold_no_descriptor_beyond(held):
    # A program reading many files cold in a row: passes beyond the bound are not taken, so
    # their descriptions are never opened.
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(MAX_WAITING + 10):
        held.passes.after_cold_read(held.fd, [(0, MiB)])
    # one may be under way (taken off the queue), the rest wait
    assert len(os.listdir("/proc/self/fd")) - before <= MAX_WAITING + 1
    held.busy.clear()
    assert held.passes.wait(10)
    assert MAX_WAITING <= len(held.spy.pieces) <= MAX_WAITING + 1
    assert len(os.listdir("/proc/self/fd")) == before


@needs_nowait
def test_it_never_reads_the_disk(tmp_path):
    # An evicted file stays evicted: the pass reads only what the page cache holds.
    path = tmp_path / "f.bin"
    write_file(path, 8 * MiB)
    pagecache.evict(os.fspath(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        if cache_state(fd, 0, 8 * MiB) != "cold":
            pytest.skip("the kernel cannot evict or tell what is cached here")
        passes = SecondPass(busy=lambda: False)
        passes.after_cold_read(fd, [(0, 8 * MiB)])
        assert passes.wait(10)
        assert cache_state(fd, 0, 8 * MiB) == "cold"
    finally:
        os.close(fd)


def activations_of_a_read(path: Path) -> int:
    before = pagecache.page_activations()
    assert before is not None
    with open(path, "rb", buffering=0) as f:
        while f.read(4 * MiB):
            pass
    after = pagecache.page_activations()
    assert after is not None
    return after - before


@needs_nowait
def test_a_kept_cold_load_leaves_its_pages_active_for_the_next(tmp_path, fresh):
    """The reload after a cold load pays no page moves: the pass paid them. (Where the
    kernel does not show them, the test calibrates first and skips.)"""
    nbytes = 32 * MiB
    pages = nbytes // os.sysconf("SC_PAGE_SIZE")
    probe = tmp_path / "probe.bin"
    write_file(probe, nbytes)
    pagecache.evict(os.fspath(probe))
    if pagecache.page_activations() is None:
        pytest.skip("no pgactivate in /proc/vmstat")
    activations_of_a_read(probe)  # cold: pages come in inactive
    if activations_of_a_read(probe) < pages // 2:  # their second read moves them
        pytest.skip("this kernel does not move pages at their second read")
    tree = {"w": np.arange(nbytes // 4, dtype=np.float32)}
    path = tmp_path / "kept.safetensors"
    arrayio.save(path, tree)

    def reload_moves(second: bool) -> int:
        pagecache.evict(os.fspath(path))
        with arrayio.config.set(second_pass=second):
            loaded = arrayio.load(path)
        assert fresh.last[0].cache == "cold" and fresh.last[0].keep
        for passes in list(second_pass._passes):  # no pass of any dispatcher still moving
            assert passes.wait(30)  # pages (the count is the whole machine's)
        np.testing.assert_array_equal(loaded["w"], tree["w"])
        return activations_of_a_read(path)

    assert reload_moves(second=False) >= pages // 2  # without it, the reload moves them
    assert reload_moves(second=True) < pages // 10


def test_the_dispatcher_passes_only_over_kept_cold_reads(tmp_path, fresh, monkeypatch):
    given: list[tuple[int, list[tuple[int, int]]]] = []
    monkeypatch.setattr(
        fresh.second_pass, "after_cold_read", lambda fd, ranges: given.append((fd, list(ranges)))
    )
    tree = {"w": np.arange(4 * MiB, dtype=np.float32)}
    path = tmp_path / "t.safetensors"
    arrayio.save(path, tree)
    pagecache.evict(os.fspath(path))
    arrayio.load(path)
    if not (fresh.last[0].cache == "cold" and fresh.last[0].keep):
        pytest.skip("the kernel cannot evict or tell what is cached here")
    assert len(given) == 1 and sum(n for _, n in given[0][1]) == tree["w"].nbytes
    arrayio.load(path)  # warm now: nothing to pass over
    assert fresh.last[0].cache == "warm" and len(given) == 1
    pagecache.evict(os.fspath(path))
    with arrayio.config.set(second_pass=False):  # turned off
        arrayio.load(path)
    assert fresh.last[0].keep and len(given) == 1


@needs_nowait
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_passes_of_its_own(tmp_path):
    # A child forked while the parent's pass waits inherits no thread: it must not leave the
    # parent's passes (and their descriptions) queued forever, and must run its own.
    path = tmp_path / "f.bin"
    write_file(path, MiB)
    busy = threading.Event()
    busy.set()
    spy = Spy()
    passes = SecondPass(busy=busy.is_set, read=spy)
    fd = os.open(path, os.O_RDONLY)
    try:
        passes.after_cold_read(fd, [(0, MiB)])  # waits in the parent's thread
        with warnings.catch_warnings():  # JAX, if another test imported it, warns of forks:
            warnings.simplefilter("ignore", RuntimeWarning)  # the child runs no JAX
            pid = os.fork()
        if pid == 0:  # the child: its own pass runs (the parent's busy flag is still set)
            code = 1
            try:
                child = SecondPass(busy=lambda: False, read=spy)
                passes._busy = lambda: False
                passes.after_cold_read(fd, [(0, MiB)])
                child.after_cold_read(fd, [(0, MiB)])
                code = 0 if passes.wait(10) and child.wait(10) and len(spy.pieces) == 2 else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        busy.clear()
        assert passes.wait(10) and spy.pieces == [(0, MiB)]  # the parent's own, once
    finally:
        os.close(fd)


@needs_nowait
def test_an_eviction_waits_for_the_passes_under_way(tmp_path):
    # A page a pass is reading cannot be evicted: tune(), the sweep and the benchmarks evict
    # through second_pass.evict, which lets the passes end first.
    path = tmp_path / "f.bin"
    write_file(path, MiB)
    started = threading.Event()

    def slow_read(fd: int, buffer: memoryview, offset: int) -> int:
        started.set()
        time.sleep(0.3)
        return os.preadv(fd, [buffer], offset)

    passes = SecondPass(busy=lambda: False, read=slow_read)
    fd = os.open(path, os.O_RDONLY)
    try:
        passes.after_cold_read(fd, [(0, MiB)])
        assert started.wait(10)
        second_pass.evict(fd)
        assert passes.wait(0)  # it had ended before the eviction
    finally:
        os.close(fd)
