"""CI smoke test of ``benchmarks.sharded``: a 2 MiB pytree over 8 CPU host devices, one
timed round, with whichever optional peers (orbax, tensorstore) are installed, and once
with both hidden, as on a machine without them.

Nothing here asserts a speed: only that every figure is there, positive and finite, beside
the ceilings, and that a missing peer is reported as unavailable, with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

OPTIONAL = ("orbax", "tensorstore")
QUANTITIES = ("save", "restore", "reshard")
CEILINGS = ("write_fsync", "warm_read")


def is_rate(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def smoke(run_module: Any, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "out"
    run_module(
        "benchmarks.sharded",
        *("--out", str(out), "--gib", "0.002", "--devices", "8", "--repeats", "1"),
        *("--dir", str(tmp_path), "--seed", "1"),
        tmp_path=tmp_path,
        timeout=120,
    )
    assert (out / "sharded.png").stat().st_size > 0
    report: dict[str, Any] = json.loads((out / "sharded.json").read_text())
    return report


def check_common(report: dict[str, Any]) -> None:
    """What every run reports: the ceilings, arrayio beside them, every round's figures."""
    assert report["benchmark"] == "sharded" and report["devices"] == 8
    assert {"date", "command", "machine", "versions"} <= set(report)
    # What the dispatcher chose for the restores it learned from (arrays of 1 MiB and more).
    assert "dispatcher" in report and "GB/s" in report["dispatcher"]
    summary = report["summary"]
    for name in CEILINGS:
        # A setting the scratch file system refuses says why instead.
        assert is_rate(summary["ceilings"][name]["GBps"]) or report["ceilings"][name]["error"]
        assert len(summary["ceilings"][name]["rounds_GBps"]) == 1
    (ceiling_round,) = report["ceiling_rows"]
    assert set(ceiling_round) == {"repetition", "write_fsync_s", "warm_read_s", "memory_copy_s"}
    assert is_rate(summary["ceilings"]["memory_copy"]["GBps"])
    # The untimed round runs the peers only; the timed one interleaves the ceilings.
    assert "ceilings" not in report["orders"][0] and "ceilings" in report["orders"][1]
    arrayio = summary["peers"]["arrayio"]
    for quantity in QUANTITIES:
        assert is_rate(arrayio[quantity]), quantity
        assert arrayio["rounds_GBps"][quantity] == [arrayio[quantity]]
        assert is_rate(arrayio["vs_ceiling"][quantity]), quantity
    assert arrayio["save_peak_extra_bytes"] >= 0


def test_every_installed_peer_is_measured_and_the_others_say_why(
    run_module: Any, tmp_path: Path
) -> None:
    report = smoke(run_module, tmp_path)
    check_common(report)
    peers, unavailable = report["summary"]["peers"], report["peers_unavailable"]
    for name in OPTIONAL:
        assert (name in peers) != (name in unavailable), name
        if name in unavailable:
            assert "Error" in unavailable[name], name
            continue
        for quantity in QUANTITIES:
            assert is_rate(peers[name][quantity]) and is_rate(peers[name]["vs_ceiling"][quantity])
    if "orbax" in peers:
        # OCDBT is orbax's default layout here: the one orbax peer is it, and says so.
        assert report["orbax_layout"] == {"ocdbt": True, "use_ocdbt_default": True}
        for name in set(peers) - {"orbax"}:
            assert all(is_rate(peers[name]["vs_orbax"][q]) for q in QUANTITIES), name


def test_missing_peers_are_listed_as_unavailable(
    run_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Packages of the same names first on the path, that fail to import, hide the real ones.
    hidden = tmp_path / "hidden"
    for name in OPTIONAL:
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    path = os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    report = smoke(run_module, tmp_path)
    check_common(report)
    assert set(report["summary"]["peers"]) == {"arrayio"}
    for name in OPTIONAL:
        assert "hidden by the test" in report["peers_unavailable"][name], name
    assert report["orbax_layout"] is None
    assert "vs_orbax" not in report["summary"]["peers"]["arrayio"]


def test_cold_restores_scaling_and_a_tensor_parallel_checkpoint(run_module: Any, tmp_path: Path):
    # One process: restores after eviction beside the disk's read ceiling, restores onto 1,
    # 2 and 4 of the 8 devices, and the Hugging Face checkpoint in 4 files loaded with a
    # slice per device (the torch peers need one process per GPU: they say so).
    out = tmp_path / "out"
    run_module(
        "benchmarks.sharded",
        *("--out", str(out), "--gib", "0.002", "--devices", "8", "--repeats", "1"),
        *("--dir", str(tmp_path), "--seed", "1", "--cold", "--scaling", "--peers", ""),
        *("--hf-gib", "0.01", "--hf-files", "4", "--ceiling-gib", str(1 / 1024)),
        *("--restore-tool", "naive"),
        tmp_path=tmp_path,
        timeout=120,
    )
    report = json.loads((out / "sharded.json").read_text())
    assert report["complete"] and report["processes"] == 1
    # The same checkpoint restored naming the tool, right after arrayio in every round.
    assert report["restore_tool"] == "naive"
    assert all(order[order.index("arrayio") + 1] == "arrayio+naive" for order in report["orders"])
    named = report["summary"]["peers"]["arrayio+naive"]
    assert "save" not in named and "save_peak_extra_bytes" not in named
    for quantity in ("restore", "reshard", "cold_restore", *report["scaling"]):
        assert is_rate(named[quantity]) and is_rate(named["vs_ceiling"][quantity]), quantity
    assert report["ceilings"]["bytes"] == 1 << 20 != report["nbytes"]  # --ceiling-gib
    assert report["scaling"] == ["restore_n1", "restore_n2", "restore_n4"]
    (ceiling_round,) = report["ceiling_rows"]
    cold = {"cold_read_s", "cold_buffered_read_s"}
    assert set(ceiling_round) == {
        "repetition",
        "write_fsync_s",
        "warm_read_s",
        "memory_copy_s",
        *cold,
    }
    summary = report["summary"]
    arrayio = summary["peers"]["arrayio"]
    # A cold restore is also judged against the disk's buffered rate (no GPU: no copy ceiling).
    assert set(arrayio["vs_tighter_ceilings"]["cold_restore"]) == {"cold_buffered_read"}
    assert arrayio["vs_tighter_ceilings"]["restore"] == {}
    for quantity in ("save", "restore", "reshard", "cold_restore", *report["scaling"]):
        assert is_rate(arrayio[quantity]), quantity
    assert set(summary["per_device"]["restore"]) == {"1", "2", "4", "8"}
    tp = summary["peers"]["arrayio-tp"]
    assert is_rate(tp["tp_warm"]) and is_rate(tp["tp_cold"])
    assert report["tensor_parallel"]["files"] == 4 and report["tensor_parallel"]["split_tensors"]
    for name in ("fastsafetensors-tp", "instanttensor-tp"):
        assert "one process per GPU" in report["peers_unavailable"][name]
    assert set(summary["peers"]) == {"arrayio", "arrayio+naive", "arrayio-tp"}
    assert (out / "sharded.png").stat().st_size > 0


def test_one_process_per_device_group_joined_by_jax_distributed(run_module: Any, tmp_path: Path):
    # Two processes of 2 host devices each: every figure is timed from all processes' start
    # to the last one's end, and every restore checked across them.
    out = tmp_path / "out"
    result = run_module(
        "benchmarks.sharded",
        *("--out", str(out), "--gib", "0.002", "--devices", "4", "--processes", "2"),
        *("--repeats", "1", "--dir", str(tmp_path), "--seed", "1", "--cold"),
        *("--peers", "tensorstore", "--hf-gib", "0.01"),
        tmp_path=tmp_path,
        timeout=180,
    )
    report = json.loads((out / "sharded.json").read_text())
    assert report["complete"] and (report["processes"], report["devices"]) == (2, 4)
    # tensorstore's peer runs in one process only (where tensorstore is installed at all).
    why = report["peers_unavailable"]["tensorstore"]
    installed = importlib.util.find_spec("tensorstore") is not None
    assert "one process only" in why if installed else "No module named" in why
    # Each process samples the ceilings on its own share of the bytes, all at once.
    ceilings = report["ceilings"]
    assert ceilings["bytes"] == 2 * ceilings["bytes_per_process"] >= report["nbytes"]
    assert report["summary"]["ceilings"]["cold_read"]["rounds_GBps"]
    assert report["summary"]["ceilings"]["cold_buffered_read"]["rounds_GBps"]
    # Their save is also judged against their writes into one shared file.
    assert report["ceilings"]["write_fsync_shared"]["bytes"] == ceilings["bytes"]
    save_also = report["summary"]["peers"]["arrayio"]["vs_tighter_ceilings"]["save"]
    assert set(save_also) == {"write_fsync_shared"} and save_also["write_fsync_shared"] > 0
    peers = report["summary"]["peers"]
    assert set(peers) == {"arrayio", "arrayio-tp"}
    for quantity in ("save", "restore", "reshard", "cold_restore"):
        assert is_rate(peers["arrayio"][quantity]), quantity
    assert is_rate(peers["arrayio-tp"]["tp_cold"])
    # Each process's own seconds (its start to its own arrays ready) beside the run's, which
    # waits for the slowest; and each process's dispatcher, as it learned on its own.
    (row,) = [r for r in report["rows"] if r["peer"] == "arrayio"]
    for quantity in ("save", "restore", "reshard", "cold_restore"):
        each = row[f"{quantity}_each_process_seconds"]
        # (process 0 times the run from its own start; another may leave the barrier first)
        assert len(each) == 2 and min(each) > 0 and each[0] <= row[f"{quantity}_s"], quantity
        # the pages the kernel moved to its active list meanwhile (Linux's /proc/vmstat)
        assert isinstance(row[f"{quantity}_pgactivate"], int), quantity
    dispatchers = report["dispatchers"]
    assert len(dispatchers) == 2 and dispatchers[0] == report["dispatcher"]
    assert all("arrayio dispatch table" in text for text in dispatchers)
    assert not list(tmp_path.glob("process-text-*"))
    # The rows came as they were measured: one line each, after the run's description.
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ABOUT", "{"))]
    assert lines[0].startswith("ABOUT ")
    assert sum(line.startswith('{"peer"') for line in lines) == 2


def test_each_ceiling_is_a_rate_of_its_own_bytes() -> None:
    # The host-to-device ceiling copies its own bytes (every GPU's share), not the disk
    # ceilings' file: each ceiling's rate, and each ratio to it, uses its own.
    from benchmarks import sharded

    report = {
        "nbytes": 8 * 10**9,
        "ceilings": {
            "bytes": 4 * 10**9,
            "warm_read": {"setting": "posix"},
            "host_to_device": {"bytes": 2 * 10**9, "setting": "torch"},
        },
        "ceiling_rows": [{"repetition": 1, "warm_read_s": 0.1, "host_to_device_s": 0.1}],
        "rows": [{"peer": "arrayio", "repetition": 1, "restore_s": 0.4}],
    }
    summary = sharded.summarize(report)
    assert summary["ceilings"]["warm_read"]["GBps"] == pytest.approx(40.0)
    assert summary["ceilings"]["host_to_device"]["GBps"] == pytest.approx(20.0)
    arrayio = summary["peers"]["arrayio"]
    assert arrayio["vs_ceiling"]["restore"] == pytest.approx(0.5)
    assert arrayio["vs_tighter_ceilings"]["restore"] == {"host_to_device": pytest.approx(1.0)}
