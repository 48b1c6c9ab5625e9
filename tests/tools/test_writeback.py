"""Buffered writes start their pages' writeback as they go (``arrayio.tools._io``).

Every write of arrayio's is flushed before its call returns; left to the kernel, a buffered
write's pages would wait in the page cache until that flush, the disk idle while the bytes
are copied. These tests pin that

* a write of ``WRITEBACK_FROM`` bytes or more asks the kernel to start writing its range back
  (``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE`` alone: nothing waits), and a smaller
  one does not ask;
* a save through a threaded buffered tool asks for each piece it writes, covering the data;
* a platform or file system without ``sync_file_range`` loses nothing: the bytes are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arrayio
from arrayio.tools import _io


def _recording(monkeypatch: pytest.MonkeyPatch, result: int = 0) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes, flags))
        return result

    monkeypatch.setattr(_io, "_sync_file_range", lambda: sync_file_range)
    return calls


def test_a_large_write_starts_its_writeback_and_a_small_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _recording(monkeypatch)
    data = np.arange(_io.WRITEBACK_FROM + 5, dtype=np.uint8)
    with open(tmp_path / "f", "wb") as file:
        assert _io.pwrite_full(file.fileno(), data, 100) == data.nbytes
        assert calls == [(100, data.nbytes, 2)]  # SYNC_FILE_RANGE_WRITE: no wait
        _io.pwrite_full(file.fileno(), data[: _io.WRITEBACK_FROM - 1], 100 + data.nbytes)
        assert len(calls) == 1
    assert (tmp_path / "f").read_bytes()[100 : 100 + data.nbytes] == data.tobytes()


def test_a_buffered_save_starts_the_writeback_of_every_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _recording(monkeypatch)
    arrays = {f"a{i}": np.full(3 << 20, i, np.uint8) for i in range(4)}
    path = tmp_path / "m.safetensors"
    arrayio.save(path, arrays, tool="posix(threads=2,task_size=4194304)")
    asked = sorted((offset, offset + nbytes) for offset, nbytes, flags in calls if flags == 2)
    covered, end = 0, None
    for start, stop in asked:  # the asked ranges cover the arrays' bytes
        if end is None or start > end:
            end = start
        covered += max(0, stop - max(start, end))
        end = max(end, stop)
    assert covered >= sum(a.nbytes for a in arrays.values())
    loaded: dict[str, Any] = arrayio.load(path)
    assert all(np.array_equal(loaded[k], v) for k, v in arrays.items())


@pytest.mark.parametrize("missing", [True, False], ids=["no sync_file_range", "refused"])
def test_without_sync_file_range_the_bytes_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: bool
) -> None:
    if missing:
        monkeypatch.setattr(_io, "_sync_file_range", lambda: None)
    else:
        _recording(monkeypatch, result=-1)
    data = np.arange(2 * _io.WRITEBACK_FROM, dtype=np.uint8)
    with open(tmp_path / "f", "wb") as file:
        assert _io.pwrite_full(file.fileno(), data, 0) == data.nbytes
    assert (tmp_path / "f").read_bytes() == data.tobytes()
