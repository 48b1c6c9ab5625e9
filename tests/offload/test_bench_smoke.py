"""benchmarks/offload_train.py --smoke runs on the CPU and writes the promised JSON."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_offload_train_smoke(tmp_path) -> None:
    frameworks = "torch,jax" if importlib.util.find_spec("jax") else "torch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARRAYIO_")}
    env.update(ARRAYIO_CACHE_DIR="none", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "benchmarks.offload_train",
            "--smoke",
            "--framework",
            frameworks,
            "--out",
            str(tmp_path / "out"),
            "--scratch",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "out" / "offload_train.json").read_text())
    assert report["benchmark"] == "offload_train" and report["smoke"] is True
    for name in frameworks.split(","):
        section = report[name]
        fit = section["fit"]
        assert fit["memory"]["fits"] and fit["memory"]["step_s"] > 0
        assert fit["activation_bytes"] > 0
        rows = fit["offload"]
        assert rows and all(row["fits"] for row in rows)
        # The smallest offloader budget must have spilled and read back. (Losses are not
        # compared: the model trains on across measurements; the hook tests compare
        # gradients.)
        smallest = min(rows, key=lambda row: row["keep_fraction"])
        assert smallest["offloader"]["bytes_written"] > 0
        assert smallest["offloader"]["bytes_read"] > 0
        assert math.isfinite(smallest["loss"])
        assert "summary" in section
    _check_planned_rows(report["torch"])
    _check_planned_batches(report["torch"])
    if "jax" in report:
        _check_jax_planned_rows(report["jax"])
    assert (tmp_path / "out" / "offload_train.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # scratch files removed


def _check_planned_rows(section: dict) -> None:
    """The planned modes ran on the CPU: no host tier there, the plan and its prediction
    recorded beside the measured steps, and the gradients unchanged."""
    rows = section["fit"]["planned"]
    assert [row["mode"] for row in rows] == ["max_overhead=0.1", "budget=0.3"]
    for row in rows:
        assert row["fits"] and row["step_s"] > 0 and row["plain_step_s"] > 0
        assert row["predicted_step_s"] >= row["recorded_step_s"] > 0
        assert row["roofline_s"] == max(row["roofline_terms_s"].values())
        assert row["roofline_terms_s"]["compute"] == row["recorded_step_s"]
        assert row["bound"] in ("compute", "pcie", "disk")
        assert set(row["tiers"]) == {"device", "host", "disk"}
        assert row["tiers"]["host"]["tensors"] == 0  # host arrays skip the host tier
        assert row["rates"]["host_bytes"] == 0 and row["rates"]["to_host"] is None
        assert row["rates"]["disk_write"] > 0 and row["host_tier"]
        assert row["planned_blocks"] >= 2 and row["planned_block_s"] > 0
        assert row["grads_agree"] and row["grad_rel_diff"] == 0.0
        assert "spill plan (" in row["explain"] and "measured" in row["explain"]
    budget = rows[1]
    assert budget["device_budget_bytes"] == int(0.3 * section["fit"]["activation_bytes"])
    met = budget["predicted_peak_saved_bytes"] <= budget["device_budget_bytes"]
    assert met or any("no spill plan meets" in w for w in budget["warnings"])
    assert budget["tiers"]["disk"]["tensors"] > 0
    assert budget["offloader"]["bytes_written"] > 0 and budget["offloader"]["bytes_read"] > 0
    assert [r["mode"] for r in section["summary"]["planned_rows"]] == [r["mode"] for r in rows]


def _check_jax_planned_rows(section: dict) -> None:
    """JAX's planned modes ran on the CPU through plan_array_step and array_step: each plan
    made in one process and run in another, the gradients' bytes those of the plain step."""
    rows = section["fit"]["planned"]
    assert [row["mode"] for row in rows] == ["max_overhead=0.1", "budget=0.3"]
    for row in rows:
        assert row["fits"] and row["step_s"] > 0 and row["plain_step_s"] > 0
        assert row["overhead"] == row["step_s"] / row["plain_step_s"] - 1
        assert row["predicted_step_s"] >= row["recorded_step_s"] > 0
        assert set(row["tiers"]) == {"device", "host", "disk"}
        assert row["tiers"]["host"]["tensors"] == 0 and row["host_tier"]  # host arrays
        assert row["plain_steps_agree"] and row["grads_agree"]
        assert row["planned_blocks"] == 1 and row["planned_block_s"] > 0  # the timed steps
        assert "spill plan (" in row["explain"] and "measured" in row["explain"]
    budget = rows[1]
    assert budget["device_budget_bytes"] == int(0.3 * section["fit"]["activation_bytes"])
    assert budget["tiers"]["disk"]["tensors"] > 0
    assert budget["offloader"]["bytes_written"] > 0 and budget["offloader"]["bytes_read"] > 0
    assert [r["mode"] for r in section["summary"]["planned_rows"]] == [r["mode"] for r in rows]


def _check_planned_batches(section: dict) -> None:
    """(5) ran its one CPU batch, twice the largest, planned within 0.3 of its activations,
    the plain step timed beside it; the summary names the largest within the overhead."""
    rows = section["fit"]["planned_batches"]
    assert [row["batch_tokens"] for row in rows] == [2 * section["fit"]["batch_tokens"]]
    row = rows[0]
    assert row["fits"] and row["recorded_without_the_limit"]
    assert row["step_s"] > 0 and row["plain_step_s"] > 0 and row["recorded_forward_s"] > 0
    assert 0 < row["recorded_forward_s"] < row["recorded_step_s"]
    assert row["saved_bytes"] >= row["tiers"]["disk"]["bytes"] > 0
    assert row["overhead"] == row["step_s"] / row["plain_step_s"] - 1
    summary = section["summary"]
    assert summary["planned_batch_rows"][0]["batch_tokens"] == row["batch_tokens"]
    within = row["overhead"] <= 0.1
    assert summary["largest_planned_batch_within_overhead"] == (
        row["batch_tokens"] if within else None
    )


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.parametrize("error", ["out of memory", "other"])
def test_a_planned_batch_puts_the_memory_limit_back_whatever_fails(tmp_path, monkeypatch, error):
    # (5) records a batch too large for the budget without the limit: the limit comes back
    # whether the row fits, runs out of memory (recorded) or fails otherwise (raised).
    import types

    import torch

    from benchmarks import offload_train as bench

    cfg = bench.Config(
        width=16, depth=2, budget=1 << 30, steps=1, batches=[8], max_batch=8,
        keep_fractions=[0.5], scratch=str(tmp_path), deadline=math.inf, device="cpu",
        smoke=True,
    )  # fmt: skip
    runner = bench._TorchRunner(cfg)
    fractions: list[float] = []

    class OutOfMemory(RuntimeError):
        pass

    fake_cuda = types.SimpleNamespace(
        set_per_process_memory_fraction=fractions.append,
        empty_cache=lambda: None,
        reset_peak_memory_stats=lambda: None,
        max_memory_allocated=lambda: 0,
        synchronize=lambda: None,
        OutOfMemoryError=OutOfMemory,
    )
    runner.torch = types.SimpleNamespace(cuda=fake_cuda)
    monkeypatch.setattr(bench, "_did_not_fit", lambda row, e: row.update(fits=False))
    runner.cuda, runner.total = True, 4 << 30

    def batch(tokens):  # the batch itself runs out of memory, before any step
        if error == "out of memory":
            raise OutOfMemory()
        return torch.zeros(tokens, cfg.width)

    def step(*args, **kwargs):
        raise ValueError("a disk full, say")

    runner.batch, runner.step = batch, step
    if error == "out of memory":
        row = runner.measure_planned(8, "budget", 0.5, 1 << 20, steps=1, record_unlimited=True)
        assert row["fits"] is False
    else:
        with pytest.raises(ValueError):
            runner.measure_planned(8, "budget", 0.5, 1 << 20, steps=1, record_unlimited=True)
    assert fractions == [1.0, 0.25]  # lifted, then the budget's share again
