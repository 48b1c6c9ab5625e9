"""Spill plans for steps that put and get their own arrays (JAX's jitted stages):
:func:`arrayio.offload.plan_array_step` records and plans one, :func:`array_step` runs one
under the plan. On the CPU the arrays are NumPy's or JAX's host arrays (the device and the
disk are the tiers); the GPU test runs JAX on a GPU with its pinned host memory."""

from __future__ import annotations

import math

import numpy as np
import pytest

import arrayio
from arrayio.offload import Kept, Rates, array_step, plan_array_step
from arrayio.offload._plan import Plan

MB = 1 << 20
DISK = Rates(math.inf, math.inf, 1e9, 1e9, 0)


def _arrays(count: int = 4) -> list[np.ndarray]:
    return [np.full(MB // 4, i, np.float32) for i in range(count)]  # 1 MiB each


def _step(step, arrays, small=None):
    """A forward pass that puts each array, a backward pass that gets them in reverse."""
    kept = [step.put(a) for a in arrays]
    if small is not None:
        kept_small = step.put(small)
        assert isinstance(kept_small, Kept) and kept_small.index is None  # below min_bytes
    return [step.get(k) for k in reversed(kept)][::-1]


def _plan_with(tiers, min_bytes=MB, sizes=None):
    """A StepPlan whose tiers are ``tiers`` (as a recording would have planned them), for
    arrays of ``sizes`` bytes where given."""
    from arrayio.offload._plan import Saved, Timeline

    plan = arrayio.offload.StepPlan("max_overhead=0.1", min_bytes)
    plan.framework = "numpy"
    if sizes is not None:
        plan.timeline = Timeline(tuple(Saved(n, 0.0, 1.0) for n in sizes), 1.0)
    plan.plan = Plan(
        tiers=tuple(tiers),
        returns=tuple(None for _ in tiers),
        step_seconds=1.0,
        peak_bytes=0,
        plain_peak_bytes=0,
        bound="compute",
        roofline_seconds=1.0,
        plain_step_seconds=1.0,
        byte_seconds=0.0,
    )
    return plan


def test_a_recorded_step_keeps_every_array_and_marks_it_in_order(tmp_path):
    arrays = _arrays()
    with arrayio.Offloader(tmp_path, device_budget_bytes=0) as off:
        with plan_array_step(off, device_budget_bytes=2 * MB, rates=DISK) as step:
            got = _step(step, arrays, small=np.zeros(4, np.float32))
            assert step.plan is None  # planned when the block ends
        assert off.stats().bytes_written == 0  # a plain step: nothing left the device
        kept = step.put(arrays[0])  # the recording over: a put through the budget (0)
        np.testing.assert_array_equal(step.get(kept), arrays[0])
    for a, b in zip(arrays, got, strict=True):
        assert b is a
    saved = step.plan.timeline.saved
    assert [s.nbytes for s in saved] == [MB] * 4  # the small array is not the plan's
    produced = [s.produced for s in saved]
    needed = [s.needed for s in saved]
    assert produced == sorted(produced)  # put in order
    assert needed == sorted(needed, reverse=True)  # got back in reverse
    assert all(s.produced <= s.needed for s in saved)
    assert step.plan.framework == "numpy" and not step.plan.cuda
    assert step.plan.plan.peak_bytes <= 2 * MB  # the budget mode met its budget


def test_a_planned_step_sends_each_array_to_its_tier(tmp_path):
    arrays = _arrays()
    plan = _plan_with(["device", "disk", "device", "disk"])
    with arrayio.Offloader(tmp_path, device_budget_bytes=64 * MB) as off:
        with array_step(off, plan) as step:
            kept = [step.put(a) for a in arrays]
            assert [isinstance(k, Kept) for k in kept] == [True, False, True, False]
            assert isinstance(step.put(_arrays(5)[4]), arrayio.offload.Handle)  # past the plan
            off.wait()
            assert off.stats().bytes_written == 2 * MB  # the two for the disk, at once
            got = [step.get(k) for k in reversed(kept)][::-1]
        assert off._step_plan is plan
    for a, b in zip(arrays, got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert plan.measured_step_seconds() is not None  # the block was timed into the plan


def test_a_get_prefetches_the_arrays_put_before_it_in_reverse(tmp_path, monkeypatch):
    arrays = _arrays(5)
    asked: list[list[int]] = []
    with arrayio.Offloader(tmp_path, device_budget_bytes=0) as off:
        real = off.prefetch
        monkeypatch.setattr(
            off, "prefetch", lambda handles: (asked.append([h.id for h in handles]), real(handles))
        )
        with array_step(off, prefetch=2) as step:  # no plan: the budget (0) spills them all
            handles = [step.put(a) for a in arrays]
            ids = [h.id for h in handles]
            np.testing.assert_array_equal(step.get(handles[4]), arrays[4])
            np.testing.assert_array_equal(step.get(handles[1]), arrays[1])
            np.testing.assert_array_equal(step.get(handles[0]), arrays[0])
    assert asked == [[ids[3], ids[2]], [ids[0]]]  # nothing before the first


def test_a_handle_the_step_drops_frees_its_array(tmp_path):
    with arrayio.Offloader(tmp_path, device_budget_bytes=64 * MB) as off:
        with array_step(off) as step:
            handle = step.put(_arrays(1)[0])
            assert off.stats().resident_bytes == MB
            step.get(handle)
            del handle  # the step holds it weakly
            assert off.stats().resident_bytes == 0


def test_plans_and_their_use_are_checked(tmp_path):
    with arrayio.Offloader(tmp_path, device_budget_bytes=MB) as off:
        with pytest.raises(ValueError, match="one of"):
            with plan_array_step(off):
                pass
        unplanned = arrayio.offload.StepPlan("max_overhead=0.1", MB)
        with pytest.raises(RuntimeError):
            with array_step(off, unplanned):
                pass
        with pytest.raises(ValueError, match="min_bytes"):
            with array_step(off, _plan_with(["disk"]), min_bytes=2 * MB):
                pass
        with pytest.raises(ZeroDivisionError):  # an error in the block: no plan
            with plan_array_step(off, max_overhead=0.1, rates=DISK) as failed:
                raise ZeroDivisionError
        assert failed.plan is None


def test_a_jax_step_is_planned_with_jaxs_arrays(tmp_path):
    # JAX's CPU arrays: a JAX step's links are measured with JAX's arrays, the plan is
    # JAX's, and the planned step gives back the arrays it was given.
    jax = pytest.importorskip("jax")
    arrays = [jax.numpy.full((MB // 4,), i, jax.numpy.float32) for i in range(3)]
    measured = []

    def measure(offloader, **options):
        measured.append(options)
        return DISK

    with arrayio.Offloader(tmp_path, device_budget_bytes=0) as off:
        with plan_array_step(off, device_budget_bytes=MB, measure=measure) as step:
            _step(step, arrays)
        assert step.plan.framework == "jax" and not step.plan.cuda
        assert measured == [{"cuda": False, "sample_bytes": MB, "framework": "jax"}]
        leaving = step.plan.tiers.count("disk")
        assert leaving >= 2  # a budget of one array: the others leave
        with array_step(off, step.plan) as planned:
            got = _step(planned, arrays)
        assert off.stats().bytes_written == leaving * MB
    for a, b in zip(arrays, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_measured_rates_for_jax_on_the_host_plan_the_disk(tmp_path):
    pytest.importorskip("jax")
    with arrayio.Offloader(tmp_path, device_budget_bytes=MB, host_budget_bytes=MB) as off:
        rates = arrayio.offload.measure_rates(
            off, cuda=False, sample_bytes=MB, repeats=1, framework="jax"
        )
    assert rates.to_host == math.inf and rates.host_bytes == 0  # host arrays skip the tier
    assert 0 < rates.disk_write < math.inf and 0 < rates.disk_read < math.inf
    with pytest.raises(ValueError, match="framework"):
        arrayio.offload.measure_rates(off, cuda=False, framework="mxnet")


@pytest.mark.gpu
def test_a_jax_gpu_step_planned_with_jaxs_host_memory(tmp_path):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU")
    arrays = [
        jax.device_put(np.full(4 * MB // 4, i, np.float32), jax.devices()[0]) for i in range(6)
    ]
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30, host_budget_bytes=64 * MB) as off:
        with plan_array_step(off, device_budget_bytes=8 * MB) as step:
            _step(step, arrays)
        plan = step.plan
        assert plan.framework == "jax" and plan.cuda and plan.host_tier is None
        assert 0 < plan.rates.to_host < math.inf and plan.rates.host_bytes == 64 * MB
        assert "host" in plan.tiers  # the budget needs some to leave, the host tier has room
        for _ in range(2):
            with array_step(off, plan) as planned:
                got = _step(planned, arrays)
            for a, b in zip(arrays, got, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                assert b.sharding.memory_kind == "device"
        explained = off.explain()
        assert off.host_tier.used_bytes == 0  # every host copy given back
    assert explained.plan.measured_steps == 2 and explained.plan.measured_step_seconds > 0


@pytest.mark.parametrize(("framework", "cap"), [("jax", 256 * MB), ("torch", 64 * MB)])
def test_the_links_are_sampled_at_the_largest_array_up_to_a_cap(tmp_path, framework, cap):
    # A JAX move is a call with a cost of its own, so JAX's plans sample larger arrays.
    from arrayio.offload._plan import Saved, Timeline
    from arrayio.offload._step_plan import make_plan

    asked = []

    def measure(offloader, **options):
        asked.append(options["sample_bytes"])
        return DISK

    timeline = Timeline((Saved(512 * MB, 0.0, 1.0), Saved(MB, 0.5, 0.6)), 1.0)
    with arrayio.Offloader(tmp_path, device_budget_bytes=MB) as off:
        plan = arrayio.offload.StepPlan("max_overhead=0.1", MB)
        make_plan(
            plan,
            off,
            timeline,
            cuda=False,
            rates=None,
            measure=measure,
            max_overhead=0.1,
            device_budget_bytes=None,
            warn_above=None,
            framework=framework,
        )
    assert asked == [cap]


def test_puts_from_several_threads_keep_each_arrays_own_place(tmp_path):
    # Each put takes its place in the recording at once: the plan's i-th array is the one
    # whose put got index i, whatever order the threads' marks come in.
    import concurrent.futures

    sizes = [(k + 1) * MB for k in range(8)]
    with arrayio.Offloader(tmp_path, device_budget_bytes=0) as off:
        with plan_array_step(off, max_overhead=0.1, rates=DISK) as step:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                kept = list(pool.map(lambda n: step.put(np.zeros(n, np.uint8)), sizes))
            for k in reversed(kept):
                step.get(k)
    saved = step.plan.timeline.saved
    assert sorted(k.index for k in kept) == list(range(8))
    assert all(saved[k.index].nbytes == k.array.nbytes for k in kept)


def test_only_gets_of_offloaded_arrays_start_reads(tmp_path, monkeypatch):
    # A get of an array the plan kept starts no read (as torch's hooks: reads started there
    # brought arrays back while the kept ones were still held, docs/design/offload.md); the
    # first offloaded array's get starts those put before it, latest first, in the order put
    # (a kept array between them is skipped, not counted).
    arrays = _arrays(4)
    asked: list[list[int]] = []
    with arrayio.Offloader(tmp_path, device_budget_bytes=64 * MB) as off:
        real = off.prefetch
        monkeypatch.setattr(
            off, "prefetch", lambda handles: (asked.append([h.id for h in handles]), real(handles))
        )
        plan = _plan_with(["disk", "device", "disk", "disk"])
        with array_step(off, plan, prefetch=2) as step:
            kept = [step.put(a) for a in arrays]
            np.testing.assert_array_equal(step.get(kept[1]), arrays[1])  # kept: no read
            np.testing.assert_array_equal(step.get(kept[3]), arrays[3])
    assert asked == [[kept[2].id, kept[0].id]]


def test_a_freed_array_is_not_prefetched(tmp_path):
    arrays = _arrays(3)
    with arrayio.Offloader(tmp_path, device_budget_bytes=0) as off:
        with array_step(off, prefetch=2) as step:
            handles = [step.put(a) for a in arrays]
            step.free(handles[1])
            np.testing.assert_array_equal(step.get(handles[2]), arrays[2])  # no error
            np.testing.assert_array_equal(step.get(handles[0]), arrays[0])


def test_a_dropped_handle_is_forgotten_even_while_the_step_is_busy(tmp_path):
    # The collector may free a handle on a thread that holds the step's lock: forgetting it
    # must not wait for that lock.
    import gc
    import threading

    with arrayio.Offloader(tmp_path, device_budget_bytes=64 * MB) as off:
        with array_step(off) as step:
            cycle = [step.put(_arrays(1)[0])]
            cycle.append(cycle)  # freed only by the collector
            del cycle
            done = threading.Event()

            def collect_holding_the_lock():
                with step._lock:
                    gc.collect()
                done.set()

            threading.Thread(target=collect_holding_the_lock, daemon=True).start()
            assert done.wait(10)
            assert step._position == {}


def test_a_step_unlike_the_plans_warns_and_mixed_arrays_are_refused(tmp_path):
    with arrayio.Offloader(tmp_path, device_budget_bytes=64 * MB) as off:
        with pytest.warns(arrayio.offload.PlanWarning, match="recorded step's had"):
            with array_step(off, _plan_with(["device", "disk"], sizes=[MB, MB])) as step:
                step.put(_arrays(1)[0])
                step.put(np.zeros(2 * MB, np.uint8))  # not the recorded second array
        jax = pytest.importorskip("jax")
        with pytest.raises(ValueError, match="one kind of array"):
            with plan_array_step(off, max_overhead=0.1, rates=DISK) as recording:
                recording.put(_arrays(1)[0])
                recording.put(jax.numpy.zeros(MB // 4, jax.numpy.float32))
