"""Choosing an arm in a context: which arms still need samples while exploring, which one
is the best, and which learned neighbour seeds a new context.

The rules run on a context's :class:`~arrayio.dispatch.table.ContextEntry` with the table's
lock held; ``docs/design/dispatcher.md`` explains them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .arm import Arm
from .table import EXPLOITING, EXPLORING, WINDOW, ArmStats, ContextEntry, Table

if TYPE_CHECKING:
    from .context import Context

__all__ = ["Bars", "Candidates", "Exploration", "attributes", "nearest_winner", "order"]

# A new context is seeded only from contexts that agree on these; among them the nearest
# is the closest size class.
_SEED_FIELDS = ("direction", "memory", "storage", "cache")


@dataclasses.dataclass(slots=True)
class Candidates:
    """A context's candidates in exploration order (the seed first), by label too."""

    order: tuple[Arm, ...]
    by_label: dict[str, Arm]


@dataclasses.dataclass(frozen=True, slots=True)
class Bars:
    """Bandwidths that sort the arms of a context while it explores."""

    prune: float  # below, after its first sample, an arm gets no more
    contend: float  # at or above, an arm gets up to contend_samples


Scan = tuple[list[tuple[Arm, ArmStats | None]], Arm | None, Bars]
"""The available candidates with their stats, the best one, and the bars."""


@dataclasses.dataclass(frozen=True, slots=True)
class Exploration:
    """How many samples each arm gets before a context exploits (see :class:`Policy
    <arrayio.dispatch.policy.Policy>` for the meaning of each tunable).

    Raises
    ------
    ValueError
        For a tunable out of range.
    """

    explore_samples: int
    contend_samples: int
    contend_ratio: float
    prune_ratio: float

    def __post_init__(self) -> None:
        if not 1 <= self.explore_samples <= WINDOW:
            raise ValueError(f"explore_samples must be in 1..{WINDOW}, got {self.explore_samples}")
        if not self.explore_samples <= self.contend_samples <= WINDOW:
            raise ValueError(
                f"contend_samples must be in {self.explore_samples}..{WINDOW}, "
                f"got {self.contend_samples}"
            )
        if not 0 < self.contend_ratio <= 1:
            raise ValueError(f"contend_ratio must be in (0, 1], got {self.contend_ratio}")
        if not 0 <= self.prune_ratio < 1:
            raise ValueError(f"prune_ratio must be in [0, 1), got {self.prune_ratio}")

    def scan(self, entry: ContextEntry, candidates: Candidates) -> Scan:
        """The available candidates with their stats, the best one, and the bars below which
        an arm is pruned, and above which it contends."""
        eligible: list[tuple[Arm, ArmStats | None]] = []
        best: Arm | None = None
        best_rate = 0.0
        for arm in candidates.order:
            stats = entry.arms.get(arm.label)
            if stats is not None and stats.unavailable is not None:
                continue
            eligible.append((arm, stats))
            if stats is not None and stats.estimate is not None and stats.estimate > best_rate:
                best, best_rate = arm, stats.estimate
        return eligible, best, Bars(self.prune_ratio * best_rate, self.contend_ratio * best_rate)

    def needs_samples(self, stats: ArmStats | None, bars: Bars, *, contending: bool = True) -> bool:
        """Whether an arm needs another sample; ``contending``: counting the close
        contenders' extra ones, which only an exploration asks for (an estimate moving
        while the context exploits does not send it back to exploring)."""
        if stats is None or stats.estimate is None:
            return True
        if stats.samples < self.explore_samples and stats.estimate >= bars.prune:
            return True
        return (
            contending and stats.samples < self.contend_samples and stats.estimate >= bars.contend
        )

    def pick(
        self,
        entry: ContextEntry,
        candidates: Candidates,
        exclude: Iterable[Arm],
        busy: Callable[[Arm], int] | None = None,
    ) -> Arm | None:
        """The arm with the fewest samples (``busy`` adds the calls measuring it now), in
        order; or, when none needs more, the best."""
        eligible, best, bars = self.scan(entry, candidates)
        pick: Arm | None = None
        pick_load = self.contend_samples
        fallback: Arm | None = None
        for arm, stats in eligible:
            if arm in exclude:
                continue
            if fallback is None or arm == best:
                fallback = arm
            if not self.needs_samples(stats, bars):
                continue
            load = stats.samples if stats is not None else 0
            if busy is not None:
                load += busy(arm)
            if load < pick_load:
                pick, pick_load = arm, load
        return pick if pick is not None else fallback  # all being measured: the best

    def rival(self, entry: ContextEntry, candidates: Candidates) -> tuple[Arm, Arm] | None:
        """While the context explores: its best arm so far (the incumbent) and the first
        other arm, in order, that needs a sample (the rival); None before any arm has an
        estimate, or when no other arm needs one."""
        if entry.phase != EXPLORING:
            return None
        eligible, best, bars = self.scan(entry, candidates)
        if best is None:
            return None
        for arm, stats in eligible:
            if arm != best and self.needs_samples(stats, bars):
                return best, arm
        return None

    def settle(self, entry: ContextEntry, candidates: Candidates) -> None:
        """Derive the phase and the chosen arm from the samples (after any change)."""
        eligible, best, bars = self.scan(entry, candidates)
        contending = entry.phase == EXPLORING
        exploring = best is None or any(
            self.needs_samples(stats, bars, contending=contending) for _, stats in eligible
        )
        entry.phase = EXPLORING if exploring else EXPLOITING
        chosen = best.label if best is not None else None
        if chosen != entry.chosen:
            entry.chosen = chosen
            entry.drift = 0
            entry.held.clear()


def order(candidates: Sequence[Arm], seed: str | None) -> Candidates:
    """``candidates`` without repeats, the seed first if it is one of them.

    Raises
    ------
    TypeError
        For a candidate that is not an :class:`~arrayio.dispatch.arm.Arm`.
    """
    arms = list(dict.fromkeys(candidates))  # drop repeats, keep the prior order
    for arm in arms:
        if not isinstance(arm, Arm):
            raise TypeError(f"candidates must be Arm instances, got {arm!r}")
    by_label = {arm.label: arm for arm in arms}
    if seed is not None and seed in by_label:
        arms.remove(by_label[seed])
        arms.insert(0, by_label[seed])
    return Candidates(tuple(arms), by_label)


def attributes(context: Context) -> dict[str, Any]:
    """The context's fields, as stored in its table entry."""
    return {
        field.name: getattr(context, field.name)
        for field in dataclasses.fields(context)
        if field.init
    }


def nearest_winner(table: Table, context: Context, key: str) -> str | None:
    """The chosen arm of the nearest exploiting context of the same kind, if any; hold the
    table's lock.

    Same kind: same direction, memory, storage and cache. Nearest: closest size class,
    then fewest other differences (load, checksum...), then the key, for determinism.
    """
    wanted = attributes(context)
    best: tuple[Any, ...] | None = None
    winner = None
    for other_key, other in table.items():
        if other_key == key or other.phase != EXPLOITING or other.chosen is None:
            continue
        known = other.attributes
        if any(known.get(name) != wanted.get(name) for name in _SEED_FIELDS):
            continue
        size_class = known.get("size_class")
        if not isinstance(size_class, int):
            continue
        others = sum(
            known.get(name) != value
            for name, value in wanted.items()
            if name not in _SEED_FIELDS and name != "size_class"
        )
        distance = (abs(size_class - context.size_class), others, other_key)
        if best is None or distance < best:
            best, winner = distance, other.chosen
    return winner
