"""Recording what the arms did in a context: measurements (small calls summed, drift of the
chosen arm held apart), failures, and the expiry of the marks failures leave.

The rules run on a context's :class:`~arrayio.dispatch.table.ContextEntry` with the table's
lock held; ``docs/design/dispatcher.md`` explains them.
"""

from __future__ import annotations

import dataclasses
import logging

from .arm import Arm
from .table import EXPLOITING, EXPLORING, ArmStats, ContextEntry

__all__ = ["Measures", "reexplore"]

logger = logging.getLogger("arrayio.dispatch")

_MIN_SECONDS = 1e-9  # a clock that did not move still gives a finite bandwidth
_RECHECK_SECONDS = 60.0  # the longest a context exploits without looking for expired marks


@dataclasses.dataclass(frozen=True, slots=True)
class Measures:
    """How measurements and failures are recorded (see :class:`Policy
    <arrayio.dispatch.policy.Policy>` for the meaning of each tunable).

    Raises
    ------
    ValueError
        For a tunable out of range.
    """

    drift_ratio: float
    drift_patience: int
    min_bytes_to_learn: int
    unavailable_ttl: float | None

    def __post_init__(self) -> None:
        if not 0 < self.drift_ratio < 1:
            raise ValueError(f"drift_ratio must be in (0, 1), got {self.drift_ratio}")
        if self.drift_patience < 1:
            raise ValueError(f"drift_patience must be at least 1, got {self.drift_patience}")
        if self.min_bytes_to_learn < 0:
            raise ValueError(
                f"min_bytes_to_learn must not be negative, got {self.min_bytes_to_learn}"
            )
        if self.unavailable_ttl is not None and self.unavailable_ttl <= 0:
            raise ValueError(
                f"unavailable_ttl must be positive or None, got {self.unavailable_ttl}"
            )

    def bandwidth(self, stats: ArmStats, nbytes: int, seconds: float) -> float | None:
        """The bandwidth of a call of ``nbytes`` (at least one) in ``seconds``; None while
        calls too small to time alone are summed until they reach ``min_bytes_to_learn``."""
        seconds = max(seconds, _MIN_SECONDS)
        if nbytes < self.min_bytes_to_learn:
            stats.pending_bytes += nbytes
            stats.pending_seconds += seconds
            if stats.pending_bytes < self.min_bytes_to_learn:
                return None
            nbytes, seconds = stats.pending_bytes, stats.pending_seconds
            stats.pending_bytes, stats.pending_seconds = 0, 0.0
        return nbytes / seconds

    def learn(
        self, key: str, entry: ContextEntry, label: str, bandwidth: float, now: float
    ) -> bool:
        """Record that arm ``label`` moved ``bandwidth`` bytes/s in the context ``key``;
        return whether the context's phase and choice must be derived again.

        A measurement of the chosen arm below ``drift_ratio`` times its estimate is held
        out of the estimate; ``drift_patience`` of them in a row re-explore the context,
        and a normal one admits them.
        """
        stats = entry.arm(label)
        entry.updated = now
        watched = entry.phase == EXPLOITING and label == entry.chosen
        estimate = stats.estimate
        if watched and estimate is not None and bandwidth < self.drift_ratio * estimate:
            stats.note(bandwidth, now)
            entry.held.append(bandwidth)
            entry.drift += 1
            if entry.drift < self.drift_patience:
                return False
            logger.info(
                "%s: %s drifted to %.3g GB/s (learned %.3g GB/s); re-exploring",
                key,
                label,
                bandwidth / 1e9,
                estimate / 1e9,
            )
            reexplore(entry)
            return True
        if watched and entry.drift:
            for held in entry.held:  # the streak ended: those samples were real
                stats.admit(held)
            entry.held.clear()
            entry.drift = 0
        before = stats.estimate
        stats.add(bandwidth, now)
        # The winner held its place: nothing else can have changed.
        held_place = (
            watched
            and before is not None
            and stats.estimate is not None
            and stats.estimate >= before
        )
        return not (held_place and now - entry.refreshed < _RECHECK_SECONDS)

    @staticmethod
    def mark_failed(entry: ContextEntry, label: str, reason: str, now: float) -> None:
        """Mark arm ``label`` unavailable for ``reason``; losing the winner re-explores."""
        stats = entry.arm(label)
        stats.failures += 1
        stats.unavailable = reason
        stats.failed_at = now
        entry.updated = now
        if entry.phase == EXPLOITING and entry.chosen == label:
            reexplore(entry)

    @staticmethod
    def withdraw(entry: ContextEntry, marks: list[tuple[Arm, str]]) -> None:
        """Undo the unavailability marks of a call whose every arm failed."""
        for arm, reason in marks:
            stats = entry.arms.get(arm.label)
            if stats is not None and stats.unavailable == reason:
                stats.unavailable = None
                stats.failed_at = None

    def expire_marks(self, entry: ContextEntry, now: float) -> None:
        """Make the arms marked unavailable ``unavailable_ttl`` seconds ago candidates again."""
        if self.unavailable_ttl is None:
            return
        for label, stats in entry.arms.items():
            if (
                stats.unavailable is not None
                and stats.failed_at is not None
                and now - stats.failed_at >= self.unavailable_ttl
            ):
                logger.info("trying %s again (marked unavailable: %s)", label, stats.unavailable)
                stats.unavailable = None


def reexplore(entry: ContextEntry) -> None:
    """Send a context back to exploring: every arm's recent samples are dropped (their
    lifetime counts, best and last are kept)."""
    for stats in entry.arms.values():
        stats.forget_recent()
    entry.drift = 0
    entry.held.clear()
    entry.reexplorations += 1
    entry.phase = EXPLORING
