"""Why the policy picks what it picks in a context: :class:`Explanation`, one
:class:`ArmReport` per arm; what :func:`arrayio.explain` shows."""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import config
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
    rule
        The page-cache rule that chose between buffered and ``O_DIRECT`` arms, and why:
        every read not in the page cache, and writes kept there.
    """

    key: str
    phase: str
    chosen: str | None
    reason: str
    arms: tuple[ArmReport, ...]
    seed: str | None = None
    reexplorations: int = 0
    rule: str | None = None

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


def cache_rule(attributes: dict[str, Any]) -> str | None:
    """Which page-cache rule a context falls under, and why (None where none applies)."""
    if attributes.get("direction") == "write":
        if attributes.get("keep"):
            return (
                "this process read back files it wrote into this directory, and this one "
                "fits twice in the memory available: written through the page cache (no "
                "O_DIRECT arm), so that its next load is a page-cache load"
            )
        return None
    if attributes.get("direction") != "read":
        return None
    cache = attributes.get("cache")
    if cache == "warm":
        return "in the page cache: buffered reads"
    if attributes.get("keep"):
        rule = (
            "not all in the page cache, and fits twice in the memory available (once, for a "
            "file this process reads again): read through the page cache (no O_DIRECT arm), "
            "so that the next load is a page-cache load"
        )
        if config.get().second_pass:
            rule += (
                ", and read once more in the background (the second pass), so that its "
                "pages are active by then"
            )
        return rule
    if cache in ("cold", "mixed"):
        return "not all in the page cache, and too large to keep there: O_DIRECT arms first"
    return None


def explanation(
    key: str,
    entry: ContextEntry,
    candidates: Candidates,
    seed: str | None,
    exploration: Exploration,
    force: Arm | None = None,
    within_calls: str | None = None,
) -> Explanation:
    """What the next call in the context ``key`` would use and why, from its entry and
    candidates (``force``: the arm it is forced to use; ``within_calls``: how the policy
    shares an exploring call between the best arm so far and a rival, if it does);
    changes nothing. Hold the table's lock."""
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
        pair = exploration.rival(entry, candidates) if within_calls is not None else None
        arm = pair[0] if pair is not None else exploration.pick(entry, candidates, ())
        phase, chosen = EXPLORING, arm.label if arm is not None else None
        reason = f"exploring: {left} arm{'s' if left != 1 else ''} left"
        if pair is not None:
            reason += f"; {pair[1].label} {within_calls}"
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
        rule=cache_rule(entry.attributes),
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
