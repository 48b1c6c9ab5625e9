"""``arrayio.tune`` teaches the dispatcher ahead of time; ``arrayio.explain`` shows what it knows.

Each test runs on a fresh in-memory dispatcher (or one whose table lives in ``tmp_path``) and
puts the process-wide one back afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import arrayio
from arrayio import tools
from arrayio.dispatch import dispatcher
from arrayio.dispatch.dispatcher import Dispatcher

MiB = 1 << 20


@pytest.fixture
def tuned(tmp_path: Path, fresh: Dispatcher) -> tuple[arrayio.DispatchReport, Path]:
    """A tuning run (2 MiB; warm and cold reads, writes) in ``tmp_path``."""
    return arrayio.tune(tmp_path, sizes=[2 << 20], caches=["warm", "cold"]), tmp_path


def test_tune_learns_every_context_it_is_given(tuned):
    report, directory = tuned
    assert isinstance(report, arrayio.DispatchReport)
    keys = [e.key for e in report.explanations]
    assert len(keys) == len(set(keys)) == 3
    assert {tuple(key.split("/")[i] for i in (0, 2, 4)) for key in keys} == {
        ("read", "2^21", "warm"),
        ("read", "2^21", "cold"),
        ("write", "2^21", "-"),
    }
    # Loads verify checksums by default; a cold read of what fits in memory stays in the page
    # cache (/keep), so that the next load of it is a page-cache read.
    assert all(key.endswith("/crc/keep" if "/cold/" in key else "/crc") for key in keys), keys
    for explanation in report.explanations:
        assert explanation.phase == "exploiting", explanation.key
        [chosen] = [arm for arm in explanation.arms if arm.state == "chosen"]
        assert chosen.label == explanation.chosen
        assert chosen.gbps is not None and chosen.gbps > 0
        assert explanation.reason.startswith("fastest of")
    assert report.table_path is None
    assert list(directory.iterdir()) == []  # the scratch files are gone


def test_tuned_contexts_are_what_the_dispatcher_then_knows(tuned):
    report, _ = tuned
    learned = {e.key: (e.phase, e.chosen) for e in arrayio.explain().explanations}
    assert {e.key: (e.phase, e.chosen) for e in report.explanations}.items() <= learned.items()


def test_the_text_report_names_every_tool(tuned):
    report, _ = tuned
    text = str(report)
    assert text.splitlines()[0] == "arrayio dispatch table: (in memory only)"
    assert set(report.tools) == set(tools.names())
    for name in tools.names():
        availability = tools.tool_class(name).availability()
        expected = None if availability else availability.reason
        assert report.tools[name] == expected, name
        [line] = [line for line in text.splitlines() if line.startswith(f"  tool {name} ")]
        assert line.endswith("available" if expected is None else expected), line
    for name in ("naive", "posix"):
        assert report.tools[name] is None
    for explanation in report.explanations:
        assert f"{explanation.key}: {explanation.chosen}  [{explanation.reason}]" in text
        for arm in explanation.arms:
            assert any(
                line.lstrip().startswith(f"{arm.label} ") and arm.state in line
                for line in text.splitlines()
            ), arm.label


def test_gpu_tools_say_why_they_cannot_run_here(tuned):
    report, _ = tuned
    for name in ("kvikio", "staged"):
        if tools.tool_class(name).availability():
            pytest.skip(f"{name} can run here")
        assert report.tools[name]
        assert report.tools[name] in str(report)
    assert "kvikio" in report.tools["kvikio"].lower() or "libcuda" in report.tools["kvikio"]
    assert "cupy" in report.tools["staged"].lower() or "cuda" in report.tools["staged"].lower()


def test_the_report_as_a_dict_is_json(tuned):
    report, _ = tuned
    data = report.as_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert set(data) == {"table_path", "tools", "contexts", "last_load", "set_ups"}
    assert [c["key"] for c in data["contexts"]] == [e.key for e in report.explanations]
    for context in data["contexts"]:
        assert context["phase"] == "exploiting"
        assert isinstance(context["arms"], list) and context["arms"]
        assert {"label", "state", "gbps", "count", "reason"} <= set(context["arms"][0])


def test_sizes_below_one_mib_are_accepted_and_not_learned(tmp_path, fresh):
    report = arrayio.tune(tmp_path, sizes=[4096, 64 << 10], caches=["warm"])
    assert report.explanations == ()
    assert len(fresh.table) == 0
    assert list(tmp_path.iterdir()) == []
    report = arrayio.tune(tmp_path, sizes=[64 << 10, MiB, 4096], caches=["warm"])
    assert sorted(e.key.split("/")[0] + e.key.split("/")[2] for e in report.explanations) == [
        "read2^20",
        "write2^20",
    ]  # exactly 1 MiB is learned
    assert all(e.phase == "exploiting" for e in report.explanations)
    assert list(tmp_path.iterdir()) == []


def test_tune_learns_even_where_a_tool_is_forced(tmp_path, fresh):
    # ARRAYIO_TOOL (or config.set(tool=...)) forces the transfers of the program; tune()
    # exists to teach the dispatcher, and must neither measure only the forced arm nor run
    # its whole max_calls budget per context waiting for an exploration that cannot end.
    with arrayio.config.set(tool="posix"):
        report = arrayio.tune(tmp_path, sizes=[MiB], directions=["read"], caches=["warm"])
    [explanation] = report.explanations
    with fresh.table.lock:
        counts = {
            label: stats.count for label, stats in fresh.table.get(explanation.key).arms.items()
        }
    # Each arm: its samples (more for close contenders), and a first call or two unrecorded.
    per_arm = fresh.policy.contend_samples
    assert sum(counts.values()) <= per_arm * len(explanation.arms) + 2, counts
    assert explanation.phase == "exploiting"


def test_tune_learns_the_batches_of_saving_and_loading_given_arrays(tmp_path, fresh):
    # A checkpoint moves as one batch of arrays, in a context of its own (its total size and
    # its typical array): tuning one transfer of its size does not teach that context.
    rng = np.random.default_rng(5)
    state = {
        f"layer{i}": rng.standard_normal(MiB // 8 * (2 if i % 2 else 1)) for i in range(6)
    }  # 1 and 2 MiB arrays: 9 MiB, typical piece 2 MiB
    state["bias"] = np.arange(10, dtype=np.float32)  # small: outside the batch
    report = arrayio.tune(tmp_path, sizes=(), arrays=state)
    keys = {e.key.split("/")[0] + "/" + e.key.split("/")[4]: e for e in report.explanations}
    assert set(keys) == {"write/-", "read/cold", "read/warm"}
    for explanation in report.explanations:
        assert explanation.key.split("/")[2] == "2^24"
        assert explanation.key.endswith(
            "/of2^21/keep" if "/cold/" in explanation.key else "/of2^21"
        )
        assert explanation.phase == "exploiting", explanation
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone

    # A program's save and warm load of the same arrays then find their contexts learned.
    path = tmp_path / "state.safetensors"
    arrayio.save(path, state)
    assert fresh.last_batch[0].key() == keys["write/-"].key
    before = {k: sum(a.count for a in e.arms.values()) for k, e in fresh.table.items()}
    for _ in range(2):
        back = arrayio.load(path)
        assert fresh.last_batch[0].key() in (keys["read/warm"].key, keys["read/cold"].key)
    assert all(back[k].tobytes() == v.tobytes() for k, v in state.items())
    after = {k: sum(a.count for a in e.arms.values()) for k, e in fresh.table.items()}
    assert set(after) == set(before)  # no new context to explore


def test_a_low_max_calls_leaves_the_rest_to_real_use(tmp_path, fresh):
    # Tuning a large checkpoint moves all of it on every call (355 s for 8.7 GB on the H200
    # VM): max_calls bounds that, and the saves that follow go on exploring where it left off.
    rng = np.random.default_rng(6)
    state = {f"layer{i}": rng.standard_normal(MiB // 4) for i in range(4)}  # 2 MiB each
    report = arrayio.tune(tmp_path, sizes=(), arrays=state, caches=("warm",), max_calls=1)
    [write] = [e for e in report.explanations if e.key.startswith("write/")]
    assert write.phase == "exploring"
    assert sum(arm.count for arm in write.arms) == 1
    path = tmp_path / "state.safetensors"
    arrayio.save(path, state)
    [again] = [e for e in arrayio.explain().explanations if e.key == write.key]
    assert sum(arm.count for arm in again.arms) == 2


def test_tune_needs_sizes_or_arrays(tmp_path, fresh):
    with pytest.raises(ValueError, match="sizes"):
        arrayio.tune(tmp_path, sizes=())


def test_tune_saves_the_table_where_the_next_process_finds_it(tmp_path):
    cache, data = tmp_path / "cache", tmp_path / "data"
    data.mkdir()
    with arrayio.config.set(cache_dir=str(cache)):
        dispatcher.reset()
        try:
            report = arrayio.tune(data, sizes=[MiB], directions=["read"], caches=["warm"])
            [table_file] = cache.glob("dispatch-*.json")
            assert report.table_path == str(table_file)
            saved = json.loads(table_file.read_text())["contexts"]
            [explanation] = report.explanations
            assert saved[explanation.key]["phase"] == "exploiting"
            assert saved[explanation.key]["chosen"] == explanation.chosen
        finally:
            dispatcher.reset()
    assert list(data.iterdir()) == []


# ---- explain -----------------------------------------------------------------------------


def saved_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tree = {
        "one_mib": rng.standard_normal(MiB // 4, dtype=np.float32),  # 2^20, the smallest learned
        "two_mib": rng.integers(0, 256, 2 * MiB, dtype=np.uint8),  # 2^21
        "almost_two_mib": rng.standard_normal((2 * MiB - 4096) // 8),  # 2^21 again
        "eight_mib": rng.integers(0, 256, 8 * MiB, dtype=np.uint8),  # 2^23
        "small": np.arange(16 << 10, dtype=np.float32),  # 64 KiB: never learned
        "tiny": np.arange(3, dtype=np.int32),
        "empty": np.zeros(0, np.float32),
    }
    path = tmp_path / "tree.safetensors"
    arrayio.save(path, tree)
    return path, tree


def test_explain_a_file_leaves_out_arrays_too_small_to_learn(tmp_path, fresh):
    # Below 1 MiB a transfer goes straight to the naive tool, with no context: explaining a
    # context for it would describe a choice that is never made. The others (13 MiB) load as
    # one batch, in the context of their total size (and typical array).
    path, _ = saved_file(tmp_path)
    report = arrayio.explain(path)
    assert [e.key.split("/")[2] for e in report.explanations] == ["2^24"]
    # Forced, every array goes through the forced arm, in the batch.
    with arrayio.config.set(tool="naive"):
        [forced] = arrayio.explain(path).explanations
    assert (forced.key, forced.phase, forced.chosen) == (
        report.explanations[0].key,
        "forced",
        "naive",
    )


def test_explain_a_file_shows_the_context_its_load_uses(tmp_path, fresh):
    path, tree = saved_file(tmp_path)
    [batch] = arrayio.explain(path).explanations
    assert batch.key.startswith("read/host/2^24/") and "/crc" in batch.key
    assert batch.phase == "exploring"
    # Explaining learns nothing (the save taught the write contexts).
    assert [key for key, _ in fresh.table.items() if key.startswith("read/")] == []

    with fresh.policy.whole_calls():  # a call per arm, as tune() learns: quick to converge
        for _ in range(40):
            back = arrayio.load(path)
            assert dispatcher.get().last[0].key() == batch.key  # the context explained
            if arrayio.explain(path).explanations[0].phase == "exploiting":
                break
    assert all(back[key].tobytes() == array.tobytes() for key, array in tree.items())
    [batch] = arrayio.explain(path).explanations
    assert batch.phase == "exploiting" and batch.chosen is not None
    assert [arm.label for arm in batch.arms if arm.state == "chosen"] == [batch.chosen]
    arrayio.load(path)  # the load that ended the exploration measured the last arm tried
    context, arm = dispatcher.get().last
    assert (context.key(), arm.label) == (batch.key, batch.chosen)

    # One array alone: its own context, the one a load of that key uses.
    [only] = arrayio.explain(path, key="eight_mib").explanations
    assert only.key.split("/")[2] == "2^23" and only.key != batch.key
    arrayio.load(path, keys="eight_mib")
    context, arm = dispatcher.get().last
    assert context.key() == only.key

    [unverified] = arrayio.explain(path, verify=False).explanations
    assert unverified.key == batch.key.replace("/crc", "")


def test_explain_a_missing_key_raises(tmp_path, fresh):
    path, _ = saved_file(tmp_path)
    with pytest.raises(arrayio.KeyNotFoundError, match="missing") as raised:
        arrayio.explain(path, key="missing")
    assert isinstance(raised.value, KeyError)
    assert str(path) in str(raised.value)


def test_explain_on_a_fresh_dispatcher_says_nothing_is_learned(tmp_path):
    cache = tmp_path / "cache"
    with arrayio.config.set(cache_dir=str(cache)):
        dispatcher.reset()
        try:
            report = arrayio.explain()
            assert report.explanations == ()
            assert report.table_path is not None and report.table_path.startswith(str(cache))
            assert "nothing learned yet" in str(report)
            assert report.as_dict()["contexts"] == []
        finally:
            dispatcher.reset()
    dispatcher.reset(Dispatcher(None))
    try:
        text = str(arrayio.explain())
        assert "(in memory only)" in text and "nothing learned yet" in text
    finally:
        dispatcher.reset()


def test_explain_a_npy_file(tmp_path, fresh):
    path = tmp_path / "w.npy"
    arrayio.save(path, np.arange(MiB, dtype=np.float32).reshape(1024, 1024))  # 4 MiB
    [explanation] = arrayio.explain(path).explanations
    # .npy records no checksum: the read would not compute one.
    assert explanation.key.startswith("read/host/2^22/") and not explanation.key.endswith("/crc")
    arrayio.load(path)
    assert dispatcher.get().last[0].key() == explanation.key


def test_tune_takes_sizes_as_the_cli_writes_them(tmp_path, fresh) -> None:
    report = arrayio.tune(
        tmp_path, sizes=("1M", MiB), directions=("read",), caches=("warm",), max_calls=1
    )
    assert [e.key.split("/")[2] for e in report.explanations] == ["2^20"]  # one size


def test_explain_shows_the_set_ups_run_in_the_background(fresh):
    # What a tool's set-up in the background cost, step by step, and whether it still runs
    # or failed (Policy.set_ups): where a user looks for a slow second load.
    done = {"arm": "kvikio(task_size=4194304,threads=16)", "for": "stand-in", "began": 1.0,
            "seconds": 0.1234, "steps": {"import": 0.04, "pinning": 0.08}}  # fmt: skip
    running = {"arm": "staged(x)", "for": "rival", "began": 2.0, "seconds": None, "steps": {}}
    failed = dict(done, arm="kvikio(y)", seconds=0.01, steps={}, error="OSError: no driver")
    with fresh.policy._tools_lock:
        fresh.policy._set_up_log.extend([done, running, failed])
    report = arrayio.explain()
    assert report.set_ups == (done, running, failed)
    text = str(report)
    assert (
        "set up in the background: kvikio(task_size=4194304,threads=16) (for the stand-in): "
        "123.4 ms (import 40.0 ms, pinning 80.0 ms)" in text
    )
    assert "set up in the background: staged(x) (for the rival): running" in text
    assert "kvikio(y) (for the stand-in): 10.0 ms; failed: OSError: no driver" in text
    assert "set up in the background: staged(x) (for the rival): running" in report._repr_html_()
    assert json.loads(json.dumps(report.as_dict()))["set_ups"][0]["steps"]["pinning"] == 0.08
