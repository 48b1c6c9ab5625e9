"""Where a shard's bytes go in its array's (``arrays/_shards.py``): every run of a block of
any shape lands on the same bytes of the whole array, and the runs hold the shard once."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayio.arrays._shards import block_runs


@st.composite
def blocks(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    index = []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        index.append(slice(start, draw(st.integers(start + 1, n))))
    return shape, tuple(index)


@settings(max_examples=200, deadline=None)
@given(blocks(), st.sampled_from([1, 2, 4, 8]))
def test_every_run_lands_on_the_shards_bytes_in_the_array(block, itemsize):
    shape, index = block
    whole = np.arange(int(np.prod(shape)) * itemsize, dtype=np.uint8) % 251
    whole = whole.view(f"V{itemsize}").reshape(shape)
    shard = np.ascontiguousarray(whole[index]).reshape(-1).view(np.uint8)
    flat = whole.reshape(-1).view(np.uint8)
    runs = block_runs(index, shape, itemsize)
    assert runs is not None
    assert sum(n for _, _, n in runs) == shard.nbytes
    at_shard = 0
    for offset, at, n in runs:
        assert at == at_shard  # in the shard's own order
        assert flat[offset : offset + n].tobytes() == shard[at : at + n].tobytes()
        at_shard += n


def test_a_whole_row_block_is_one_run_and_columns_one_per_row():
    assert block_runs((slice(2, 4), slice(0, 5)), (6, 5), 4) == [(40, 0, 40)]
    assert block_runs((slice(2, 4), slice(1, 3)), (6, 5), 4) == [(44, 0, 8), (64, 8, 8)]
    assert block_runs((slice(0, 2, 2), slice(0, 5)), (6, 5), 4) is None  # a step: not a block
