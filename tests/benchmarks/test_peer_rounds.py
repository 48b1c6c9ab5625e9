"""How a round of the peer benchmarks is run (``benchmarks.peers._harness.measure_round``):
phases in order, the ceiling's samples inside their phase, failures kept apart, the disk
cleaned up; and how peers are grouped to fit on the disk."""

from __future__ import annotations

import collections
import os

import pytest

from benchmarks.peers import _harness as h


class FakeCeilings:
    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log
        self.paths: list[str | None] = []  # the file each sample was given

    def sample(self, name: str, path: str | None = None) -> None:
        self.log.append(("ceiling", name))
        self.paths.append(path)

    def lead_in(self, name: str) -> None:
        self.log.append(("lead-in", name))


def fake_peer(
    name: str, log: list[tuple[str, str]], fail: str | None = None, checked: list[str] | None = None
) -> h.Peer:
    def save(path: str) -> None:
        log.append((name, "save"))
        if fail == "save":
            raise OSError("disk full")
        with open(path, "wb") as f:
            f.write(name.encode() * 100)

    def load(path: str) -> bytes:
        log.append((name, "load"))
        if fail == "load":
            raise ValueError("bad file")
        with open(path, "rb") as f:
            return f.read()

    def check(out: bytes) -> None:
        assert out == name.encode() * 100
        if checked is not None:
            checked.append(name)

    return h.Peer(name, save, load, check)


def test_a_round_runs_every_save_then_every_cold_load_then_every_warm_load(tmp_path):
    log: list[tuple[str, str]] = []
    checked: list[str] = []
    peers = [fake_peer(n, log, checked=checked) for n in ("a", "b", "c")]
    paths = {p.name: str(tmp_path / p.name) for p in peers}
    fake = FakeCeilings(log)
    got = h.measure_round(
        peers, paths, drop=False, verify={"b"}, seed="s", ceilings=fake, lead_in=fake.lead_in
    )
    # Each phase opens with its untimed lead-in.
    assert [log[i] for i in (0, 5, 10)] == [
        ("lead-in", "write_fsync"),
        ("lead-in", "cold_read"),
        ("lead-in", "warm_read"),
    ]
    phases = [log[1:5], log[6:10], log[11:15]]
    assert len(log) == 15
    assert sorted(phases[0]) == [
        ("a", "save"),
        ("b", "save"),
        ("c", "save"),
        ("ceiling", "write_fsync"),
    ]
    for phase, ceiling in zip(phases[1:], ("cold_read", "warm_read"), strict=True):
        assert sorted(phase) == [("a", "load"), ("b", "load"), ("c", "load"), ("ceiling", ceiling)]
    assert checked == ["b"]  # its cold load only
    assert set(got.seconds) == {"a", "b", "c"}
    assert all(
        set(s) == set(h.QUANTITIES) and all(v > 0 for v in s.values()) for s in got.seconds.values()
    )
    assert got.disk == {"a": 100, "b": 100, "c": 100} and not got.errors
    # The collector's time inside each timed sample is kept beside it.
    assert {name: set(q) for name, q in got.gc.items()} == {n: set(h.QUANTITIES) for n in "abc"}
    assert all(r["ms"] >= 0 and r["full"] >= 0 for q in got.gc.values() for r in q.values())
    # The orders are recorded as they ran.
    assert [who for who, _ in phases[0]] == got.orders["save"]
    assert set(got.orders) == set(h.QUANTITIES)
    assert not any(os.path.exists(p) for p in paths.values())  # the files are removed


def test_each_phase_of_each_round_has_its_own_order(tmp_path):
    firsts = collections.Counter()
    for seed in range(12):
        log: list[tuple[str, str]] = []
        peers = [fake_peer(n, log) for n in ("a", "b", "c", "d")]
        h.measure_round(
            peers,
            {p.name: str(tmp_path / p.name) for p in peers},
            False,
            set(),
            seed=str(seed),
            ceilings=FakeCeilings(log),
        )
        firsts.update(who for who, _ in (log[0], log[5], log[10]))
    assert len(firsts) == 5  # every peer, and the ceiling, opened some phase


@pytest.mark.parametrize("first", [True, False])
def test_the_cold_ceiling_reads_the_named_peers_file_beside_its_load(tmp_path, first):
    for seed in range(6):
        log: list[tuple[str, str]] = []
        peers = [fake_peer(n, log) for n in ("a", "b", "c", "d")]
        paths = {p.name: str(tmp_path / p.name) for p in peers}
        fake = FakeCeilings(log)
        got = h.measure_round(
            peers,
            paths,
            False,
            set(),
            seed=str(seed),
            ceilings=fake,
            cold_ceiling_reads="b",
            ceiling_first=first,
        )
        cold = got.orders["cold_load"]
        here = cold.index("ceiling")
        assert cold[here + 1 if first else here - 1] == "b", (seed, cold)
        # Only the cold read's sample is given the peer's file.
        assert fake.paths == [None, paths["b"], None]
        assert sorted(got.orders["save"]) == sorted(cold) == sorted(got.orders["warm_load"])


def test_without_the_named_peer_the_cold_ceiling_reads_its_own_file(tmp_path):
    log: list[tuple[str, str]] = []
    peers = [fake_peer("a", log), fake_peer("b", log, fail="save")]
    fake = FakeCeilings(log)
    h.measure_round(
        peers,
        {p.name: str(tmp_path / p.name) for p in peers},
        False,
        set(),
        seed="s",
        ceilings=fake,
        cold_ceiling_reads="b",
    )
    assert fake.paths == [None, None, None]  # b's save failed: no file of its to read


def test_a_ceiling_is_judged_on_its_samples_in_the_rounds(tmp_path, monkeypatch):
    nbytes = 3 << 20
    ceilings = h.DiskCeilings(str(tmp_path), nbytes, drop=False)
    try:
        ceilings.search()
        search = ceilings.report()["cold_read"]
        # Before any round: the search's best, and said so.
        assert search["judged_on"] == "search"
        assert search["GBps"] == search["search_GBps"] == max(search["upfront_GBps"].values())
        peer = tmp_path / "peer.bin"
        peer.write_bytes(b"x" * (1 << 20))
        read: list[tuple[str, int]] = []

        def fake_read(tool, cold, path=None, view=None, ready=None):
            read.append((path, None if view is None else view.nbytes))
            return 0.5

        monkeypatch.setattr(ceilings, "_read", fake_read)
        ceilings.sample("cold_read", str(peer))
        ceilings.sample("cold_read", str(tmp_path / "gone"))  # no such file: its own
        assert read == [(str(peer), 1 << 20), (None, None)]  # None: the ceiling's own
        limit = ceilings.limits["cold_read"]
        # Seconds scaled to the ceiling's size: 1 MiB in 0.5 s is 3 MiB in 1.5 s.
        assert limit.samples == [1.5, 0.5]
        assert limit.files == ["peer.bin", "ceiling.bin"]
        report = ceilings.report()["cold_read"]
        assert report["judged_on"] == "rounds"
        assert report["GBps"] == pytest.approx(nbytes / 1.0 / h.GB)  # the median, 1.0 s
        assert report["search_GBps"] == search["search_GBps"]
    finally:
        ceilings.close()


@pytest.mark.parametrize("fail", ["save", "load"])
def test_a_failing_peer_is_reported_and_the_others_measured(tmp_path, fail):
    log: list[tuple[str, str]] = []
    peers = [fake_peer("good", log), fake_peer("bad", log, fail=fail)]
    paths = {p.name: str(tmp_path / p.name) for p in peers}
    got = h.measure_round(peers, paths, drop=False, verify=set(), seed="s")
    assert set(got.seconds) == {"good"} and set(got.errors) == {"bad"}
    assert ("OSError: disk full" if fail == "save" else "ValueError: bad file") == got.errors["bad"]
    assert log.count(("bad", "load")) == (1 if fail == "load" else 0)  # not tried again
    assert not any(os.path.exists(p) for p in paths.values())


def test_a_failed_check_is_a_failure_of_that_peer(tmp_path):
    log: list[tuple[str, str]] = []
    peer = fake_peer("p", log)
    got = h.measure_round([peer], {"p": str(tmp_path / "p")}, False, {"p"}, "s")
    assert not got.errors

    def wrong_values(out: bytes) -> None:
        raise AssertionError("q: values differ")

    wrong = h.Peer("q", peer.save, peer.load, wrong_values)
    got = h.measure_round([wrong], {"q": str(tmp_path / "q")}, False, {"q"}, "s")
    assert set(got.errors) == {"q"} and not got.seconds


def test_the_lead_in_writes_then_reads_back_a_file_of_its_own(tmp_path):
    ceilings = h.DiskCeilings(str(tmp_path), 3 << 20, drop=False)
    try:
        ceilings.search()
        ceiling_file = os.path.getmtime(ceilings.path)
        ceilings.lead_in("write_fsync")
        assert os.path.getsize(ceilings.lead_in_path) == ceilings.lead_in_bytes == 3 << 20
        ceilings.lead_in("warm_read")  # nothing to do
        assert os.path.exists(ceilings.lead_in_path)
        ceilings.lead_in("cold_read")
        assert not os.path.exists(ceilings.lead_in_path)
        assert os.path.getmtime(ceilings.path) == ceiling_file  # the ceiling's file untouched
        assert all(not limit.samples for limit in ceilings.limits.values())  # untimed
    finally:
        ceilings.close()


def test_peers_are_grouped_to_fit_on_the_disk(tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(h.shutil, "disk_usage", lambda _: usage(1000, 0, 1000))
    peers = [h.Peer(n, print, print, print) for n in "abcde"]
    sizes = dict(zip("abcde", (300, 300, 300, 900, 100), strict=True))
    groups = h.groups_on_disk(peers, str(tmp_path), lambda p: sizes[p.name])
    # 80% of the free space: 800 bytes a group; one too big for it goes alone.
    assert [[p.name for p in g] for g in groups] == [["a", "b"], ["c"], ["d"], ["e"]]
    # Room kept for the lead-in's file: 600 bytes a group.
    groups = h.groups_on_disk(peers, str(tmp_path), lambda p: sizes[p.name], reserve=200)
    assert [[p.name for p in g] for g in groups] == [["a", "b"], ["c"], ["d"], ["e"]]
    groups = h.groups_on_disk(peers, str(tmp_path), lambda p: sizes[p.name], reserve=300)
    assert [[p.name for p in g] for g in groups] == [["a"], ["b"], ["c"], ["d"], ["e"]]


def _result(arrayio_rounds: int, torch_rounds: int) -> dict:
    def peer(gbps: float, rounds: int) -> dict:
        return {
            "save_GBps": gbps,
            "cold_load_GBps": gbps,
            "warm_load_GBps": gbps * 10,
            "samples": rounds,
            "paired_fraction_of_ceiling": {"save": 1.0, "cold_load": 1.0, "warm_load": 1.0},
        }

    ceiling = {"GBps": 3.0, "interleaved_GBps": 3.0, "search_GBps": 3.5}
    return {
        "peers": {
            "arrayio": peer(3.0, arrayio_rounds),
            "torch": peer(1.0, torch_rounds),
            "safetensors": peer(1.0, 5),
        },
        "ceilings": {"write_fsync": ceiling, "cold_read": ceiling, "warm_read": ceiling},
    }


@pytest.mark.parametrize(
    ("mine", "theirs", "judged"), [(3, 3, True), (5, 2, False), (2, 5, False), (1, 1, False)]
)
def test_a_goal_is_judged_on_three_rounds_a_side(mine, theirs, judged):
    # The figures are medians of at least 3 repetitions.
    from benchmarks.peers.checkpoint import targets, verdict

    goals = targets(_result(mine, theirs))["arrayio"]
    vs_torch, vs_ceiling = goals["save_vs_torch"], goals["save_vs_write_ceiling"]
    assert vs_torch["rounds"] == min(mine, theirs)
    assert (vs_torch["met"] is not None) == judged
    assert (vs_ceiling["met"] is not None) == (mine >= 3)  # a ceiling is 3 samples a setting
    # Judged against the ceiling's GBps (the rounds'), the search's best beside it.
    assert vs_ceiling["ratio"] == 1.0 and vs_ceiling["reference_GBps"] == 3.0
    assert vs_ceiling["ratio_vs_search"] == pytest.approx(3.0 / 3.5)
    if judged:
        assert vs_torch["met"] is True and verdict(vs_torch) == "met"
    else:
        assert verdict(vs_torch) == (
            f"not judged: {min(mine, theirs)} round{'s' * (min(mine, theirs) != 1)}, fewer than 3"
        )


def test_the_collector_is_metered_inside_a_block_and_only_there():
    import gc

    with h.GcMeter() as inside:
        gc.collect()
    gc.collect()
    assert inside.full == 1 and inside.seconds > 0
    assert inside.report()["full"] == 1


def test_a_failed_warm_up_search_still_closes_its_ceilings(tmp_path, monkeypatch):
    import argparse

    from benchmarks.peers import checkpoint

    closed: list[bool] = []

    class FailingCeilings:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def search(self) -> None:
            raise OSError("disk gone")

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(h, "DiskCeilings", FailingCeilings)
    monkeypatch.setattr(checkpoint, "make_peers", lambda state, device: ([], {}))
    args = argparse.Namespace(
        d_model=128, vocab=1024, device="cpu", dir=str(tmp_path), drop_caches=False
    )
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.warm_up(args, 0.001, {}, {}, search=True)
    assert closed == [True]  # its tool threads and files do not outlive the failure
    assert os.listdir(tmp_path) == []  # nor does its scratch directory


def test_the_write_ceiling_also_tries_writers_into_a_reserved_file(tmp_path, monkeypatch):
    """arrayio reserves a large write's blocks first; the raw write ceiling must try that too,
    or it would understate the disk against arrayio (benchmarks._ceiling_tools)."""
    from arrayio.tools import _io
    from benchmarks import _ceiling_tools

    calls: list[tuple[int, int]] = []
    real = _io._fallocate()

    def counting(fd, mode, offset, length):
        calls.append((offset, length))
        return real(fd, mode, offset, length) if real is not None else 0

    monkeypatch.setattr(_io, "_fallocate", lambda: counting)
    nbytes = 2 << 20
    ceilings = h.DiskCeilings(str(tmp_path), nbytes, drop=False)
    try:
        ceilings.search()
        searched = ceilings.report()["write_fsync"]["upfront_GBps"]
    finally:
        ceilings.close()
    reserved = [label for label in searched if label.endswith(_ceiling_tools.PREALLOCATED)]
    assert len(reserved) == 3 and len(searched) == len(h.DiskCeilings.WRITE)
    # Each of their samples reserved the whole file once; no other setting reserved anything.
    assert calls == [(0, nbytes)] * (3 * h.DiskCeilings.SAMPLES)


def test_a_reserving_ceiling_tool_writes_the_bytes(tmp_path):
    import numpy as np

    from benchmarks import _ceiling_tools

    tool = _ceiling_tools.make("posix+fallocate", threads=2, task_size=1 << 20)
    try:
        assert tool.label.endswith("+fallocate")
        data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
        path = tmp_path / "f"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            tool.write(fd, data, 4096)
            back = np.empty_like(data)
            tool.read(fd, back, 4096)
        finally:
            os.close(fd)
        assert path.stat().st_size == 4096 + data.nbytes
        np.testing.assert_array_equal(back, data)
    finally:
        tool.close()
    with pytest.raises(ValueError):
        _ceiling_tools.make("direct+fallocate+x", threads=1, task_size=1 << 20)


def test_goal_repeats_add_rounds_of_the_targets_terms_alone(tmp_path, monkeypatch):
    import argparse

    from benchmarks.peers import checkpoint

    log: list[tuple[str, str]] = []
    names = ("arrayio", "torch", "numpy", "arrayio-cupy")
    monkeypatch.setattr(
        checkpoint, "make_peers", lambda state, device: ([fake_peer(n, log) for n in names], {})
    )
    args = argparse.Namespace(
        d_model=128,
        vocab=1024,
        device="cpu",
        dir=str(tmp_path),
        drop_caches=False,
        tune=False,
        repeats=1,
        goal_repeats=3,
    )
    report: dict = {"seed": "s", "sizes": []}
    checkpoint.run_size(
        args, 0.001, h.Deadline(None), {}, None, report, str(tmp_path / "checkpoint.json")
    )
    (size,) = report["sizes"]
    samples = {name: row["samples"] for name, row in size["peers"].items()}
    # Every front door (not only the torch one), torch: every round; numpy: the first.
    assert samples == {"arrayio": 3, "torch": 3, "arrayio-cupy": 3, "numpy": 1}
    assert collections.Counter(log)[("numpy", "save")] == 1
    assert collections.Counter(log)[("arrayio-cupy", "save")] == 3
    assert len(size["ceilings"]["write_fsync"]["interleaved_seconds"]) == 3
    assert "rounds_skipped_for_time" not in size["peers"]["numpy"]
    # Judged on three rounds a side: the goal against torch is judged, as is the ceiling's.
    goals = size["targets"]["arrayio"]
    assert goals["save_vs_torch"]["rounds"] == 3 and goals["save_vs_torch"]["met"] is not None
    assert goals["save_vs_write_ceiling"]["met"] is not None


def test_goal_repeats_below_repeats_are_refused(tmp_path):
    from benchmarks.peers import checkpoint

    with pytest.raises(SystemExit):
        checkpoint.main(["--out", str(tmp_path), "--repeats", "3", "--goal-repeats", "2"])


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


def _plan(round_index: int, budget: float, repeats: int = 3):
    from benchmarks.peers import checkpoint

    peers = [_Named(n) for n in ("numpy", "arrayio", "orbax", "torch", "arrayio-cupy")]
    expected = {p.name: 10.0 for p in peers}
    chosen, skipped = checkpoint.plan_round(
        peers, round_index, repeats, expected, 5.0, lambda seconds: seconds < budget
    )
    return [p.name for p in chosen], skipped


def test_a_round_plans_the_goals_terms_first_then_the_others():
    # Every peer needs 14 s (10 s measured, 1.2x, plus 2 s); the ceilings' samples 5 s.
    # Plenty of time: all, the goals' terms first.
    assert _plan(0, 1e9) == (["arrayio", "torch", "arrayio-cupy", "numpy", "orbax"], [])
    # Time for the goals' terms alone: the others are skipped, and reported.
    assert _plan(2, 5 + 3 * 14 + 1) == (["arrayio", "torch", "arrayio-cupy"], ["numpy", "orbax"])


def test_a_round_keeps_time_for_the_goals_terms_later_rounds_up_to_repeats():
    # Round 1 of 3: one later round of the goals' terms (5 + 3 x 10 s) must still fit
    # after numpy's 14 s, so a budget that holds this round alone leaves numpy out.
    this_round = 5 + 3 * 14
    assert _plan(1, this_round + 14 + 1) == (
        ["arrayio", "torch", "arrayio-cupy"],
        ["numpy", "orbax"],
    )
    assert _plan(1, this_round + 14 + 35 + 1)[0] == ["arrayio", "torch", "arrayio-cupy", "numpy"]


def test_rounds_past_repeats_hold_the_goals_terms_alone_and_never_cost_the_others_rounds():
    # --goal-repeats 9 with --repeats 3: the goals' terms' rounds 4 to 9 are not kept time
    # for in round 0, so the other peers still get theirs.
    this_round = 5 + 5 * 14
    assert _plan(0, this_round + 2 * 35 + 1)[1] == []
    # Past --repeats, the others do not run and are not counted as skipped.
    assert _plan(3, 1e9) == (["arrayio", "torch", "arrayio-cupy"], [])
    assert _plan(3, 5 + 14 + 1) == (["arrayio"], ["torch", "arrayio-cupy"])
