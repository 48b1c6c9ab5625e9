"""CI smoke test of ``benchmarks.zarr_read`` on the CPU: it runs on a small array into host
memory, checks what every store read, and its JSON and plot have the promised shape. No
speed is asserted (CI machines are too noisy); peers that cannot run here are recorded as
skipped, with the reason."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("zarr")
pytestmark = pytest.mark.slow


def is_rate(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_zarr_read_benchmark_runs_on_the_cpu(tmp_path, run_module):
    out = tmp_path / "out"
    run_module(
        "benchmarks.zarr_read",
        "--memory",
        "host",
        "--size",
        "8M",
        "--chunk",
        "1M",
        "--repeats",
        "1",
        "--learn",
        "0",
        "--out",
        str(out),
        "--dir",
        str(tmp_path),
        tmp_path=tmp_path,
    )
    report = json.loads((out / "zarr_read.json").read_text())

    assert report["benchmark"] == "zarr_read" and report["memory"] == "host"
    assert report["command"].startswith("python -m benchmarks.zarr_read --memory host")
    assert report["versions"]["zarr"] and report["machine"]["cpus"]
    assert report["array_bytes"] == 8 << 20
    for codec in ("none", "zstd"):
        assert is_rate(report["ceilings"][codec]["warm_read_GBps"])
    assert report["stored_bytes"]["zstd"] < report["stored_bytes"]["none"]

    rows = report["rows"]
    cases = {(r["codec"], r["decoder"], r["store"], r["cache"]) for r in rows}
    expected = {
        (codec, decoder, store, cache)
        for codec, decoder in (("none", None), ("zstd", "arrayio"), ("zstd", "zarr"))
        for store in ("arrayio", "zarr.LocalStore", "kvikio.GDSStore")
        for cache in ("cold", "warm")
    }
    assert cases == expected
    for row in rows:
        case = f"{row['codec']}/{row['decoder']}/{row['store']}/{row['cache']}"
        if row["store"] in ("arrayio", "zarr.LocalStore"):
            assert "failed" not in row and "skipped" not in row, case
            assert row["verified"] is True and is_rate(row["GBps"]), case
            assert len(row["seconds"]) == 1, case
            if row["codec"] == "zstd":
                # The class that decoded is recorded, and is the one the case asked for.
                wanted = (
                    "arrayio.zarr.codecs.ZstdCodec"
                    if row["decoder"] == "arrayio"
                    else "zarr.codecs.zstd.ZstdCodec"
                )
                assert wanted in row["decoded_by"], case
        else:
            assert ("skipped" in row and row["skipped"]) or is_rate(row.get("GBps")), case

    summary = report["summary"]
    assert set(summary) == {
        "none/-/cold",
        "none/-/warm",
        "zstd/arrayio/cold",
        "zstd/arrayio/warm",
        "zstd/zarr/cold",
        "zstd/zarr/warm",
    }
    assert is_rate(summary["none/-/warm"]["arrayio_GBps"])
    assert summary["none/-/warm"]["best_peer"] in ("zarr.LocalStore", "kvikio.GDSStore")
    assert (out / "zarr_read.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
