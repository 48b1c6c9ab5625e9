"""Counts in reprs and messages read as English ("1 array", "2 arrays"), and a future's repr
names its state in the words of the public API."""

from __future__ import annotations

import numpy as np
import pytest

import arrayio
from arrayio.api._async import AsyncFuture


def test_format_count():
    from arrayio.runtime._units import format_count

    assert format_count(0, "array") == "0 arrays"
    assert format_count(1, "array") == "1 array"
    assert format_count(2, "sample") == "2 samples"
    assert format_count(1, "entry", "entries") == "1 entry"
    assert format_count(3, "entry", "entries") == "3 entries"


def test_reader_repr_of_one_array_of_one_byte(tmp_path):
    path = tmp_path / "one.safetensors"
    arrayio.save(path, {"a": np.zeros(1, np.uint8)})
    with arrayio.open(path) as reader:
        assert repr(reader).endswith("(safetensors, 1 array, 1 byte)>")
        assert "1 array," in reader._repr_html_()
    arrayio.save(path, {"a": np.zeros(2, np.uint8), "b": np.zeros(1, np.uint8)})
    with arrayio.open(path) as reader:
        assert repr(reader).endswith("(safetensors, 2 arrays, 3 bytes)>")


def test_async_future_repr_names_public_states():
    future = AsyncFuture("save", "/x.safetensors")
    assert repr(future) == "<arrayio.AsyncFuture save '/x.safetensors' pending>"
    assert future.cancel()
    assert repr(future) == "<arrayio.AsyncFuture save '/x.safetensors' cancelled>"
    running = AsyncFuture("load", "/y")
    assert running._start()
    assert repr(running).endswith(" running>")
    running.set_result(None)
    assert repr(running).endswith(" finished>")
    failed = AsyncFuture("load", "/z")
    failed._start()
    failed.set_exception(OSError("boom"))
    assert repr(failed).endswith(" failed>")


def test_dispatch_reprs_count_contexts():
    from arrayio.dispatch.policy import Policy
    from arrayio.dispatch.table import Table

    table = Table()
    assert repr(table) == "<arrayio dispatch table, 0 contexts>"
    table.entry("read/host/2^20/x/warm/x1/crc")
    assert repr(table) == "<arrayio dispatch table, 1 context>"
    assert repr(Policy(lambda _context: [], table)) == "<arrayio dispatch policy, 1 context>"


def test_dispatch_report_counts_samples_and_calls():
    from arrayio.api._tuning import DispatchReport
    from arrayio.dispatch.policy import ArmReport, Explanation

    one = ArmReport("naive", "measured", 1.0, 1.0, 1.0, samples=1, count=1, failures=0)
    two = ArmReport("posix", "measured", 2.0, 2.0, 2.0, samples=2, count=2, failures=0)
    report = DispatchReport(
        (Explanation("k", "exploring", "naive", "exploring", (one, two)),), {}, None
    )
    text = str(report)
    assert "(1 sample, 1 call)" in text and "(2 samples, 2 calls)" in text


def test_offloader_repr_counts_arrays(tmp_path):
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 20) as offloader:
        handle = offloader.put(np.zeros(1, np.uint8))
        assert "1 array, 1/1048576 bytes held" in repr(offloader), handle


@pytest.mark.parametrize("count, expected", [(1, "1 array"), (2, "2 arrays")])
def test_cli_convert_counts_arrays(capsys, tmp_path, count, expected):
    from arrayio import cli

    arrayio.save(tmp_path / "a.safetensors", {f"k{i}": np.ones(2) for i in range(count)})
    assert cli.main(["convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.npz")]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f": {expected}")
    assert cli.main(["info", str(tmp_path / "a.safetensors")]) == 0
    out = capsys.readouterr().out
    assert f"safetensors, {expected}," in out
    assert f"checksums: CRC-32C on the header and {count} of {expected}\n" in out
