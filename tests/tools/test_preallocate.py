"""Reserving a file's blocks before a large write (``arrayio.tools._io.preallocate``).

ext4 lets parallel ``O_DIRECT`` writers overlap only where the blocks are already reserved,
so arrayio reserves a write's range, or a batch's whole span, once before any tool starts.
These tests pin that

* the reservation covers exactly the bytes to be written and sets the file's size to their
  end, and is skipped where the file already reaches that far;
* a save reserves its data once, from the first array's byte to the file's end, whatever
  the number of arrays (reserving per array would wait for the writes in flight);
* a file system without ``fallocate`` changes nothing: the save works;
* a disk without room fails the save before anything is written, and the old file stays.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arrayio
from arrayio.formats import npy, safetensors
from arrayio.tools import _io

MiB = 1 << 20


class FakeFallocate:
    """Stands in for the C library's ``fallocate``: records each call, and either fails with
    ``error`` or calls the real one."""

    def __init__(self, error: int | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.error = error
        self.real = _io._fallocate()

    def __call__(self, fd: int, mode: int, offset: int, length: int) -> int:
        assert mode == 0
        self.calls.append((fd, offset, length))
        if self.error is not None:
            ctypes.set_errno(self.error)
            return -1
        if self.real is None:
            return 0
        return self.real(fd, mode, offset, length)


@pytest.fixture
def fake_fallocate(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeFallocate]:
    def install(error: int | None = None) -> FakeFallocate:
        fake = FakeFallocate(error)
        monkeypatch.setattr(_io, "_fallocate", lambda: fake)
        return fake

    return install


def real_fallocate_or_skip(path: Path) -> None:
    with open(path, "wb") as f:
        if not _io.preallocate(f.fileno(), 0, 4096):
            pytest.skip("fallocate is not supported on this file system")


def test_preallocate_reserves_the_range_and_sets_the_size(tmp_path: Path) -> None:
    real_fallocate_or_skip(tmp_path / "probe")
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert _io.preallocate(fd, 3 * MiB, 5 * MiB)
        st = os.fstat(fd)
        assert st.st_size == 8 * MiB
        assert st.st_blocks * 512 >= 5 * MiB  # the blocks are there, not a sparse file
        assert os.pread(fd, 4096, 7 * MiB) == bytes(4096)  # reserved bytes read as zeros
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [8 * MiB, 9 * MiB])
def test_preallocate_skips_a_file_that_already_reaches_the_end(
    tmp_path: Path, fake_fallocate: Callable[..., FakeFallocate], size: int
) -> None:
    fake = fake_fallocate()
    path = tmp_path / "f"
    path.write_bytes(b"")
    os.truncate(path, size)
    fd = os.open(path, os.O_RDWR)
    try:
        assert not _io.preallocate(fd, 0, 8 * MiB)
        assert not _io.preallocate(fd, 2 * MiB, 0)
    finally:
        os.close(fd)
    assert fake.calls == []
    assert path.stat().st_size == size


def test_save_reserves_its_data_once(
    tmp_path: Path, fake_fallocate: Callable[..., FakeFallocate]
) -> None:
    fake = fake_fallocate()
    rng = np.random.default_rng(0)
    tree = {
        "a": rng.standard_normal(MiB // 4, dtype=np.float32),  # 1 MiB
        "b": rng.integers(0, 255, 3 * MiB + 5, dtype=np.uint8),
        "bias": np.arange(10, dtype=np.float32),
        "c": rng.standard_normal((512, 1024)).astype(np.float64),
    }  # 4 MiB
    path = tmp_path / "ckpt.safetensors"
    arrayio.save(path, tree)
    with open(path, "rb") as f:
        header = safetensors.read_header(f.fileno(), str(path))
    first = min(entry.start for entry in header.entries.values())
    assert len(fake.calls) == 1
    _, offset, length = fake.calls[0]
    assert (offset, offset + length) == (first, path.stat().st_size)
    loaded = arrayio.load(path)
    for key, value in tree.items():
        np.testing.assert_array_equal(loaded[key], value)


def test_npy_save_reserves_the_array_after_its_header(
    tmp_path: Path, fake_fallocate: Callable[..., FakeFallocate]
) -> None:
    fake = fake_fallocate()
    array = np.arange(3 * MiB // 8, dtype=np.float64)
    path = tmp_path / "a.npy"
    arrayio.save(path, array)
    with open(path, "rb") as f:
        header = npy.read_header(f.fileno(), str(path))
    assert [(o, n) for _, o, n in fake.calls] == [(header.data_start, array.nbytes)]
    np.testing.assert_array_equal(np.load(path), array)


def test_small_saves_reserve_nothing(
    tmp_path: Path, fake_fallocate: Callable[..., FakeFallocate]
) -> None:
    fake = fake_fallocate()
    arrayio.save(tmp_path / "s.safetensors", {"a": np.ones(1000), "b": np.zeros(3)})
    arrayio.save(tmp_path / "s.npy", np.ones(1000))
    assert fake.calls == []


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_save_without_fallocate_still_works(
    tmp_path: Path, fake_fallocate: Callable[..., FakeFallocate], code: int
) -> None:
    fake = fake_fallocate(code)
    tree = {"w": np.arange(MiB, dtype=np.float32), "b": np.ones(7, np.int8)}
    path = tmp_path / "x.safetensors"
    arrayio.save(path, tree)
    assert len(fake.calls) == 1
    loaded = arrayio.load(path)
    np.testing.assert_array_equal(loaded["w"], tree["w"])
    np.testing.assert_array_equal(loaded["b"], tree["b"])


@pytest.mark.parametrize(
    "name,old,new",
    [
        ("ckpt.safetensors", {"w": np.arange(10.0)}, {"w": np.arange(MiB, dtype=np.float32)}),
        ("a.npy", np.arange(10.0), np.arange(MiB, dtype=np.float32)),
    ],
)
def test_no_room_fails_before_writing_and_keeps_the_old_file(
    tmp_path: Path, fake_fallocate: Callable[..., FakeFallocate], name: str, old: Any, new: Any
) -> None:
    path = tmp_path / name
    arrayio.save(path, old)
    before = path.read_bytes()
    fake = fake_fallocate(errno.ENOSPC)
    written: list[int] = []
    real_pwritev = os.pwritev

    def counting_pwritev(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        written.append(offset)
        return real_pwritev(fd, buffers, offset, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "pwritev", counting_pwritev)
        with pytest.raises(OSError) as raised:
            arrayio.save(path, new)
    assert raised.value.errno == errno.ENOSPC
    assert len(fake.calls) == 1 and written == []
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
