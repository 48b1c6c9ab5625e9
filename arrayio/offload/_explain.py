"""What a spill plan does and what bounds its step (:class:`PlanExplanation`), and what an
offloader holds and moved with the plan it last ran (:class:`OffloadExplanation`): what
:meth:`StepPlan.explain <arrayio.offload.StepPlan.explain>` and
:meth:`Offloader.explain <arrayio.offload.Offloader.explain>` return."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..runtime._units import format_bytes, format_count
from ._plan import TIERS, Rates

if TYPE_CHECKING:
    from ._offloader import OffloadStats

__all__ = ["OffloadExplanation", "PlanExplanation", "TierShare"]


@dataclasses.dataclass(frozen=True, slots=True)
class TierShare:
    """The saved tensors a plan puts on one tier (``"device"``, ``"host"`` or ``"disk"``)."""

    tier: str
    tensors: int
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class PlanExplanation:
    """A spill plan, its predicted step, its measured one, and what bounds it.

    Attributes
    ----------
    mode
        ``"max_overhead=0.1"`` or ``"device_budget_bytes=..."``.
    tiers
        Tensors and bytes per tier, device first.
    plain_step_seconds
        The recorded step, nothing offloaded.
    predicted_step_seconds
        The step the planner predicts under the plan.
    measured_step_seconds
        The median of the steps run under the plan (``activations(plan=...)`` blocks);
        None before the first.
    measured_steps
        How many of them the median is of (the latest ones).
    bound
        What bounds the predicted step: ``"compute"`` (the copies hide behind it),
        ``"pcie"`` or ``"disk"`` (the link the step waits on most).
    roofline_seconds
        The step no schedule can beat: the longest of ``link_seconds``.
    link_seconds
        ``"compute"`` (the plain step), ``"pcie"`` and ``"disk"`` (each link's bytes under
        the plan over its rate, busiest direction).
    peak_bytes, plain_peak_bytes
        The saved tensors' predicted peak on the device, and with nothing offloaded.
    rates
        The rates planned with.
    host_tier
        Why the plan has no host tier, where it has none.
    """

    mode: str
    tiers: tuple[TierShare, ...]
    plain_step_seconds: float
    predicted_step_seconds: float
    measured_step_seconds: float | None
    measured_steps: int
    bound: str
    roofline_seconds: float
    link_seconds: dict[str, float]
    peak_bytes: int
    plain_peak_bytes: int
    rates: Rates
    host_tier: str | None = None

    def bytes_on(self, tier: str) -> int:
        """The saved bytes the plan puts on ``tier``."""
        return sum(share.nbytes for share in self.tiers if share.tier == tier)

    def as_dict(self) -> dict[str, Any]:
        """The explanation as plain dictionaries and lists (JSON-compatible but for the
        rates of links that cost nothing, ``inf``)."""
        data = dataclasses.asdict(self)
        data["tiers"] = list(data["tiers"])
        return data

    def __str__(self) -> str:
        total = sum(share.nbytes for share in self.tiers)
        count = sum(share.tensors for share in self.tiers)
        lines = [
            f"spill plan ({self.mode}): {format_count(count, 'saved tensor')}, "
            f"{format_bytes(total)}"
        ]
        lines += [
            f"  {share.tier + ':':8}{format_count(share.tensors, 'tensor')}, "
            f"{format_bytes(share.nbytes)}"
            for share in self.tiers
        ]
        plain = self.plain_step_seconds
        step = (
            f"step: plain {_ms(plain)}, predicted {_ms(self.predicted_step_seconds)} "
            f"({_change(self.predicted_step_seconds, plain)})"
        )
        if self.measured_step_seconds is None:
            step += ", not run yet"
        else:
            step += (
                f", measured {_ms(self.measured_step_seconds)} "
                f"({_change(self.measured_step_seconds, plain)}, median of "
                f"{self.measured_steps})"
            )
        lines.append(step)
        terms = ", ".join(f"{name} {_ms(seconds)}" for name, seconds in self.link_seconds.items())
        lines.append(
            f"bound by {self.bound} (predicted); roofline {_ms(self.roofline_seconds)} ({terms})"
        )
        lines.append(
            f"saved tensors' peak on the device: {format_bytes(self.peak_bytes)} predicted, "
            f"{format_bytes(self.plain_peak_bytes)} plain "
            f"({self.peak_bytes / max(self.plain_peak_bytes, 1):.2f}x)"
        )
        rates = self.rates
        host = (
            f"host tier {format_bytes(rates.host_bytes)} at {_gbps(rates.to_host)} out, "
            f"{_gbps(rates.from_host)} back"
            if self.host_tier is None
            else f"no host tier: {self.host_tier}"
        )
        lines.append(
            f"rates: {host}; disk {_gbps(rates.disk_write)} write, {_gbps(rates.disk_read)} read"
        )
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadExplanation:
    """What an :class:`~arrayio.offload.Offloader` holds and moved, and the spill plan
    last run through it (None where ``activations()`` ran without a
    :class:`~arrayio.offload.StepPlan`)."""

    stats: OffloadStats
    host_budget_bytes: int
    plan: PlanExplanation | None

    def as_dict(self) -> dict[str, Any]:
        """The explanation as plain dictionaries and lists."""
        return {
            "stats": dataclasses.asdict(self.stats),
            "host_budget_bytes": self.host_budget_bytes,
            "plan": None if self.plan is None else self.plan.as_dict(),
        }

    def __str__(self) -> str:
        stats = self.stats
        held = format_bytes(stats.resident_bytes)
        written, read = format_bytes(stats.bytes_written), format_bytes(stats.bytes_read)
        lines = [
            f"offloader: {held} held of a {format_bytes(stats.budget_bytes)} budget (peak "
            f"{format_bytes(stats.peak_resident_bytes)}), {format_count(stats.arrays, 'array')}",
            f"spilled now: {format_bytes(stats.host_bytes)} in the host tier (of "
            f"{format_bytes(self.host_budget_bytes)}), {format_bytes(stats.disk_bytes)} on disk",
            f"moved: {written} out in {format_count(stats.writes, 'spill')}, {read} back in "
            f"{format_count(stats.reads, 'read')}",
        ]
        if self.plan is None:
            lines.append("no spill plan run: arrayio.offload.plan_step() makes one")
        else:
            lines.append(str(self.plan))
        return "\n".join(lines)


def tier_shares(tiers: tuple[str, ...], nbytes: list[int]) -> tuple[TierShare, ...]:
    """Tensors and bytes per tier, in :data:`TIERS` order."""
    return tuple(
        TierShare(
            tier,
            tiers.count(tier),
            sum(n for n, t in zip(nbytes, tiers, strict=True) if t == tier),
        )
        for tier in TIERS
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _gbps(rate: float) -> str:
    return "unlimited" if rate == float("inf") else f"{rate / 1e9:.1f} GB/s"


def _change(seconds: float, plain: float) -> str:
    return f"{seconds / plain - 1:+.0%}" if plain > 0 else "n/a"
