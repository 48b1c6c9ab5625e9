"""plan_step(): a plain step recorded, rates measured (faked here) or given, a plan made in
each mode, applied by activations(plan=...), and explained; on the CPU."""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayio
from arrayio.offload import PlanWarning, Rates, StepPlan, activations, measure_rates, plan_step
from arrayio.offload._plan import plan, simulate
from arrayio.offload._rates import host_rates, why_no_host_tier

torch = pytest.importorskip("torch")

KB = 1 << 10
MIN_BYTES = 64 * KB
WIDTHS = [256, 128, 192, 64, 320]  # saved tensors of different sizes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for a, b in zip(WIDTHS, WIDTHS[1:], strict=False):
        blocks += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def _step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _rates(link: float, disk: float, host: int = 1 << 30) -> Rates:
    return Rates(link, link, disk, disk, host)


class _FakeMeasure:
    """Rates given, and what plan_step asked for."""

    def __init__(self, rates: Rates) -> None:
        self.rates = rates
        self.calls: list[dict] = []

    def __call__(self, offloader, **kwargs) -> Rates:
        self.calls.append({"offloader": offloader, **kwargs})
        return self.rates


FAST = _rates(1e15, 1e15)
SLOW = _rates(1.0, 1.0)


@pytest.fixture
def model_and_batch():
    return _model(), torch.randn(512, WIDTHS[0])


def _planned_steps(off, model, x, step_plan, steps: int = 2) -> list[torch.Tensor]:
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with activations(off, plan=step_plan):
            model(x).square().sum().backward()
    off.wait()  # the spills run in the background
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("link_rates", [FAST, _rates(1e9, 1e8), SLOW], ids=["fast", "mid", "slow"])
def test_the_overhead_mode_holds_its_bound_exactly_when_the_rates_allow(
    tmp_path, model_and_batch, link_rates
):
    model, x = model_and_batch
    expected = _step(model, x)
    measure = _FakeMeasure(link_rates)
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        with plan_step(off, max_overhead=0.1, min_bytes=MIN_BYTES, measure=measure) as sp:
            _step(model, x)
        assert measure.calls == [
            {"offloader": off, "cuda": False, "sample_bytes": 1 << 20}  # the smallest sample
        ]
        chosen, timeline = sp.plan, sp.timeline
        assert [s.nbytes for s in timeline.saved] == [512 * w * 4 for w in WIDTHS[1:]]
        assert chosen == plan(timeline, link_rates, max_overhead=0.1)  # the pure planner's
        assert chosen.step_seconds <= 1.1 * timeline.step_seconds + 1e-12
        if chosen.tiers == ("device",) * len(timeline.saved):
            # Nothing moved: then no single move stays within the bound and frees memory.
            for i in range(len(timeline.saved)):
                for tier in ("host", "disk"):
                    tiers = ["device"] * len(timeline.saved)
                    tiers[i] = tier
                    single = simulate(timeline, link_rates, tiers)
                    assert not (
                        single.step_seconds <= 1.1 * timeline.step_seconds + 1e-12
                        and single.memory < chosen.memory
                    )
        got = _planned_steps(off, model, x, sp)
        stats = off.stats()
    moved = [s.nbytes for s, t in zip(timeline.saved, chosen.tiers, strict=True) if t != "device"]
    assert stats.writes == 2 * len(moved) and stats.bytes_written == 2 * sum(moved)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


@given(
    link=st.floats(1e3, 1e13),
    disk=st.floats(1e3, 1e11),
    host=st.integers(0, 1 << 21),
    overhead=st.sampled_from([0.0, 0.1, 0.5]),
)
@settings(max_examples=25, deadline=None)
def test_any_rates_given_plan_within_the_bound(link, disk, host, overhead):
    model, x = _model(), torch.randn(512, WIDTHS[0])
    link_rates = _rates(link, disk, host)
    with tempfile.TemporaryDirectory() as scratch:
        with arrayio.Offloader(scratch, device_budget_bytes=1 << 30) as off:
            with plan_step(off, max_overhead=overhead, min_bytes=MIN_BYTES, rates=link_rates) as sp:
                _step(model, x)
    chosen, timeline = sp.plan, sp.timeline
    assert chosen == plan(timeline, link_rates, max_overhead=overhead)
    assert chosen.step_seconds <= (1 + overhead) * timeline.step_seconds + 1e-12
    assert chosen.bytes_on("host", timeline) <= host
    # Rates given with no host bytes: explain() says so.
    assert (sp.host_tier is None) == (host > 0)


def test_fast_links_move_all_but_what_backward_needs_at_once(tmp_path, model_and_batch):
    model, x = model_and_batch
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        with plan_step(off, max_overhead=0.0, min_bytes=MIN_BYTES, rates=FAST) as sp:
            _step(model, x)
    assert sp.plan.peak_bytes < sp.plan.plain_peak_bytes
    assert sp.tiers.count("device") <= 1  # the last saved, needed as backward starts
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        with plan_step(off, max_overhead=0.1, min_bytes=MIN_BYTES, rates=SLOW) as sp:
            _step(model, x)
    assert sp.tiers == ("device",) * 4 and sp.plan.peak_bytes == sp.plan.plain_peak_bytes


def test_the_budget_mode_meets_the_budget_and_gradients_hold(tmp_path, model_and_batch):
    model, x = model_and_batch
    expected = _step(model, x)
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        with plan_step(off, max_overhead=0.0, min_bytes=MIN_BYTES, rates=SLOW) as probe:
            _step(model, x)  # the plain peak
        plain_peak = probe.plan.plain_peak_bytes
        budget = plain_peak // 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # met, and fast: no warning
            with plan_step(
                off, device_budget_bytes=budget, warn_above=1.5, min_bytes=MIN_BYTES, rates=FAST
            ) as sp:
                _step(model, x)
        assert sp.plan.peak_bytes <= budget < plain_peak
        assert sp.mode == f"device_budget_bytes={budget}"
        got = _planned_steps(off, model, x, sp, steps=1)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_a_slow_plan_warns_above_the_threshold(tmp_path, model_and_batch):
    model, x = model_and_batch
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        with plan_step(off, max_overhead=0.0, min_bytes=MIN_BYTES, rates=SLOW) as probe:
            _step(model, x)  # the plain peak
        budget = probe.plan.plain_peak_bytes // 2
        slow = _rates(1e6, 1e6)  # a tensor of 128 KiB or more takes a tenth of a second
        with pytest.warns(PlanWarning, match=r"warn_above=2\b") as caught:
            with plan_step(
                off, device_budget_bytes=budget, warn_above=2.0, min_bytes=MIN_BYTES, rates=slow
            ) as sp:
                _step(model, x)
    assert sp.plan.step_seconds > 2.0 * sp.plan.plain_step_seconds
    assert caught[0].filename == __file__  # points at the caller's block


def test_a_budget_no_plan_meets_warns(tmp_path, model_and_batch):
    model, x = model_and_batch
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        with pytest.warns(PlanWarning, match="no spill plan meets device_budget_bytes=0"):
            with plan_step(off, device_budget_bytes=0, min_bytes=MIN_BYTES, rates=FAST) as sp:
                _step(model, x)
    assert sp.plan.peak_bytes > 0  # the tensor backward needs first never leaves


def test_explain_shows_the_plan_the_prediction_and_the_measured_step(tmp_path, model_and_batch):
    model, x = model_and_batch
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        before = off.explain()
        assert before.plan is None and "no spill plan run" in str(before)
        with plan_step(off, max_overhead=0.1, min_bytes=MIN_BYTES, rates=FAST) as sp:
            _step(model, x)
        assert sp.explain().measured_step_seconds is None
        assert "not run yet" in str(sp.explain())
        _planned_steps(off, model, x, sp, steps=3)
        explained = off.explain()
    plan_part = explained.plan
    assert plan_part is not None and plan_part == sp.explain()
    assert plan_part.mode == "max_overhead=0.1"
    assert [share.tier for share in plan_part.tiers] == ["device", "host", "disk"]
    assert sum(share.tensors for share in plan_part.tiers) == 4
    assert sum(share.nbytes for share in plan_part.tiers) == sum(512 * w * 4 for w in WIDTHS[1:])
    for tier in ("device", "host", "disk"):
        assert plan_part.bytes_on(tier) == sp.plan.bytes_on(tier, sp.timeline)
    assert plan_part.measured_steps == 3 and plan_part.measured_step_seconds > 0
    assert plan_part.measured_step_seconds == sp.measured_step_seconds()
    assert plan_part.predicted_step_seconds == sp.plan.step_seconds
    assert plan_part.plain_step_seconds == sp.timeline.step_seconds
    assert plan_part.bound == sp.plan.bound == "compute"  # fake links this fast hide
    assert set(plan_part.link_seconds) == {"compute", "pcie", "disk"}
    assert plan_part.roofline_seconds == max(plan_part.link_seconds.values())
    assert plan_part.host_tier is None  # the rates given hold host bytes
    text = str(explained)
    for words in ("spill plan (max_overhead=0.1)", "predicted", "measured", "median of 3"):
        assert words in text
    assert "bound by compute" in text and "roofline" in text
    assert explained.stats.writes > 0
    json.dumps(explained.as_dict())  # plain data


def test_measured_rates_on_the_host_plan_the_device_and_the_disk(tmp_path, model_and_batch):
    model, x = model_and_batch
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30, host_budget_bytes=1 << 30) as off:
        with plan_step(off, max_overhead=0.5, min_bytes=MIN_BYTES) as sp:  # rates measured
            _step(model, x)
        assert off.stats().writes == 0  # measuring spilled nothing of the offloader's
        assert [e.name for e in os.scandir(off.directory)] == [".lock"]
    rates = sp.rates
    assert rates.to_host == rates.from_host == math.inf and rates.host_bytes == 0
    assert 0 < rates.disk_write < math.inf and 0 < rates.disk_read < math.inf
    assert "host" not in sp.tiers
    assert sp.host_tier == "the step runs on the host, whose arrays skip the host tier"
    assert "no host tier: the step runs on the host" in str(sp.explain())


def test_measure_rates_without_a_host_tier(tmp_path):
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 20) as off:
        assert why_no_host_tier(off, cuda=True) == (
            "the offloader has no host tier (host_budget_bytes=0)"
        )
        rates = measure_rates(off, cuda=False, sample_bytes=1 << 20, repeats=1)
    assert rates.host_bytes == 0 and rates.to_host == math.inf
    assert rates.disk_write > 0 and rates.disk_read > 0


def test_host_rates_time_the_tiers_own_copies():
    from tests.offload.test_host_tier import _Device, _fake_tier

    lent: list[int] = []
    tier = _fake_tier(1 << 20, lent)
    ticks = iter(range(100))
    out, back = host_rates(tier, _Device(np.zeros(1 << 20, np.uint8)), 3, lambda: next(ticks))
    assert out == back == 1 << 20  # one tick per copy
    assert lent == [1 << 20] * 4  # an untimed copy, then three
    assert tier.used_bytes == 0  # measuring takes none of the budget


def test_modes_and_misuse_are_checked(tmp_path, model_and_batch):
    model, x = model_and_batch
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 20) as off:
        for modes in ({}, {"max_overhead": 0.1, "device_budget_bytes": 1}):
            with pytest.raises(ValueError, match="one of"), plan_step(off, **modes):
                pass
        with pytest.raises(ValueError, match="max_overhead"), plan_step(off, max_overhead=-1):
            pass
        with pytest.raises(ValueError, match="warn_above"):
            with plan_step(off, max_overhead=0.1, warn_above=0):
                pass
        with plan_step(off, max_overhead=0.1, min_bytes=MIN_BYTES, rates=FAST) as sp:
            assert isinstance(sp, StepPlan) and "recording" in repr(sp)
            with pytest.raises(RuntimeError, match="plan_step"), activations(off, plan=sp):
                pass
            _step(model, x)
        assert "saved tensors leave the device" in repr(sp)
        with pytest.raises(ValueError, match="min_bytes"):
            with activations(off, plan=sp, min_bytes=1 << 20):
                pass
        with pytest.raises(ZeroDivisionError):  # an error in the block: no plan
            with plan_step(off, max_overhead=0.1, rates=FAST) as failed:
                raise ZeroDivisionError
        assert failed.plan is None


@pytest.mark.gpu
def test_a_gpu_step_planned_with_measured_host_and_disk_rates(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    model = _model().cuda()
    x = torch.randn(4096, WIDTHS[0], device="cuda")
    expected = _step(model, x)  # also the warm-up
    with arrayio.Offloader(
        tmp_path, device_budget_bytes=1 << 30, host_budget_bytes=64 << 20
    ) as off:
        with plan_step(off, max_overhead=0.5, min_bytes=MIN_BYTES) as sp:
            _step(model, x)
        assert sp.cuda and sp.host_tier is None
        rates = sp.rates
        assert 0 < rates.to_host < math.inf and 0 < rates.from_host < math.inf
        assert 0 < rates.disk_write < math.inf and rates.host_bytes == 64 << 20
        got = _planned_steps(off, model, x, sp)
        explained = off.explain()
        assert off.host_tier.used_bytes == 0  # every host copy given back
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert explained.plan.measured_steps == 2 and explained.plan.measured_step_seconds > 0
    assert "host tier 64.0 MiB" in str(explained)
