"""A spill plan made from one recorded step: :func:`plan_step` records a plain forward and
backward pass (:mod:`arrayio.offload._timeline`), measures the offloader's links
(:mod:`arrayio.offload._rates`) unless given their rates, and plans
(:mod:`arrayio.offload._plan`); the :class:`StepPlan` it yields is then given to
:func:`~arrayio.offload.activations` for the steps that follow, which time themselves
into it, so that :meth:`StepPlan.explain` sets the measured step beside the predicted one.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ._clock import Mark
from ._explain import PlanExplanation, tier_shares
from ._plan import Plan, Rates, Timeline, link_seconds, plan
from ._rates import JAX_SAMPLE_BYTES, SAMPLE_BYTES, measure_rates, why_no_host_tier
from ._timeline import record_step

if TYPE_CHECKING:
    from ._offloader import Offloader

__all__ = ["PlanWarning", "StepPlan", "checked_mode", "make_plan", "plan_step"]

_RUNS_KEPT = 64  # the measured step is the median of the latest runs
_MIN_SAMPLE = 1 << 20


class PlanWarning(RuntimeWarning):
    """A spill plan is predicted to slow the step more than asked, or to miss its budget."""


class StepPlan:
    """A spill plan for the steps like the one :func:`plan_step` recorded.

    Give it to :func:`~arrayio.offload.activations` (``plan=``); each block it runs is
    timed as the recorded step was. Planned when the :func:`plan_step` block ends: until
    then ``plan`` is None.

    Attributes
    ----------
    mode
        ``"max_overhead=..."`` or ``"device_budget_bytes=..."``.
    framework
        Whose step was recorded: ``"torch"`` (:func:`plan_step`), or the framework of the
        arrays :func:`~arrayio.offload.plan_array_step` recorded (``"jax"``, ``"torch"``,
        ``"numpy"``...).
    min_bytes
        The smallest tensor recorded; ``activations`` must offload with the same.
    timeline, rates, plan
        The recorded step, the rates planned with, and the plan
        (:class:`~arrayio.offload._plan.Plan`: ``tiers``, ``step_seconds``, ``bound``...).
    host_tier
        Why the plan uses no host tier, where it uses none.
    """

    def __init__(self, mode: str, min_bytes: int) -> None:
        self.mode = mode
        self.min_bytes = min_bytes
        self.framework = "torch"
        self.cuda = False
        self.timeline: Timeline | None = None
        self.rates: Rates | None = None
        self.plan: Plan | None = None
        self.host_tier: str | None = None
        self._runs: collections.deque[tuple[Mark, Mark] | float] = collections.deque(
            maxlen=_RUNS_KEPT
        )

    @property
    def tiers(self) -> tuple[str, ...]:
        """Each saved tensor's tier, in the order the step saves them.

        Raises
        ------
        RuntimeError
            Before the :func:`plan_step` block has ended.
        """
        return self._planned().tiers

    @property
    def predicted_step_seconds(self) -> float:
        return self._planned().step_seconds

    def measured_step_seconds(self) -> float | None:
        """The median of the latest steps run under the plan; None before the first. On
        the GPU, waits for the last of them to finish."""
        seconds = self._seconds()
        return statistics.median(seconds) if seconds else None

    def explain(self) -> PlanExplanation:
        """The plan: tensors and bytes per tier, the plain, predicted and measured step,
        what bounds it and the roofline's terms.

        Raises
        ------
        RuntimeError
            Before the :func:`plan_step` block has ended.
        """
        chosen = self._planned()
        assert self.timeline is not None and self.rates is not None
        seconds = self._seconds()
        return PlanExplanation(
            mode=self.mode,
            tiers=tier_shares(chosen.tiers, [s.nbytes for s in self.timeline.saved]),
            plain_step_seconds=chosen.plain_step_seconds,
            predicted_step_seconds=chosen.step_seconds,
            measured_step_seconds=statistics.median(seconds) if seconds else None,
            measured_steps=len(seconds),
            bound=chosen.bound,
            roofline_seconds=chosen.roofline_seconds,
            link_seconds=link_seconds(self.timeline, self.rates, chosen.tiers),
            peak_bytes=chosen.peak_bytes,
            plain_peak_bytes=chosen.plain_peak_bytes,
            rates=self.rates,
            host_tier=self.host_tier,
        )

    def checked_min_bytes(self, given: int | None) -> int:
        """The ``min_bytes`` of a step run under the plan: the one it was recorded with.

        Raises
        ------
        ValueError
            If ``given`` (not None) differs: the ``i``-th array saved would not be the
            plan's ``i``-th.
        """
        if given is not None and given != self.min_bytes:
            raise ValueError(
                f"min_bytes={given}, but the plan was recorded with "
                f"min_bytes={self.min_bytes}: its arrays would not be these"
            )
        return self.min_bytes

    def forget_runs(self) -> None:
        """Forget the steps measured so far, so that the measured step is the next ones'
        (after a first step that compiled, say, as a JAX step's first run does)."""
        self._runs.clear()

    def ran(self, start: Mark, end: Mark) -> None:
        """A step ran under the plan from ``start`` to ``end`` (what ``activations`` calls)."""
        self._runs.append((start, end))

    def _seconds(self) -> list[float]:
        # Marks read once, then kept as seconds: CUDA events are read when the device is
        # past them, which the step that recorded them did not wait for.
        runs = [run if isinstance(run, float) else run[1].since(run[0]) for run in self._runs]
        self._runs.clear()
        self._runs.extend(runs)
        return runs

    def _planned(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("the plan is made when the plan_step() block ends")
        return self.plan

    def __repr__(self) -> str:
        if self.plan is None:
            return f"<arrayio.offload.StepPlan {self.mode}: recording>"
        moved = len(self.plan.tiers) - self.plan.tiers.count("device")
        return (
            f"<arrayio.offload.StepPlan {self.mode}: {moved} of {len(self.plan.tiers)} saved "
            f"tensors leave the device, step {self.plan.step_seconds * 1e3:.1f} ms predicted "
            f"against {self.plan.plain_step_seconds * 1e3:.1f} ms plain>"
        )


@contextlib.contextmanager
def plan_step(
    offloader: Offloader,
    *,
    max_overhead: float | None = None,
    device_budget_bytes: int | None = None,
    warn_above: float | None = None,
    rates: Rates | None = None,
    measure: Callable[..., Rates] = measure_rates,
    min_bytes: int = 1 << 20,
    cuda: bool | None = None,
) -> Iterator[StepPlan]:
    """Record one plain training step (a forward and backward pass) in the block, and
    plan the steps like it: which saved tensors stay on the device, and which go to
    ``offloader``'s host tier or disk.

    Parameters
    ----------
    offloader
        Where the spills will go: its links are measured, its host tier planned for.
    max_overhead
        Plan for as little device memory as possible with the step predicted at most
        ``1 + max_overhead`` times the plain one.
    device_budget_bytes
        Plan for a peak of saved tensors on the device within this many bytes (the
        offloader's own budget counts what it holds the same way), with the least predicted
        slowdown. Give exactly one of the two modes.
    warn_above
        Warn (:class:`PlanWarning`) when the predicted step exceeds ``warn_above`` times
        the plain one. A budget that no plan meets warns too.
    rates
        The links' rates, used as given; default: measured by ``measure`` once the step is
        recorded.
    measure
        ``measure(offloader, cuda=..., sample_bytes=...)`` returns the :class:`Rates`;
        default :func:`~arrayio.offload.measure_rates` (on the host, or without a host
        tier, it plans the device and the disk only).
    min_bytes
        Smaller tensors are left to autograd, as :func:`~arrayio.offload.activations`
        leaves them.
    cuda
        Whether the step runs CUDA (default: whether torch has initialized it).

    Yields
    ------
    StepPlan
        Planned when the block ends; then give it to ``activations(offloader, plan=...)``.

    Raises
    ------
    ValueError
        If not exactly one mode is given, or a value is out of range.

    Examples
    --------
    >>> with arrayio.offload.plan_step(off, max_overhead=0.1) as step_plan:
    ...     model(x).sum().backward()          # a plain step, recorded
    >>> for x in batches:
    ...     with arrayio.offload.activations(off, plan=step_plan):
    ...         model(x).sum().backward()
    >>> print(off.explain())
    """
    step_plan = StepPlan(checked_mode(max_overhead, device_budget_bytes, warn_above), min_bytes)
    with record_step(min_bytes=min_bytes, cuda=cuda) as recorder:
        yield step_plan
    make_plan(
        step_plan,
        offloader,
        recorder.timeline(),
        cuda=recorder.cuda,
        rates=rates,
        measure=measure,
        max_overhead=max_overhead,
        device_budget_bytes=device_budget_bytes,
        warn_above=warn_above,
    )


def checked_mode(
    max_overhead: float | None, device_budget_bytes: int | None, warn_above: float | None
) -> str:
    """The plan's mode, as :attr:`StepPlan.mode` names it.

    Raises
    ------
    ValueError
        If not exactly one mode is given, or a value is out of range.
    """
    if (max_overhead is None) == (device_budget_bytes is None):
        raise ValueError("give one of max_overhead and device_budget_bytes")
    if max_overhead is not None and not max_overhead >= 0:
        raise ValueError(f"max_overhead must be >= 0, got {max_overhead}")
    if device_budget_bytes is not None and device_budget_bytes < 0:
        raise ValueError(f"device_budget_bytes must be >= 0, got {device_budget_bytes}")
    if warn_above is not None and not warn_above > 0:
        raise ValueError(f"warn_above must be > 0, got {warn_above}")
    return (
        f"max_overhead={max_overhead:g}"
        if max_overhead is not None
        else f"device_budget_bytes={device_budget_bytes}"
    )


def make_plan(
    step_plan: StepPlan,
    offloader: Offloader,
    timeline: Timeline,
    *,
    cuda: bool,
    rates: Rates | None,
    measure: Callable[..., Rates],
    max_overhead: float | None,
    device_budget_bytes: int | None,
    warn_above: float | None,
    framework: str | None = None,
) -> None:
    """Plan ``step_plan`` from a recorded ``timeline``: the links' ``rates`` (measured by
    ``measure`` where not given, told the ``framework`` whose arrays spill where one is
    given), the plan, and its warnings."""
    if rates is None:
        largest = max((s.nbytes for s in timeline.saved), default=0)
        cap = JAX_SAMPLE_BYTES if framework == "jax" else SAMPLE_BYTES
        sample = min(max(largest, _MIN_SAMPLE), cap)
        options = {} if framework is None else {"framework": framework}
        rates = measure(offloader, cuda=cuda, sample_bytes=sample, **options)
    chosen = plan(
        timeline, rates, max_overhead=max_overhead, device_budget_bytes=device_budget_bytes
    )
    step_plan.cuda = cuda
    step_plan.timeline, step_plan.rates, step_plan.plan = timeline, rates, chosen
    if not rates.host_bytes:
        step_plan.host_tier = (
            why_no_host_tier(offloader, cuda=cuda)
            or "the rates given hold no host bytes (host_bytes=0)"
        )
    _warn(chosen, device_budget_bytes, warn_above)


def _warn(chosen: Plan, budget: int | None, warn_above: float | None) -> None:
    # stacklevel 5: this function, make_plan, the generator, contextlib's __exit__, the
    # caller's block.
    if budget is not None and chosen.peak_bytes > budget:
        warnings.warn(
            f"no spill plan meets device_budget_bytes={budget}: the closest keeps "
            f"{chosen.peak_bytes} bytes of saved tensors on the device at its peak",
            PlanWarning,
            stacklevel=5,
        )
    if warn_above is not None and chosen.step_seconds > warn_above * chosen.plain_step_seconds:
        warnings.warn(
            f"the spill plan's step is predicted at {chosen.step_seconds * 1e3:.1f} ms, "
            f"{chosen.overhead + 1:.2f} times the plain step's "
            f"{chosen.plain_step_seconds * 1e3:.1f} ms (warn_above={warn_above:g}), bound "
            f"by {chosen.bound}: a larger budget or host tier would help",
            PlanWarning,
            stacklevel=5,
        )
