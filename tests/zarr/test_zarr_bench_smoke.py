"""CI smoke test of ``benchmarks.zarr_read`` on the CPU: it runs on a small array into host
memory, chunked and sharded, whole and in a slab, checks what every reader read, and that
its JSON and plot have the promised shape. No speed is asserted (CI machines are too
noisy). The peers zarrs, tensorstore and JAX are optional: where one is not installed, the
run must list it under ``peers_unavailable`` and skip it, and its rows are not checked."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import pytest

pytest.importorskip("zarr")
pytestmark = pytest.mark.slow

READERS = (
    "arrayio",
    "zarr.LocalStore",
    "kvikio.GDSStore",
    "kvikio.GDSStore(threads=16)",
    "zarrs",
    "tensorstore",
    "arrayio.zarr.read(jax)",
)
# The reader's name, and the module it needs beyond zarr and arrayio.
OPTIONAL = {"zarrs": "zarrs", "tensorstore": "tensorstore", "arrayio.zarr.read(jax)": "jax"}
INSTALLED = {
    name: importlib.util.find_spec(module) is not None for name, module in OPTIONAL.items()
}
ROWS = (8 << 20) // 4096  # the array's rows of 4 KiB
SLAB = (int(ROWS * 0.45), int(ROWS * 0.45) + ROWS // 10)


def is_rate(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def must_run(reader: str) -> bool:
    """Whether the reader has to have run here: kvikio never does on the CPU."""
    return reader in ("arrayio", "zarr.LocalStore") or INSTALLED.get(reader, False)


def run(run_module, tmp_path, *args: str) -> dict:
    out = tmp_path / "out"
    run_module(
        "benchmarks.zarr_read",
        "--memory",
        "host",
        "--size",
        "8M",
        "--chunk",
        "1M",
        "--shard",
        "4M",
        "--repeats",
        "1",
        "--learn",
        "0",
        *args,
        "--out",
        str(out),
        "--dir",
        str(tmp_path),
        tmp_path=tmp_path,
    )
    return json.loads((out / "zarr_read.json").read_text())


def test_zarr_read_benchmark_runs_every_layout_selection_and_peer(tmp_path, run_module):
    report = run(run_module, tmp_path, "--layouts", "chunked,sharded", "--selections", "whole,slab")

    assert report["benchmark"] == "zarr_read" and report["memory"] == "host"
    # its data sets are removed: no scratch directory is left in --dir
    assert not list(tmp_path.glob("arrayio-zarr-read-*"))
    assert report["command"].startswith("python -m benchmarks.zarr_read --memory host")
    assert report["versions"]["zarr"] and report["machine"]["cpus"] and report["cores"] >= 1
    assert report["array_bytes"] == 8 << 20
    assert report["selections"] == {"whole": [0, ROWS], "slab": list(SLAB)}
    assert report["layouts"]["chunked"]["shards"] is None
    assert report["layouts"]["sharded"]["shard_bytes"] == 4 << 20
    assert report["layouts"]["sharded"]["chunk_bytes"] == 1 << 20
    # What the dispatcher chose for the stores' batches is kept beside the rates.
    assert "host" in report["dispatcher"] and "read" in report["dispatcher"]
    for layout in ("chunked", "sharded"):
        for codec in ("none", "zstd"):
            assert is_rate(report["ceilings"][f"{layout}/{codec}"]["warm_read_GBps"])
        stored = report["stored_bytes"]
        assert stored[f"{layout}/zstd"] < stored[f"{layout}/none"]
    # An optional peer is either measured or listed as unavailable, with the reason.
    for reader, installed in INSTALLED.items():
        assert (reader in report["peers_unavailable"]) is not installed, reader
    for gds in ("kvikio.GDSStore", "kvikio.GDSStore(threads=16)"):
        if gds in report["peers_unavailable"]:
            assert report["peers_unavailable"][gds]
            assert gds not in report["gds_kvikio_threads"]

    rows = report["rows"]
    cases = {
        (r["layout"], r["codec"], r["decoder"], r["selection"], r["store"], r["cache"])
        for r in rows
    }
    expected = {
        (layout, codec, decoder, chosen, store, cache)
        for layout in ("chunked", "sharded")
        for codec, decoder in (("none", None), ("zstd", "arrayio"), ("zstd", "zarr"))
        for chosen in ("whole", "slab")
        for store in READERS
        for cache in ("cold", "warm")
    }
    assert cases == expected and len(rows) == len(expected)
    for row in rows:
        case = "/".join(str(row[k]) for k in ("layout", "codec", "decoder", "selection"))
        case += f"/{row['store']}/{row['cache']}"
        whole = row["selection"] == "whole"
        assert row["selection_bytes"] == (8 << 20 if whole else (SLAB[1] - SLAB[0]) * 4096)
        if not must_run(row["store"]):
            assert ("skipped" in row and row["skipped"]) or is_rate(row.get("GBps")), case
            continue
        # Every reader that runs here read the right values, every time.
        assert "failed" not in row and "skipped" not in row, case
        assert row["verified"] is True and is_rate(row["GBps"]), case
        assert len(row["seconds"]) == 1, case
        assert row["GBps"] == pytest.approx(row["selection_bytes"] / row["median_s"] / 1e9)
        assert is_rate(row["stored_GBps"]) if whole else row["stored_GBps"] is None, case
        if row["codec"] == "zstd" and row["store"] in ("arrayio", "zarr.LocalStore"):
            # The class that decoded is recorded, and is the one the case asked for.
            wanted = (
                "arrayio.zarr.codecs.ZstdCodec"
                if row["decoder"] == "arrayio"
                else "zarr.codecs.zstd.ZstdCodec"
            )
            assert wanted in row["decoded_by"], case
        if row["layout"] == "sharded" and row["store"] == "arrayio":
            assert row["decoded_by"].startswith("zarr.codecs.sharding.ShardingCodec["), case
        if row["store"] == "zarrs":
            settings = row["reader_settings"]
            assert settings["codec_pipeline.path"] == "zarrs.ZarrsCodecPipeline", case
            assert settings["threading.max_workers"] == report["cores"], case
        if row["store"] == "tensorstore":
            context = row["reader_settings"]["tensorstore_context"]
            assert context["data_copy_concurrency"]["limit"] == report["cores"], case

    summary = report["summary"]
    assert len(summary) == 2 * 3 * 2 * 2
    assert set(summary) == {
        f"{layout}/{codec}/{chosen}/{cache}"
        for layout in ("chunked", "sharded")
        for codec in ("none/-", "zstd/arrayio", "zstd/zarr")
        for chosen in ("whole", "slab")
        for cache in ("cold", "warm")
    }
    for key, entry in summary.items():
        assert is_rate(entry["arrayio_GBps"]), key
        for reader, installed in INSTALLED.items():
            if installed and reader != "arrayio.zarr.read(jax)":
                assert is_rate(entry["peers_GBps"][reader]), key
        if INSTALLED["arrayio.zarr.read(jax)"]:
            assert is_rate(entry["arrayio_read_jax_GBps"]), key
        assert entry["best_cpu_peer"] in ("zarr.LocalStore", "zarrs", "tensorstore"), key
        assert is_rate(entry["ratio_to_best_cpu_peer"]) and is_rate(entry["ratio_to_best_peer"])
    assert (tmp_path / "out" / "zarr_read.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_users_pipeline_gives_arrayio_its_own_and_the_peers_their_defaults(
    tmp_path, run_module
):
    report = run(
        run_module,
        tmp_path,
        "--pipeline",
        "users",
        "--codecs",
        "zstd",
        "--layouts",
        "sharded",
        "--selections",
        "slab",
        "--stores",
        "arrayio,zarr.LocalStore",
    )
    rows = {(r["store"], r["cache"]): r for r in report["rows"]}
    assert set(rows) == {(s, c) for s in ("arrayio", "zarr.LocalStore") for c in ("cold", "warm")}
    for (store, _), row in rows.items():
        assert row["decoder"] == "users" and row["verified"] is True and is_rate(row["GBps"])
        if store == "arrayio":
            assert row["reader_settings"] == {"codec_pipeline.path": "arrayio.zarr.CodecPipeline"}
        else:
            assert row["reader_settings"] == {}
            assert "zarr.codecs.zstd.ZstdCodec" in row["decoded_by"]
    assert set(report["summary"]) == {
        "sharded/zstd/users/slab/cold",
        "sharded/zstd/users/slab/warm",
    }


def test_a_reader_that_reads_wrong_values_stops_the_run(tmp_path):
    """A peer's wrong answer is an error of the run, never a row marked failed."""
    from benchmarks import zarr_read as bench

    root = str(tmp_path / "array")
    data = bench.make_data(root, 1 << 20, 64 << 10, "zstd", shard_bytes=256 << 10)
    args = argparse.Namespace(
        memory="host", pipeline="batched", learn=0, repeats=1, drop_caches=False
    )

    class OffByOne(bench.StoreReader):
        def read(self, opened, chosen):
            result = super().read(opened, chosen)
            result[-1, -1] += 1
            return result

    class Broken(bench.StoreReader):
        def read(self, opened, chosen):
            raise RuntimeError("cannot read this array")

    slab = bench.selection("slab", data["shape"][0])
    right = bench.StoreReader("zarr.LocalStore", root, data, args)
    broken = Broken("zarr.LocalStore", root, data, args)
    done = bench.run_rounds(args, {"right": right, "broken": broken}, slab, "warm", data)
    assert len(done.seconds["right"]) == 1 and "cannot read" in done.failed["broken"]

    wrong = OffByOne("zarr.LocalStore", root, data, args)
    with pytest.raises(bench.WrongData, match="wrong values"):
        bench.run_rounds(args, {"right": right, "wrong": wrong}, slab, "warm", data)
    # A result of the wrong rows is caught too, though its values are the array's.
    shifted = bench.Selection("slab", slab.start + 1, slab.stop + 1)
    with pytest.raises(bench.WrongData):
        bench.verify("shifted", right.read(right.open(), shifted), slab, data, "host")


def test_the_proposed_targets_take_the_read_and_the_decode_in_turn():
    # nvCOMP's batch takes as long as its slowest chunk: the decode follows the read of its
    # batch, so the proposed bound adds their times (rates combined harmonically).
    from benchmarks import zarr_read

    ceiling = {
        "warm_read_GBps": 5.0,
        "pinned_host_to_device_GBps": 50.0,
        "nvcomp_decode_GBps": 30.0,
        "cold_direct_read_GBps": 2.0,
    }
    warm = zarr_read.targets("zstd", "warm", 12.0, None, {}, {"zarrs": 3.0}, ceiling, 4.0)
    assert warm["lowest_of_three"]["bound"] == 20.0  # the page cache times the ratio
    bound = 1 / (1 / 20.0 + 1 / 200.0 + 1 / 30.0)
    assert math.isclose(warm["read_then_decode"]["bound"], bound)
    assert warm["read_then_decode"]["met"] is (12.0 / bound >= 0.8)
    assert warm["best_cpu_peer"]["bound"] == 3.0  # judged warm, not cold
    cold = zarr_read.targets("zstd", "cold", 4.0, None, {}, {"zarrs": 3.0}, ceiling, 4.0)
    assert "best_cpu_peer" not in cold
    assert math.isclose(cold["disk_then_decode"]["bound"], 1 / (1 / 8.0 + 1 / 30.0))
    assert cold["disk_ceiling_times_ratio"]["bound"] == 8.0
    plain = zarr_read.targets("none", "warm", 9.0, None, {}, {}, ceiling, 1)
    assert "read_then_decode" not in plain


def test_each_gdsstore_reader_opens_with_its_own_kvikio_pool(monkeypatch):
    """KvikIO's pool is process-wide and arrayio's KvikIO tool resizes it: the GDSStore
    reader of KvikIO's defaults runs with the pool the run started with, the tuned one with
    16 threads, each set again before every open."""
    import sys
    import types

    from benchmarks import zarr_read

    pool = {"num_threads": 3}
    defaults = types.SimpleNamespace(get=pool.__getitem__, set=pool.__setitem__)
    opened = []
    kvikio_zarr = types.SimpleNamespace(
        GDSStore=lambda root, read_only: opened.append(pool["num_threads"]) or root
    )
    kvikio = types.ModuleType("kvikio")
    kvikio.defaults, kvikio.zarr = defaults, kvikio_zarr
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.setitem(sys.modules, "kvikio.zarr", kvikio_zarr)
    monkeypatch.setattr(zarr_read, "_kvikio_start_threads", None)

    zarr_read.require("kvikio.GDSStore", "host")  # notes the pool before any read
    pool["num_threads"] = 8  # an arrayio read resizes it
    zarr_read.make_store("kvikio.GDSStore(threads=16)", "/data")
    pool["num_threads"] = 8
    zarr_read.make_store("kvikio.GDSStore", "/data")
    assert opened == [16, 3]
