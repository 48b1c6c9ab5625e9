"""Why the policy picks what it picks in a context: :class:`Explanation`, one
:class:`ArmReport` per arm; what :func:`arrayio.explain` shows."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._choosing import Candidates, Exploration
from .arm import Arm
from .table import EXPLOITING, EXPLORING, ArmStats, ContextEntry

__all__ = ["ArmReport", "Explanation", "explanation"]


@dataclasses.dataclass(frozen=True, slots=True)
class ArmReport:
    """One arm in an :class:`Explanation`.

    ``state`` is ``"chosen"``, ``"measured"``, ``"pruned"``, ``"unmeasured"``,
    ``"unavailable"`` or ``"not a candidate"`` (measured earlier, or forced, but not offered
    by ``candidates`` now). Bandwidths are in GB/s (1e9 bytes per second); ``gbps`` is the
    estimate, ``None`` when unmeasured since the last (re-)exploration.
    """

    label: str
    state: str
    gbps: float | None
    best_gbps: float | None
    last_gbps: float | None
    samples: int
    count: int
    failures: int
    reason: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Explanation:
    """Why :meth:`Policy.choose <arrayio.dispatch.policy.Policy.choose>` picks what it
    picks in one context.

    Attributes
    ----------
    key
        The context key.
    phase
        ``"exploring"``, ``"exploiting"`` or ``"forced"``.
    chosen
        The label of the arm the next call would use, or ``None`` if none is available.
    reason
        ``"exploring: 2 arms left"``, ``"fastest of 5 measured"``, ``"forced"``...
    arms
        Every arm known in this context, candidates first in exploration order.
    seed
        The neighbour's winner explored first, if any.
    reexplorations
        Times this context went back to exploring.
    """

    key: str
    phase: str
    chosen: str | None
    reason: str
    arms: tuple[ArmReport, ...]
    seed: str | None = None
    reexplorations: int = 0

    @property
    def unavailable(self) -> dict[str, str]:
        """Label to reason, for the arms that may not be used here."""
        return {
            arm.label: arm.reason
            for arm in self.arms
            if arm.state == "unavailable" and arm.reason is not None
        }

    def as_dict(self) -> dict[str, Any]:
        """The explanation as plain dictionaries and lists (JSON-compatible)."""
        data = dataclasses.asdict(self)
        data["arms"] = list(data["arms"])
        data["unavailable"] = self.unavailable
        return data


def explanation(
    key: str,
    entry: ContextEntry,
    candidates: Candidates,
    seed: str | None,
    exploration: Exploration,
    force: Arm | None = None,
) -> Explanation:
    """What the next call in the context ``key`` would use and why, from its entry and
    candidates (``force``: the arm it is forced to use); changes nothing. Hold the table's
    lock."""
    eligible, _, bars = exploration.scan(entry, candidates)
    left = sum(
        exploration.needs_samples(stats, bars, contending=entry.phase == EXPLORING)
        for _, stats in eligible
    )
    measured = sum(stats is not None and stats.estimate is not None for _, stats in eligible)
    if force is not None:
        phase, chosen, reason = "forced", force.label, "forced"
    elif not eligible:
        phase, chosen, reason = entry.phase, None, "no transfer tool available"
    elif entry.phase == EXPLOITING and entry.chosen is not None:
        phase, chosen = EXPLOITING, entry.chosen
        reason = f"fastest of {measured} measured"
    else:
        arm = exploration.pick(entry, candidates, ())
        phase, chosen = EXPLORING, arm.label if arm is not None else None
        reason = f"exploring: {left} arm{'s' if left != 1 else ''} left"
        if entry.reexplorations:
            reason += f" (re-exploration {entry.reexplorations})"
        if seed is not None:
            reason += f", seeded with {seed}"
    shown = chosen if phase != "forced" else None
    reports = [
        _report(
            arm.label,
            entry.arms.get(arm.label),
            shown,
            bars.prune,
            exploration.explore_samples,
            candidate=True,
        )
        for arm in candidates.order
    ]
    reports += [
        _report(label, stats, shown, bars.prune, exploration.explore_samples, candidate=False)
        for label, stats in entry.arms.items()
        if label not in candidates.by_label
    ]
    return Explanation(
        key=key,
        phase=phase,
        chosen=chosen,
        reason=reason,
        arms=tuple(reports),
        seed=seed,
        reexplorations=entry.reexplorations,
    )


def _report(
    label: str,
    stats: ArmStats | None,
    chosen: str | None,
    floor: float,
    explore_samples: int,
    *,
    candidate: bool,
) -> ArmReport:
    if stats is None:
        return ArmReport(label, "unmeasured", None, None, None, 0, 0, 0)
    if stats.unavailable is not None:
        state = "unavailable"
    elif not candidate:
        state = "not a candidate"
    elif label == chosen:
        state = "chosen"
    elif stats.estimate is None:
        state = "unmeasured"
    elif stats.estimate < floor and stats.samples < explore_samples:
        state = "pruned"
    else:
        state = "measured"

    def gbps(rate: float | None) -> float | None:
        return None if rate is None or (rate == 0 and stats.count == 0) else rate / 1e9

    return ArmReport(
        label,
        state,
        gbps(stats.estimate),
        gbps(stats.best),
        gbps(stats.last),
        stats.samples,
        stats.count,
        stats.failures,
        stats.unavailable,
    )
