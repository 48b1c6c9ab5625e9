"""Which transfer tool, with which parameters, serves a request: learned on the real work.

For every context the :class:`Policy` explores the eligible arms on the first calls, then
exploits the fastest, re-explores when its bandwidth drifts and falls back when a tool
fails; what it learns goes into a :class:`~arrayio.dispatch.table.Table`. The rules live in
``_choosing`` (which arm), ``_recording`` (measurements and failures) and ``explain``;
``docs/design/dispatcher.md`` explains them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import ToolUnavailableError
from ..runtime import _background, _stages
from ._choosing import Candidates, Exploration, attributes, nearest_winner, order
from ._recording import Measures
from .arm import Arm
from .candidates import CACHED, ON_DISK
from .explain import ArmReport, Explanation, explanation
from .failures import chain, is_tool_failure
from .table import EXPLOITING, ContextEntry, Table

if TYPE_CHECKING:
    from ..tools import Tool
    from .context import Context

__all__ = ["Arm", "ArmReport", "Explanation", "Policy", "Split", "is_tool_failure"]

logger = logging.getLogger("arrayio.dispatch")

R = TypeVar("R")

MAX_SHARE = 0.5  # a rival never takes more of a call than the incumbent
# Rivals are set up (in the background, which slows the calls that run meanwhile: pinning
# memory holds the CUDA driver) only once the incumbent has this many samples and the
# context's calls have taken ``Policy.setup_after`` seconds; the setting up is then charged
# to the context's regret. A script that loads a model once never pays for it.
PREPARE_AFTER = 2

# The rate a call is assumed to run at where nothing of its context was measured, to judge
# whether it hides a tool's set-up (see Policy._stand_in): a fast path's, so that short
# calls of unknown contexts get a stand-in.
FIRST_GUESS_RATE = 10e9

# The rate a read from the disk is assumed to run at where nothing of its context was
# measured, to judge whether a set-up hides behind it (see Policy._stand_in): a fast NVMe
# drive's, so that only reads long on any disk start one.
DISK_GUESS_RATE = 5e9


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """How a call of an exploring context is shared: ``share`` of its bytes go to the
    ``rival`` arm being measured, the rest to the ``incumbent``, the best arm so far."""

    incumbent: Arm
    rival: Arm
    share: float


class Policy:
    """Learns, per context, which arm is fastest; see ``docs/design/dispatcher.md``.

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
        straight to the chosen tool.
    regret, first_share
        While a context explores, a call that can be divided gives a rival arm a share of its
        bytes (:meth:`split`): ``first_share`` before the rival has an estimate, then as
        much as keeps the time lost to it under ``regret`` of the call's, at most half.
    setup_after
        Seconds a context's calls must have taken before its rivals are set up (with
        ``skip_first_call``; see :data:`PREPARE_AFTER`).
    stand_in_for
        How many times its set-up's cost the stand-ins' calls take before the arm they stand
        in for is set up (see :meth:`_stand_in`).
    setup_seconds
        What a process's first use of an arm's tool costs beyond its transfer (default: the
        tool's :attr:`~arrayio.tools.Tool.setup_seconds`); see :meth:`run`.
    idle_wait
        Seconds without a call after a stand-in's call for the program to count as busy
        with other work, so that a set-up then overlaps that work (see :meth:`_stand_in`).
    setup_wait
        Seconds a call served by the page cache waits for its arm's set-up in progress,
        rather than running a stand-in beside it (see :meth:`_wait_for_set_up`); 0: never.
    read_ahead
        Asks for the files an arm's set-up will read, before a read from the disk that the
        set-up runs beside (default: the tool's :meth:`~arrayio.tools.Tool.read_ahead`).

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
        regret: float = 0.1,
        first_share: float = 1 / 64,
        setup_after: float = 2.0,
        stand_in_for: float = 1.0,
        setup_seconds: Callable[[Arm], float] | None = None,
        idle_wait: float = 0.05,
        setup_wait: float = 0.5,
        read_ahead: Callable[[Arm], None] | None = None,
    ) -> None:
        self.exploration = Exploration(
            explore_samples,
            contend_samples if contend_samples is not None else max(explore_samples, 4),
            contend_ratio,
            prune_ratio,
        )
        self.measures = Measures(drift_ratio, drift_patience, min_bytes_to_learn, unavailable_ttl)
        if sample_every < 1:
            raise ValueError(f"sample_every must be at least 1, got {sample_every}")
        if not 0 < regret < 1:
            raise ValueError(f"regret must be in (0, 1), got {regret}")
        if not 0 < first_share <= MAX_SHARE:
            raise ValueError(f"first_share must be in (0, {MAX_SHARE}], got {first_share}")
        if not stand_in_for >= 0:  # (NaN too)
            raise ValueError(f"stand_in_for must be at least 0, got {stand_in_for}")
        self.regret, self.first_share = regret, first_share
        self.setup_after = setup_after
        self.stand_in_for = stand_in_for
        self.idle_wait = idle_wait
        self.setup_wait = setup_wait
        self._read_ahead = read_ahead if read_ahead is not None else _read_ahead_of
        # Whether exploring contexts share calls between arms (:meth:`split`); tune() turns
        # it off, to learn quickly on calls of its own.
        self.within_calls = True
        # Per context: seconds of its calls, and of those the seconds rivals ran.
        self._spent: dict[str, float] = {}
        self._explored: dict[str, float] = {}
        self._candidates = candidates
        self.table = table if table is not None else Table()
        self._clock = clock
        self._make = make if make is not None else Arm.make
        self.skip_first_call = skip_first_call
        self.sample_every = sample_every
        self._lock = self.table.lock
        # Apart from the table's lock: making a tool can take seconds (importing KvikIO).
        self._tools_lock = threading.Lock()
        self._arms: dict[str, Candidates] = {}
        # Arms whose tools are set up (made and prepared), and those being set up in the
        # background before a rival's first share of a call.
        self._ready: set[Arm] = set()
        self._preparing: set[Arm] = set()
        # What calls waiting for a tool's set-up wait on, by tool name (made by the first such
        # call: a set-up is the tool's, whichever of its arms runs it), and the tools whose
        # set-up outlasted a wait: calls no longer wait for them.
        self._set_up_done: dict[str, threading.Event] = {}
        self._waited_out: set[str] = set()
        # Tools (by name) set up in this process: what a set-up costs (imports, pinned
        # pools) is the tool's, whichever arm of it paid.
        self._set_up_tools: set[str] = set()
        _policies.add(self)
        self._in_flight: dict[tuple[str, str], int] = {}
        self._tools: dict[Arm, Tool] = {}
        self._setup_seconds = setup_seconds if setup_seconds is not None else _setup_seconds
        # Seconds the stand-ins' calls have taken, in any context: the arm they stand in for
        # is set up once they reach its set-up's cost (see _stand_in).
        self._stood_in_seconds = 0.0
        # Calls running now, and calls started so far: an idle watch (see _watch_idle)
        # compares them before and after its wait.
        self._running = 0
        self._started = 0
        self._idle_watches: set[Arm] = set()
        # Arms set up for a stand-in's context, whose first call is not yet measured: set-up
        # imports the libraries, and the first transfer still pins the tool's own buffers.
        self._unmeasured: set[Arm] = set()
        # Every set-up this process ran in the background, for set_ups().
        self._set_up_log: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        from ..runtime._units import format_count

        return f"<arrayio dispatch policy, {format_count(len(self.table), 'context')}>"

    # -- tunables (read-only) ---------------------------------------------------------------

    @property
    def explore_samples(self) -> int:
        return self.exploration.explore_samples

    @property
    def contend_samples(self) -> int:
        return self.exploration.contend_samples

    @property
    def contend_ratio(self) -> float:
        return self.exploration.contend_ratio

    @property
    def prune_ratio(self) -> float:
        return self.exploration.prune_ratio

    @property
    def drift_ratio(self) -> float:
        return self.measures.drift_ratio

    @property
    def drift_patience(self) -> int:
        return self.measures.drift_patience

    @property
    def min_bytes_to_learn(self) -> int:
        return self.measures.min_bytes_to_learn

    @property
    def unavailable_ttl(self) -> float | None:
        return self.measures.unavailable_ttl

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
                with _stages.stage("making tools"):  # (KvikIO's imports, on first use)
                    tool = self._make(arm)
                availability = tool.availability()
                if not availability:
                    tool.close()
                    raise ToolUnavailableError(
                        f"{arm.label} cannot run here: {availability.reason}"
                    )
                self._tools[arm] = tool
            return tool

    def setting_up(self) -> list[Arm]:
        """The arms whose tools are being set up in the background at this moment."""
        with self._tools_lock:
            return sorted(self._preparing, key=lambda arm: arm.label)

    def _set_up(self, key: str, entry: ContextEntry, incumbent: Arm, rival: Arm) -> bool:
        """Whether ``rival``'s tool is set up for a fair measurement; if not, and the context
        has earned it (:data:`PREPARE_AFTER` samples, :attr:`setup_after` seconds, and the
        seconds spent on rivals within the regret), set it up in the background, once: a
        rival's first share of a user's call would otherwise pay for its threads, pinned
        buffers and imports, which take longer than a share's transfer."""
        with self._tools_lock:
            if rival in self._ready:
                return True
            if rival in self._preparing:
                return False
        with self._lock:
            spent = self._spent.get(key, 0.0)
            explored = self._explored.get(key, 0.0)
        if (
            entry.arms[incumbent.label].samples < PREPARE_AFTER
            or spent < self.setup_after
            or explored > self.regret * spent
        ):
            return False
        with self._tools_lock:
            if rival in self._preparing or rival in self._ready:
                return rival in self._ready
            if self._tool_being_set_up(rival):
                return False  # one set-up of a tool at a time (see _claim); a later call's turn
            self._preparing.add(rival)
        self._start_preparing(rival, key)
        return False

    def set_ups(self) -> list[dict[str, Any]]:
        """The set-ups this process ran in the background, in the order they began: the arm,
        whom for (``"stand-in"``: the arm a stand-in ran for; ``"rival"``), when it began
        (``time.perf_counter()``), its seconds (None while it runs) and its steps' seconds
        as the tool recorded them (:attr:`~arrayio.tools.Tool.set_up_steps`)."""
        with self._tools_lock:
            return [dict(record, steps=dict(record["steps"])) for record in self._set_up_log]

    def _prepare(self, arm: Arm, key: str | None) -> None:
        start = time.perf_counter()
        record: dict[str, Any] = {
            "arm": arm.label,
            "for": "stand-in" if key is None else "rival",
            "began": start,
            "seconds": None,
            "steps": {},
        }
        with self._tools_lock:
            self._set_up_log.append(record)
        tool = None
        try:
            tool = self.tool(arm)
            tool.prepare()
        except Exception as error:  # noqa: BLE001 - a call measures it, and marks it
            logger.info("setting up %s failed: %s", arm.label, error)
            record["error"] = f"{type(error).__name__}: {error}"
        finally:
            with self._tools_lock:
                record["seconds"] = time.perf_counter() - start
                record["steps"] = dict(getattr(tool, "set_up_steps", {}))
                self._preparing.discard(arm)
                self._ready.add(arm)
                self._set_up_tools.add(arm.name)
                if key is None:
                    self._unmeasured.add(arm)
                done = self._set_up_done.pop(arm.name, None)
            if done is not None:
                done.set()
            if key is not None:
                with self._lock:  # what it cost the calls meanwhile, at most its duration
                    seconds = time.perf_counter() - start
                    self._explored[key] = self._explored.get(key, 0.0) + seconds

    def _wait_for_set_up(self, context: Context, arm: Arm) -> None:
        """Wait (up to :attr:`setup_wait`) for the set-up of ``arm``'s tool in progress (by
        any arm of the tool: a cold read sets up the arm its reload will choose, but a
        rival's or an idle gap's set-up may be another's) where the call reads from the page
        cache and the tool has a set-up to stand in for, so that the call runs on the arm
        once it is ready.

        A stand-in run beside a set-up shares the interpreter's lock with its import and the
        CUDA driver with its pinning: a warm load beside KvikIO's set-up lost 0.12 to 0.48 s
        to it, and the reload right after a cold start whose libraries were cold too (the
        import then ends inside that reload) ran at a sixth of the next one
        (``docs/design/dispatcher.md``). Waiting costs at most what is left of the set-up, and
        the call then runs at the arm's rate. A read from the disk runs beside the set-up,
        which its waits hide; so do writes and reads whose cache state is unknown. A set-up
        that outlasts a wait is not waited for again, nor one that cannot start any more
        (the process's exit has begun)."""
        if (
            self.setup_wait <= 0
            or context.direction != "read"
            or context.cache not in CACHED
            or self._setup_seconds(arm) <= 0  # (a rival's set-up: no stand-in either)
            or _background.exiting()
        ):
            return
        with self._tools_lock:
            tool = arm.name
            if tool in self._waited_out or not self._tool_being_set_up(arm):
                return
            done = self._set_up_done.setdefault(tool, threading.Event())
        with _stages.stage("waiting for a set-up"):
            finished = done.wait(self.setup_wait)
        if not finished:
            with self._tools_lock:
                self._waited_out.add(tool)

    def _stand_in(
        self, context: Context, key: str, arm: Arm, nbytes: int, exclude: Iterable[Arm]
    ) -> tuple[Arm, Arm | None, Arm | None]:
        """The arm to run a call of ``nbytes`` for which ``arm`` was chosen, the arm to set
        up once the call is done, and the arm to set up beside it (each or None); lock held.

        An arm whose tool costs seconds to set up (KvikIO's imports) and that this process
        has not set up yet would spend longer on that than on a short call: such a call
        goes to the first candidate with nothing to set up (a warm model load is a tenth of a
        second; importing KvikIO, most of another). The chosen arm is set up in the
        background once the stand-ins' calls, in any context, have taken :attr:`stand_in_for`
        times as long as the set-up costs (a ski-rental rule: a process that loads a few
        times and exits never pays for the set-up, and one that goes on loading pays for it
        only once its calls have taken at least as long as the set-up), or as soon as
        the program leaves a gap of :attr:`idle_wait` after a stand-in's call (the set-up then
        overlaps the program's own work, see :meth:`_watch_idle`), and runs the calls once it
        is. A call long
        enough to hide the set-up (more than ``1 / regret`` times it, at the arm's measured
        rate, or the best measured, or :data:`FIRST_GUESS_RATE`) runs the arm itself. The
        stand-in's calls are not recorded (see :meth:`run`).

        A stand-in's read from the disk that is expected to outlast the set-up (at the arm's
        measured rate or :data:`DISK_GUESS_RATE`) starts its tool's set-up at once, beside the
        call, through the arm the reloads will choose (:meth:`_reload_arm`): its threads wait
        on the disk, so the set-up costs the call little, and the reloads that follow a cold
        start (page-cache reads) find it ready.
        The files the set-up reads are asked for first, before the call's reads fill the
        disk's queue (see :meth:`run`).
        """
        setup = self._setup_seconds(arm)
        if setup <= 0:
            return arm, None, None
        entry, candidates = self._known(context, key)
        with self._tools_lock:
            if arm in self._ready or (arm in self._tools and arm not in self._preparing):
                return arm, None, None
            if arm.name in self._set_up_tools:
                return arm, None, None  # another arm of its tool paid for the set-up
        stats = entry.arms.get(arm.label)
        rate = stats.estimate if stats is not None else None
        if not rate:
            measured = [s.estimate for s in entry.arms.values() if s.estimate]
            rate = max(measured) if measured else FIRST_GUESS_RATE
        if setup <= self.regret * nbytes / rate:
            return arm, None, None
        excluded = set(exclude)
        for other in candidates.order:
            if other == arm or other in excluded or self._setup_seconds(other) > 0:
                continue
            other_stats = entry.arms.get(other.label)
            if other_stats is not None and other_stats.unavailable is not None:
                continue
            disk_rate = (stats.estimate if stats is not None else None) or DISK_GUESS_RATE
            beside = context.direction == "read" and context.cache in ON_DISK
            if beside and setup <= nbytes / disk_rate:
                reload = self._reload_arm(context, arm)
                return other, None, reload if self._claim(reload) else None
            earned = self._stood_in_seconds >= setup * self.stand_in_for
            return other, arm if earned and self._claim(arm) else None, None
        return arm, None, None

    def _reload_arm(self, context: Context, arm: Arm) -> Arm:
        """The arm of ``arm``'s tool that a reload of a cold read in ``context`` (the same
        read from the page cache) chooses, or ``arm`` where the reload chooses another tool;
        lock held. A set-up beside a cold read is for those reloads, and a tool's set-up is
        its arm's: KvikIO pins bounce buffers of its arm's task size, and pinning the cold
        arm's larger ones took as many times longer, which pushed the set-up past the cold
        read into the reload that waited for it. The cold arm's first call then pins its own,
        during a read whose waits on the disk hide it."""
        reload = dataclasses.replace(context, cache="warm", keep=False)
        chosen = self._choose(reload, reload.key(), (), reserve=False)
        return chosen if chosen is not None and chosen.name == arm.name else arm

    def _set_up_beside(self, arm: Arm) -> None:
        """Start setting ``arm`` up beside a read from the disk (claimed by
        :meth:`_stand_in`): its files asked for first, while the disk's queue is empty (a
        failure to ask costs only time; the set-up starts whatever happens)."""
        try:
            with _stages.stage("reading ahead"):
                self._read_ahead(arm)
        except Exception as error:  # noqa: BLE001 - only the set-up's speed is at stake
            logger.info("reading ahead for %s failed: %s", arm.label, error)
        finally:
            self._start_preparing(arm)

    def _set_up_after(self, arm: Arm | None) -> None:
        """Start setting ``arm`` up in the background (after a stand-in's call: importing
        KvikIO holds the interpreter's lock for tens of milliseconds, which would slow a
        call's workers; between calls it overlaps the program's own work)."""
        if arm is not None:
            self._start_preparing(arm)

    def _watch_idle(self, arm: Arm) -> None:
        """Set ``arm`` up if no call starts within :attr:`idle_wait` of a stand-in's call.

        A program that loads, then computes (an eval loop, a notebook's next cell), leaves
        gaps between calls much longer than the set-up: run there, it slows no transfer.
        Back-to-back loads leave none, and wait until the stand-ins' calls reach
        :attr:`stand_in_for` times the set-up's cost. Untimed calls count as calls that
        start (see :meth:`_untimed_arm`), though not as running ones: a set-up may begin
        beside one still moving when the watch looks."""
        with self._lock:
            if arm in self._idle_watches:
                return
            self._idle_watches.add(arm)
            started = self._started

        def watch() -> None:
            try:
                _background.sleep(self.idle_wait)
                with self._lock:
                    idle = self._running == 0 and self._started == started
                if idle and not _background.exiting() and self._claim(arm):
                    self._start_preparing(arm)
            finally:
                with self._lock:
                    self._idle_watches.discard(arm)

        # Only its set-up is waited for at exit, not its wait (which the exit cuts short).
        _background.start_untracked(watch, name="arrayio-idle-watch")

    def _claim(self, arm: Arm) -> bool:
        """Mark ``arm`` as being set up, unless it is made or being set up already, or
        another arm of its tool is being set up: every set-up (a stand-in's arm, a rival's,
        one beside a cold read, one in an idle gap; a rival's, in :meth:`_set_up`, by the same
        test) waits while its tool is being set up, so a tool is set up for one arm at a
        time. A second set-up of one tool (another arm's buffers, pinned while
        the first set-up imports) would run beside the very calls the first is for: the
        cold arm's idle watch after a cold read whose reload arm was being set up beside it
        pinned its 16 MiB buffers during the reload. Once the tool is set up, another arm's
        first call pins its own (:meth:`_stand_in`)."""
        with self._tools_lock:
            if arm in self._preparing or arm in self._tools or self._tool_being_set_up(arm):
                return False
            self._preparing.add(arm)
            return True

    def _tool_being_set_up(self, arm: Arm) -> bool:
        """Whether ``arm``'s tool is being set up for any arm (tools lock held)."""
        return any(other.name == arm.name for other in self._preparing)

    def _start_preparing(self, arm: Arm, key: str | None = None) -> None:
        """Set ``arm`` up on a thread of its own (in :attr:`_preparing` already), for a
        rival of context ``key`` or a stand-in's arm (None); a process that exits meanwhile
        waits for it (:mod:`~arrayio.runtime._background`)."""
        _background.start(self._prepare, arm, key, name="arrayio-prepare")

    def _is_fresh(self, arm: Arm) -> bool:
        """Whether ``arm``'s tool is yet to be made. Its first call then also pays for
        setting it up (thread pool, pinned buffers, CUDA streams): no fair sample, so it is
        not recorded, and the arm is simply measured again on a later call."""
        if not self.skip_first_call:
            return False
        with self._tools_lock:
            if arm in self._unmeasured:  # set up for a stand-in's arm: its first call
                self._unmeasured.discard(arm)  # still pins its buffers
                return True
            return arm not in self._tools

    def close(self) -> None:
        """Close the tools the policy made (they are made again if needed)."""
        with self._tools_lock:
            tools, self._tools = list(self._tools.values()), {}
            self._ready.clear()
            self._waited_out.clear()
        for tool in tools:
            tool.close()

    # -- choosing ---------------------------------------------------------------------------

    def choose(self, context: Context) -> Arm:
        """The arm to use for a call in ``context``: the next to measure while the context
        explores, the fastest once it exploits.

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

    def _choose(
        self,
        context: Context,
        key: str,
        exclude: Iterable[Arm],
        *,
        reserve: bool,
        prefer: Arm | None = None,
    ) -> Arm | None:
        """The arm for the next call (``prefer`` where it is an available candidate not
        excluded); with ``reserve``, counted in flight until released: while several
        threads explore one context, each takes an arm no other is measuring."""
        entry, candidates = self._known(context, key)
        arm = None
        if prefer is not None and prefer not in exclude and prefer in candidates.order:
            stats = entry.arms.get(prefer.label)
            if stats is None or stats.unavailable is None:
                arm = prefer
        if arm is None and entry.phase == EXPLOITING and entry.chosen is not None:
            arm = candidates.by_label.get(entry.chosen)
            if arm is not None and arm in exclude:
                arm = None
        if arm is None:
            busy = (lambda arm: self._in_flight.get((key, arm.label), 0)) if reserve else None
            arm = self.exploration.pick(entry, candidates, exclude, busy)
        if arm is not None and reserve:
            slot = (key, arm.label)
            self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
        return arm

    def split(self, context: Context) -> Split | None:
        """How to share a call of ``context`` between the best arm so far and a rival that
        needs a sample, so that exploring costs a bounded part of the call; None: the whole
        call goes to :meth:`choose`'s arm (the context exploits, or nothing was measured
        yet, in which case that arm is the prior).

        The rival's share is :attr:`first_share` while it has no estimate (and none until
        its tool is set up, see :meth:`_set_up`); once measured at a fraction ``r``
        of the incumbent's bandwidth, its part of the call takes ``1 / r`` times as long as
        the incumbent would, so a share of ``regret / (1 / r - 1)`` loses at most
        ``regret`` of the call (at most :data:`MAX_SHARE`). An arm below the prune ratio
        gets no more samples at all.
        """
        if not self.within_calls:
            return None
        key = context.key()
        with self._lock:
            entry, candidates = self._known(context, key)
            pair = self.exploration.rival(entry, candidates)
            if pair is None:
                return None
            incumbent, rival = pair
            best = entry.arms[incumbent.label].estimate
            stats = entry.arms.get(rival.label)
            estimate = stats.estimate if stats is not None else None
        if self.skip_first_call and not self._set_up(key, entry, incumbent, rival):
            return Split(incumbent, rival, 0.0)  # the incumbent's, until the rival is set up
        share = self.first_share
        if estimate is not None and best:
            slowdown = best / estimate - 1 if estimate > 0 else float("inf")
            share = MAX_SHARE if slowdown <= 0 else min(MAX_SHARE, self.regret / slowdown)
            share = max(share, self.first_share)
        return Split(incumbent, rival, share)

    def undivided(self, context: Context, split: Split, nbytes: int) -> Arm:
        """The arm for a whole call of ``nbytes`` in an exploring context that cannot be
        divided (one small transfer): the rival if, counting this call at half the
        incumbent's bandwidth (the prune ratio's bar), the seconds rivals ran stay within
        :attr:`regret` of the seconds of the context's calls; else the incumbent. The bound
        holds over the calls rather than within each."""
        key = context.key()
        with self._lock:
            stats = self.table.get(key)
            best = stats.arms.get(split.incumbent.label) if stats is not None else None
            rate = best.estimate if best is not None else None
            expected = 2 * nbytes / rate if rate else 0.0
            explored = self._explored.get(key, 0.0) + expected
            allowed = explored <= self.regret * (self._spent.get(key, 0.0) + expected)
        return split.rival if allowed else split.incumbent

    def account(self, context: Context, seconds: float, explored: float = 0.0) -> None:
        """Count a call's ``seconds`` in its context, ``explored`` of them a rival's."""
        key = context.key()
        with self._lock:
            self._spent[key] = self._spent.get(key, 0.0) + seconds
            self._explored[key] = self._explored.get(key, 0.0) + explored

    @contextlib.contextmanager
    def whole_calls(self) -> Iterator[None]:
        """Explore one whole call per arm in the ``with`` block, as :func:`arrayio.tune`
        does: learning converges in fewer calls, each paid in full."""
        previous, self.within_calls = self.within_calls, False
        try:
            yield
        finally:
            self.within_calls = previous

    def _release(self, key: str, arm: Arm) -> None:
        slot = (key, arm.label)
        with self._lock:
            remaining = self._in_flight.get(slot, 0) - 1
            if remaining > 0:
                self._in_flight[slot] = remaining
            else:
                self._in_flight.pop(slot, None)

    def _known(self, context: Context, key: str) -> tuple[ContextEntry, Candidates]:
        """The entry (created, and seeded, if new) and candidates of a context; lock held."""
        entry = self.table.get(key)
        if entry is None:
            entry = self.table.entry(key, attributes(context))
            entry.seed = nearest_winner(self.table, context, key)
        candidates = self._arms.get(key)
        if candidates is None:
            candidates = self._arms[key] = order(self._candidates(context), entry.seed)
            self._refresh(entry, candidates, self.table.clock())
        return entry, candidates

    def _refresh(self, entry: ContextEntry, candidates: Candidates, now: float) -> None:
        """Expire old unavailability marks, then derive phase and choice; lock held."""
        self.measures.expire_marks(entry, now)
        entry.refreshed = now
        self.exploration.settle(entry, candidates)

    # -- recording --------------------------------------------------------------------------

    def record(self, context: Context, arm: Arm, nbytes: int, seconds: float) -> None:
        """Learn that ``arm`` moved ``nbytes`` in ``seconds`` in ``context``.

        Calls of zero bytes teach nothing and are ignored.
        """
        self._record(context, context.key(), arm, nbytes, seconds)

    def _record(self, context: Context, key: str, arm: Arm, nbytes: int, seconds: float) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            entry, candidates = self._known(context, key)
            bandwidth = self.measures.bandwidth(entry.arm(arm.label), nbytes, seconds)
            if bandwidth is None:
                return
            now = self.table.clock()
            if self.measures.learn(key, entry, arm.label, bandwidth, now):
                self._refresh(entry, candidates, now)

    def fail(self, context: Context, arm: Arm, error: BaseException) -> None:
        """Mark ``arm`` unavailable in ``context`` because of ``error``.

        The reason kept is ``f"{type(error).__name__}: {error}"``. If ``arm`` was the
        winner, the context is re-explored.
        """
        key = context.key()
        reason = f"{type(error).__name__}: {error}"
        with self._lock:
            entry, candidates = self._known(context, key)
            now = self.table.clock()
            self.measures.mark_failed(entry, arm.label, reason, now)
            self._refresh(entry, candidates, now)
        logger.info("%s: %s failed (%s); not using it there", key, arm.label, reason)

    def _withdraw(self, context: Context, marks: list[tuple[Arm, str]]) -> None:
        """Undo the unavailability marks of a call whose every arm failed: when everything
        fails the cause is rarely the tools, and the marks would make a transient fault a
        dead context."""
        with self._lock:
            entry, candidates = self._known(context, context.key())
            self.measures.withdraw(entry, marks)
            self._refresh(entry, candidates, self.table.clock())

    # -- running ----------------------------------------------------------------------------

    def run(
        self,
        context: Context,
        nbytes: int,
        operation: Callable[[Tool], R],
        *,
        force: Arm | None = None,
        prefer: Arm | None = None,
        waiting: bool = False,
    ) -> tuple[R, Arm]:
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
        prefer
            Try this arm first (the incumbent of a :class:`Split` call), then fall back as
            usual.
        waiting
            The call is one an exploring context gives whole to ``prefer`` while its rival
            waits for its set-up (a :class:`Split` of share 0): sampled as an exploiting
            context's calls are, rather than timed each (the incumbent's part of a shared
            call is timed).

        Returns
        -------
        tuple
            The operation's result and the arm that produced it.

        Raises
        ------
        Exception
            A data or environment error at once (see :func:`is_tool_failure`); the last
            tool failure, chained to the earlier ones, when every eligible arm failed;
            whatever a forced arm raises; :class:`~arrayio.errors.ToolUnavailableError`
            when no arm is available in this context at all.
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
        if self.sample_every > 1 and (prefer is None or waiting):
            fast = self._exploit_untimed(key, operation, prefer)
            if fast is not None:
                return fast
        tried: list[Arm] = []
        marks: list[tuple[Arm, str]] = []
        last_error: BaseException | None = None
        while True:
            with self._lock:
                arm = self._choose(context, key, tried, reserve=True, prefer=prefer)
                if arm is None:
                    break
            try:
                self._wait_for_set_up(context, arm)
            except BaseException:  # (an interrupt in the wait: the arm is not run)
                self._release(key, arm)
                raise
            with self._lock:
                runner, set_up, beside = self._stand_in(context, key, arm, nbytes, tried)
                self._running += 1
                self._started += 1
            try:
                try:
                    if beside is not None:
                        self._set_up_beside(beside)
                    fresh = self._is_fresh(runner)
                    tool = self.tool(runner)
                    start = self._clock()
                    result = operation(tool)
                    seconds = self._clock() - start
                finally:
                    with self._lock:
                        self._running -= 1
                    self._release(key, arm)
                    self._set_up_after(set_up)
                    if runner != arm and set_up is None:
                        self._watch_idle(arm)
            except BaseException as error:
                if not is_tool_failure(error):
                    raise
                chain(error, last_error)
                last_error = error
                tried.append(runner)
                self.fail(context, runner, error)
                marks.append((runner, f"{type(error).__name__}: {error}"))
                continue
            # A stand-in's call teaches nothing: it ran because the chosen arm was not set
            # up, and counting it would make it the incumbent that the arm, measured on
            # small shares of calls where its per-call costs weigh most, must then beat.
            if runner != arm:
                with self._lock:
                    self._stood_in_seconds += seconds
            elif not fresh:
                self._record(context, key, arm, nbytes, seconds)
            return result, runner
        if last_error is None:
            with self._lock:
                raise self._nothing_available(key)
        self._withdraw(context, marks)
        if hasattr(last_error, "add_note"):  # Python 3.11+
            last_error.add_note(
                f"arrayio: every transfer tool failed for {key}: "
                f"{', '.join(arm.label for arm in tried)}"
            )
        raise last_error

    def _exploit_untimed(
        self, key: str, operation: Callable[[Tool], R], prefer: Arm | None = None
    ) -> tuple[R, Arm] | None:
        """Run a call on the arm :meth:`_untimed_arm` gives, without the bookkeeping. None:
        take the full path (the timed call, or any tool failure, which the full path then
        handles with its fallbacks)."""
        chosen = self._untimed_arm(key, prefer)
        if chosen is None:
            return None
        arm, tool = chosen
        try:
            return operation(tool), arm
        except BaseException as error:
            if not is_tool_failure(error):
                raise
            return None  # the full path retries, marks the failure and falls back

    def untimed_arm(self, context: Context, split: Split | None) -> tuple[Arm, Tool] | None:
        """The arm and tool for a whole call of ``context`` (whose :meth:`split` is
        ``split``) run without the bookkeeping (no timing, no locks), as :meth:`run` runs
        it; None: the call takes :meth:`run`'s full path (it is the timed one in
        ``sample_every``, which that path counts and times; it is shared with a rival; or
        nothing is settled). An untimed call is counted here."""
        if self.sample_every <= 1 or (split is not None and split.share):
            return None
        incumbent = split.incumbent if split is not None else None
        return self._untimed_arm(context.key(), incumbent, leave_timed_call=True)

    def _untimed_arm(
        self, key: str, prefer: Arm | None, *, leave_timed_call: bool = False
    ) -> tuple[Arm, Tool] | None:
        """The chosen arm of an exploiting, steady context and its tool, unless this call is
        the one in ``sample_every`` that is timed. The same for a call an exploring context
        gives whole to its best arm so far (``prefer``: while a rival waits for its set-up,
        every call is such a call, and a store's crowd of chunk reads paid the full path on
        each)."""
        entry = self.table.get(key)
        if entry is None or entry.drift:
            return None
        candidates = self._arms.get(key)
        if prefer is not None:  # measured enough to be the best so far, and usable
            arm: Arm | None = prefer
            stats = entry.arms.get(prefer.label)
            if stats is None or stats.samples < PREPARE_AFTER or stats.unavailable is not None:
                return None
        elif entry.phase != EXPLOITING or entry.chosen is None:
            return None
        else:
            arm = candidates.by_label.get(entry.chosen) if candidates is not None else None
        tool = self._tools.get(arm) if arm is not None else None
        if arm is None or tool is None or arm in self._preparing:
            return None  # (being set up in the background: the full path has a stand-in)
        # A lost update under threads only shifts which call is timed.
        if entry.untimed + 1 >= self.sample_every:
            if not leave_timed_call:  # (else the full path counts the call, and times it)
                entry.untimed = 0
            return None
        entry.untimed += 1
        with self._lock:
            self._started += 1  # a call began: no idle gap (see _watch_idle)
        return arm, tool

    def _nothing_available(self, key: str) -> ToolUnavailableError:
        entry = self.table.get(key)
        candidates = self._arms.get(key)
        if entry is None or candidates is None or not candidates.order:
            return ToolUnavailableError(f"no transfer tool is a candidate for {key}")
        reasons = "; ".join(
            f"{label}: {stats.unavailable}"
            for label, stats in entry.arms.items()
            if label in candidates.by_label and stats.unavailable is not None
        )
        return ToolUnavailableError(f"no transfer tool is available for {key} ({reasons})")

    # -- explaining -------------------------------------------------------------------------

    def explain(self, context: Context, *, force: Arm | None = None) -> Explanation:
        """What :meth:`choose` picks in ``context`` and why; changes nothing."""
        key = context.key()
        with self._lock:
            entry = self.table.get(key)
            candidates = self._arms.get(key)
            seed = entry.seed if entry is not None else nearest_winner(self.table, context, key)
            if candidates is None:
                candidates = order(self._candidates(context), seed)
            known = entry if entry is not None else ContextEntry(attributes(context))
            return explanation(
                key,
                known,
                candidates,
                seed,
                self.exploration,
                force,
                self._within_calls_state(key, known, candidates),
            )

    def _within_calls_state(
        self, key: str, entry: ContextEntry, candidates: Candidates
    ) -> str | None:
        """How the next exploring call of ``key`` is shared, in words (None: it is not);
        hold the table's lock. Changes nothing (:meth:`split` starts setting rivals up)."""
        if not self.within_calls:
            return None
        pair = self.exploration.rival(entry, candidates)
        if pair is None:
            return None
        incumbent, rival = pair
        with self._tools_lock:
            ready, preparing = rival in self._ready, rival in self._preparing
        if ready or not self.skip_first_call:
            return f"measured on a share of each call, {incumbent.label} moving the rest"
        if preparing:
            return "being set up in the background; the calls go to the best arm so far"
        return (
            f"set up once the context's calls have taken {self.setup_after:g} s; "
            "until then the calls go to the best arm so far"
        )


_policies: weakref.WeakSet[Policy] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The threads setting rivals up are the parent's: in the child they never finish.
    for policy in list(_policies):
        policy._preparing = set()
        policy._set_up_done = {}
        policy._waited_out = set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_ahead_of(arm: Arm) -> None:
    """Ask for the files ``arm``'s tool's set-up will read (its failure is
    :meth:`Policy._set_up_beside`'s to swallow)."""
    from .. import tools

    tools.tool_class(arm.name).read_ahead()


@functools.cache
def _setup_seconds(arm: Arm) -> float:
    """The set-up cost that ``arm``'s tool declares (0 for an unknown tool); asked on every
    call, so remembered per arm."""
    from .. import tools

    try:
        return float(tools.tool_class(arm.name).setup_seconds)
    except Exception:  # noqa: BLE001 - an unknown or broken tool has nothing to stand in for
        return 0.0
