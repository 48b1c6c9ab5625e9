"""CI smoke tests of the benchmark harnesses: they run, and their JSON has the promised shape.

Nothing here asserts a speed: CI machines are too noisy for that. Each harness runs in a
subprocess from the repository root, with its scratch files under ``tmp_path`` and the
dispatcher's table kept in memory (``ARRAYIO_CACHE_DIR=none``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics

import numpy as np
import pytest

pytestmark = pytest.mark.slow

QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20]  # what --quick sweeps
SMALL_TRANSFER = 1 << 20


def leftovers(directory, *outputs) -> list[str]:
    """What a harness left in ``directory`` besides its ``outputs`` (and matplotlib's cache)."""
    kept = {path.name for path in outputs} | {"mpl"}
    return sorted(path.name for path in directory.iterdir() if path.name not in kept)


def is_rate(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def smoke_report(run_module, tmp_path, module: str, name: str) -> tuple[dict, object]:
    """Run ``benchmarks.<module> --smoke`` in ``tmp_path``; its report and output folder."""
    out = tmp_path / "out"
    run_module(
        f"benchmarks.{module}",
        "--smoke",
        "--out",
        str(out),
        "--dir",
        str(tmp_path),
        tmp_path=tmp_path,
    )
    return json.loads((out / f"{name}.json").read_text()), out


def test_the_sweep_runs_quick_and_reports_every_case(tmp_path, run_module):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    run_module(
        "benchmarks.sweep",
        "--quick",
        "--out",
        str(out),
        "--plot",
        str(png),
        "--dir",
        str(tmp_path),
        tmp_path=tmp_path,
    )
    report = json.loads(out.read_text())
    assert report["benchmark"] == "sweep"
    assert report["checksum"] is True and report["repeats"] == 1

    ceilings = report["ceilings"]
    assert is_rate(ceilings["warm_read_16_threads"]) and is_rate(ceilings["write_fsync"])
    for name, value in ceilings.items():
        # A ceiling that could not be measured (O_DIRECT refused) is reported as an error.
        assert is_rate(value) or (name.endswith("_error") and isinstance(value, str)), name

    rows = report["rows"]
    # Each panel measures its largest size first, right after its ceiling's search.
    for panel in {(row["direction"], row["cache"]) for row in rows}:
        order = [row["bytes"] for row in rows if (row["direction"], row["cache"]) == panel]
        assert order == sorted(QUICK_SIZES, reverse=True), panel
        assert report["panels"][f"{panel[0]}/{panel[1]}/host"]["sizes"] == QUICK_SIZES
    cases = [(row["direction"], row["cache"], row["bytes"]) for row in rows]
    assert sorted(cases) == sorted(
        [
            (direction, cache, nbytes)
            for direction, cache in (("read", "cold"), ("read", "warm"), ("write", "-"))
            for nbytes in QUICK_SIZES
        ]
    )
    for row in rows:
        case = f"{row['direction']}/{row['cache']}/{row['bytes']}"
        assert row["memory"] == "host", case
        assert is_rate(row["dispatcher_GBps"]), case
        measured = {
            label: value for label, value in row["tools_GBps"].items() if isinstance(value, float)
        }
        assert len(measured) >= 2, case
        assert all(is_rate(value) for value in measured.values()), case
        choice = row["dispatcher_choice"]
        assert isinstance(choice["arm"], str) and choice["arm"], case
        if row["bytes"] < SMALL_TRANSFER:
            assert choice == {
                "context": "small transfer, not learned",
                "arm": "naive",
                "explain": None,
            }, case
        else:
            assert choice["context"].startswith(f"{row['direction']}/host/"), case
        assert row["summary"]["best_tool"] in measured, case
        assert [sorted(order) for order in row["orders"]] == [sorted(row["seconds"])], case

    assert png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert leftovers(tmp_path, out, png) == []  # its scratch directory is removed


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("safetensors") is None,
    reason="the core baseline compares with torch and safetensors",
)
def test_the_core_baseline_runs_on_the_cpu(tmp_path, run_module):
    out = tmp_path / "c.json"
    run_module(
        "benchmarks.core_baseline",
        "--device",
        "cpu",
        "--gib",
        "0.0625",
        "--repeats",
        "1",
        "--out",
        str(out),
        "--dir",
        str(tmp_path),
        tmp_path=tmp_path,
    )
    report = json.loads(out.read_text())
    assert report["benchmark"] == "core_baseline"
    assert (report["device"], report["repeats"], report["arrays"]) == ("cpu", 1, 16)
    assert report["bytes"] == 16 * ((1 << 26) // 16 // 4) * 4
    assert report["machine"]["gpu"] is None
    assert isinstance(report["cold_cache_dropped"], bool)
    assert {"arrayio", "torch", "safetensors"} <= set(report["results"])
    for name, result in report["results"].items():
        assert is_rate(result["write_GBps"]) and is_rate(result["warm_read_GBps"]), name
        if report["cold_cache_dropped"]:
            assert is_rate(result["cold_read_GBps"]), name
        else:
            assert result["cold_read_GBps"] is None, name
        assert {kind: len(seconds) for kind, seconds in result["seconds"].items()} == {
            "write": 1,
            "cold": 1,
            "warm": 1,
        }, name
    assert leftovers(tmp_path, out) == []


def test_held_out_ratio_removes_the_winners_luck_but_not_a_real_gap():
    from benchmarks.sweep import held_out_ratio

    rng = np.random.default_rng(0)
    # Seven arms doing the same work, and a dispatcher running one of them: the best median
    # overstates the arms' speed, the held-out comparison does not.
    same = {f"arm{i}": list(1.0 + 0.1 * rng.standard_normal(11)) for i in range(7)}
    dispatcher = list(1.0 + 0.1 * rng.standard_normal(11))
    best_median = min(statistics.median(v) for v in same.values())
    assert best_median / statistics.median(dispatcher) < 0.97  # the bias it removes
    assert 0.93 < held_out_ratio(same, dispatcher) < 1.07
    # A dispatcher 30% slower than the best arm is reported as such.
    fast = {"fast": [1.0] * 8, "slow": [2.0] * 8}
    assert held_out_ratio(fast, [1.3] * 8) == pytest.approx(1 / 1.3)
    assert held_out_ratio(fast, [1.3] * 3) is None  # too few rounds to split


def test_each_round_runs_the_runners_in_its_own_order():
    from benchmarks.sweep import round_orders

    labels = ["naive", "staged", "kvikio", "dispatcher", "ceiling"]
    orders = round_orders(labels, 12, "read/cold/cuda/16777216")
    assert all(sorted(order) == sorted(labels) for order in orders)
    assert orders == round_orders(labels, 12, "read/cold/cuda/16777216")  # repeatable
    # Nobody keeps a place or a predecessor in every round.
    for label in labels:
        assert len({order.index(label) for order in orders}) > 1, label
        before = {order[order.index(label) - 1] if order.index(label) else None for order in orders}
        assert len(before) > 1, label


def test_the_sweep_judges_its_targets_on_the_ceiling_in_the_same_rounds():
    from benchmarks.sweep import targets

    def row(panel: str, nbytes: int, dispatcher: float, in_rounds: float | None) -> dict:
        direction, cache, memory = panel.split("/")
        return {
            "direction": direction,
            "cache": cache,
            "memory": memory,
            "bytes": nbytes,
            "dispatcher_GBps": dispatcher,
            "ceiling_interleaved": None
            if in_rounds is None
            else {"GBps": in_rounds, "paired_ratio": dispatcher / in_rounds},
        }

    report = {
        "ceilings": {"cold_read_direct": 3.5, "warm_read_16_threads": 40.0, "write_fsync": 3.0},
        "rows": [
            row("read/cold/cuda", 1 << 30, 3.0, 3.2),
            row("read/warm/cuda", 1 << 30, 30.0, None),
            row("write/-/cuda", 1 << 30, 2.0, 2.4),
            row("write/-/cuda", 1 << 20, 9.0, None),
        ],
    }  # not the largest size
    got = targets(report)
    cold, warm, write = got["read/cold/cuda"], got["read/warm/cuda"], got["write/-/cuda"]
    assert (cold["judged_on"], cold["ratio"], cold["met"]) == ("rounds", 3.0 / 3.2, True)
    assert cold["ratio_vs_search"] == 3.0 / 3.5
    # No sample in the rounds: the search's value.
    assert (warm["judged_on"], warm["ratio"], warm["met"]) == ("search", 0.75, False)
    assert (write["judged_on"], write["ratio"], write["met"]) == ("rounds", 2.0 / 2.4, False)
    assert write["bytes"] == 1 << 30


def test_multi_file_compares_a_checkpoint_in_files_with_one_file(tmp_path, run_module):
    pytest.importorskip("torch")  # the state dict is first_calls' (bfloat16 torch tensors)
    report, out = smoke_report(run_module, tmp_path, "multi_file", "multi_file")
    assert report["benchmark"] == "multi_file" and report["checkpoint"]["shards"] >= 2
    assert {"date", "command", "machine"} <= set(report)
    (row,) = report["rounds"]
    assert is_rate(row["one_file"]) and is_rate(row["files"]) and is_rate(row["ceiling"])
    summary = report["summary"]["warm"]
    assert summary["files_over_one"] == pytest.approx(row["files"] / row["one_file"])
    assert leftovers(tmp_path, out) == []  # the scratch checkpoint is removed


def test_zarr_write_compares_durable_writes_of_every_writer(tmp_path, run_module):
    pytest.importorskip("zarr")
    report, out = smoke_report(run_module, tmp_path, "zarr_write", "zarr_write")
    assert report["benchmark"] == "zarr_write" and {"date", "command", "machine"} <= set(report)
    ran = [
        w
        for w in ("arrayio", "nvmestore+zarr", "zarr.LocalStore", "zarrs", "tensorstore")
        if w not in report["writers_unavailable"]
    ]
    assert {"arrayio", "nvmestore+zarr", "zarr.LocalStore"} <= set(ran)
    assert {(r["chunk_bytes"], r["codec"]) for r in report["rows"]} == {
        (chunk, codec) for chunk in (1 << 20, 256 << 10) for codec in ("none", "zstd")
    }
    for row in report["rows"]:
        assert set(row["GBps"]) == set(ran) and all(is_rate(v) for v in row["GBps"].values())
        assert is_rate(row["ceiling_GBps"]) and sorted(row["order"]) == sorted(ran)
    for case in report["summary"].values():
        assert case["best_peer"] in ran and case["arrayio_over_best_peer"] > 0
    assert (out / "zarr_write.png").stat().st_size > 0
    assert leftovers(tmp_path, out) == []  # the scratch arrays are removed
