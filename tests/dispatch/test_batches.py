"""Batches of transfers (``Dispatcher.read_many``/``write_many``), what loads and saves of
several arrays use: every request's bytes and checksum exactly as alone, one context for
the batch, a bounded number in flight, every started transfer waited for before an error
leaves, and ``done`` once per request even when a failing tool's batch is redone.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayio
from arrayio import tools
from arrayio.dispatch import Arm, batches, dispatcher
from arrayio.dispatch.context import piece_class, size_class
from arrayio.dispatch.dispatcher import SMALL_TRANSFER, Dispatcher
from arrayio.errors import ToolUnavailableError, TruncatedFileError
from arrayio.tools import Capabilities, IOFuture, Tool
from arrayio.tools._io import pread_full, pwrite_full
from arrayio.tools.naive import NaiveTool
from arrayio.tools.posix import PosixTool

MiB = 1 << 20


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "_REGISTRY", dict(tools._REGISTRY))


class Slow(Tool):
    """pread/pwrite on a thread pool, each taking a moment; counts how many run at once."""

    name = "slow"
    capabilities = Capabilities(frozenset({"host"}), checksums=False)
    lock = threading.Lock()
    running = 0
    most = 0
    finished: list[int] = []
    fail_at: int | None = None  # the file offset whose transfer raises

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.pool = ThreadPoolExecutor(8)

    def _run(self, move, fd, buffer, file_offset):
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        try:
            time.sleep(0.02)
            if file_offset == cls.fail_at:
                raise ToolUnavailableError("slow: injected failure")
            return move(fd, buffer, file_offset)
        finally:
            with cls.lock:
                cls.running -= 1
                cls.finished.append(file_offset)

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        return IOFuture(self.pool.submit(self._run, pread_full, fd, buffer, file_offset))

    def pwrite(self, fd, buffer, file_offset, *, checksum=None):
        return IOFuture(self.pool.submit(self._run, pwrite_full, fd, buffer, file_offset))

    def close(self) -> None:
        self.pool.shutdown()


@pytest.fixture
def slow(registry, monkeypatch):
    monkeypatch.setattr(Slow, "running", 0)
    monkeypatch.setattr(Slow, "most", 0)
    monkeypatch.setattr(Slow, "finished", [])
    monkeypatch.setattr(Slow, "fail_at", None)
    tools.register("slow", Slow, clobber=True)
    return Slow


def layout(sizes: list[int], gaps: list[int]) -> list[tuple[int, int]]:
    """(offset, size) of each request, one after another with the given gaps."""
    ranges, offset = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        offset += gap
        ranges.append((offset, size))
        offset += size
    return ranges


@given(
    sizes=st.lists(
        st.sampled_from([0, 1, 4095, 4096, 70_000, MiB, MiB + 13, 3 * MiB - 7]),
        min_size=1,
        max_size=7,
    ),
    data=st.data(),
    tool=st.sampled_from(
        [None, "posix(threads=3,task_size=65536)", "direct(threads=2,task_size=1048576)", "naive"]
    ),
)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_batches_move_every_request_exactly_with_its_checksum(tmp_path, fresh, sizes, data, tool):
    gaps = data.draw(
        st.lists(st.sampled_from([0, 1, 512, 4096]), min_size=len(sizes), max_size=len(sizes))
    )
    ranges = layout(sizes, gaps)
    end = max(offset + size for offset, size in ranges)
    content = np.random.default_rng(len(sizes)).integers(0, 256, end, dtype=np.uint8)
    path = tmp_path / "batch.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        sources = [content[offset : offset + size].copy() for offset, size in ranges]
        done: list[int] = []
        crcs = fresh.write_many(
            fd,
            [(offset, src) for (offset, _), src in zip(ranges, sources, strict=True)],
            with_checksum=True,
            tool=tool,
            done=done.append,
        )
        assert sorted(done) == list(range(len(ranges)))
        expected = [crc32c.crc32c(src.tobytes()) for src in sources]
        assert crcs == expected
        on_disk = np.fromfile(path, dtype=np.uint8)
        for (offset, size), src in zip(ranges, sources, strict=True):
            assert on_disk[offset : offset + size].tobytes() == src.tobytes()

        dests = [np.full(size, 0xA5, np.uint8) for _, size in ranges]
        done.clear()
        crcs = fresh.read_many(
            fd,
            [(offset, dest) for (offset, _), dest in zip(ranges, dests, strict=True)],
            with_checksum=True,
            tool=tool,
            done=done.append,
        )
        assert sorted(done) == list(range(len(ranges)))
        assert crcs == expected
        for dest, src in zip(dests, sources, strict=True):
            assert dest.tobytes() == src.tobytes()
        # Without checksums: none reported.
        assert fresh.read_many(fd, [(ranges[0][0], dests[0])], tool=tool) == [None]
    finally:
        os.close(fd)


def test_a_batch_is_learned_by_its_total_size_and_its_typical_piece(tmp_path, fresh):
    path = tmp_path / "b.bin"
    path.write_bytes(os.urandom(6 * MiB))
    dests = [np.empty(2 * MiB, np.uint8) for _ in range(3)]
    fd = os.open(path, os.O_RDONLY)
    try:
        fresh.read_many(fd, [(i * 2 * MiB, dest) for i, dest in enumerate(dests)])
        context, _ = fresh.last
        assert context.size_class == 23  # 6 MiB rounds up to 2^23
        assert context.pieces == 21  # of 2 MiB pieces
        assert context.key().endswith("/of2^21")
        assert context.key() != fresh.context("read", fd, 0, 6 * MiB, "host", False).key()
        # A batch that is mostly one piece is learned as one transfer of its size.
        one = fresh.batch_context("read", fd, [(0, 5 * MiB), (5 * MiB, MiB)], "host", False)
        assert one.pieces == 0
        assert one.key() == fresh.context("read", fd, 0, 6 * MiB, "host", False).key()
        # Small requests go one by one through the naive tool, outside the batch.
        small = [np.empty(1000, np.uint8) for _ in range(3)]
        fresh.read_many(fd, [(i * 1000, s) for i, s in enumerate(small)])
        assert fresh.last == (None, Arm("naive"))
        assert b"".join(s.tobytes() for s in small) == path.read_bytes()[:3000]
    finally:
        os.close(fd)


def test_a_batch_keeps_a_bounded_number_in_flight(tmp_path, fresh, slow, monkeypatch):
    monkeypatch.setattr(batches, "BATCH_WINDOW", 3)
    count = 12
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(count * MiB))
    dests = [np.empty(MiB, np.uint8) for _ in range(count)]
    fd = os.open(path, os.O_RDONLY)
    try:
        fresh.read_many(fd, [(i * MiB, d) for i, d in enumerate(dests)], tool="slow")
    finally:
        os.close(fd)
    assert 2 <= slow.most <= 3  # in flight together, never more than the window
    assert b"".join(d.tobytes() for d in dests) == path.read_bytes()


def test_a_failure_waits_for_every_started_transfer_before_falling_back(
    tmp_path, fresh, slow, monkeypatch
):
    # The failing tool's other transfers may still be writing into the buffers: the
    # fallback must not start before they have all stopped, or they would overwrite it.
    count = 10
    path = tmp_path / "f.bin"
    content = os.urandom(count * MiB)
    path.write_bytes(content)
    monkeypatch.setattr(
        dispatcher, "candidate_arms", lambda context: [Arm("slow"), Arm.of("posix", threads=2)]
    )
    slow.fail_at = 2 * MiB
    dests = [np.empty(MiB, np.uint8) for _ in range(count)]
    done: list[int] = []
    started_fallback: list[int] = []
    real_posix = tools.tool_class("posix").pread

    def posix_pread(self, *args, **kwargs):
        started_fallback.append(len(slow.finished))
        return real_posix(self, *args, **kwargs)

    monkeypatch.setattr(tools.tool_class("posix"), "pread", posix_pread)
    fd = os.open(path, os.O_RDONLY)
    try:
        fresh.read_many(fd, [(i * MiB, d) for i, d in enumerate(dests)], done=done.append)
    finally:
        os.close(fd)
    assert b"".join(d.tobytes() for d in dests) == content
    started = len(slow.finished)
    assert started >= 3 and min(started_fallback) == started  # all done before the fallback
    assert sorted(done) == list(range(count))  # once each, despite the redo
    [context] = [e for e in arrayio.explain().explanations]
    assert "slow" in context.unavailable


def test_a_short_file_in_a_batch_is_a_data_error(tmp_path, fresh):
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(5 * MiB))
    dests = [np.empty(2 * MiB, np.uint8) for _ in range(3)]  # the last runs 1 MiB past the end
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TruncatedFileError, match="1048576 bytes short"):
            fresh.read_many(fd, [(i * 2 * MiB, d) for i, d in enumerate(dests)], path="short")
    finally:
        os.close(fd)
    assert all(not e.unavailable for e in arrayio.explain().explanations)  # no tool blamed


def test_an_error_from_done_stops_the_batch_after_its_transfers(tmp_path, fresh, slow, monkeypatch):
    # How a cancelled save_async stops: the callback raises; what started finishes first.
    monkeypatch.setattr(batches, "BATCH_WINDOW", 2)
    path = tmp_path / "c.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    sources = [np.full(MiB, i, np.uint8) for i in range(8)]

    def done(i: int) -> None:
        if i == 1:
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            fresh.write_many(
                fd, [(i * MiB, s) for i, s in enumerate(sources)], tool="slow", done=done
            )
        assert slow.running == 0
        assert len(slow.finished) < len(sources)  # it stopped starting new ones
    finally:
        os.close(fd)


def test_loads_and_saves_of_many_arrays_use_one_batch(tmp_path, fresh, monkeypatch):
    batches: list[int] = []
    for name in ("read_many", "write_many"):
        real = getattr(Dispatcher, name)

        def spy(self, fd, requests, *args, real=real, **kwargs):
            batches.append(len(requests))
            return real(self, fd, requests, *args, **kwargs)

        monkeypatch.setattr(Dispatcher, name, spy)
    rng = np.random.default_rng(0)
    tree = {
        "a": rng.standard_normal(MiB),
        "b": {"c": rng.integers(0, 9, 3 * MiB, np.uint8), "d": np.arange(10)},
        "e": [1, None],
    }
    path = tmp_path / "t.safetensors"
    arrayio.save(path, tree)
    back = arrayio.load(path)
    assert batches == [3, 3]  # every array of the save, then of the load
    assert back["b"]["c"].tobytes() == tree["b"]["c"].tobytes()
    assert back["a"].tobytes() == tree["a"].tobytes() and back["e"] == [1, None]
    assert SMALL_TRANSFER <= tree["a"].nbytes


def _record_calls(monkeypatch, method: str, owner: type = Dispatcher) -> list[tuple[int, int]]:
    """Record (file offset, bytes) of every ``owner.<method>`` call from now on."""
    calls: list[tuple[int, int]] = []
    real = getattr(owner, method)

    def spy(self, fd, buffer, file_offset, **kwargs):
        calls.append((file_offset, buffer.nbytes))
        return real(self, fd, buffer, file_offset, **kwargs)

    monkeypatch.setattr(owner, method, spy)
    return calls


def _read_into(
    fresh, path, ranges: list[tuple[int, int]], buffers: list | None = None, **kwargs
) -> tuple[list, list[int | None]]:
    """Read every ``(offset, size)`` range of the file as one ``read_many``, into
    ``buffers`` (by default new host buffers): the buffers and what it returned."""
    if buffers is None:
        buffers = [np.empty(n, np.uint8) for _, n in ranges]
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = fresh.read_many(
            fd, [(o, b) for (o, _), b in zip(ranges, buffers, strict=True)], **kwargs
        )
    finally:
        os.close(fd)
    return buffers, crcs


def test_small_neighbours_are_read_with_one_read(tmp_path, fresh, monkeypatch):
    content = os.urandom(3 * MiB)
    path = tmp_path / "s.bin"
    path.write_bytes(content)
    # Neighbours (gaps of 0 and 100 bytes), one far away, one overlapping the first.
    ranges = [(0, 4096), (4096, 8192), (12388, 50_000), (2 * MiB, 4096), (100, 300)]
    reads: list[tuple[int, int]] = []  # the system calls: (file offset, bytes asked)
    real_preadv = os.preadv

    def preadv(fd, buffers, offset, *flags):
        reads.append((offset, sum(memoryview(b).nbytes for b in buffers)))
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    dests, crcs = _read_into(fresh, path, ranges, with_checksum=True)
    # The overlapping request starts a run of its own in file order, which its neighbours
    # after it join (one read straight into their buffers, the gap between two of them into
    # scratch); the first stays alone.
    assert sorted(reads) == [(0, 4096), (100, 62288), (2 * MiB, 4096)]
    for (offset, size), dest, crc in zip(ranges, dests, crcs, strict=True):
        assert dest.tobytes() == content[offset : offset + size]
        assert crc == crc32c.crc32c(content[offset : offset + size])


def test_a_short_file_under_small_neighbours_names_the_short_array(tmp_path, fresh):
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(10_000))
    dests = [np.empty(4096, np.uint8) for _ in range(3)]  # the last ends 2288 bytes past EOF
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TruncatedFileError, match="file ends at byte 10000, 2288 bytes"):
            fresh.read_many(fd, [(i * 4096, d) for i, d in enumerate(dests)], path="short")
    finally:
        os.close(fd)


def test_small_writes_that_touch_are_written_with_one_write(tmp_path, fresh, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(b"\xee" * (3 * MiB))
    # Three that touch, then one 1 byte further on (the byte between must survive), and one
    # far away.
    ranges = [(0, 4096), (4096, 10_000), (14_096, 300), (14_397, 5000), (2 * MiB, 4096)]
    sources = [
        np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
        for i, (_, n) in enumerate(ranges)
    ]
    writes = _record_calls(monkeypatch, "write")
    fd = os.open(path, os.O_RDWR)
    try:
        crcs = fresh.write_many(
            fd, [(o, s) for (o, _), s in zip(ranges, sources, strict=True)], with_checksum=True
        )
    finally:
        os.close(fd)
    assert sorted(writes) == [(0, 14_396), (14_397, 5000), (2 * MiB, 4096)]
    content = path.read_bytes()
    for (offset, size), src, crc in zip(ranges, sources, crcs, strict=True):
        assert content[offset : offset + size] == src.tobytes()
        assert crc == crc32c.crc32c(src.tobytes())
    assert content[14_396] == 0xEE and content[-1] == 0xEE


def test_an_exception_from_done_is_no_tool_failure(tmp_path, fresh, monkeypatch):
    # A cancelled save_async raises from its progress callback, inside the batch: that must
    # not mark the tool unavailable, nor have another tool write the whole batch again.
    monkeypatch.setattr(
        dispatcher, "candidate_arms", lambda context: [Arm.of("posix", threads=2), Arm("naive")]
    )
    calls: list[int] = []
    posix = tools.tool_class("posix")
    real = posix.pwrite

    def counting(self, fd, buffer, file_offset, **kwargs):
        calls.append(file_offset)
        return real(self, fd, buffer, file_offset, **kwargs)

    monkeypatch.setattr(posix, "pwrite", counting)

    class Cancelled(Exception):
        pass

    def done(i: int) -> None:
        if i == 0:
            raise Cancelled

    sources = [np.full(MiB, i, np.uint8) for i in range(4)]
    fd = os.open(tmp_path / "c.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(Cancelled):
            fresh.write_many(fd, [(i * MiB, s) for i, s in enumerate(sources)], done=done)
    finally:
        os.close(fd)
    assert sorted(calls) == [i * MiB for i in range(4)]  # once each: no second tool
    assert all(not e.unavailable for e in arrayio.explain().explanations)


def test_requests_of_one_task_run_on_the_tools_threads_within_a_batch(tmp_path, fresh, monkeypatch):
    from arrayio.tools import posix as posix_module

    threads: set[str] = set()
    real = posix_module.pread_full

    def recording(fd, view, offset):
        threads.add(threading.current_thread().name)
        time.sleep(0.001)
        return real(fd, view, offset)

    monkeypatch.setattr(posix_module, "pread_full", recording)
    path = tmp_path / "t.bin"
    path.write_bytes(os.urandom(16 * MiB))
    dests = [np.empty(MiB, np.uint8) for _ in range(16)]  # each one task of posix(4x4 MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        fresh.read_many(
            fd,
            [(i * MiB, d) for i, d in enumerate(dests)],
            tool="posix(threads=4,task_size=4194304)",
        )
        assert threading.current_thread().name not in threads  # all on the pool
        assert len(threads) >= 2
        threads.clear()
        fresh.read(fd, dests[0], 0, tool="posix(threads=4,task_size=4194304)")
        assert threads == {threading.current_thread().name}  # alone: in the caller
    finally:
        os.close(fd)
    assert b"".join(d.tobytes() for d in dests) == path.read_bytes()


class RecordingChecksums(batches._device_checksum.DeviceChecksums):
    """A stand-in for the GPU's DeviceChecksums: CRCs on the host, every call recorded."""

    made: list[RecordingChecksums] = []
    on_launch = None  # called with the index of each launch

    def __init__(self, buffers, segment=None, *, own_stream=False) -> None:
        self.buffers = list(buffers)
        self.own_stream = own_stream  # safe only for buffers whose writes are complete
        self.events: list[object] = []
        RecordingChecksums.made.append(self)

    def launch(self, index: int) -> None:
        self.events.append(("launch", index))
        if RecordingChecksums.on_launch is not None:
            RecordingChecksums.on_launch(index)

    def results(self) -> list[int]:
        self.events.append("results")
        return [crc32c.crc32c(buffer.tobytes()) for buffer in self.buffers]

    def abandon(self) -> None:
        self.events.append("abandon")


class Gated(Tool):
    """pread on threads; the read at ``last`` waits until the first checksum is launched
    (or 10 s) and records whether it was."""

    name = "gated"
    capabilities = Capabilities(frozenset({"host"}), checksums=False)
    last = -1
    gate = threading.Event()
    gate_was_open: list[bool] = []

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.pool = ThreadPoolExecutor(4)

    def _read(self, fd, buffer, file_offset):
        if file_offset == type(self).last:
            type(self).gate_was_open.append(type(self).gate.wait(10))
        return pread_full(fd, buffer, file_offset)

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        return IOFuture(self.pool.submit(self._read, fd, buffer, file_offset))

    def pwrite(self, fd, buffer, file_offset, *, checksum=None):
        return IOFuture(self.pool.submit(pwrite_full, fd, buffer, file_offset))

    def close(self) -> None:
        self.pool.shutdown()


@pytest.fixture
def gpu_checksums(registry, monkeypatch):
    """Batches that checksum every buffer 'on the GPU', through RecordingChecksums."""
    monkeypatch.setattr(batches, "checksum_on_gpu", lambda buffer, tool, from_disk=False: True)
    monkeypatch.setattr(batches, "synchronize_device", lambda buffer: None)
    monkeypatch.setattr(batches._device_checksum, "DeviceChecksums", RecordingChecksums)
    monkeypatch.setattr(RecordingChecksums, "made", [])
    monkeypatch.setattr(RecordingChecksums, "on_launch", None)
    monkeypatch.setattr(Gated, "gate", threading.Event())
    monkeypatch.setattr(Gated, "gate_was_open", [])
    tools.register("gated", Gated, clobber=True)
    return RecordingChecksums


def test_a_read_batch_checksums_each_array_on_the_gpu_as_it_lands(tmp_path, gpu_checksums):
    # The first array's kernel must start while the last array is still being read: the
    # last read waits for that launch (it would time out if checksums ran after the batch).
    count = 6
    path = tmp_path / "g.bin"
    content = os.urandom(count * MiB)
    path.write_bytes(content)
    Gated.last = (count - 1) * MiB
    gpu_checksums.on_launch = lambda index: Gated.gate.set()
    dests = [np.empty(MiB, np.uint8) for _ in range(count)]
    reported: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = batches.read_batch(
            Gated(), fd, [(i * MiB, d) for i, d in enumerate(dests)], "g", True, reported.append
        )
    finally:
        os.close(fd)
    assert Gated.gate_was_open == [True]
    [sums] = gpu_checksums.made
    assert sums.own_stream  # each array is complete when its tool's future is done
    launches = [event for event in sums.events if event != "results"]
    assert launches == [("launch", k) for k in range(count)] and sums.events[-1] == "results"
    assert reported == list(range(count))
    assert crcs == [crc32c.crc32c(content[i * MiB : (i + 1) * MiB]) for i in range(count)]


def test_a_failed_read_batch_waits_for_its_launched_checksums(tmp_path, gpu_checksums):
    # The fallback tool refills the buffers: no kernel of the failed batch may still read them.
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(3 * MiB))
    dests = [np.empty(2 * MiB, np.uint8) for _ in range(2)]  # the second ends past the file
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TruncatedFileError):
            batches.read_batch(
                Gated(), fd, [(0, dests[0]), (2 * MiB, dests[1])], "short", True, lambda index: None
            )
    finally:
        os.close(fd)
    [sums] = gpu_checksums.made
    assert sums.events == [("launch", 0), ("launch", 1), "abandon"]


def test_a_write_batch_checksums_on_the_gpu_while_it_writes(tmp_path, gpu_checksums):
    path = tmp_path / "w.bin"
    sources = [np.full(MiB, i, np.uint8) for i in range(3)]
    written: list[int] = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        crcs = batches.write_batch(
            Gated(), fd, [(i * MiB, s) for i, s in enumerate(sources)], True, written.append
        )
    finally:
        os.close(fd)
    [sums] = gpu_checksums.made
    assert sums.events == [("launch", 0), ("launch", 1), ("launch", 2), "results"]
    assert written == [0, 1, 2]
    assert crcs == [crc32c.crc32c(s.tobytes()) for s in sources]
    assert path.read_bytes() == b"".join(s.tobytes() for s in sources)


class Gathering(Tool):
    """Host memory, with ``pwritev`` (buffers back to back as one range), as the staged tool
    has for device memory; records each call's (file offset, buffer sizes)."""

    name = "gathering"
    capabilities = Capabilities(frozenset({"host"}), checksums=True)
    calls: list[tuple[str, int, list[int]]] = []

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.pool = ThreadPoolExecutor(3)

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        def read() -> int:
            got = pread_full(fd, buffer, file_offset)
            if checksum is not None:
                checksum.add_data(0, buffer[:got])
            return got

        return IOFuture(self.pool.submit(read))

    def pwrite(self, fd, buffer, file_offset, *, checksum=None):
        type(self).calls.append(("pwrite", file_offset, [buffer.nbytes]))
        if checksum is not None:
            checksum.add_data(0, buffer)
        return IOFuture(self.pool.submit(pwrite_full, fd, buffer, file_offset))

    def pwritev(self, fd, buffers, file_offset, *, checksums=None):
        type(self).calls.append(("pwritev", file_offset, [b.nbytes for b in buffers]))
        for buffer, part in zip(buffers, checksums or [None] * len(buffers), strict=True):
            if part is not None:
                part.add_data(0, buffer)
        joined = np.concatenate([b.reshape(-1) for b in buffers])
        return IOFuture(self.pool.submit(pwrite_full, fd, joined, file_offset))

    def preadv(self, fd, requests, *, checksums=None):
        """The range from the first request to the end of the last, read at once (as the
        staged tool's chunks are), each request's bytes copied out of it."""
        type(self).calls.append(("preadv", requests[0][0], [b.nbytes for _, b in requests]))
        first = requests[0][0]
        span = np.empty(requests[-1][0] + requests[-1][1].nbytes - first, np.uint8)

        def read() -> int:
            got = pread_full(fd, span, first)
            for (offset, buffer), part in zip(requests, checksums, strict=True):
                have = max(0, min(buffer.nbytes, got - (offset - first)))
                buffer[:have] = span[offset - first : offset - first + have]
                if part is not None:
                    part.add_data(0, buffer[:have])
            return got

        return IOFuture(self.pool.submit(read))

    def close(self) -> None:
        self.pool.shutdown()


@given(
    sizes=st.lists(
        st.sampled_from([1, 4095, 4096, MiB, MiB + 13, 2 * MiB]), min_size=1, max_size=8
    ),
    gaps=st.lists(st.sampled_from([0, 0, 0, 1, 4096]), min_size=8, max_size=8),
    shuffle=st.randoms(use_true_random=False),
)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_write_batch_gathers_neighbours_into_one_range_each(
    tmp_path, monkeypatch, sizes, gaps, shuffle
):
    monkeypatch.setattr(batches, "GATHER_BYTES", 3 * MiB)
    monkeypatch.setattr(Gathering, "calls", [])
    ranges = layout(sizes, gaps[: len(sizes)])
    rng = np.random.default_rng(len(sizes))
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _, size in ranges]
    batch = [(offset, source) for (offset, _), source in zip(ranges, sources, strict=True)]
    shuffle.shuffle(batch)  # the batch's order is not the file's
    reported: list[int] = []
    path = tmp_path / "g.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    tool = Gathering()
    try:
        crcs = batches.write_batch(tool, fd, batch, True, reported.append)
    finally:
        os.close(fd)
        tool.close()
    assert sorted(reported) == list(range(len(batch)))  # each request once
    assert crcs == [crc32c.crc32c(source.tobytes()) for _, source in batch]
    content = path.read_bytes()
    for offset, source in batch:
        assert content[offset : offset + source.nbytes] == source.tobytes()
    if len(batch) < 2:
        assert [kind for kind, _, _ in Gathering.calls] == ["pwrite"]
        return
    # One call per run of neighbours, in file order, each at most 3 MiB unless one array is
    # larger, together covering every request once.
    assert {kind for kind, _, _ in Gathering.calls} == {"pwritev"}
    expected = batches.runs(batch, range(len(batch)), 0, 3 * MiB)
    assert sorted((offset, sizes) for _, offset, sizes in Gathering.calls) == sorted(
        (batch[run[0]][0], [batch[i][1].nbytes for i in run]) for run in expected
    )
    for run in expected:
        # neighbours: each ends where the next starts
        assert all(
            batch[a][0] + batch[a][1].nbytes == batch[b][0]
            for a, b in zip(run, run[1:], strict=False)
        )
        assert len(run) == 1 or sum(batch[i][1].nbytes for i in run) <= 3 * MiB


@given(
    sizes=st.lists(
        st.sampled_from([1, 4095, 4096, MiB, MiB + 13, 2 * MiB]), min_size=1, max_size=8
    ),
    gaps=st.lists(st.sampled_from([0, 0, 1, 4096, 70_000]), min_size=8, max_size=8),
    short=st.sampled_from([0, 0, 1, 5000]),
    shuffle=st.randoms(use_true_random=False),
)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_read_batch_scatters_neighbours_from_one_range_each(
    tmp_path, monkeypatch, sizes, gaps, short, shuffle
):
    # Neighbours (at most RUN_GAP apart, up to SCATTER_BYTES a run) are read as one range;
    # each request gets its own bytes and CRC; a file that ends inside the last request is
    # a data error, as with one read per request.
    monkeypatch.setattr(batches, "SCATTER_BYTES", 3 * MiB)
    monkeypatch.setattr(Gathering, "calls", [])
    ranges = layout(sizes, gaps[: len(sizes)])
    end = max(offset + size for offset, size in ranges)
    content = np.random.default_rng(len(sizes)).integers(0, 256, end, dtype=np.uint8)
    path = tmp_path / "s.bin"
    path.write_bytes(content[: end - min(short, sizes[-1])].tobytes())
    batch = [(offset, np.zeros(size, np.uint8)) for offset, size in ranges]
    shuffle.shuffle(batch)
    reported: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    tool = Gathering()
    try:
        if short:
            with pytest.raises(TruncatedFileError):
                batches.read_batch(tool, fd, batch, str(path), True, reported.append)
            return
        crcs = batches.read_batch(tool, fd, batch, str(path), True, reported.append)
    finally:
        os.close(fd)
        tool.close()
    assert sorted(reported) == list(range(len(batch)))
    for (offset, buffer), crc in zip(batch, crcs, strict=True):
        expected = content[offset : offset + buffer.nbytes]
        assert buffer.tobytes() == expected.tobytes()
        assert crc == crc32c.crc32c(expected.tobytes())
    if len(batch) < 2:
        assert Gathering.calls == []  # one pread, not recorded
        return
    expected_runs = batches.runs(batch, range(len(batch)), batches.RUN_GAP, 3 * MiB)
    assert sorted((offset, sizes) for _, offset, sizes in Gathering.calls) == sorted(
        (batch[run[0]][0], [batch[i][1].nbytes for i in run]) for run in expected_runs
    )


class _Device:
    """Host bytes posing as device memory (a kind scatter_from_host fills one by one)."""

    device_index = 0

    def __init__(self, nbytes: int) -> None:
        self.data = np.zeros(nbytes, np.uint8)
        self.nbytes = nbytes

    def copy_from_host(self, offset: int, src: np.ndarray) -> None:
        self.data[offset : offset + src.nbytes] = src


def test_small_neighbours_read_as_one_run_fill_host_and_device_buffers_alike(tmp_path, fresh):
    # A run of small neighbours is read once; each piece, host or device, gets its own
    # bytes (not its neighbour's, nor the gap's between them) and its own CRC.
    rng = np.random.default_rng(7)
    path = tmp_path / "d.bin"
    path.write_bytes(rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    data = path.read_bytes()
    places = [(0, 4096), (4096, 10), (5000, 3000), (40_000, 60_000), (150_000, 1)]
    buffers = [np.empty(n, np.uint8) if i % 2 else _Device(n) for i, (_, n) in enumerate(places)]
    _, crcs = _read_into(fresh, path, places, buffers, with_checksum=True)
    for (offset, n), buffer, crc in zip(places, buffers, crcs, strict=True):
        got = buffer if isinstance(buffer, np.ndarray) else buffer.data
        assert got.tobytes() == data[offset : offset + n], (offset, n)
        assert crc == crc32c.crc32c(data[offset : offset + n])


def _mixed(tmp_path, big: int = 6) -> tuple[os.PathLike, bytes, list[tuple[int, int]]]:
    """A file with ``big`` 1 MiB arrays, then 20 small neighbours: (path, content, ranges)."""
    ranges = [(i * MiB, MiB) for i in range(big)] + [
        (big * MiB + 5000 * k, 4000) for k in range(20)
    ]
    content = os.urandom(big * MiB + 5000 * 20)
    path = tmp_path / "mixed.bin"
    path.write_bytes(content)
    return path, content, ranges


def test_the_small_neighbours_of_a_read_move_while_its_batch_transfers_do(
    tmp_path, fresh, slow, monkeypatch
):
    # The small arrays of a load are read while the batch's transfers are in flight, not
    # before they start; every byte is where it would be alone.
    monkeypatch.setattr(dispatcher, "candidate_arms", lambda context: [Arm("slow")])
    in_flight_then: list[int] = []
    real = NaiveTool.read

    real_scattered = NaiveTool.read_scattered

    def naive_read(self, fd, buffer, file_offset, **kwargs):
        in_flight_then.append(slow.running)
        return real(self, fd, buffer, file_offset, **kwargs)

    def naive_scattered(fd, offsets, views, scratch):
        in_flight_then.append(slow.running)
        return real_scattered(fd, offsets, views, scratch)

    monkeypatch.setattr(NaiveTool, "read", naive_read)
    monkeypatch.setattr(NaiveTool, "read_scattered", staticmethod(naive_scattered))
    path, content, ranges = _mixed(tmp_path)
    done: list[int] = []
    dests, _ = _read_into(fresh, path, ranges, done=done.append)
    assert in_flight_then and in_flight_then[0] > 0  # the one run's read, inside the batch
    assert sorted(done) == list(range(len(ranges)))
    for (offset, n), dest in zip(ranges, dests, strict=True):
        assert dest.tobytes() == content[offset : offset + n]


def test_small_neighbours_move_once_when_a_failing_tool_batch_is_redone(
    tmp_path, fresh, slow, monkeypatch
):
    monkeypatch.setattr(
        dispatcher, "candidate_arms", lambda context: [Arm("slow"), Arm.of("posix", threads=2)]
    )
    slow.fail_at = 3 * MiB
    reads = _record_calls(monkeypatch, "read", NaiveTool)
    real_scattered = NaiveTool.read_scattered

    def scattered(fd, offsets, views, scratch):  # a run of host neighbours: (first, span)
        reads.append((offsets[0], offsets[-1] + views[-1].nbytes - offsets[0]))
        return real_scattered(fd, offsets, views, scratch)

    monkeypatch.setattr(NaiveTool, "read_scattered", staticmethod(scattered))
    path, content, ranges = _mixed(tmp_path)
    done: list[int] = []
    dests, _ = _read_into(fresh, path, ranges, done=done.append)
    assert reads == [(6 * MiB, 5000 * 19 + 4000)]  # one read of the run, not one per tool
    assert sorted(done) == list(range(len(ranges)))
    for (offset, n), dest in zip(ranges, dests, strict=True):
        assert dest.tobytes() == content[offset : offset + n]
    [context] = [e for e in arrayio.explain().explanations]
    assert "slow" in context.unavailable  # the batch fell back; the small reads did not


def test_an_error_of_the_small_neighbours_inside_a_batch_is_no_tool_failure(
    tmp_path, fresh, slow, monkeypatch
):
    # What the small arrays' part raises (here a cancelled load's callback) leaves as itself,
    # after the batch's started transfers, and blames no tool.
    monkeypatch.setattr(
        dispatcher, "candidate_arms", lambda context: [Arm("slow"), Arm.of("posix", threads=2)]
    )
    path, _, ranges = _mixed(tmp_path)

    class Cancelled(Exception):
        pass

    def done(i: int) -> None:
        if i == len(ranges) - 1:  # a small one
            raise Cancelled

    with pytest.raises(Cancelled):
        _read_into(fresh, path, ranges, done=done)
    assert slow.running == 0
    assert all(not e.unavailable for e in arrayio.explain().explanations)


# -- dividing a batch between two arms ------------------------------------------------------


def _requests(sizes: list[int]) -> list[tuple[int, np.ndarray]]:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(o, np.empty(s, np.uint8)) for o, s in zip(offsets, sizes, strict=True)]


def test_a_division_gives_the_rival_whole_requests_from_the_end():
    batch = _requests([8 * MiB] * 8)
    division = batches.divide(batch, 0.25)
    assert division is not None
    assert division.rival == [6, 7] and division.incumbent == list(range(6))
    assert division.pieces == batch and division.owners == list(range(8))


def test_a_division_cuts_a_request_for_the_rest_of_the_share():
    batch = _requests([32 * MiB] * 4)
    division = batches.divide(batch, 1 / 64)  # 2 MiB: the tail of the last request
    assert division is not None
    assert division.owners == [0, 1, 2, 3, 3]
    head, tail = division.pieces[3], division.pieces[4]
    assert (head[0], head[1].nbytes) == (96 * MiB, 30 * MiB)
    assert (tail[0], tail[1].nbytes) == (126 * MiB, 2 * MiB)
    assert np.shares_memory(tail[1], batch[3][1])  # a view: the bytes land in place
    assert division.rival == [4] and division.incumbent == [0, 1, 2, 3]


def test_a_division_is_whole_mebibytes_and_never_more_than_the_share():
    for sizes, share in (([5 * MiB, 3 * MiB, 7 * MiB], 0.3), ([64 * MiB], 0.1)):
        division = batches.divide(_requests(sizes), share)
        assert division is not None
        rival = sum(division.pieces[k][1].nbytes for k in division.rival)
        assert rival % MiB == 0 and 0 < rival <= share * sum(sizes)
        assert rival + sum(division.pieces[k][1].nbytes for k in division.incumbent) == sum(sizes)


def test_nothing_to_divide_below_a_mebibyte_or_without_views():
    assert batches.divide(_requests([8 * MiB]), 1 / 64) is None  # 128 KiB
    assert batches.divide(_requests([8 * MiB, 8 * MiB]), 0.99) is not None

    class Opaque:  # a device buffer that cannot be viewed in parts
        nbytes = 64 * MiB
        device_index = 0

    assert batches.divide([(0, Opaque())], 0.25) is None


# -- several files as one batch ------------------------------------------------------------


def _random_files(tmp_path, name, sizes):
    """Files ``name0``, ``name1``... of random bytes, of ``sizes``; their paths."""
    paths = []
    for i, n in enumerate(sizes):
        path = tmp_path / name.format(i)
        path.write_bytes(os.urandom(n))
        paths.append(str(path))
    return paths


def _open_all(paths):
    return [os.open(p, os.O_RDONLY) for p in paths]


@given(sizes=st.lists(st.sampled_from([1, 4095, 70_000, MiB, MiB + 13]), min_size=1, max_size=9))
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_files_read_as_one_batch_each_fill_their_buffer(tmp_path, fresh, sizes):
    rng = np.random.default_rng(len(sizes))
    contents = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    paths = []
    for i, content in enumerate(contents):
        path = tmp_path / f"chunk{i}.bin"
        path.write_bytes(content.tobytes())
        paths.append(str(path))
    buffers = [np.zeros(n, np.uint8) for n in sizes]
    fds = _open_all(paths)
    try:
        fresh.read_files([(fd, 0, b) for fd, b in zip(fds, buffers, strict=True)], paths=paths)
    finally:
        for fd in fds:
            os.close(fd)
    for buffer, content in zip(buffers, contents, strict=True):
        assert buffer.tobytes() == content.tobytes()
    context, _ = fresh.last
    assert context.size_class == size_class(sum(sizes))  # learned as one transfer
    assert context.pieces == piece_class(sizes)


def test_a_short_file_among_many_is_a_data_error(tmp_path, fresh):
    paths = _random_files(tmp_path, "c{}", [MiB, MiB, MiB - 5])
    fds = _open_all(paths)
    try:
        with pytest.raises(TruncatedFileError, match=r"c2: file ends at byte 1048571"):
            fresh.read_files([(fd, 0, np.empty(MiB, np.uint8)) for fd in fds], paths=paths)
    finally:
        for fd in fds:
            os.close(fd)
    assert all(not e.unavailable for e in arrayio.explain().explanations)  # no tool blamed


class _CountedPosix(PosixTool):
    """The posix tool, counting its single reads and its runs."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.singles: list[int] = []
        self.runs: list[list[int]] = []
        self.bundles: list[list[int]] = []

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        self.singles.append(file_offset)
        return super().pread(fd, buffer, file_offset, checksum=checksum)

    def preadv_host(self, fd, requests):
        self.runs.append([offset for offset, _ in requests])
        return super().preadv_host(fd, requests)

    def pread_each_host(self, requests):  # single reads, a bundle of them per task
        self.bundles.append([offset for _, offset, _ in requests])
        self.singles.extend(offset for _, offset, _ in requests)
        return super().pread_each_host(requests)


@given(
    sizes=st.lists(st.integers(1, 300_000), min_size=1, max_size=24),
    gaps=st.lists(st.sampled_from([0, 0, 0, 1, 5000]), min_size=24, max_size=24),
    threads=st.sampled_from([1, 4]),
)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_ranges_that_touch_in_a_file_are_read_as_one_run_each(tmp_path, sizes, gaps, threads):
    # A shard's inner chunks, one request each: those that start where the one before ends
    # (up to RUN_BYTES a run) go to the tool as one preadv of their buffers, the others
    # alone; every buffer gets its own bytes, and each request is reported once.
    offsets, at = [], 0
    for size, gap in zip(sizes, gaps, strict=False):
        at += gap
        offsets.append(at)
        at += size
    content = np.random.default_rng(len(sizes)).integers(0, 256, at, dtype=np.uint8)
    path = tmp_path / "shard.bin"
    path.write_bytes(content.tobytes())
    order = np.random.default_rng(at).permutation(len(sizes))  # (any order of requests)
    buffers = [np.zeros(sizes[i], np.uint8) for i in order]
    reported: list[int] = []
    tool = _CountedPosix(threads=threads)
    fd = os.open(path, os.O_RDONLY)
    try:
        requests = [(fd, offsets[i], b) for i, b in zip(order, buffers, strict=True)]
        batches.read_files(tool, requests, [str(path)] * len(requests), reported.append)
    finally:
        os.close(fd)
        tool.close()
    for i, buffer in zip(order, buffers, strict=True):
        assert buffer.tobytes() == content[offsets[i] : offsets[i] + sizes[i]].tobytes()
    assert sorted(reported) == list(range(len(sizes)))
    # Every range is read once, alone or in a run; a run's ranges touch, in file order, and
    # fit in RUN_BYTES; and no two neighbours that touch were left apart while their run
    # had room for the next.
    size_at = dict(zip(offsets, sizes, strict=False))
    assert sorted(tool.singles + [o for run in tool.runs for o in run]) == sorted(offsets)
    for run in tool.runs:
        assert len(run) > 1 and all(a + size_at[a] == b for a, b in zip(run, run[1:], strict=False))
        assert run[-1] + size_at[run[-1]] - run[0] <= batches.RUN_BYTES
    start_of = {o: run[0] for run in tool.runs for o in run} | {o: o for o in tool.singles}
    end_of_group = {o: o + size_at[o] for o in tool.singles} | {
        run[0]: run[-1] + size_at[run[-1]] for run in tool.runs
    }
    for offset in offsets:
        end = offset + size_at[offset]
        if end in size_at and start_of[end] != start_of[offset]:  # touching, in two groups
            first = start_of[offset]
            assert end_of_group[first] == end  # the next began a group of its own:
            assert end + size_at[end] - first > batches.RUN_BYTES  # it did not fit


def test_a_run_the_file_ends_in_names_its_first_short_request(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(250_000))
    tool = _CountedPosix(threads=2)
    fd = os.open(path, os.O_RDONLY)
    try:
        requests = [(fd, k * 100_000, np.empty(100_000, np.uint8)) for k in range(4)]
        with pytest.raises(
            TruncatedFileError, match=r"file ends at byte 250000, 50000 bytes short"
        ):
            batches.read_files(tool, requests, [str(path)] * 4, lambda i: None)
    finally:
        os.close(fd)
        tool.close()
    assert tool.runs == [[0, 100_000, 200_000, 300_000]]


def test_runs_hold_host_buffers_of_one_file_only():
    host = np.empty(10, np.uint8)
    requests = [
        (3, 0, host),
        (3, 10, host),
        (4, 20, host),  # another file
        (3, 20, _Device(10)),  # device memory
        (3, 30, np.empty(0, np.uint8)),  # nothing to read
        (3, 40, host),  # a gap before it
    ]
    fds = [fd for fd, _, _ in requests]
    pieces = [(offset, buffer) for _, offset, buffer in requests]
    assert batches._host_runs(fds, pieces) == [[0, 1], [2], [3], [4], [5]]


def test_files_of_mixed_cache_states_are_a_mixed_batch(tmp_path, fresh, monkeypatch):
    from arrayio.dispatch import dispatcher as dispatcher_module

    states = iter(["warm", "cold", "warm"])
    monkeypatch.setattr(dispatcher_module, "cache_state", lambda fd, offset, n: next(states))
    paths = []
    for i in range(3):
        path = tmp_path / f"m{i}"
        path.write_bytes(os.urandom(MiB))
        paths.append(str(path))
    fds = _open_all(paths)
    try:
        context = fresh.files_context([(fd, 0, np.empty(MiB, np.uint8)) for fd in fds], "host")
    finally:
        for fd in fds:
            os.close(fd)
    assert context.cache == "mixed"
    with pytest.raises(ValueError, match="one memory kind"):
        fresh.read_files([(0, 0, np.empty(1, np.uint8)), (0, 0, _Device(1))])


@pytest.mark.parametrize("count", [1, 5])
def test_the_callers_work_runs_once_while_a_batch_moves(tmp_path, fresh, count):
    # A load wraps its buffers as the framework's arrays while their bytes move: the work
    # runs once, before the batch reports its first transfer done (after it, for a transfer
    # alone), and the bytes are right.
    content = os.urandom(count * MiB)
    path = tmp_path / "m.bin"
    path.write_bytes(content)
    dests = [np.empty(MiB, np.uint8) for _ in range(count)]
    events: list[str] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        fresh.read_many(
            fd,
            [(i * MiB, d) for i, d in enumerate(dests)],
            done=lambda i: events.append("done"),
            meanwhile=lambda: events.append("meanwhile"),
        )
    finally:
        os.close(fd)
    assert b"".join(d.tobytes() for d in dests) == content
    assert events.count("meanwhile") == 1
    assert events[0 if count > 1 else -1] == "meanwhile"


def test_an_error_of_the_callers_work_is_raised_once_the_transfers_end(tmp_path, fresh):
    path = tmp_path / "e.bin"
    path.write_bytes(os.urandom(4 * MiB))
    dests = [np.empty(MiB, np.uint8) for _ in range(4)]
    done: list[int] = []

    def fail() -> None:
        raise KeyError("wrapping failed")

    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(KeyError, match="wrapping failed"):
            fresh.read_many(
                fd, [(i * MiB, d) for i, d in enumerate(dests)], done=done.append, meanwhile=fail
            )
    finally:
        os.close(fd)
    assert all(not e.unavailable for e in arrayio.explain().explanations)  # no tool blamed


# -- several devices in one read -----------------------------------------------------------


class _OnDevice:
    """Host bytes posing as memory of GPU ``device_index``."""

    def __init__(self, nbytes: int, device_index: int) -> None:
        self.data = np.zeros(nbytes, np.uint8)
        self.nbytes = nbytes
        self.device_index = device_index


def test_each_devices_transfers_move_at_once_with_the_others(tmp_path, registry, monkeypatch):
    # One read of pieces for two GPUs (a process driving both, as a sharded restore does):
    # each device's transfers must be in flight while the other's are, or every tool's
    # pipeline fills and drains once per device. The tool lets a transfer through only once
    # one of the other device's is in flight too.
    arrived: set[int] = set()
    both = threading.Event()
    devices_met: set[int] = set()

    class MeetsTheOtherDevice(Tool):
        name = "meets"
        capabilities = Capabilities(frozenset({"cuda"}), checksums=False)

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            arrived.add(buffer.device_index)
            if arrived == {0, 1}:
                both.set()
            if not both.wait(timeout=10):
                raise RuntimeError(f"device {buffer.device_index}'s transfer moved alone")
            devices_met.add(buffer.device_index)
            host = np.empty(buffer.nbytes, np.uint8)
            n = pread_full(fd, host, file_offset)
            buffer.data[:] = host
            return IOFuture.completed(n)

        pwrite = pread

    tools.register("meets", MeetsTheOtherDevice, clobber=True)
    monkeypatch.setattr(dispatcher, "candidate_arms", lambda context: [Arm("meets")])
    content = np.random.default_rng(5).integers(0, 256, 8 * MiB, dtype=np.uint8)
    path = tmp_path / "two-devices.bin"
    path.write_bytes(content.tobytes())
    # A batch of two pieces for each device; device 1's starts a moment late, after
    # device 0 has chosen its tool in its context.
    ranges = [(0, 2 * MiB), (2 * MiB, 2 * MiB), (4 * MiB, 2 * MiB), (6 * MiB, 2 * MiB)]
    buffers = [_OnDevice(2 * MiB, d) for d in (0, 0, 1, 1)]
    real_batch = Dispatcher._batch

    def late_on_one(self, direction, fd, batch, *args, **kwargs):
        if batch[0][1].device_index == 1:
            time.sleep(0.2)
        return real_batch(self, direction, fd, batch, *args, **kwargs)

    monkeypatch.setattr(Dispatcher, "_batch", late_on_one)
    active = Dispatcher(None)
    try:
        _read_into(active, path, ranges, buffers)
        learned = [key for key, _ in active.table.items()]
    finally:
        active.close()
    assert devices_met == {0, 1}
    # Both devices' batches are learned as two transfers at once, whichever started first.
    assert learned and all("/x2" in key for key in learned), learned
    for (offset, n), buffer in zip(ranges, buffers, strict=True):
        assert np.array_equal(buffer.data, content[offset : offset + n]), offset


def _read_two_devices(tmp_path, monkeypatch, name: str, pread) -> None:
    """Make a tool of ``pread`` (device memory only) the one candidate, and read a 4 MiB
    file's halves into stand-ins of GPUs 0 and 1, with a new dispatcher."""
    tool = type(
        name,
        (Tool,),
        {
            "name": name,
            "capabilities": Capabilities(frozenset({"cuda"}), checksums=False),
            "pread": pread,
            "pwrite": pread,
        },
    )
    tools.register(name, tool, clobber=True)
    monkeypatch.setattr(dispatcher, "candidate_arms", lambda context: [Arm(name)])
    path = tmp_path / f"{name}.bin"
    path.write_bytes(bytes(4 * MiB))
    buffers = [_OnDevice(2 * MiB, 0), _OnDevice(2 * MiB, 1)]
    active = Dispatcher(None)
    try:
        _read_into(active, path, [(0, 2 * MiB), (2 * MiB, 2 * MiB)], buffers)
    finally:
        active.close()


def test_a_failing_device_raises_once_every_device_has_ended(tmp_path, registry, monkeypatch):
    # Device 1's transfer fails for good; device 0's, slower, is still filling its buffer:
    # the read raises only once it has ended, so that nothing writes into the caller's
    # buffers after the call returns.
    ended: list[int] = []

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        if buffer.device_index == 1:
            raise ToolUnavailableError("fails-on-one: injected")
        time.sleep(0.3)
        buffer.data[:] = 1
        ended.append(buffer.device_index)
        return IOFuture.completed(buffer.nbytes)

    with pytest.raises(ToolUnavailableError, match="injected"):
        _read_two_devices(tmp_path, monkeypatch, "fails-on-one", pread)
    assert ended == [0]


def test_reads_wait_for_the_callers_streams_before_any_tool_runs(
    tmp_path, registry, monkeypatch, fresh
):
    # Device buffers are filled from the tools' own streams: the caller's queued work on
    # them must be done first (the GPU test shows the race; here, the order of the calls).
    from arrayio.dispatch import _transfer

    events: list[str] = []
    monkeypatch.setattr(
        _transfer,
        "wait_for_current_streams",
        lambda buffers: events.append(f"wait {sorted(b.device_index for b in buffers)}"),
    )

    class Records(Tool):
        name = "records"
        capabilities = Capabilities(frozenset({"cuda"}), checksums=False)

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            events.append(f"read {buffer.device_index}")
            return IOFuture.completed(buffer.nbytes)

        pwrite = pread

    tools.register("records", Records, clobber=True)
    monkeypatch.setattr(dispatcher, "candidate_arms", lambda context: [Arm("records")])
    path = tmp_path / "r.bin"
    path.write_bytes(bytes(4 * MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        _transfer.read_many(fd, [(0, _OnDevice(2 * MiB, 1)), (2 * MiB, _OnDevice(2 * MiB, 1))])
        _transfer.read_into(fd, 0, _OnDevice(2 * MiB, 0))
    finally:
        os.close(fd)
    assert events[0] == "wait [1, 1]" and events[1:3] == ["read 1", "read 1"]
    assert events[3:] == ["wait [0]", "read 0"]


def test_an_interrupt_in_one_devices_transfers_waits_for_the_others(
    tmp_path, registry, monkeypatch
):
    # Ctrl-C lands on the caller's thread while another device's transfer, on a thread of
    # the read, is still filling its buffer: the interrupt is raised only once that
    # transfer has ended (nothing writes into the caller's buffers after the call).
    import signal

    ended: list[int] = []

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        time.sleep(0.6)
        buffer.data[:] = 1
        ended.append(buffer.device_index)
        return IOFuture.completed(buffer.nbytes)

    interrupt = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            _read_two_devices(tmp_path, monkeypatch, "slow-per-device", pread)
        assert 1 in ended  # the other device's transfer had ended when the call raised
    finally:
        interrupt.cancel()


def test_a_data_error_on_one_device_outranks_a_tool_failure_on_another(
    tmp_path, registry, monkeypatch
):
    def pread(self, fd, buffer, file_offset, *, checksum=None):
        if buffer.device_index == 1:
            raise TruncatedFileError("pretend: the file ends early")
        raise ToolUnavailableError("pretend: this tool cannot run")

    with pytest.raises(TruncatedFileError, match="ends early") as raised:
        _read_two_devices(tmp_path, monkeypatch, "truncated-on-one", pread)
    # The other device's failure is not lost: it is noted on the error raised.
    assert any("cannot run" in note for note in getattr(raised.value, "__notes__", []))


def test_a_read_from_the_disk_is_checksummed_on_the_host_where_the_tool_can(monkeypatch):
    # Where the GPU can checksum: large buffers go to it from the page cache, not from the
    # disk (the disk bounds the read, the host's checksums hide behind it); a tool that
    # cannot checksum leaves every buffer to the GPU; small ones stay with a tool that can.
    monkeypatch.setattr(batches._device_checksum, "available", lambda: True)
    large, small = _OnDevice(8 * MiB, 0), _OnDevice(MiB, 0)
    # (what the rule reads of a tool: whether it checksums the bytes it moves)
    can = SimpleNamespace(capabilities=Capabilities(frozenset({"cuda"}), checksums=True))
    cannot = SimpleNamespace(capabilities=Capabilities(frozenset({"cuda"}), checksums=False))
    on_gpu = batches.checksum_on_gpu
    assert on_gpu(large, can) and on_gpu(large, can, from_disk=False)
    assert not on_gpu(large, can, from_disk=True)
    assert not on_gpu(small, can) and not on_gpu(small, can, from_disk=True)
    assert on_gpu(large, cannot, from_disk=True) and on_gpu(small, cannot, from_disk=True)
    assert not on_gpu(np.empty(8 * MiB, np.uint8), cannot)  # host memory: never
    monkeypatch.setattr(batches._device_checksum, "available", lambda: False)
    assert not on_gpu(large, can) and not on_gpu(large, cannot)


def test_a_batch_read_says_whether_it_comes_from_the_disk(tmp_path, monkeypatch):
    from benchmarks import _pagecache as pagecache

    seen: list[bool] = []
    real = batches.read_batch

    def recording(*args, from_disk=False, **kwargs):
        seen.append(from_disk)
        return real(*args, from_disk=from_disk, **kwargs)

    monkeypatch.setattr(batches, "read_batch", recording)
    content = np.random.default_rng(7).integers(0, 256, 8 * MiB, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(content.tobytes())
    active = Dispatcher(None)
    fd = os.open(path, os.O_RDONLY)
    try:
        for cache in ("cold", "warm"):
            if cache == "cold":
                pagecache.evict(os.fspath(path))
            else:
                path.read_bytes()
            dests = [np.empty(4 * MiB, np.uint8) for _ in range(2)]
            active.read_many(fd, [(0, dests[0]), (4 * MiB, dests[1])], with_checksum=True)
            assert np.array_equal(np.concatenate(dests), content), cache
    finally:
        os.close(fd)
        active.close()
    assert seen and seen[0] is True and seen[-1] is False, seen


def test_a_read_from_the_disk_checksums_on_the_host_and_builds_the_kernel_for_later(
    tmp_path, monkeypatch
):
    # Stand-ins of GPU memory, a tool that checksums as the bytes pass: read from the disk,
    # every checksum is the tool's (none launched on the "GPU"), right, and the kernel is
    # built ahead for the GPU's devices; from the page cache, the large buffers go to the GPU.
    built: list[list[int]] = []
    launched: list[int] = []

    class Kernels:
        def __init__(self, buffers, own_stream=False):
            self.buffers = list(buffers)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def launch(self, index):
            launched.append(index)

        def results(self):
            return [crc32c.crc32c(buffer.data.tobytes()) for buffer in self.buffers]

    class PassesBytes(Tool):
        name = "passes-bytes"
        capabilities = Capabilities(frozenset({"cuda"}), checksums=True)

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            n = pread_full(fd, buffer.data, file_offset)
            if checksum is not None:
                checksum.add_data(0, buffer.data[:n])
            return IOFuture.completed(n)

        pwrite = pread

    monkeypatch.setattr(batches._device_checksum, "available", lambda: True)
    monkeypatch.setattr(batches._device_checksum, "DeviceChecksums", Kernels)
    monkeypatch.setattr(batches._device_checksum, "build_ahead", built.append)
    content = np.random.default_rng(11).integers(0, 256, 16 * MiB, dtype=np.uint8)
    path = tmp_path / "g.bin"
    path.write_bytes(content.tobytes())
    expected = [crc32c.crc32c(content[i * 8 * MiB : (i + 1) * 8 * MiB].tobytes()) for i in (0, 1)]
    fd = os.open(path, os.O_RDONLY)
    try:
        for from_disk in (True, False):
            buffers = [_OnDevice(8 * MiB, 0), _OnDevice(8 * MiB, 0)]
            batch = [(0, buffers[0]), (8 * MiB, buffers[1])]
            crcs = batches.read_batch(
                PassesBytes(), fd, batch, str(path), True, lambda i: None, from_disk=from_disk
            )
            assert crcs == expected, from_disk
            assert np.array_equal(np.concatenate([b.data for b in buffers]), content)
            if from_disk:
                assert launched == [] and built == [[0]]
    finally:
        os.close(fd)
    assert sorted(launched) == [0, 1] and built == [[0]]  # the page cache's: on the GPU


@given(
    layout=st.lists(
        st.lists(st.sampled_from([1, 4095, 70_000, MiB, 2 * MiB + 13]), min_size=1, max_size=4),
        min_size=1,
        max_size=4,
    )
)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_checkpoint_s_files_read_as_one_batch_fill_and_checksum_their_buffers(
    tmp_path, fresh, layout
):
    # Files of several arrays each (small ones through the naive tool, neighbours in a file
    # with one read; large ones in the batch): every buffer holds its bytes, every CRC is
    # its bytes', each request is reported once and the caller's work runs once.
    rng = np.random.default_rng(sum(map(len, layout)))
    paths, requests, expected = [], [], []
    for f, sizes in enumerate(layout):
        content = rng.integers(0, 256, sum(sizes) + 100 * len(sizes), dtype=np.uint8)
        path = tmp_path / f"shard{f}.safetensors"
        path.write_bytes(content.tobytes())
        offset = 0
        for n in sizes:
            offset += 100  # a gap between arrays, as a header or padding leaves
            requests.append((f, offset, np.zeros(n, np.uint8)))
            expected.append(content[offset : offset + n])
            offset += n
        paths.append(str(path))
    fds = _open_all(paths)
    done: list[int] = []
    meanwhile: list[int] = []
    try:
        crcs = fresh.read_many_files(
            [(fds[f], offset, buffer) for f, offset, buffer in requests],
            paths=[paths[f] for f, _, _ in requests],
            with_checksum=True,
            done=done.append,
            meanwhile=lambda: meanwhile.append(1),
        )
    finally:
        for fd in fds:
            os.close(fd)
    for (_, _, buffer), want, crc in zip(requests, expected, crcs, strict=True):
        assert buffer.tobytes() == want.tobytes()
        assert crc == crc32c.crc32c(want.tobytes())
    assert sorted(done) == list(range(len(requests))) and meanwhile == [1]
    large = [buffer.nbytes for _, _, buffer in requests if buffer.nbytes >= SMALL_TRANSFER]
    if len(large) > 1:  # learned as one transfer of the files' large arrays
        context, _ = fresh.last
        assert context.size_class == size_class(sum(large)) and context.checksum


def test_a_short_shard_among_many_is_a_data_error_naming_it(tmp_path, fresh):
    paths = _random_files(tmp_path, "s{}.safetensors", [2 * MiB, 2 * MiB, 2 * MiB - 5])
    fds = _open_all(paths)
    try:
        with pytest.raises(TruncatedFileError, match=r"s2.safetensors: file ends at byte"):
            fresh.read_many_files([(fd, 0, np.empty(2 * MiB, np.uint8)) for fd in fds], paths=paths)
        with pytest.raises(ValueError, match="one path per request"):
            fresh.read_many_files([(fds[0], 0, np.empty(2 * MiB, np.uint8))], paths=[])
        with pytest.raises(ValueError, match="one memory kind"):
            fresh.read_many_files(
                [(fds[0], 0, np.empty(2 * MiB, np.uint8)), (fds[1], 0, _Device(2 * MiB))],
                paths=paths[:2],
            )
    finally:
        for fd in fds:
            os.close(fd)
    assert all(not e.unavailable for e in arrayio.explain().explanations)  # no tool blamed


@pytest.mark.parametrize(
    ("entry", "files"), [("read_many", 1), ("read_many_files", 1), ("read_many_files", 3)]
)
def test_what_a_progress_callback_raises_leaves_the_read_as_it_was_raised(
    tmp_path, fresh, entry, files
):
    # A progress bar closed under a load (a KeyboardInterrupt in a notebook) must end the
    # read with the caller's own exception, whichever batch (one file's or several's) ran.
    paths = _random_files(tmp_path, "s{}.safetensors", [4 * MiB] * files)
    fds = _open_all(paths)

    class Stop(Exception):
        pass

    def done(i: int) -> None:
        raise Stop(f"progress {i}")

    which = [k % files for k in range(2 * files)]  # two arrays of each file
    requests = [
        (fds[f], (k // files) * 2 * MiB, np.empty(2 * MiB, np.uint8)) for k, f in enumerate(which)
    ]
    try:
        with pytest.raises(Stop, match="progress"):
            if entry == "read_many":
                fresh.read_many(fds[0], [(o, b) for _, o, b in requests], done=done)
            else:
                fresh.read_many_files(requests, paths=[paths[f] for f in which], done=done)
    finally:
        for fd in fds:
            os.close(fd)


def test_shards_whose_large_arrays_sit_in_one_file_are_still_learned_as_shards(
    tmp_path, fresh, monkeypatch
):
    # A checkpoint whose last shard holds only a norm: its large arrays are all in the first
    # file, and the load is still a read of the shards, learned in the files' context (as
    # every load of that checkpoint is), not in one file's.
    paths = _random_files(tmp_path, "s{}.safetensors", [8 * MiB, 4096])
    fds = _open_all(paths)
    used: list[str] = []
    for name in ("files_context", "batch_context"):
        real = getattr(fresh, name)
        monkeypatch.setattr(
            fresh, name, lambda *a, real=real, name=name, **k: used.append(name) or real(*a, **k)
        )
    requests = [
        (fds[0], 0, np.empty(2 * MiB, np.uint8)),
        (fds[0], 4 * MiB, np.empty(2 * MiB, np.uint8)),
        (fds[1], 0, np.empty(4096, np.uint8)),
    ]
    try:
        fresh.read_many_files(requests, paths=[paths[0], paths[0], paths[1]])
    finally:
        for fd in fds:
            os.close(fd)
    assert used == ["files_context"]


def test_a_checkpoint_s_first_load_is_no_re_read(tmp_path, fresh):
    # Several requests of one file in one batch are one read of it: the first load of a
    # checkpoint's files is not taken for a re-read (which keeps it in the page cache and
    # marks its directory as re-read for the process).
    paths = []
    for n in range(2):
        path = tmp_path / f"s{n}.bin"
        path.write_bytes(os.urandom(4 * MiB))
        paths.append(str(path))
    answers: list[object] = []
    real = fresh.rereads.read

    def read(fd, ask=True):
        answers.append(real(fd, ask=ask))
        return answers[-1]

    fresh.rereads.read = read
    fds = _open_all(paths)
    try:
        requests = [
            (fd, offset, np.empty(2 * MiB, np.uint8)) for fd in fds for offset in (0, 2 * MiB)
        ]
        fresh.read_many_files(requests, paths=[paths[i // 2] for i in range(4)])
    finally:
        for fd in fds:
            os.close(fd)
    assert answers == [None, None]
    other = tmp_path / "never-read.bin"
    other.write_bytes(b"x" * MiB)
    fd = os.open(other, os.O_RDONLY)
    try:
        assert real(fd) is None  # its directory is not one the process re-reads
    finally:
        os.close(fd)


def test_small_neighbours_in_strided_host_buffers_still_get_their_bytes(tmp_path, fresh):
    # A run read straight into its buffers needs each to be contiguous: strided ones (every
    # other byte of a larger array) are read through staging and copied, as before.
    content = os.urandom(MiB)
    path = tmp_path / "strided.bin"
    path.write_bytes(content)
    ranges = [(0, 4096), (4096, 8192), (20_000, 1000)]
    backing = [np.zeros(2 * n, np.uint8) for _, n in ranges]
    dests, crcs = _read_into(fresh, path, ranges, [b[::2] for b in backing], with_checksum=True)
    for (offset, size), dest, crc in zip(ranges, dests, crcs, strict=True):
        assert dest.tobytes() == content[offset : offset + size]
        assert crc == crc32c.crc32c(content[offset : offset + size])


@given(
    sizes=st.lists(st.sampled_from([1, 4095, 70_000, 300_000]), min_size=1, max_size=40),
    large=st.integers(0, 2),
    threads=st.sampled_from([1, 2, 4]),
)
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_many_small_files_are_read_in_bundles_a_task_each(tmp_path, sizes, large, threads):
    # A Zarr array's chunk files: past one per thread, the small ones are read in bundles
    # (a task each, BUNDLES_PER_THREAD per thread at most, about equal in bytes); a file
    # larger than BUNDLE_BYTES keeps its own read; every buffer gets its file's bytes, and
    # each request is reported once.
    sizes = sizes + [batches.BUNDLE_BYTES + 1] * large
    folder = tmp_path / f"files-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    paths = _random_files(folder, "c{}", sizes)
    buffers = [np.zeros(n, np.uint8) for n in sizes]
    tool = _CountedPosix(threads=threads)
    fds = _open_all(paths)
    reported: list[int] = []
    try:
        requests = [(fd, 0, b) for fd, b in zip(fds, buffers, strict=True)]
        batches.read_files(tool, requests, paths, reported.append)
    finally:
        for fd in fds:
            os.close(fd)
        tool.close()
    for path, buffer in zip(paths, buffers, strict=True):
        assert buffer.tobytes() == Path(path).read_bytes()
    assert sorted(reported) == list(range(len(sizes)))
    small = len(sizes) - large
    assert tool.runs == []  # no two requests of one file
    assert sorted(tool.singles) == [0] * len(sizes)  # each file read once, from its start
    bundled = sum(len(b) for b in tool.bundles)
    tasks = len(tool.bundles) + small - bundled  # a bundle of one is a plain read
    if small > threads:
        assert tasks <= threads * batches.BUNDLES_PER_THREAD
        assert bundled or small <= threads * batches.BUNDLES_PER_THREAD
    else:
        assert tool.bundles == []


def test_a_short_file_in_a_bundle_is_named(tmp_path):
    paths = _random_files(tmp_path, "c{}", [1000] * 7 + [990] + [1000] * 4)
    tool = _CountedPosix(threads=2)
    fds = _open_all(paths)
    try:
        with pytest.raises(TruncatedFileError, match=r"c7: file ends at byte 990, 10 bytes short"):
            batches.read_files(
                tool, [(fd, 0, np.empty(1000, np.uint8)) for fd in fds], paths, lambda i: None
            )
    finally:
        for fd in fds:
            os.close(fd)
        tool.close()
    assert len(tool.bundles) > 1


@given(st.integers(0, 500), st.integers(2, 80))
def test_a_spread_takes_evenly_spaced_items_first_and_last_among_them(n, count):
    from arrayio.dispatch.dispatcher import _spread

    items = list(range(n))
    taken = list(_spread(items, count))
    if n <= count:
        assert taken == items
    else:
        assert len(taken) == count == len(set(taken)) and taken == sorted(taken)
        assert taken[0] == 0 and taken[-1] == n - 1
        gaps = [b - a for a, b in zip(taken, taken[1:], strict=False)]
        assert max(gaps) - min(gaps) <= 1  # evenly spread


def test_a_batch_of_many_files_asks_the_cache_state_of_a_spread_of_them(
    tmp_path, fresh, monkeypatch
):
    # A Zarr array's thousand chunk files: CACHE_PROBES of them are asked, spread over the
    # batch, and one cold file among those asked makes the batch mixed.
    from arrayio.dispatch import dispatcher as dispatcher_module

    asked: list[int] = []

    def state(fd, offset, nbytes):
        asked.append(offset)
        return "cold" if offset == 199 else "warm"

    monkeypatch.setattr(dispatcher_module, "cache_state", state)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(400))
    fd = os.open(path, os.O_RDONLY)
    fds = [os.dup(fd) for _ in range(200)]  # 200 files, to the batch
    try:
        requests = [(fds[i], i, np.empty(1, np.uint8)) for i in range(200)]
        context = fresh.files_context(requests, "host")
        assert len(asked) == dispatcher_module.CACHE_PROBES and context.cache == "mixed"
        assert asked[0] == 0 and asked[-1] == 199
        asked.clear()
        assert fresh.files_context(requests[:150], "host").cache == "warm"
    finally:
        for each in [fd, *fds]:
            os.close(each)


def test_a_batch_of_a_few_files_asks_once_a_file_over_its_requests(tmp_path, fresh, monkeypatch):
    # A checkpoint's 4 shards of 40 tensors each: one question a file, over the span of its
    # requests (as a batch of one file asks over its span), and a cold range in one file's
    # span makes the batch mixed.
    from arrayio.dispatch import dispatcher as dispatcher_module

    asked: list[tuple[int, int, int]] = []
    cold: set[tuple[int, int]] = set()  # (fd, offset)

    def state(fd, offset, nbytes):
        asked.append((fd, offset, nbytes))
        return (
            "cold" if any(f == fd and offset <= at < offset + nbytes for f, at in cold) else "warm"
        )

    monkeypatch.setattr(dispatcher_module, "cache_state", state)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1000))
    fds = [os.open(path, os.O_RDONLY) for _ in range(4)]
    try:
        requests = [(fd, 100 + 10 * i, np.empty(10, np.uint8)) for fd in fds for i in range(40)]
        requests.reverse()  # the span, whatever the order
        assert fresh.files_context(requests, "host").cache == "warm"
        assert sorted(asked) == sorted((fd, 100, 400) for fd in fds)
        cold.add((fds[2], 455))
        assert fresh.files_context(requests, "host").cache == "mixed"
    finally:
        for fd in fds:
            os.close(fd)
