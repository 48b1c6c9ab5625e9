"""examples/jax_offload.py runs, spills, trains (its loss falls), and reproduces the losses and
parameters of the run without offloading."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "jax_offload.py"


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
@pytest.mark.parametrize("plan", [[], ["--plan-overhead", "0.1"]], ids=["budget", "planned"])
def test_jax_example(tmp_path, plan) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(EXAMPLE),
            "--batch",
            "256",
            "--width",
            "128",
            "--depth",
            "6",
            "--steps",
            "3",
            "--budget-mib",
            "0.25",
            "--dir",
            str(tmp_path),
            *plan,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "losses and parameters identical to the run without offloading: True" in result.stdout
    # It trains: every step's loss is lower than the one before.
    losses = [
        float(line.split("loss ")[1].split(" ")[0])
        for line in result.stdout.splitlines()
        if line.startswith("step ")
    ]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], result.stdout
    written = float(result.stdout.split("written ")[1].split(" MiB")[0])
    assert written > 0
    assert list(tmp_path.iterdir()) == []  # the offloader removed its directory
    if plan:  # the plan made from a recorded step, and the steps timed under it
        assert "spill plan (max_overhead=0.1)" in result.stdout
        assert "median of 1)" in result.stdout  # the steps after the first two
