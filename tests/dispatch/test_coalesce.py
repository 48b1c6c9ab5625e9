"""The queue of reads that many threads ask for one at a time (``arrayio.dispatch.coalesce``):
every read fills its own buffer, reads asked while a batch moves go in the next one, a
read's error is its own, and an interrupt strands no waiting thread."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from arrayio.dispatch import coalesce
from arrayio.errors import TruncatedFileError

MiB = 1 << 20


def _files(tmp_path, sizes):
    rng = np.random.default_rng(len(sizes))
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}"
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        paths.append(path)
    return paths


@pytest.fixture
def moves(monkeypatch):
    """The size of every group the queue hands to the dispatcher; the first held a moment,
    so that the reads asked meanwhile queue behind it."""
    sizes: list[int] = []
    real = coalesce._move

    def move(group):
        sizes.append(len(group))
        if len(sizes) == 1:
            time.sleep(0.2)
        return real(group)

    monkeypatch.setattr(coalesce, "_move", move)
    return sizes


def _read_all(queue, paths, sizes, offset=0):
    """Each file read by a thread of its own; the buffers, and each thread's error."""
    out = [np.zeros(size, np.uint8) for size in sizes]
    errors: list[BaseException | None] = [None] * len(paths)

    def one(i):
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            queue.read(fd, offset, out[i], str(paths[i]))
        except BaseException as error:  # noqa: BLE001 - kept for the test
            errors[i] = error
        finally:
            os.close(fd)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(paths))]
    for thread in threads:
        thread.start()
        time.sleep(0.005)  # the first leads before the others ask
    for thread in threads:
        thread.join(30)
    return out, errors


@pytest.mark.parametrize("size", [4096, 3 * MiB])  # the dispatcher's small reads, and batches
def test_reads_asked_together_move_together_each_into_its_buffer(
    tmp_path, monkeypatch, moves, fresh, size
):
    monkeypatch.setattr(coalesce, "LEADERS", 1)  # one batch at a time: the rest queue
    paths = _files(tmp_path, [size + i for i in range(12)])
    queue = coalesce.Coalescer()
    out, errors = _read_all(queue, paths, [size + i for i in range(12)])
    assert errors == [None] * 12
    for path, buffer in zip(paths, out, strict=True):
        assert buffer.tobytes() == path.read_bytes()
    assert sum(moves) == 12 and max(moves[1:], default=0) >= 2, moves  # the rest queued
    assert queue.batches == len(moves)


def test_at_most_so_many_batches_move_at_once_and_the_rest_queue(tmp_path, monkeypatch, fresh):
    # A store's callers keep a window of reads in flight and ask for the next as one lands:
    # a few batches move at once, so that the disk's queue does not drain at each batch's end.
    monkeypatch.setattr(coalesce, "LEADERS", 2)
    lock, moving, most, sizes = threading.Lock(), [0], [0], []
    real = coalesce._move

    def move(group):
        with lock:
            moving[0] += 1
            most[0] = max(most[0], moving[0])
            sizes.append(len(group))
        time.sleep(0.05)
        try:
            return real(group)
        finally:
            with lock:
                moving[0] -= 1

    monkeypatch.setattr(coalesce, "_move", move)
    paths = _files(tmp_path, [4096 + i for i in range(12)])
    out, errors = _read_all(coalesce.Coalescer(), paths, [4096 + i for i in range(12)])
    assert errors == [None] * 12
    assert all(b.tobytes() == p.read_bytes() for p, b in zip(paths, out, strict=True))
    assert most[0] == 2 and sum(sizes) == 12 and max(sizes) >= 2, (most, sizes)


def test_a_short_file_fails_its_own_read_only(tmp_path, moves, fresh):
    sizes = [2 * MiB] * 6
    paths = _files(tmp_path, sizes)
    with open(paths[3], "r+b") as f:
        f.truncate(MiB)  # half of what its reader asks for
    out, errors = _read_all(coalesce.Coalescer(), paths, sizes)
    assert isinstance(errors[3], TruncatedFileError)
    for i in (0, 1, 2, 4, 5):
        assert errors[i] is None and out[i].tobytes() == paths[i].read_bytes()


def test_an_interrupt_strands_no_waiting_read(tmp_path, monkeypatch, fresh):
    # The leader's batch is interrupted (KeyboardInterrupt): every read of it, and those
    # queued behind it, raise instead of waiting forever; the next read leads again.
    paths = _files(tmp_path, [4096] * 4)
    queue = coalesce.Coalescer()
    real = coalesce._move
    entered = threading.Event()

    def interrupted(group):
        entered.set()
        time.sleep(0.2)
        raise KeyboardInterrupt

    monkeypatch.setattr(coalesce, "_move", interrupted)
    out, errors = _read_all(queue, paths, [4096] * 4)
    assert entered.is_set()
    assert all(isinstance(error, KeyboardInterrupt) for error in errors), errors
    monkeypatch.setattr(coalesce, "_move", real)
    out, errors = _read_all(queue, paths[:1], [4096])
    assert errors == [None] and out[0].tobytes() == paths[0].read_bytes()
