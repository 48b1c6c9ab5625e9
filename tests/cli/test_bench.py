"""``arrayio bench`` (:mod:`arrayio.cli._sweep`): the columns of one table measure the same thing.

Every write arm, the dispatcher's included, is timed until its bytes are on the device: the
dispatcher leaves small writes (below 1 MiB) unflushed, to the save's final fsync, so timing
its bare call against flushed tools compared the page cache with the disk.
"""

from __future__ import annotations

import collections

from arrayio.cli import _sweep as _bench
from arrayio.dispatch.dispatcher import SMALL_TRANSFER


def test_every_write_arm_is_flushed_small_sizes_included(tmp_path, fresh, monkeypatch):
    flushed: collections.Counter[str] = collections.Counter()
    arm = [""]
    measure, flush = _bench._measure, _bench.flush_range

    def measuring(name, *args, **kwargs):
        arm[0] = name
        return measure(name, *args, **kwargs)

    def flushing(fd, offset, nbytes):
        flushed[arm[0]] += 1
        flush(fd, offset, nbytes)

    monkeypatch.setattr(_bench, "_measure", measuring)
    monkeypatch.setattr(_bench, "flush_range", flushing)
    size = 256 << 10
    assert size < SMALL_TRANSFER  # the dispatcher's own path does not flush here
    result = _bench.run(
        tmp_path, sizes=[size], directions=["write"], tool_names=["naive"], repeats=1
    )
    assert {row.arm for row in result.rows} == {"naive", "dispatcher"}
    assert all(row.gbps for row in result.rows)
    assert flushed["naive"] > 0 and flushed["dispatcher"] >= flushed["naive"]
    assert "write, host memory, flushed to the device" in result.table()
