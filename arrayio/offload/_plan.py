"""A spill plan: which of a training step's saved tensors leave the device, for which tier,
and when they come back, chosen from the step's measured timeline and each tier's rates.

Spilling whatever exceeds a budget straight to NVMe makes every step wait on the disk: a
model makes activations at about a hundred times the rate a disk writes them. SSDTrain and
ZeRO-Infinity get their small overheads by moving only what the copies can hide behind
compute, to the fastest tier with room (pinned host memory, then the disk), and by bringing
tensors back in backward order just before they are needed. This module is that decision,
with no I/O and no framework: the inputs are numbers, so that it is tested with fake
timelines and fake rates.

:func:`simulate` predicts a step under an assignment of tiers:

- a tensor sent down is copied to the host; copies share the device-to-host link in the
  order the tensors are produced (first come, first served), and a disk-tier tensor then
  goes on to the disk on the disk's write link. A host-tier tensor leaves the device once
  its copy is done, a disk-tier one once it is on disk: the offloader holds an array until
  its spill is complete (a file is written from the device, through staging buffers);
- in backward, each comes back over the host-to-device link (after a disk read, for the disk
  tier), in the order backward needs them, each started as late as the link's queue allows
  so that it is on the device when needed and not long before (every byte back early is
  device memory held);
- a tensor not back when backward needs it stalls the step until it is, and every later
  need moves by as much.

:func:`plan` chooses the assignment, in one of two modes: ``max_overhead`` (as little device
memory as possible with the step at most that much slower) or ``device_budget_bytes`` (meet
the budget with the least slowdown).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import math
from collections.abc import Sequence

__all__ = ["TIERS", "Plan", "Rates", "Saved", "Timeline", "link_seconds", "plan", "simulate"]

TIERS = ("device", "host", "disk")


@dataclasses.dataclass(frozen=True, slots=True)
class Saved:
    """One tensor the forward pass saves for backward: its bytes, when it is produced and
    when backward first needs it (seconds from the step's start)."""

    nbytes: int
    produced: float
    needed: float

    def __post_init__(self) -> None:
        if self.nbytes < 0 or not 0 <= self.produced <= self.needed:
            raise ValueError(f"a saved tensor needs 0 <= produced <= needed: {self}")


@dataclasses.dataclass(frozen=True, slots=True)
class Timeline:
    """A plain step as measured: its saved tensors, its seconds, and the device bytes that
    are not saved tensors (parameters, gradients, optimizer state, workspace)."""

    saved: tuple[Saved, ...]
    step_seconds: float
    base_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Rates:
    """Bytes per second of each link, and the bytes the host tier may hold.

    A link that costs nothing is ``math.inf``: for a step on the host, whose tensors are
    written to disk from where they are, ``to_host`` and ``from_host``.
    """

    to_host: float
    from_host: float
    disk_write: float
    disk_read: float
    host_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """An assignment of tiers and what :func:`simulate` predicts of it.

    Attributes
    ----------
    tiers
        Each saved tensor's tier (:data:`TIERS`), in the timeline's order.
    returns
        When each tensor's copy back to the device starts (seconds from the step's start,
        stalls included); None for a tensor that stays.
    step_seconds
        The predicted step.
    peak_bytes, plain_peak_bytes
        The predicted peak of device memory, and the plain step's.
    bound
        What bounds the step: ``"compute"`` (no stall), ``"pcie"`` or ``"disk"`` (the link
        busiest for longest).
    roofline_seconds
        The step no schedule can beat: the longest of the compute and of each link's bytes
        over its rate.
    plain_step_seconds
        The measured plain step.
    byte_seconds
        The saved tensors' device bytes integrated over the step.
    """

    tiers: tuple[str, ...]
    returns: tuple[float | None, ...]
    step_seconds: float
    peak_bytes: int
    plain_peak_bytes: int
    bound: str
    roofline_seconds: float
    plain_step_seconds: float
    byte_seconds: float

    @property
    def memory(self) -> tuple[int, float]:
        """What a plan is judged on, least first: the peak, then the byte-seconds held (a
        move that leaves the peak where it is, set by other tensors, still makes room
        for the moves that lower it)."""
        return self.peak_bytes, self.byte_seconds

    def bytes_on(self, tier: str, timeline: Timeline) -> int:
        """The saved bytes ``tier`` holds under this plan."""
        return sum(s.nbytes for s, t in zip(timeline.saved, self.tiers, strict=True) if t == tier)

    @property
    def overhead(self) -> float:
        """The predicted step's excess over the plain step, as a fraction of it."""
        if self.plain_step_seconds <= 0:
            return 0.0
        return self.step_seconds / self.plain_step_seconds - 1

    def describe(self, timeline: Timeline) -> str:
        """The plan in a few lines."""
        gib = 1 << 30
        lines = [
            f"{self.tiers.count('host')} tensors to host memory "
            f"({self.bytes_on('host', timeline) / gib:.2f} GiB), "
            f"{self.tiers.count('disk')} to disk ({self.bytes_on('disk', timeline) / gib:.2f} "
            f"GiB), {self.tiers.count('device')} stay",
            f"step {self.step_seconds * 1e3:.1f} ms predicted against "
            f"{self.plain_step_seconds * 1e3:.1f} plain ({self.overhead:+.0%}); roofline "
            f"{self.roofline_seconds * 1e3:.1f} ms; bound by {self.bound}",
            f"peak device memory {self.peak_bytes / gib:.2f} GiB against "
            f"{self.plain_peak_bytes / gib:.2f} plain "
            f"({self.peak_bytes / max(self.plain_peak_bytes, 1):.2f}x)",
        ]
        return "\n".join(lines)


def simulate(
    timeline: Timeline,
    rates: Rates,
    tiers: Sequence[str],
    *,
    device_budget_bytes: int | None = None,
) -> Plan:
    """Predict a step of ``timeline`` with each saved tensor on ``tiers[i]``; see the module
    docstring. With ``device_budget_bytes``, forward waits before producing a tensor that
    would not fit until copies out make room (as the Offloader's ``put`` does), and the
    step is that much longer; where no copy in flight can make room, it goes on over."""
    saved = timeline.saved
    if len(tiers) != len(saved):
        raise ValueError(f"{len(tiers)} tiers for {len(saved)} saved tensors")
    if any(t not in TIERS for t in tiers):
        raise ValueError(f"tiers are {TIERS}: {sorted(set(tiers) - set(TIERS))}")
    moved = {i for i, t in enumerate(tiers) if t != "device" and saved[i].nbytes}
    # Forward: tensors made in order, each moved one copied to the host as the link frees
    # (first come, first served), then to the disk for the disk tier.
    made = [s.produced for s in saved]
    left = [math.inf] * len(saved)  # when the tensor's device copy is freed
    on_disk = [0.0] * len(saved)
    link = disk = 0.0
    waited = 0.0  # forward's waits for room so far
    waits: list[tuple[float, float]] = []  # (a production, the waits by then)
    # (when, bytes) of device copies still held: those leaving for the host, which forward
    # may wait for, and those backward frees, which it cannot (in an interleaved step,
    # backward may free some before forward ends).
    leaving: list[tuple[float, int]] = []
    used: list[tuple[float, int]] = []
    held = timeline.base_bytes
    for i in sorted(range(len(saved)), key=lambda i: (saved[i].produced, i)):
        now = saved[i].produced + waited
        for queue in (leaving, used):
            while queue and queue[0][0] <= now:
                held -= heapq.heappop(queue)[1]
        if device_budget_bytes is not None:
            while leaving and held + saved[i].nbytes > device_budget_bytes:
                when, nbytes = heapq.heappop(leaving)
                now, held = max(now, when), held - nbytes
                while used and used[0][0] <= now:
                    held -= heapq.heappop(used)[1]
            waited = now - saved[i].produced
        made[i] = now
        waits.append((saved[i].produced, waited))
        held += saved[i].nbytes
        if i in moved:
            link = left[i] = max(now, link) + saved[i].nbytes / rates.to_host
            if tiers[i] == "disk":
                disk = on_disk[i] = max(left[i], disk) + saved[i].nbytes / rates.disk_write
                left[i] = on_disk[i]
            heapq.heappush(leaving, (left[i], saved[i].nbytes))
        else:
            heapq.heappush(used, (saved[i].needed + waited, saved[i].nbytes))
    produced_at = [p for p, _ in waits]
    # Each need moves by forward's waits before it.
    needs = [
        s.needed + (waits[k - 1][1] if (k := bisect.bisect_right(produced_at, s.needed)) else 0.0)
        for s in saved
    ]
    back = sorted(moved, key=lambda i: (needs[i], i))
    # The latest each copy back may start (as late as the link's queue allows), from the
    # last need backwards; and the latest each disk read may end: when its copy starts.
    latest = [0.0] * len(saved)
    limit = math.inf
    for i in reversed(back):
        latest[i] = limit = min(needs[i], limit) - saved[i].nbytes / rates.from_host
    ready = {i: left[i] for i in back}
    limit = math.inf
    reads = [i for i in back if tiers[i] == "disk"]
    latest_read = {}
    for i in reversed(reads):
        latest_read[i] = limit = min(latest[i], limit) - saved[i].nbytes / rates.disk_read
    reader = 0.0
    for i in reads:
        start = max(on_disk[i], reader, latest_read[i])
        ready[i] = reader = start + saved[i].nbytes / rates.disk_read
    # Backward: copies back in need order; a late one stalls the step.
    stall = 0.0
    link = 0.0
    returns: list[float | None] = [None] * len(saved)
    stalls: list[tuple[float, float]] = []  # (a need, backward's stalls by then)
    for i in back:
        start = max(ready[i], link, latest[i] + stall)
        returns[i] = start
        link = start + saved[i].nbytes / rates.from_host
        stall += max(0.0, link - (needs[i] + stall))
        stalls.append((needs[i], stall))
    step = timeline.step_seconds + waited + stall
    # Backward frees each tensor once it is used, later by the stalls before its need.
    stalled_needs = [need for need, _ in stalls]
    freed = [
        need + (stalls[k - 1][1] if (k := bisect.bisect_right(stalled_needs, need)) else 0.0)
        for need in needs
    ]
    peak, byte_seconds = _peak(timeline, tiers, made, left, returns, freed)
    plain_peak = _plain_peak(timeline)
    links = link_seconds(timeline, rates, tiers)
    roofline = max(links.values())
    del links["compute"]
    bound = "compute" if waited + stall <= 1e-12 else max(links, key=lambda name: links[name])
    return Plan(
        tuple(tiers),
        tuple(returns),
        step,
        peak,
        plain_peak,
        bound,
        roofline,
        timeline.step_seconds,
        byte_seconds,
    )


def link_seconds(timeline: Timeline, rates: Rates, tiers: Sequence[str]) -> dict[str, float]:
    """The roofline's terms: the plain step's compute, and each link's busiest direction
    (its bytes over its rate), for ``"compute"``, ``"pcie"`` and ``"disk"``. The step
    cannot be shorter than any of them, whatever the schedule."""
    saved = timeline.saved
    pcie = sum(s.nbytes for s, t in zip(saved, tiers, strict=True) if t != "device")
    to_disk = sum(s.nbytes for s, t in zip(saved, tiers, strict=True) if t == "disk")
    return {
        "compute": timeline.step_seconds,
        "pcie": max(pcie / rates.to_host, pcie / rates.from_host) if pcie else 0.0,
        "disk": max(to_disk / rates.disk_write, to_disk / rates.disk_read) if to_disk else 0.0,
    }


@functools.lru_cache(maxsize=8)
def _plain_peak(timeline: Timeline) -> int:
    """The plain step's peak (every tensor on the device): the same for every plan that
    :func:`plan` tries on ``timeline``."""
    saved = timeline.saved
    peak, _ = _peak(
        timeline,
        ["device"] * len(saved),
        [s.produced for s in saved],
        [math.inf] * len(saved),
        [None] * len(saved),
        [s.needed for s in saved],
    )
    return peak


def _peak(
    timeline: Timeline,
    tiers: Sequence[str],
    made: list[float],
    left: list[float],
    returns: list[float | None],
    freed: list[float],
) -> tuple[int, float]:
    """The most device bytes held at once, and the byte-seconds of the saved tensors held:
    the base, plus each saved tensor from its
    production until it leaves, and again from its return until backward frees it (a tensor
    whose copy out is still running when its copy back would start never leaves)."""
    events: list[tuple[float, int]] = []
    for i, s in enumerate(timeline.saved):
        back_at = returns[i]
        if tiers[i] == "device" or back_at is None or left[i] >= back_at:
            events += [(made[i], s.nbytes), (freed[i], -s.nbytes)]
        else:
            events += [(made[i], s.nbytes), (left[i], -s.nbytes)]
            events += [(back_at, s.nbytes), (freed[i], -s.nbytes)]
    held = peak = 0
    area = 0.0
    now = 0.0
    for at, change in sorted(events, key=lambda e: (e[0], e[1])):  # frees first at a tie
        area += held * (at - now)
        now = at
        held += change
        peak = max(peak, held)
    return timeline.base_bytes + peak, area


def plan(
    timeline: Timeline,
    rates: Rates,
    *,
    max_overhead: float | None = None,
    device_budget_bytes: int | None = None,
) -> Plan:
    """The tiers for ``timeline``'s saved tensors, in one of two modes (give exactly one):

    ``max_overhead``
        As little peak device memory as possible, with the predicted step at most
        ``1 + max_overhead`` times the plain one.
    ``device_budget_bytes``
        A predicted peak within the budget, with the least predicted slowdown found; where
        no plan meets it, the plan that comes closest (``peak_bytes`` says by how much).

    Tensors are taken greedily, those that free the most bytes for the longest first (a
    long gap between production and need hides the copies best), each to the host while
    the host budget has room, else the disk, and kept where the mode's condition holds. In
    the budget mode, the tensors sent down are then kept on the device again wherever the
    budget still holds and the step is shorter for it (:func:`_kept_back`).
    """
    if (max_overhead is None) == (device_budget_bytes is None):
        raise ValueError("give one of max_overhead and device_budget_bytes")
    saved = timeline.saved
    order = sorted(
        range(len(saved)),
        key=lambda i: (-saved[i].nbytes * (saved[i].needed - saved[i].produced), i),
    )
    tiers = ["device"] * len(saved)
    best = simulate(timeline, rates, tiers)
    host = 0
    if max_overhead is not None:
        allowed = timeline.step_seconds * (1 + max_overhead) + 1e-12
        for i in order:
            for tier in _tiers_for(saved[i], host, rates):
                trial = simulate(timeline, rates, _with(tiers, i, tier))
                if trial.step_seconds <= allowed and trial.memory < best.memory:
                    tiers, best = list(trial.tiers), trial
                    host += saved[i].nbytes if tier == "host" else 0
                    break
        for k in range(1, len(order) + 1):  # (see the budget mode's prefixes below)
            trial = simulate(timeline, rates, _prefix(saved, order[:k], rates))
            if trial.step_seconds <= allowed and trial.memory < best.memory:
                best = trial
        return best
    budget = device_budget_bytes
    assert budget is not None
    best = simulate(timeline, rates, tiers, device_budget_bytes=budget)
    if best.peak_bytes <= budget:
        return best  # nothing needs to move
    for i in order:
        if best.peak_bytes <= budget:
            break
        trials = [
            simulate(timeline, rates, _with(tiers, i, tier), device_budget_bytes=budget)
            for tier in _tiers_for(saved[i], host, rates)
        ]
        useful = [t for t in trials if t.memory < best.memory]
        if not useful:
            continue
        chosen = min(useful, key=lambda t: (t.step_seconds, t.memory))
        host += saved[i].nbytes if chosen.tiers[i] == "host" else 0
        tiers, best = list(chosen.tiers), chosen
    # One tensor at a time can stall: once the link's queue is long, sending one more tensor
    # to the host lowers no peak, and only the disk's (which stalls the whole step, spreading
    # it out) does, though sending several more to the host would. So the plans that send
    # the first k tensors of the order down (the host while it has room) compete too.
    for k in range(1, len(order) + 1):
        trial = simulate(
            timeline, rates, _prefix(saved, order[:k], rates), device_budget_bytes=budget
        )
        if _ranked(trial, budget) < _ranked(best, budget):
            best = trial
    return _kept_back(timeline, rates, best, budget, order)


def _kept_back(
    timeline: Timeline, rates: Rates, best: Plan, budget: int, order: Sequence[int]
) -> Plan:
    """``best`` with the tensors it sends down kept on the device again, one at a time, where
    the budget still holds and the predicted step is shorter. Both passes above add tensors
    until the peak fits, and some they sent down early turn out not to be needed for it;
    every byte that stays is a byte the link does not carry twice. One pass, the tensors
    tried in the reverse of the order they were sent down in (the least useful first): one
    simulation per tensor, where a search to a fixed point could take that many per round."""
    if best.peak_bytes > budget:
        return best
    for i in reversed(order):
        if best.tiers[i] == "device":
            continue
        trial = simulate(
            timeline, rates, _with(list(best.tiers), i, "device"), device_budget_bytes=budget
        )
        if trial.peak_bytes <= budget and trial.step_seconds < best.step_seconds:
            best = trial
    return best


def _prefix(saved: Sequence[Saved], moved: Sequence[int], rates: Rates) -> list[str]:
    """Tiers sending ``moved`` down, each to the host while it has room, else the disk."""
    tiers, host = ["device"] * len(saved), 0
    for i in moved:
        tiers[i] = _tiers_for(saved[i], host, rates)[0]
        host += saved[i].nbytes if tiers[i] == "host" else 0
    return tiers


def _ranked(candidate: Plan, budget: int) -> tuple[bool, int, float, tuple[int, float]]:
    """Plans within the budget first, by step then memory; the others by their peak."""
    over = candidate.peak_bytes > budget
    return over, candidate.peak_bytes if over else 0, candidate.step_seconds, candidate.memory


def _tiers_for(tensor: Saved, host_used: int, rates: Rates) -> list[str]:
    """The tiers to try for ``tensor``: the host while it has room, and the disk."""
    if host_used + tensor.nbytes <= rates.host_bytes:
        return ["host", "disk"]
    return ["disk"]


def _with(tiers: list[str], index: int, tier: str) -> list[str]:
    changed = list(tiers)
    changed[index] = tier
    return changed
