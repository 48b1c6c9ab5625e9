"""Which transfer tool, with which parameters, serves a request: learned on the real work.

An *arm* is a tool with its parameters (``posix(task_size=8388608,threads=16)``). For every
context (direction, memory, size class, storage, cache state, load) the :class:`Policy`
explores the eligible arms on the first calls, then exploits the fastest, and keeps what it
learned in a :class:`~arrayio.dispatch.Table` that can be saved and reloaded.

Exploration
    The eligible arms (``candidates(context)``, best guess first) are measured in rounds:
    every arm's first sample, then every surviving arm's second, up to ``explore_samples``
    each. Interleaving the rounds spreads slow changes (a cache warming up) over all arms
    instead of favouring one. An arm whose first sample is below ``prune_ratio`` (0.5) times
    the best estimate so far is pruned: it gets no more samples, which bounds the cost of
    exploring hopeless arms to one call each. Arms within ``contend_ratio`` (0.85) of the
    best get samples up to ``contend_samples`` (4): where two arms are that close, two
    samples each pick the wrong one too often (on the H200 VM, arms 10-20% apart swapped
    places between runs), while a hopeless arm still costs one call. A context never seen
    before is seeded with the winner of its nearest learned neighbour (same direction,
    memory, storage and cache; the closest size class, then the same load): that arm goes
    first, so it sets the bar that prunes the slow arms at once. While several threads
    explore one context, each call takes an arm that no other call is already measuring (up
    to its missing samples).

Exploitation
    The arm with the best estimate (the median of its recent samples, see
    :mod:`~arrayio.dispatch.table`) is used. The context goes back to exploring whenever an
    eligible arm lacks samples: a new candidate, or an arm whose unavailability mark expired.
    With ``sample_every`` above 1, only one exploiting call in that many is timed and
    recorded (drift is watched on those); the others go straight to the chosen tool, since
    the bookkeeping costs microseconds that matter on megabyte transfers.

Drift
    A measurement of the chosen arm below ``drift_ratio`` times its estimate counts as
    drifting; it is held out of the estimate, so that a slowdown cannot lower the bar it is
    compared with. ``drift_patience`` drifting measurements in a row start a re-exploration:
    every arm's recent samples are dropped (lifetime counts, best and last are kept) and all
    are measured again, since a slower winner says the conditions changed for the others
    too. A normal measurement ends the streak and admits the held samples: they were real.
    Losing the winner to a failure re-explores in the same way. Only the winner is watched:
    an arm that became faster elsewhere is found at the next re-exploration.

First calls
    A tool's first call pays for setting the tool up (thread pools, pinned host buffers,
    CUDA streams), which can take longer than the transfer itself: it is not recorded, so
    exploration measures every arm on a warm tool.

Small calls
    Timing a call of a few kilobytes measures the clock and the call overhead more than the
    tool. Calls smaller than ``min_bytes_to_learn`` (64 KiB) are therefore summed per arm
    (bytes and seconds) until they reach it, and the sum counts as one sample: exploration
    and drift detection work unchanged, on fewer, steadier samples.

Failures
    :meth:`Policy.run` tells two kinds of exception apart (:func:`is_tool_failure`).

    * Data and environment errors propagate at once and mark nothing: any tool would fail
      the same way. They are :class:`~arrayio.errors.FormatError` and its subclasses
      (:class:`~arrayio.errors.TruncatedFileError`, :class:`~arrayio.errors.ChecksumError`,
      :class:`~arrayio.errors.HeaderTooLargeError`), ``MemoryError`` (CuPy's
      ``OutOfMemoryError`` included), exceptions that are not ``Exception`` (``KeyboardInterrupt``,
      ``SystemExit``), and ``OSError`` about the file system rather than the tool: ``ENOSPC``,
      ``EDQUOT``, ``EFBIG``, ``EROFS``.
    * Everything else is a tool failure: :class:`~arrayio.errors.ToolUnavailableError`, other
      ``OSError`` (``EINVAL`` from ``O_DIRECT``), ``RuntimeError`` (KvikIO, CUDA),
      ``ImportError``, ``TypeError`` (a tool refusing a buffer), an unknown tool name, a tool
      whose ``availability()`` is false, or any bug inside a tool. The arm is marked
      unavailable in that context and the whole request is retried with the next choice
      (safe: a read fills its whole destination again, a write rewrites its whole range).

    When every eligible arm fails within one call, the last error is raised, chained
    (``__context__``) to the earlier ones, and the marks that call made are withdrawn:
    when everything fails the cause is rarely the tools, and keeping the marks would turn a
    transient fault into a dead context. Marks expire after ``unavailable_ttl`` seconds of
    the table's clock (a day by default, so that a reloaded table retries a tool after a
    driver or library update).

Forcing
    ``run(..., force=arm)`` (the ``tool=`` argument, ``ARRAYIO_TOOL``) uses that arm only:
    no choice, no fallback, and a failure propagates without marking the arm, since the
    caller asked for it. The measurement is still recorded.

Threads
    The table and the policy's own bookkeeping (candidates per context, calls in flight) are
    guarded by one lock, :attr:`Table.lock <arrayio.dispatch.Table.lock>`, held for a few
    dictionary operations per call and never during the I/O. Tools are made once per arm,
    under a lock of their own, and shared by the threads.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import FormatError, ToolUnavailableError
from .table import EXPLOITING, EXPLORING, WINDOW, ArmStats, ContextEntry, Table

if TYPE_CHECKING:
    from ..tools import Tool
    from .context import Context

__all__ = ["Arm", "ArmReport", "Explanation", "Policy", "is_tool_failure"]

logger = logging.getLogger("arrayio.dispatch")

R = TypeVar("R")

_ENVIRONMENT_ERRNOS = frozenset(
    code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG, errno.EROFS)
    if code is not None
)
_MIN_SECONDS = 1e-9  # a clock that did not move still gives a finite bandwidth
_RECHECK_SECONDS = 60.0  # the longest a context exploits without looking for expired marks
_SEED_FIELDS = ("direction", "memory", "storage", "cache")


def is_tool_failure(error: BaseException) -> bool:
    """Whether ``error`` should make the dispatcher fall back to another tool.

    False for data and environment errors (see the module docstring), which propagate.
    """
    if not isinstance(error, Exception):
        return False
    if isinstance(error, (FormatError, MemoryError)):
        return False
    if isinstance(error, OSError) and not isinstance(error, ToolUnavailableError):
        return error.errno not in _ENVIRONMENT_ERRNOS
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Arm:
    """A transfer tool with its parameters: what the policy learns about.

    ``params`` may be given as a mapping; it is stored as a tuple of (key, value) pairs
    sorted by key, so equal arms compare and hash equal. :attr:`label` is the format of
    :attr:`Tool.label <arrayio.tools.Tool.label>`: ``name(k1=v1,k2=v2)`` or ``name``.
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()
    label: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        items = self.params.items() if isinstance(self.params, Mapping) else self.params
        params = tuple(sorted(((str(key), value) for key, value in items),
                              key=lambda item: item[0]))
        if len({key for key, _ in params}) != len(params):
            raise ValueError(f"repeated parameter in {params!r}")
        object.__setattr__(self, "params", params)
        inner = ",".join(f"{key}={value}" for key, value in params)
        object.__setattr__(self, "label", f"{self.name}({inner})" if inner else self.name)

    @classmethod
    def of(cls, name: str, /, **params: Any) -> Arm:
        """``Arm.of("posix", threads=16)``."""
        return cls(name, tuple(params.items()))

    @classmethod
    def from_tool(cls, tool: Tool) -> Arm:
        """The arm of an existing tool instance."""
        return cls(tool.name, tuple(tool.params.items()))

    def make(self) -> Tool:
        """A new instance of the tool: ``arrayio.tools.make(name, **params)``.

        Raises
        ------
        UnknownToolError
            If no tool is registered under :attr:`name`.
        """
        from .. import tools

        return tools.make(self.name, **dict(self.params))

    def __str__(self) -> str:
        return self.label


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
    """Why :meth:`Policy.choose` picks what it picks in one context.

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
        return {arm.label: arm.reason for arm in self.arms
                if arm.state == "unavailable" and arm.reason is not None}

    def as_dict(self) -> dict[str, Any]:
        """The explanation as plain dictionaries and lists (JSON-compatible)."""
        data = dataclasses.asdict(self)
        data["arms"] = list(data["arms"])
        data["unavailable"] = self.unavailable
        return data


@dataclasses.dataclass(slots=True)
class _Arms:
    """A context's candidates in exploration order (the seed first), by label too."""

    order: tuple[Arm, ...]
    by_label: dict[str, Arm]


@dataclasses.dataclass(frozen=True, slots=True)
class _Bars:
    prune: float  # below, after its first sample, an arm gets no more
    contend: float  # at or above, an arm gets up to contend_samples


class Policy:
    """Learns, per context, which arm is fastest; see the module docstring.

    Parameters
    ----------
    candidates
        The arms eligible for a context, best guess first. Called once per context and
        process; the result is kept.
    table
        Where the learning goes (a new empty table by default).
    clock
        Measures the operations (``time.perf_counter``-like).
    make
        Makes the tool of an arm (default :meth:`Arm.make`); the policy keeps one per arm.
    explore_samples
        Samples per arm while exploring (1 to :data:`~arrayio.dispatch.table.WINDOW`).
    contend_samples, contend_ratio
        Arms whose estimate is at least ``contend_ratio`` times the best get samples up to
        ``contend_samples`` (``explore_samples`` to ``WINDOW``; default 4, or
        ``explore_samples`` if more) before the context exploits.
    prune_ratio
        While exploring, an arm measured below this fraction of the best estimate gets no
        more samples (0 disables pruning).
    drift_ratio
        A measurement of the chosen arm below this fraction of its estimate is drifting.
    drift_patience
        Drifting measurements in a row that start a re-exploration.
    min_bytes_to_learn
        Calls smaller than this are summed per arm until they reach it, and timed as one.
    unavailable_ttl
        Seconds (of the table's clock) after which an unavailable arm is tried again;
        ``None`` keeps the marks forever.
    skip_first_call
        Do not record the first call of each arm's tool, which pays for its setup.
    sample_every
        Once a context exploits, time and record only one call in this many; the others go
        straight to the chosen tool (see "Exploitation" in the module docstring).

    Raises
    ------
    ValueError
        For a tunable out of range.
    """

    def __init__(
        self,
        candidates: Callable[[Context], Sequence[Arm]],
        table: Table | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        make: Callable[[Arm], Tool] | None = None,
        explore_samples: int = 2,
        contend_samples: int | None = None,
        contend_ratio: float = 0.85,
        prune_ratio: float = 0.5,
        drift_ratio: float = 0.6,
        drift_patience: int = 3,
        min_bytes_to_learn: int = 64 << 10,
        unavailable_ttl: float | None = 24 * 3600.0,
        skip_first_call: bool = True,
        sample_every: int = 1,
    ) -> None:
        if not 1 <= explore_samples <= WINDOW:
            raise ValueError(f"explore_samples must be in 1..{WINDOW}, got {explore_samples}")
        if contend_samples is None:
            contend_samples = max(explore_samples, 4)
        if not explore_samples <= contend_samples <= WINDOW:
            raise ValueError(f"contend_samples must be in {explore_samples}..{WINDOW}, got "
                             f"{contend_samples}")
        if not 0 < contend_ratio <= 1:
            raise ValueError(f"contend_ratio must be in (0, 1], got {contend_ratio}")
        if not 0 <= prune_ratio < 1:
            raise ValueError(f"prune_ratio must be in [0, 1), got {prune_ratio}")
        if not 0 < drift_ratio < 1:
            raise ValueError(f"drift_ratio must be in (0, 1), got {drift_ratio}")
        if drift_patience < 1:
            raise ValueError(f"drift_patience must be at least 1, got {drift_patience}")
        if min_bytes_to_learn < 0:
            raise ValueError(f"min_bytes_to_learn must not be negative, got {min_bytes_to_learn}")
        if unavailable_ttl is not None and unavailable_ttl <= 0:
            raise ValueError(f"unavailable_ttl must be positive or None, got {unavailable_ttl}")
        self._candidates = candidates
        self.table = table if table is not None else Table()
        self._clock = clock
        self._make = make if make is not None else Arm.make
        self.explore_samples = explore_samples
        self.contend_samples = contend_samples
        self.contend_ratio = contend_ratio
        self.prune_ratio = prune_ratio
        self.drift_ratio = drift_ratio
        self.drift_patience = drift_patience
        self.min_bytes_to_learn = min_bytes_to_learn
        self.unavailable_ttl = unavailable_ttl
        self.skip_first_call = skip_first_call
        if sample_every < 1:
            raise ValueError(f"sample_every must be at least 1, got {sample_every}")
        self.sample_every = sample_every
        self._lock = self.table.lock
        # Apart from the table's lock: making a tool can take seconds (importing KvikIO).
        self._tools_lock = threading.Lock()
        self._arms: dict[str, _Arms] = {}
        self._in_flight: dict[tuple[str, str], int] = {}
        self._tools: dict[Arm, Tool] = {}

    def __repr__(self) -> str:
        from ..runtime._units import format_count

        return f"<arrayio dispatch policy, {format_count(len(self.table), 'context')}>"

    # -- tools ------------------------------------------------------------------------------

    def tool(self, arm: Arm) -> Tool:
        """The policy's instance of ``arm``'s tool, made on first use.

        Raises
        ------
        ToolUnavailableError
            If the tool says it cannot run here; or whatever making it raises.
        """
        with self._tools_lock:
            tool = self._tools.get(arm)
            if tool is None:
                tool = self._make(arm)
                availability = tool.availability()
                if not availability:
                    tool.close()
                    raise ToolUnavailableError(
                        f"{arm.label} cannot run here: {availability.reason}")
                self._tools[arm] = tool
            return tool

    def _is_fresh(self, arm: Arm) -> bool:
        """Whether ``arm``'s tool is yet to be made. Its first call then also pays for
        setting it up (thread pool, pinned buffers, CUDA streams): no fair sample, so it is
        not recorded, and the arm is simply measured again on a later call."""
        if not self.skip_first_call:
            return False
        with self._tools_lock:
            return arm not in self._tools

    def close(self) -> None:
        """Close the tools the policy made (they are made again if needed)."""
        with self._tools_lock:
            tools, self._tools = list(self._tools.values()), {}
        for tool in tools:
            tool.close()

    # -- choosing ---------------------------------------------------------------------------

    def choose(self, context: Context) -> Arm:
        """The arm to use for a call in ``context``: see the module docstring.

        Raises
        ------
        ToolUnavailableError
            If no candidate is available in this context.
        """
        key = context.key()
        with self._lock:
            arm = self._choose(context, key, (), reserve=False)
            if arm is None:
                raise self._nothing_available(key)
            return arm

    def _choose(self, context: Context, key: str, exclude: Iterable[Arm], *,
                reserve: bool) -> Arm | None:
        """The arm for the next call; with ``reserve``, counted in flight until released."""
        entry, arms = self._known(context, key)
        arm = None
        if entry.phase == EXPLOITING and entry.chosen is not None:
            arm = arms.by_label.get(entry.chosen)
            if arm is not None and arm in exclude:
                arm = None
        if arm is None:
            arm = self._explore(key, entry, arms, exclude, reserve=reserve)
        if arm is not None and reserve:
            slot = (key, arm.label)
            self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
        return arm

    def _explore(self, key: str, entry: ContextEntry, arms: _Arms, exclude: Iterable[Arm], *,
                 reserve: bool) -> Arm | None:
        """The arm with the fewest samples (in flight included), in order; or the best."""
        eligible, best, bars = self._scan(entry, arms)
        pick: Arm | None = None
        pick_load = self.contend_samples
        fallback: Arm | None = None
        for arm, stats in eligible:
            if arm in exclude:
                continue
            if fallback is None or arm == best:
                fallback = arm
            if not self._needs_samples(stats, bars):
                continue
            load = (stats.samples if stats is not None else 0)
            if reserve:
                load += self._in_flight.get((key, arm.label), 0)
            if load < pick_load:
                pick, pick_load = arm, load
        return pick if pick is not None else fallback  # all being measured: the best

    def _release(self, key: str, arm: Arm) -> None:
        slot = (key, arm.label)
        with self._lock:
            remaining = self._in_flight.get(slot, 0) - 1
            if remaining > 0:
                self._in_flight[slot] = remaining
            else:
                self._in_flight.pop(slot, None)

    def _scan(self, entry: ContextEntry, arms: _Arms
              ) -> tuple[list[tuple[Arm, ArmStats | None]], Arm | None, _Bars]:
        """The available candidates with their stats, the best one, and the bars below which
        an arm is pruned, and above which it contends."""
        eligible: list[tuple[Arm, ArmStats | None]] = []
        best: Arm | None = None
        best_rate = 0.0
        for arm in arms.order:
            stats = entry.arms.get(arm.label)
            if stats is not None and stats.unavailable is not None:
                continue
            eligible.append((arm, stats))
            if stats is not None and stats.estimate is not None and stats.estimate > best_rate:
                best, best_rate = arm, stats.estimate
        return eligible, best, _Bars(self.prune_ratio * best_rate,
                                     self.contend_ratio * best_rate)

    def _needs_samples(self, stats: ArmStats | None, bars: _Bars, *,
                       contending: bool = True) -> bool:
        """Whether an arm needs another sample; ``contending``: counting the close
        contenders' extra ones, which only an exploration asks for (an estimate moving
        while the context exploits does not send it back to exploring)."""
        if stats is None or stats.estimate is None:
            return True
        if stats.samples < self.explore_samples and stats.estimate >= bars.prune:
            return True
        return (contending and stats.samples < self.contend_samples
                and stats.estimate >= bars.contend)

    def _known(self, context: Context, key: str) -> tuple[ContextEntry, _Arms]:
        """The entry (created, and seeded, if new) and candidates of a context; lock held."""
        entry = self.table.get(key)
        if entry is None:
            entry = self.table.entry(key, _attributes(context))
            entry.seed = self._nearest_winner(context, key)
        arms = self._arms.get(key)
        if arms is None:
            arms = self._arms[key] = _order(self._candidates(context), entry.seed)
            self._refresh(entry, arms, self.table.clock())
        return entry, arms

    def _nearest_winner(self, context: Context, key: str) -> str | None:
        """The chosen arm of the nearest exploiting context of the same kind, if any.

        Same kind: same direction, memory, storage and cache. Nearest: closest size class,
        then fewest other differences (load, checksum...), then the key, for determinism.
        """
        wanted = _attributes(context)
        best: tuple[Any, ...] | None = None
        winner = None
        for other_key, other in self.table.items():
            if other_key == key or other.phase != EXPLOITING or other.chosen is None:
                continue
            attributes = other.attributes
            if any(attributes.get(name) != wanted.get(name) for name in _SEED_FIELDS):
                continue
            size_class = attributes.get("size_class")
            if not isinstance(size_class, int):
                continue
            others = sum(attributes.get(name) != value for name, value in wanted.items()
                         if name not in _SEED_FIELDS and name != "size_class")
            distance = (abs(size_class - context.size_class), others, other_key)
            if best is None or distance < best:
                best, winner = distance, other.chosen
        return winner

    def _refresh(self, entry: ContextEntry, arms: _Arms, now: float) -> None:
        """Recompute phase and chosen arm after a change; lock held."""
        if self.unavailable_ttl is not None:
            for label, stats in entry.arms.items():
                if (stats.unavailable is not None and stats.failed_at is not None
                        and now - stats.failed_at >= self.unavailable_ttl):
                    logger.info("trying %s again (marked unavailable: %s)", label,
                                stats.unavailable)
                    stats.unavailable = None
        entry.refreshed = now
        eligible, best, bars = self._scan(entry, arms)
        contending = entry.phase == EXPLORING
        exploring = best is None or any(
            self._needs_samples(s, bars, contending=contending) for _, s in eligible)
        entry.phase = EXPLORING if exploring else EXPLOITING
        chosen = best.label if best is not None else None
        if chosen != entry.chosen:
            entry.chosen = chosen
            entry.drift = 0
            entry.held.clear()

    def _reexplore(self, entry: ContextEntry) -> None:
        for stats in entry.arms.values():
            stats.forget_recent()
        entry.drift = 0
        entry.held.clear()
        entry.reexplorations += 1
        entry.phase = EXPLORING

    # -- learning ---------------------------------------------------------------------------

    def record(self, context: Context, arm: Arm, nbytes: int, seconds: float) -> None:
        """Learn that ``arm`` moved ``nbytes`` in ``seconds`` in ``context``.

        Calls of zero bytes teach nothing and are ignored.
        """
        self._record(context, context.key(), arm, nbytes, seconds)

    def _record(self, context: Context, key: str, arm: Arm, nbytes: int,
                seconds: float) -> None:
        if nbytes <= 0:
            return
        seconds = max(seconds, _MIN_SECONDS)
        with self._lock:
            entry, arms = self._known(context, key)
            stats = entry.arm(arm.label)
            if nbytes < self.min_bytes_to_learn:
                stats.pending_bytes += nbytes
                stats.pending_seconds += seconds
                if stats.pending_bytes < self.min_bytes_to_learn:
                    return
                nbytes, seconds = stats.pending_bytes, stats.pending_seconds
                stats.pending_bytes, stats.pending_seconds = 0, 0.0
            bandwidth = nbytes / seconds
            now = self.table.clock()
            entry.updated = now
            watched = entry.phase == EXPLOITING and arm.label == entry.chosen
            if watched and stats.estimate is not None and (
                    bandwidth < self.drift_ratio * stats.estimate):
                stats.note(bandwidth, now)
                entry.held.append(bandwidth)
                entry.drift += 1
                if entry.drift < self.drift_patience:
                    return
                logger.info("%s: %s drifted to %.3g GB/s (learned %.3g GB/s); re-exploring",
                            key, arm.label, bandwidth / 1e9, stats.estimate / 1e9)
                self._reexplore(entry)
            else:
                if watched and entry.drift:
                    for held in entry.held:  # the streak ended: those samples were real
                        stats.admit(held)
                    entry.held.clear()
                    entry.drift = 0
                before = stats.estimate
                stats.add(bandwidth, now)
                if (watched and before is not None and stats.estimate >= before
                        and now - entry.refreshed < _RECHECK_SECONDS):
                    return  # the winner held its place: nothing else can have changed
            self._refresh(entry, arms, now)

    def fail(self, context: Context, arm: Arm, error: BaseException) -> None:
        """Mark ``arm`` unavailable in ``context`` because of ``error``.

        The reason kept is ``f"{type(error).__name__}: {error}"``. If ``arm`` was the
        winner, the context is re-explored.
        """
        key = context.key()
        reason = f"{type(error).__name__}: {error}"
        with self._lock:
            entry, arms = self._known(context, key)
            now = self.table.clock()
            stats = entry.arm(arm.label)
            stats.failures += 1
            stats.unavailable = reason
            stats.failed_at = now
            entry.updated = now
            if entry.phase == EXPLOITING and entry.chosen == arm.label:
                self._reexplore(entry)
            self._refresh(entry, arms, now)
        logger.info("%s: %s failed (%s); not using it there", key, arm.label, reason)

    def _withdraw(self, context: Context, marks: list[tuple[Arm, str]]) -> None:
        """Undo the unavailability marks of a call whose every arm failed."""
        key = context.key()
        with self._lock:
            entry, arms = self._known(context, key)
            for arm, reason in marks:
                stats = entry.arms.get(arm.label)
                if stats is not None and stats.unavailable == reason:
                    stats.unavailable = None
                    stats.failed_at = None
            self._refresh(entry, arms, self.table.clock())

    # -- running ----------------------------------------------------------------------------

    def run(self, context: Context, nbytes: int, operation: Callable[[Tool], R], *,
            force: Arm | None = None) -> tuple[R, Arm]:
        """Run ``operation`` with the chosen tool, falling back to others when tools fail.

        Parameters
        ----------
        context
            The request's context.
        nbytes
            Bytes the operation moves (what its bandwidth is computed from).
        operation
            Does the I/O with the tool it is given and returns its result (bytes moved).
        force
            Use this arm only: no choice, no fallback; the measurement is still recorded.

        Returns
        -------
        tuple
            The operation's result and the arm that produced it.

        Raises
        ------
        Exception
            A data or environment error at once (see the module docstring); the last tool
            failure, chained to the earlier ones, when every eligible arm failed; whatever
            a forced arm raises; :class:`~arrayio.errors.ToolUnavailableError` when no arm
            is available in this context at all.
        """
        if force is not None:
            fresh = self._is_fresh(force)
            tool = self.tool(force)
            start = self._clock()
            result = operation(tool)
            if not fresh:
                self.record(context, force, nbytes, self._clock() - start)
            return result, force
        key = context.key()
        if self.sample_every > 1:
            fast = self._exploit_untimed(key, operation)
            if fast is not None:
                return fast
        tried: list[Arm] = []
        marks: list[tuple[Arm, str]] = []
        last_error: BaseException | None = None
        while True:
            with self._lock:
                arm = self._choose(context, key, tried, reserve=True)
            if arm is None:
                break
            try:
                try:
                    fresh = self._is_fresh(arm)
                    tool = self.tool(arm)
                    start = self._clock()
                    result = operation(tool)
                    seconds = self._clock() - start
                finally:
                    self._release(key, arm)
            except BaseException as error:
                if not is_tool_failure(error):
                    raise
                _chain(error, last_error)
                last_error = error
                tried.append(arm)
                self.fail(context, arm, error)
                marks.append((arm, f"{type(error).__name__}: {error}"))
                continue
            if not fresh:
                self._record(context, key, arm, nbytes, seconds)
            return result, arm
        if last_error is None:
            with self._lock:
                raise self._nothing_available(key)
        self._withdraw(context, marks)
        if hasattr(last_error, "add_note"):  # Python 3.11+
            last_error.add_note(f"arrayio: every transfer tool failed for {key}: "
                                f"{', '.join(arm.label for arm in tried)}")
        raise last_error

    def _exploit_untimed(self, key: str, operation: Callable[[Tool], R]
                         ) -> tuple[R, Arm] | None:
        """Run a call of an exploiting, steady context on its chosen tool without the
        bookkeeping (no timing, no locks), unless this call is the one in ``sample_every``
        that is timed. None: take the full path (that call, or any tool failure, which the
        full path then handles with its fallbacks)."""
        entry = self.table.get(key)
        if entry is None or entry.phase != EXPLOITING or entry.chosen is None or entry.drift:
            return None
        arms = self._arms.get(key)
        arm = arms.by_label.get(entry.chosen) if arms is not None else None
        tool = self._tools.get(arm) if arm is not None else None
        if tool is None:
            return None
        entry.untimed += 1  # a lost update under threads only shifts which call is timed
        if entry.untimed >= self.sample_every:
            entry.untimed = 0
            return None
        try:
            return operation(tool), arm
        except BaseException as error:
            if not is_tool_failure(error):
                raise
            return None  # the full path retries, marks the failure and falls back

    def _nothing_available(self, key: str) -> ToolUnavailableError:
        entry = self.table.get(key)
        arms = self._arms.get(key)
        if entry is None or arms is None or not arms.order:
            return ToolUnavailableError(f"no transfer tool is a candidate for {key}")
        reasons = "; ".join(f"{label}: {stats.unavailable}"
                            for label, stats in entry.arms.items()
                            if label in arms.by_label and stats.unavailable is not None)
        return ToolUnavailableError(f"no transfer tool is available for {key} ({reasons})")

    # -- explaining -------------------------------------------------------------------------

    def explain(self, context: Context, *, force: Arm | None = None) -> Explanation:
        """What :meth:`choose` picks in ``context`` and why; changes nothing."""
        key = context.key()
        with self._lock:
            entry = self.table.get(key)
            arms = self._arms.get(key)
            seed = entry.seed if entry is not None else self._nearest_winner(context, key)
            if arms is None:
                arms = _order(self._candidates(context), seed)
            if entry is None:
                entry = ContextEntry()
            eligible, best, bars = self._scan(entry, arms)
            floor = bars.prune
            left = sum(self._needs_samples(stats, bars, contending=entry.phase == EXPLORING)
                       for _, stats in eligible)
            measured = sum(stats is not None and stats.estimate is not None
                           for _, stats in eligible)
            if force is not None:
                phase, chosen, reason = "forced", force.label, "forced"
            elif not eligible:
                phase, chosen, reason = entry.phase, None, "no transfer tool available"
            elif entry.phase == EXPLOITING and entry.chosen is not None:
                phase, chosen = EXPLOITING, entry.chosen
                reason = f"fastest of {measured} measured"
            else:
                arm = self._explore(key, entry, arms, (), reserve=False)
                phase, chosen = EXPLORING, arm.label if arm is not None else None
                reason = f"exploring: {left} arm{'s' if left != 1 else ''} left"
                if entry.reexplorations:
                    reason += f" (re-exploration {entry.reexplorations})"
                if seed is not None:
                    reason += f", seeded with {seed}"
            reports = [_report(arm.label, entry.arms.get(arm.label),
                               chosen if phase != "forced" else None, floor,
                               self.explore_samples, candidate=True)
                       for arm in arms.order]
            reports += [_report(label, stats, chosen if phase != "forced" else None, floor,
                                self.explore_samples, candidate=False)
                        for label, stats in entry.arms.items() if label not in arms.by_label]
            return Explanation(key=key, phase=phase, chosen=chosen, reason=reason,
                               arms=tuple(reports), seed=seed,
                               reexplorations=entry.reexplorations)


def _attributes(context: Context) -> dict[str, Any]:
    """The context's fields, as stored in its table entry."""
    return {field.name: getattr(context, field.name) for field in dataclasses.fields(context)
            if field.init}


def _order(candidates: Sequence[Arm], seed: str | None) -> _Arms:
    order = list(dict.fromkeys(candidates))  # drop repeats, keep the prior order
    for arm in order:
        if not isinstance(arm, Arm):
            raise TypeError(f"candidates must be Arm instances, got {arm!r}")
    by_label = {arm.label: arm for arm in order}
    if seed is not None and seed in by_label:
        order.remove(by_label[seed])
        order.insert(0, by_label[seed])
    return _Arms(tuple(order), by_label)


def _report(label: str, stats: ArmStats | None, chosen: str | None, floor: float,
            explore_samples: int, *, candidate: bool) -> ArmReport:
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

    return ArmReport(label, state, gbps(stats.estimate), gbps(stats.best), gbps(stats.last),
                     stats.samples, stats.count, stats.failures, stats.unavailable)


def _chain(error: BaseException, previous: BaseException | None) -> None:
    """Make ``previous`` the context at the end of ``error``'s chain (keeping its own)."""
    if previous is None:
        return
    seen = set()
    tail = error
    while True:
        seen.add(id(tail))
        following = tail.__cause__ or tail.__context__
        if following is None or id(following) in seen:
            break
        tail = following
    if id(previous) not in seen:
        tail.__context__ = previous
        tail.__suppress_context__ = False
