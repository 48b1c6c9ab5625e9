"""CI smoke test of benchmarks/zstd_decode.py: it runs at a tiny size on the CPU and its JSON
has the promised shape. The GPU rows are skipped, with the reason recorded; nothing here
asserts a speed."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("zarr")
pytest.importorskip("numcodecs")

pytestmark = pytest.mark.slow


def is_rate(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_the_zstd_benchmark_runs_tiny_on_the_cpu(tmp_path, run_module):
    run_module(
        "benchmarks.zstd_decode",
        "--out",
        str(tmp_path),
        "--no-gpu",
        "--gib",
        "0.004",
        "--chunk-mib",
        "0.25",
        "1",
        "--threads",
        "2",
        tmp_path=tmp_path,
        timeout=120,
    )
    report = json.loads((tmp_path / "zstd_decode.json").read_text())
    assert report["benchmark"] == "zstd_decode" and report["repeats"] == 3
    assert report["gpu_skipped"] == "--no-gpu"
    assert {"zarr", "numcodecs", "numpy", "python"} <= set(report["versions"])
    assert report["machine"]["cpus"] >= 1 and report["command"].endswith("--threads 2")
    assert [row["chunk_bytes"] for row in report["rows"]] == [1 << 18, 1 << 20]
    for row in report["rows"]:
        assert row["bytes"] == row["chunks"] * row["chunk_bytes"] and row["ratio"] > 1
        for kind, names in (
            ("decode", ["numcodecs_1_thread", "numcodecs_threads", "zarr_codec"]),
            ("encode", ["numcodecs_1_thread", "numcodecs_threads"]),
        ):
            rates = row[f"{kind}_GBps"]
            assert all(is_rate(rates[name]) for name in names), (kind, rates)
            assert rates["arrayio_gpu"] is None and rates["nvcomp_raw"] is None
            assert all(len(row["seconds"][kind][name]) == 3 for name in names)
        assert row["decode_speedup"] is None
