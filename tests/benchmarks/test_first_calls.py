"""The first-calls benchmark (``benchmarks.first_calls``): its CPU-only ``--smoke`` run has
the promised JSON, every call's figure positive and every check passed; its pieces (the
order of a phase, the checks that keep a lazy peer from winning, the summary's ratios, the
read-only ceilings) behave as documented.

Nothing here asserts a speed: CI machines are too noisy for that.
"""

from __future__ import annotations

import json
import math
import random
import types
from pathlib import Path

import numpy as np
import pytest

from benchmarks import _first_calls_sequence as sequence
from benchmarks import first_calls as fc

PATTERNS = ("warm", "cold_start", "cold_every")


def is_rate(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory, run_module) -> tuple[Path, str]:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    tmp = tmp_path_factory.mktemp("first_calls")
    done = run_module(
        "benchmarks.first_calls",
        "--smoke",
        "--out",
        str(tmp / "out"),
        "--dir",
        str(tmp),
        tmp_path=tmp,
        timeout=120,
    )
    return tmp / "out", done.stdout


@pytest.mark.slow
def test_the_smoke_run_reports_every_call_of_every_sequence(smoke) -> None:
    out, stdout = smoke
    report = json.loads((out / "first_calls.json").read_text())
    assert report["benchmark"] == "first-calls" and report["smoke"] is True
    assert {"date", "command", "machine", "commit", "seed"} <= set(report)
    assert (out / "first_calls.png").stat().st_size > 0
    assert {p: v["calls"] for p, v in report["patterns"].items()} == dict.fromkeys(PATTERNS, 2)
    assert report["file"]["smallest_bytes"] < report["file"]["largest_bytes"]
    assert report["file"]["checked_tensors"]
    peers = set(fc.SMOKE_PEERS) - set(report["peers_unavailable"])
    assert {"arrayio-numpy", "arrayio-numpy-posix", "arrayio-torch", "safetensors"} <= peers
    assert report["learned"] == ["arrayio-numpy"]
    assert set(report["warm_up"]) == peers
    series = sorted(peers) + ["arrayio-numpy (learned)"]
    runs = {(s["pattern"], s["series"]): s for s in report["sequences"]}
    assert len(runs) == len(report["sequences"]) == len(PATTERNS) * len(series)
    for (pattern, name), run in runs.items():
        where = (pattern, name)
        assert run["error"] is None and run["check"] == "passed", where
        assert len(run["GBps"]) == 2 and all(is_rate(v) for v in run["GBps"]), where
        assert run["setup_seconds"]["import"] >= 0, where
        # A fresh sequence starts with an empty cache dir, a learned one with a table.
        assert bool(run["cache_files_at_start"]) == name.endswith("(learned)"), where
        # Only the fixed-choice reference forces a tool; the others let the dispatcher choose.
        assert run["forced_tool"] == ("posix" if name == "arrayio-numpy-posix" else None), where
        assert run["second_pass"] == (True if name.startswith("arrayio") else None), where
        # arrayio's sequences say which tools their calls ran on.
        assert ("dispatch table" in (run["dispatcher"] or "")) == name.startswith("arrayio"), where
        if name.startswith("arrayio"):  # its background work as each call began
            assert [set(b) for b in run["background"]] == [{"setting_up", "second_pass"}] * 2
            # and where each call's load spent its time
            assert [s["call"] for s in run["stages"]] == ["load", "load"], where
            assert all("transfers" in s["stages"] for s in run["stages"]), where
        else:
            assert run["background"] is None and run["stages"] is None, where
    assert runs["warm", "safetensors"]["page_cache"] == ["warmed", None]
    assert runs["cold_start", "safetensors"]["page_cache"] == ["evicted", None]
    assert runs["cold_every", "safetensors"]["page_cache"] == ["evicted", "evicted"]
    # The ceilings, sampled once per pattern, and the cold start's first re-read beside its
    # disk (O_DIRECT may be refused: then it says why).
    for name in ("cold_read", "warm_read", "reread_read"):
        assert is_rate(report["ceilings"][name]["GBps"]) or report["ceilings"][name]["error"]
    assert "write_fsync" not in report["ceilings"]
    sampled = sorted((s["pattern"], s["ceiling"]) for s in report["ceiling_samples"])
    expected = [("cold_start", "reread_read"), ("warm", "warm_read")]
    if not report["ceilings"]["cold_read"]["error"]:  # (O_DIRECT refused: no disk samples)
        expected += [("cold_every", "cold_read"), ("cold_start", "cold_read")]
    assert sampled == sorted(expected)
    assert "page cache, first re-read ceiling" in stdout
    for pattern in PATTERNS:
        assert all(len(m) == 2 for m in report["medians_GBps"][pattern].values())
        table = report["table"][pattern]
        assert table["best"]["calls 3-6"] is None and is_rate(table["best"]["call 1"])
        ratios = [table[name]["call 1"]["ratio_to_best"] for name in series]
        assert max(ratios) == 1.0 and all(0 < r <= 1 for r in ratios)
        assert f"\n{pattern}: 2 calls" in stdout
    assert "arrayio-numpy (learned)" in stdout


@pytest.mark.slow
def test_the_plot_can_be_redrawn_from_the_json(smoke, tmp_path: Path, run_module) -> None:
    out, _ = smoke
    copy = tmp_path / "first_calls.json"
    copy.write_text((out / "first_calls.json").read_text())
    run_module("benchmarks.first_calls", "--replot", str(copy), tmp_path=tmp_path, timeout=120)
    assert (tmp_path / "first_calls.png").stat().st_size > 0


def test_a_learned_sequence_runs_after_its_fresh_one() -> None:
    jobs = [fc.Job(p, "warm", 0) for p in ("a", "b", "c")]
    jobs += [fc.Job(p, "warm", 0, learned=True) for p in ("a", "c")]
    for seed in range(50):
        order = fc.phase_order([*jobs, None], random.Random(seed))
        assert sorted(order, key=repr) == sorted([*jobs, None], key=repr)
        names = [j.series if j else "ceiling" for j in order]
        for peer in ("a", "c"):
            assert names.index(peer) < names.index(f"{peer} (learned)")
    # A learned sequence shares its fresh one's cache dir.
    assert jobs[3].cache_name == jobs[0].cache_name and jobs[3].name != jobs[0].name


def test_the_state_dict_looks_like_a_decoder() -> None:
    entries = fc.layout(64 << 20, d_model=256, vocab=4096)
    total = sum(math.prod(shape) * 2 for _, shape in entries)
    assert 0.8 < total / (64 << 20) < 1.2
    names = [name for name, _ in entries]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert "model.layers.0.self_attn.k_proj.weight" in names
    sizes = sorted(math.prod(shape) for _, shape in entries)
    assert sizes[0] == 256 and sizes[-1] == 4096 * 256


def test_the_checked_tensors_fit_their_budget() -> None:
    torch = pytest.importorskip("torch")
    state = {f"t{i}": torch.zeros(1 << 10, dtype=torch.bfloat16) for i in range(20)}
    assert len(fc.checked_keys(state, 1 << 30)) == 8
    keys = fc.checked_keys(state, 5 << 10)  # room for two of 2 KiB
    assert keys == ["t0", "t3"]
    assert fc.checked_keys({"big": torch.zeros(1 << 20)}, 1) == ["big"]  # at least one


def expected_for(arrays: dict[str, np.ndarray]) -> dict:
    return {
        "tensors": {k: [list(a.shape), sequence.dtype_name(a)] for k, a in arrays.items()},
        "crc32": {k: sequence.crc32(a) for k, a in arrays.items()},
    }


def saved_spec(tmp_path: Path, **fields: object) -> dict:
    """A warm sequence of 3 calls of arrayio into NumPy, over a small file arrayio saved,
    with ``fields`` added or replaced."""
    import arrayio

    arrays = {"w": np.arange(1024, dtype=np.float32).reshape(32, 32)}
    path = tmp_path / "w.safetensors"
    arrayio.save(path, arrays)
    spec = {
        "peer": "arrayio-numpy",
        "device": "cpu",
        "path": str(path),
        "pattern": "warm",
        "calls": 3,
        "drop_caches": False,
        "expected": expected_for(arrays),
        "result": str(tmp_path / "result.json"),
    }
    return {**spec, **fields}


def test_the_checks_refuse_less_than_the_file() -> None:
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((4, 8)).astype(np.float32), "b": np.arange(5)}
    expected = expected_for(arrays)
    sequence.check_structure(arrays, expected, "cpu")
    sequence.check_content(arrays, expected)
    with pytest.raises(AssertionError, match="missing"):
        sequence.check_structure({"a": arrays["a"]}, expected, "cpu")
    with pytest.raises(AssertionError, match="float32"):
        sequence.check_structure({**arrays, "a": arrays["a"][:2]}, expected, "cpu")
    with pytest.raises(AssertionError, match="cuda"):
        sequence.check_structure(arrays, expected, "cuda")
    with pytest.raises(AssertionError, match="CRC-32"):
        sequence.check_content({**arrays, "b": np.zeros(5, dtype=arrays["b"].dtype)}, expected)


def test_a_sequence_reports_where_it_failed(tmp_path: Path) -> None:
    spec = saved_spec(tmp_path, pattern="cold_every", calls=2)
    result = sequence.run(spec)
    assert result["error"] is None and result["check"] == "passed"
    assert len(result["seconds"]) == 2 and result["page_cache"] == ["evicted", "evicted"]
    assert json.loads((tmp_path / "result.json").read_text())["seconds"] == result["seconds"]
    wrong = expected_for({"w": np.arange(1024, dtype=np.float32).reshape(32, 32) + 1})
    result = sequence.run({**spec, "expected": wrong})
    assert result["failed_at"] == "check of call 1" and "CRC-32" in result["check"]
    assert result["seconds"] == []
    result = sequence.run({**spec, "path": str(tmp_path / "missing.safetensors")})
    assert result["failed_at"] == "call 1" and result["check"] is None


def test_an_arrayio_sequence_records_its_background_work_and_waits_its_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from arrayio.dispatch import dispatcher

    slept: list[float] = []
    monkeypatch.setattr(sequence.time, "sleep", slept.append)
    spec = saved_spec(tmp_path, gap=0.25)
    result = sequence.run(spec)
    assert result["error"] is None and slept == [0.25] * 3
    assert len(result["background"]) == 3
    for busy in result["background"]:
        assert set(busy) == {"setting_up", "second_pass"}
        assert isinstance(busy["second_pass"], bool) and isinstance(busy["setting_up"], list)
    # What it reads is the process's dispatcher, never one made for the record.
    monkeypatch.setattr(dispatcher, "_dispatcher", None)
    assert sequence.background(sequence.PEERS["arrayio-numpy"]) == {
        "setting_up": [],
        "second_pass": False,
    }
    assert dispatcher.current() is None
    assert sequence.background(sequence.PEERS["safetensors"]) is None
    result = sequence.run({**spec, "peer": "safetensors-numpy", "gap": 0})
    assert "background" not in result and len(slept) == 3


def test_unavailable_peers_say_why() -> None:
    chosen, unavailable = fc.choose_peers(["arrayio-numpy", "arrayio-cupy"], "cpu")
    assert chosen == ["arrayio-numpy"] and "not cpu" in unavailable["arrayio-cupy"]
    chosen, unavailable = fc.choose_peers(["safetensors-numpy"], "cuda")
    assert not chosen and "not cuda" in unavailable["safetensors-numpy"]
    # Every peer the benchmark can name has a loader, and the defaults are peers.
    assert set(sequence.LOADERS) == set(sequence.PEERS)
    for names in (*fc.DEFAULT_PEERS.values(), fc.SMOKE_PEERS, fc.SMOKE_LEARNED):
        assert set(names) <= set(sequence.PEERS)


def test_the_table_compares_each_column_with_its_best() -> None:
    def run(series: str, pattern: str, gbps: list[float], error: str | None = None) -> dict:
        return {"series": series, "pattern": pattern, "GBps": gbps, "error": error}

    report = {
        "peers": {"x": {}, "y": {}},
        "patterns": {p: {"calls": 8} for p in PATTERNS},
        "ceilings": {"cold_read": {"GBps": 2.0}, "warm_read": {"GBps": 30.0}},
        "sequences": [
            run("x", "warm", [1, 2, 4, 4, 4, 4, 8, 8]),
            run("x", "warm", [3, 2, 4, 4, 4, 4, 8, 8]),
            run("y", "warm", [4, 1, 2, 2, 2, 2, 2, 2]),
            run("y (learned)", "warm", [1, 1, 1, 1, 1, 1, 1, 1]),
            run("y", "warm", [100] * 8, error="check failed"),  # never counted
        ],
    }
    fc.summarize(report)
    assert report["medians_GBps"]["warm"]["x"] == [2, 2, 4, 4, 4, 4, 8, 8]
    table = report["table"]["warm"]
    assert table["best"] == {"call 1": 4, "call 2": 2, "calls 3-6": 4, "later": 8}
    assert table["x"]["call 1"] == {"GBps": 2, "ratio_to_best": 0.5}
    assert table["y"]["later"] == {"GBps": 2, "ratio_to_best": 0.25}
    assert list(table) == ["x", "y", "y (learned)", "best"]
    assert report["ceilings_GBps"] == {"warm_read": 30.0, "cold_read": 2.0}
    text = fc.table_text(report)
    assert "page-cache read ceiling 30.00 GB/s" in text and "2.00 (0.50)" in text
    assert report["table"]["cold_start"] == {"best": dict.fromkeys(table["best"])}


def test_read_only_ceilings_write_their_file_plainly(tmp_path: Path) -> None:
    from benchmarks.peers import _harness as h

    with pytest.raises(ValueError, match="unknown ceilings"):
        h.DiskCeilings(str(tmp_path), 1 << 20, drop=False, limits=("cold_reads",))
    ceilings = h.DiskCeilings(str(tmp_path), 2 << 20, drop=False, limits=("cold_read", "warm_read"))
    try:
        ceilings.search()
        assert set(ceilings.report()) == {"bytes", "cold_read", "warm_read"}
        assert is_rate(ceilings.report()["warm_read"]["GBps"])
        ceilings.sample("warm_read")
        assert len(ceilings.limits["warm_read"].samples) == 1
        assert (tmp_path / "ceiling.bin").stat().st_size == 2 << 20
    finally:
        ceilings.close()


def test_the_first_re_read_ceiling_reads_once_untimed_after_eviction(
    tmp_path: Path, monkeypatch
) -> None:
    from benchmarks.peers import _harness as h

    ceilings = h.DiskCeilings(
        str(tmp_path), 2 << 20, drop=False, limits=("cold_read", "warm_read", "reread_read")
    )
    try:
        ceilings.search()
        assert is_rate(ceilings.report()["reread_read"]["GBps"])
        steps: list[tuple[str, int | None]] = []
        monkeypatch.setattr(h, "evict", lambda path, drop: steps.append(("evict", None)))
        monkeypatch.setattr(
            h, "warm", lambda path, passes=h.WARM_PASSES: steps.append(("read", passes))
        )
        ceilings.sample("reread_read")
        assert steps == [("evict", None), ("read", 1)]  # the timed read is the second
        steps.clear()
        ceilings.sample("warm_read")
        assert steps == [("read", h.WARM_PASSES)]  # the timed read is at least the third
        assert [len(ceilings.limits[n].samples) for n in ("reread_read", "warm_read")] == [1, 1]
    finally:
        ceilings.close()
    # Asked for by name only: the other benchmarks' ceilings are unchanged.
    others = h.DiskCeilings(str(tmp_path), 1 << 20, drop=False)
    try:
        assert "reread_read" not in others.settings
    finally:
        others.close()


class FakeRunner:
    """Sequences that take no time: each call at 2 GB/s of 1 GB, or failing for ``failing``."""

    files = {"safetensors": "model.safetensors"}

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.failing = failing
        self.ran: list[fc.Job] = []

    def run(self, job: fc.Job, calls: int, deadline: object) -> dict:
        self.ran.append(job)
        if job.peer in self.failing:
            return {"seconds": [], "error": "boom", "failed_at": "call 1", "process_seconds": 0}
        return {"seconds": [0.5] * calls, "check": "passed", "error": None, "process_seconds": 0}


class NoCeilings:
    """Ceilings that could not be measured, as where O_DIRECT is refused."""

    def __init__(self) -> None:
        self.limits = {
            name: types.SimpleNamespace(tool=None) for name in ("cold_read", "warm_read")
        }

    def report(self) -> dict:
        return {name: {"GBps": None, "error": "refused"} for name in self.limits}


def rounds_report(peers: list[str]) -> dict:
    return {
        "patterns": {pattern: {} for pattern in fc.PATTERNS},
        "file": {"bytes": 10**9},
        "seed": "s",
        "peers": {p: {} for p in peers},
        "peers_unavailable": {},
        "warm_up": {},
        "sequences": [],
        "orders": [],
        "ceiling_samples": [],
        "skipped_for_time": [],
    }


def test_rounds_run_every_sequence_and_stop_a_failing_peer(tmp_path: Path) -> None:
    from benchmarks.peers import _harness as h

    peers = ["a", "b", "bad"]
    runner, report = FakeRunner(failing=("bad",)), rounds_report(peers)
    calls = {"warm": 3, "cold_start": 2, "cold_every": 1}
    rounds = fc.Rounds(runner, NoCeilings(), calls, h.Deadline(None), report)
    assert rounds.warm_up(peers) == ["a", "b"]
    assert "boom" in report["peers_unavailable"]["bad"]
    rounds.run(["a", "b", "bad"], ["b"], 2, str(tmp_path / "r.json"))
    measured = [(j.series, j.pattern, j.repetition) for j in runner.ran if j.repetition >= 0]
    assert len(measured) == len(set(measured)) == 2 * 3 * 3 + 1  # "bad" ran once
    assert report["peers"]["bad"]["error"] == "call 1: boom"
    for run in report["sequences"]:
        if run["peer"] != "bad":
            assert run["GBps"] == [2.0] * calls[run["pattern"]]
    assert report["table"]["warm"]["b (learned)"]["call 1"]["ratio_to_best"] == 1.0
    assert json.loads((tmp_path / "r.json").read_text())["sequences"] == report["sequences"]
    assert not report["skipped_for_time"]


def test_rounds_past_their_deadline_are_skipped_and_said(tmp_path: Path) -> None:
    from benchmarks.peers import _harness as h

    runner, report = FakeRunner(), rounds_report(["a"])
    calls = dict.fromkeys(PATTERNS, 2)
    rounds = fc.Rounds(runner, NoCeilings(), calls, h.Deadline(0.0), report)
    rounds.run(["a"], ["a"], 1, str(tmp_path / "r.json"))
    assert not runner.ran and not report["sequences"]
    skipped = {(s["series"], s["pattern"]) for s in report["skipped_for_time"]}
    assert skipped == {(name, p) for name in ("a", "a (learned)") for p in PATTERNS}


def test_patterns_can_be_chosen_and_keep_their_order() -> None:
    args, _ = fc.parse(["--out", "x", "--patterns", "cold_every,warm"])
    assert list(fc.calls_of(args)) == ["warm", "cold_every"]
    assert list(fc.calls_of(fc.parse(["--out", "x"])[0])) == list(fc.PATTERNS)
    with pytest.raises(SystemExit):
        fc.parse(["--out", "x", "--patterns", "tepid"])


def test_a_cpu_call_ends_with_a_byte_of_every_page_read(tmp_path: Path) -> None:
    # A loader that maps the file has read nothing when it returns: the clock runs on until
    # each page of each array has been read once, mapped or copied, nested or not.
    data = (np.arange(5 * sequence.PAGE + 7) % 251).astype(np.uint8)
    path = tmp_path / "mapped.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    copied = np.arange(1000, dtype=np.float32)
    expected = int(data[:: sequence.PAGE].sum()) + int(
        copied.view(np.uint8)[:: sequence.PAGE].sum()
    )
    out = {"mapped": mapped, "layer": {"copied": copied}, "empty": np.zeros(0, np.uint8)}
    assert sequence.touch_pages(out) == expected


def test_only_arrayio_into_jax_on_a_gpu_records_its_pool() -> None:
    # Each such call records how many outputs came from the pool of memory JAX gave back,
    # and how many the driver allocated anew; no other sequence has that pool.
    from arrayio.arrays import _driver_buffers
    from benchmarks import _first_calls_sequence as sequence

    jax_peer, torch_peer = sequence.PEERS["arrayio-jax"], sequence.PEERS["arrayio-torch"]
    assert sequence._driver_pool(jax_peer, "cuda:0") is _driver_buffers._pool
    assert sequence._driver_pool(jax_peer, "cpu") is None
    assert sequence._driver_pool(torch_peer, "cuda:0") is None


def test_a_fixed_choice_forces_its_tool_once_arrayio_is_imported(tmp_path: Path) -> None:
    # The peer's set-up imports arrayio before making its loader, and arrayio reads
    # ARRAYIO_TOOL when imported: the loader must force the tool through the settings.
    import arrayio

    path = tmp_path / "a.safetensors"
    arrayio.save(path, {"x": np.arange(1000, dtype=np.float32)})
    try:
        load = sequence.LOADERS["arrayio-numpy-posix"]("cpu")
        assert arrayio.config.get().tool == "posix"
        np.testing.assert_array_equal(load(str(path))["x"], np.arange(1000, dtype=np.float32))
    finally:
        arrayio.config.set(tool=None)


def test_the_peer_without_a_second_pass_turns_it_off_once_arrayio_is_imported(
    tmp_path: Path,
) -> None:
    import arrayio

    path = tmp_path / "a.safetensors"
    arrayio.save(path, {"x": np.arange(1000, dtype=np.float32)})
    try:
        load = sequence.LOADERS["arrayio-numpy-no-second-pass"]("cpu")
        assert arrayio.config.get().second_pass is False
        np.testing.assert_array_equal(load(str(path))["x"], np.arange(1000, dtype=np.float32))
    finally:
        arrayio.config.set(second_pass=True)


def test_the_peer_that_verifies_nothing_turns_verification_off(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import arrayio

    path = tmp_path / "a.safetensors"
    arrayio.save(path, {"x": np.arange(1000, dtype=np.float32)})
    try:
        load = sequence.LOADERS["arrayio-torch-no-verify"]("cpu")
        assert arrayio.config.get().verify_checksums is False
        np.testing.assert_array_equal(
            load(str(path))["x"].numpy(), np.arange(1000, dtype=np.float32)
        )
    finally:
        arrayio.config.set(verify_checksums=True)


def test_a_sequence_past_its_call_budget_makes_no_more_calls(tmp_path: Path) -> None:
    spec = saved_spec(tmp_path, call_budget=0.0)
    result = sequence.run(spec)
    assert result["error"] is None and len(result["seconds"]) == 1 and result["cut_after"] == 1
    result = sequence.run({**spec, "call_budget": 3600.0})
    assert len(result["seconds"]) == 3 and "cut_after" not in result
    record = fc.record_of(fc.Job("arrayio-numpy", "warm", 0), 3, 4096, {"cut_after": 1})
    assert record["cut_after"] == 1


@pytest.mark.parametrize(
    ("fields", "checked"),
    [
        ({}, 1),
        ({"check_call": 3}, 3),
        ({"check_call": 9}, 3),  # past the sequence: its last call
        ({"check_call": 3, "call_budget": 0.0}, 1),  # cut after call 1: checked before the cut
    ],
)
def test_one_call_of_a_sequence_has_its_bytes_checked(tmp_path: Path, fields, checked) -> None:
    # Reading JAX's arrays back to the host slows its next load: --check-call moves the
    # check of the bytes away from calls 1 and 2; a sequence cut short still checks one.
    result = sequence.run(saved_spec(tmp_path, **fields))
    assert result["error"] is None and result["check"] == "passed"
    assert result["checked_call"] == checked


def test_a_wrong_byte_fails_the_checked_call_only(tmp_path: Path, monkeypatch) -> None:
    checked: list[int] = []
    real = sequence.check_content

    def counting(out, expected):
        checked.append(len(checked) + 1)
        return real(out, expected)

    monkeypatch.setattr(sequence, "check_content", counting)
    spec = saved_spec(tmp_path, check_call=2)
    spec["expected"] = {**spec["expected"], "crc32": {"w": 0}}  # no file has this CRC-32
    result = sequence.run(spec)
    assert checked == [1] and result["failed_at"] == "check of call 2"
    assert result["check"] == result["error"] and len(result["seconds"]) == 1


def test_the_stage_medians_say_where_each_call_went() -> None:
    # Per call column, the median of each stage; "elsewhere" is the load's time outside its
    # top-level stages (the checksums' wait happens inside the transfers, not beside them).
    def record(load: float, transfers: float, checks: float | None = None) -> dict:
        stages = {"open": 0.001, "allocate": 0.002, "transfers": transfers, "finish": 0.0}
        if checks is not None:
            stages["checksums on the GPU"] = checks
        return {"call": "load", "seconds": load, "stages": stages}

    def run(stages: list, error: str | None = None) -> dict:
        return {
            "series": "a",
            "pattern": "warm",
            "GBps": [1.0] * len(stages),
            "error": error,
            "stages": stages,
        }

    report = {
        "peers": {"a": {}, "b": {}},
        "patterns": {"warm": {"calls": 4}},
        "ceilings": {},
        "sequences": [
            run([record(0.100, 0.090, 0.002), record(0.050, 0.040), record(0.045, 0.040)]),
            run(
                [
                    record(0.120, 0.100, 0.004),
                    record(0.060, 0.040),
                    record(0.041, 0.036),
                    record(0.043, 0.038),
                ]
            ),
            run([record(9.0, 9.0)], error="check failed"),  # never counted
            {"series": "b", "pattern": "warm", "GBps": [1.0], "error": None},  # a peer
        ],
    }
    fc.summarize(report)
    staged = report["stage_medians_ms"]["warm"]
    assert list(staged) == ["a"]
    assert staged["a"]["call 1"]["load"] == pytest.approx(110.0)
    assert staged["a"]["call 1"]["checksums on the GPU"] == pytest.approx(3.0)
    assert staged["a"]["call 1"]["elsewhere"] == pytest.approx(12.0)  # 110 - (1 + 2 + 95)
    assert staged["a"]["call 2"]["elsewhere"] == pytest.approx(12.0)
    assert staged["a"]["later"]["load"] == pytest.approx(43.0)  # calls 3 and 4 together
    text = fc.table_text(report)
    assert "call 1: load 110.0 ms: open 1.0, allocate 2.0, transfers 95.0" in text
    assert "(checksums on the GPU 3.0), elsewhere 12.0" in text


def test_the_set_up_medians_say_what_each_set_up_cost_and_when_it_began() -> None:
    def set_up(began: float, seconds: float | None, pinning: float) -> dict:
        steps = {"import": 0.04, "pinning": pinning}
        return {"arm": "kvikio(x)", "for": "stand-in", "began": began, "seconds": seconds,
                "steps": steps}  # fmt: skip

    def run(began: list, set_ups: list) -> dict:
        return {"series": "a", "pattern": "cold_start", "GBps": [1.0] * len(began),
                "error": None, "began": began, "set_ups": set_ups}  # fmt: skip

    report = {
        "peers": {"a": {}},
        "patterns": {"cold_start": {"calls": 3}},
        "ceilings": {},
        "sequences": [
            run([0.0, 1.0, 1.3], [set_up(0.01, 0.12, 0.06)]),  # in call 1
            run([0.0, 0.9, 1.2], [set_up(0.95, 0.20, 0.10)]),  # in call 2
            run([0.0, 1.1, 1.4], [set_up(0.02, 0.14, 0.08), set_up(2.0, None, 0.0)]),
        ],
    }
    fc.summarize(report)
    found = report["set_up_medians"]["cold_start"]["a"]["kvikio(x) for the stand-in"]
    assert found["sequences"] == 3  # (the set-up still running at the end is not counted)
    assert found["seconds"] == pytest.approx(0.14)
    assert found["steps"] == pytest.approx({"import": 0.04, "pinning": 0.08})
    assert found["call"] == 1
    text = fc.table_text(report)
    assert "set up kvikio(x) for the stand-in: 140.0 ms (import 40.0, pinning 80.0)" in text
    assert "began in call 1 (medians of 3)" in text


def test_the_stand_in_peer_forces_the_dispatchers_stand_in_for_warm_gpu_reads() -> None:
    # The stand-in is the first candidate with nothing to set up (Policy._stand_in): the
    # peer must force that arm, or it measures something the dispatcher never runs.
    from arrayio.dispatch.candidates import candidate_arms
    from arrayio.dispatch.context import Context
    from arrayio.dispatch.dispatcher import parse_arm

    warm_load = Context("read", "cuda", 31, "vda", "warm", 1)
    no_set_up = [arm for arm in candidate_arms(warm_load) if arm.name != "kvikio"]
    assert parse_arm(sequence.STAND_IN) == no_set_up[0]


def test_the_peer_without_a_set_up_wait_turns_it_off(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import arrayio
    from arrayio.dispatch import dispatcher

    path = tmp_path / "a.safetensors"
    arrayio.save(path, {"x": np.arange(1000, dtype=np.float32)})
    waited = dispatcher.get().policy.setup_wait
    try:
        load = sequence.LOADERS["arrayio-torch-no-setup-wait"]("cpu")
        assert dispatcher.get().policy.setup_wait == 0.0
        np.testing.assert_array_equal(
            load(str(path))["x"].numpy(), np.arange(1000, dtype=np.float32)
        )
    finally:
        dispatcher.get().policy.setup_wait = waited
