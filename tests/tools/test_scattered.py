"""``pread_scattered``: a run of host buffers, neighbours in the file, read with one
``preadv`` straight into them (the bytes between them into scratch)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayio.tools._io import _IOV_MAX, pread_scattered


def _scattered(fd: int, pieces: list, scratch: np.ndarray) -> bool:
    return pread_scattered(fd, [o for o, _ in pieces], [v for _, v in pieces], scratch)


def _file(tmp_path, nbytes: int) -> tuple[int, bytes]:
    content = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(content)
    return os.open(path, os.O_RDONLY), content


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 70), st.integers(0, 300)), min_size=1, max_size=40),
    st.integers(0, 50),
)
def test_every_piece_gets_its_own_bytes(tmp_path_factory, layout, start) -> None:
    # Pieces of any size (empty too) with gaps of any size up to the scratch's, in file order.
    tmp_path = tmp_path_factory.mktemp("scattered")
    offsets, at = [], start
    for gap, size in layout:
        at += gap
        offsets.append((at, size))
        at += size
    fd, content = _file(tmp_path, at + 10)
    try:
        pieces = [(o, np.full(n, 7, np.uint8)) for o, n in offsets]
        assert _scattered(fd, pieces, np.empty(70, np.uint8))
        for offset, view in pieces:
            assert view.tobytes() == content[offset : offset + view.nbytes]
    finally:
        os.close(fd)


def test_more_pieces_than_one_call_takes(tmp_path, monkeypatch) -> None:
    # Linux takes at most IOV_MAX buffers a call: the rest follow in further calls.
    count = 2 * _IOV_MAX + 37
    fd, content = _file(tmp_path, count * 24)
    calls: list[int] = []
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        calls.append(len(buffers))
        return real(fd, buffers, offset, *flags)

    try:
        pieces = [(24 * i + 8, np.empty(16, np.uint8)) for i in range(count)]  # 8-byte gaps
        monkeypatch.setattr(os, "preadv", preadv)
        assert _scattered(fd, pieces, np.empty(8, np.uint8))
        monkeypatch.undo()
        assert max(calls) <= _IOV_MAX and len(calls) == -(-(2 * count) // _IOV_MAX)
        for offset, view in pieces:
            assert view.tobytes() == content[offset : offset + 16]
    finally:
        os.close(fd)


def test_a_short_read_is_finished_piece_by_piece(tmp_path, monkeypatch) -> None:
    # A preadv may stop early (a signal): what is left is read, none of it lost or shifted.
    fd, content = _file(tmp_path, 4096)
    real = os.preadv
    first = [True]

    def stopping_early(fd, buffers, offset, *flags):
        if first[0]:
            first[0] = False
            return real(fd, [memoryview(buffers[0])[:5]], offset, *flags)  # 5 bytes only
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", stopping_early)
    try:
        pieces = [(0, np.empty(100, np.uint8)), (150, np.empty(1000, np.uint8))]
        assert _scattered(fd, pieces, np.empty(64, np.uint8))
        for offset, view in pieces:
            assert view.tobytes() == content[offset : offset + view.nbytes]
    finally:
        os.close(fd)


def test_a_file_that_ends_first_says_so(tmp_path) -> None:
    fd, _ = _file(tmp_path, 1000)
    try:
        pieces = [(0, np.empty(500, np.uint8)), (600, np.empty(500, np.uint8))]
        assert not _scattered(fd, pieces, np.empty(100, np.uint8))
    finally:
        os.close(fd)


@pytest.mark.parametrize("offsets", [[(0, 10), (5, 10)], [(20, 10), (0, 10)], [(0, 10), (200, 10)]])
def test_overlaps_disorder_and_wide_gaps_are_refused(tmp_path, offsets) -> None:
    # A gap wider than the scratch would shift every later piece: refused, nothing read.
    fd, _ = _file(tmp_path, 1000)
    try:
        pieces = [(o, np.empty(n, np.uint8)) for o, n in offsets]
        with pytest.raises(ValueError, match="overlap"):
            _scattered(fd, pieces, np.empty(64, np.uint8))
    finally:
        os.close(fd)
