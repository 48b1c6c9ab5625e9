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
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # scratch files removed
