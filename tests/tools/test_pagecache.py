"""The pagecache tool (:mod:`arrayio.tools.pagecache`): its plan of mappings and windows,
checked on the CPU for any requests and file; its reads into GPU memory, on the GPU machine
(the conformance suite, and a load that names it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayio import tools
from arrayio.errors import ToolUnavailableError
from arrayio.tools.pagecache import PAGE, plan

requests_strategy = st.lists(
    st.tuples(st.integers(0, 5 * PAGE), st.integers(0, 6 * PAGE)), max_size=6
).map(lambda gaps_sizes: _in_file_order(gaps_sizes))


def _in_file_order(gaps_sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Requests in file order, none overlapping: each starts a gap after the one before."""
    requests, at = [], 0
    for gap, size in gaps_sizes:
        requests.append((at + gap, size))
        at += gap + size
    return requests


@settings(max_examples=300, deadline=None)
@given(
    requests=requests_strategy,
    file_size=st.integers(0, 40 * PAGE),
    window=st.integers(1, 8).map(lambda pages: pages * PAGE + 17),
)
def test_the_plan_copies_every_byte_to_the_end_of_the_file_once(requests, file_size, window):
    map_start, map_length, windows = plan(requests, file_size, window)
    expected = {
        (index, offset + k)
        for index, (offset, size) in enumerate(requests)
        for k in range(min(size, max(0, file_size - offset)))
    }
    copied = []
    for window_ in windows:
        # whole pages, inside the mapping's pages, which hold no page past the end of the file
        assert window_.start % PAGE == 0 and window_.length % PAGE == 0
        assert 0 < window_.length <= window - window % PAGE
        assert window_.start + window_.length <= -(-map_length // PAGE) * PAGE
        assert window_.copies, "a window with nothing to copy is registered for nothing"
        for copy in window_.copies:
            assert window_.start <= copy.source
            assert copy.source + copy.nbytes <= window_.start + window_.length
            offset = requests[copy.request][0]
            assert map_start + copy.source == offset + copy.target
            copied += [(copy.request, offset + copy.target + k) for k in range(copy.nbytes)]
    assert len(copied) == len(set(copied)), "a byte copied twice"
    assert set(copied) == expected
    # a mapping past the end of the file is refused (mmap.mmap raises ValueError)
    assert map_start % PAGE == 0 and map_start + map_length <= file_size
    starts = [w.start for w in windows]
    assert starts == sorted(starts)
    assert all(a.start + a.length <= b.start for a, b in zip(windows, windows[1:], strict=False))


def test_nothing_to_read_maps_nothing():
    assert plan([], 100, 1 << 20) == (0, 0, [])
    assert plan([(50, 0), (200, 10)], 100, 1 << 20) == (0, 0, [])


def test_it_is_registered_and_says_why_it_cannot_run():
    assert "pagecache" in tools.names()
    tool = tools.make("pagecache", threads=3, window=1 << 20)
    assert tool.label == "pagecache(threads=3,window=1048576)"
    assert tool.capabilities.serves("read", "cuda")
    assert not tool.capabilities.serves("read", "host")
    assert not tool.capabilities.serves("write", "cuda")
    assert not tool.capabilities.checksums
    availability = type(tool).availability()
    assert availability or availability.reason


def test_it_refuses_host_memory_and_writes(tmp_path):
    tool = tools.make("pagecache")
    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * 10_000)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(TypeError, match="device memory"):
            tool.pread(fd, np.empty(100, np.uint8), 0)
        with pytest.raises(ToolUnavailableError, match="reads only"):
            tool.pwrite(fd, np.empty(100, np.uint8), 0)
    finally:
        os.close(fd)
        tool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("like", ["cupy", "torch"])
def test_a_load_that_names_it_reads_exactly(tmp_path, like):
    import arrayio

    if not tools.tool_class("pagecache").availability():
        pytest.skip(tools.tool_class("pagecache").availability().reason)
    framework = pytest.importorskip(like)
    rng = np.random.default_rng(9)
    arrays = {
        "embed": rng.normal(size=(3000, 1000)).astype(np.float32),  # several windows
        "norm": rng.normal(size=(7,)).astype(np.float32),  # shares a page with its neighbours
        "odd": rng.integers(0, 255, 12_345, dtype=np.uint8),
        "empty": np.zeros((0, 4), np.float32),
    }
    path = tmp_path / "model.safetensors"
    arrayio.save(path, arrays)
    os.sync()
    loaded = arrayio.load(path, like=like, device="cuda", tool="pagecache(window=1048576)")
    for key, expected in arrays.items():
        got = loaded[key]
        host = got.cpu().numpy() if like == "torch" else framework.asnumpy(got)
        np.testing.assert_array_equal(host, expected)
