"""The learned dispatch table: what each arm achieved in each context, saved as JSON.

For every context key (``read/host/2^20/nvme0n1/cold/x1``) a :class:`ContextEntry` holds the
policy's phase and chosen arm there, and an :class:`ArmStats` per arm label: its recent
bandwidths (the estimate is their median), counts and unavailability. One re-entrant lock,
:attr:`Table.lock`, guards it all. :meth:`Table.save` replaces the file atomically;
:meth:`Table.load` returns an empty table, with a warning, for a missing, damaged, foreign
or newer file: a lost table only costs a new exploration. ``docs/design/dispatcher.md``
describes the format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..integrity._atomic import atomic_write

__all__ = [
    "EXPLOITING",
    "EXPLORING",
    "FORMAT",
    "VERSION",
    "WINDOW",
    "ArmStats",
    "ContextEntry",
    "Table",
]

logger = logging.getLogger("arrayio.dispatch")

FORMAT = "arrayio-dispatch-table"
VERSION = 1
WINDOW = 8
"""Samples per arm that the bandwidth estimate is the median of."""

EXPLORING = "exploring"
EXPLOITING = "exploiting"
_PHASES = (EXPLORING, EXPLOITING)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


@dataclasses.dataclass(slots=True)
class ArmStats:
    """What one arm achieved in one context.

    Attributes
    ----------
    recent
        Bandwidths (bytes/s) since the context was last (re-)explored, newest last, at
        most :data:`WINDOW`.
    count
        Measurements ever made (not reset by re-exploration).
    best, last
        Highest and latest bandwidth ever measured (bytes/s; 0 before the first).
    failures
        Times the arm failed here.
    unavailable
        Why the arm may not be used here (``"OSError: [Errno 22] Invalid argument"``), or
        ``None``.
    failed_at, first_learned, learned
        Table-clock times of the last failure, of the first and of the latest measurement.
    """

    recent: list[float] = dataclasses.field(default_factory=list)
    count: int = 0
    best: float = 0.0
    last: float = 0.0
    failures: int = 0
    unavailable: str | None = None
    failed_at: float | None = None
    first_learned: float | None = None
    learned: float | None = None
    # Derived or transient, never persisted: the cached median of ``recent``, and the calls
    # too small to time alone, summed until they make one sample (see Policy).
    estimate: float | None = dataclasses.field(default=None, compare=False, repr=False)
    pending_bytes: int = dataclasses.field(default=0, compare=False, repr=False)
    pending_seconds: float = dataclasses.field(default=0.0, compare=False, repr=False)

    def __post_init__(self) -> None:
        del self.recent[:-WINDOW]
        self.estimate = _median(self.recent) if self.recent else None

    @property
    def samples(self) -> int:
        """Measurements since the last (re-)exploration (at most :data:`WINDOW`)."""
        return len(self.recent)

    def note(self, bandwidth: float, now: float) -> None:
        """Count a measurement without letting it into the estimate (a suspected drift)."""
        self.count += 1
        self.last = bandwidth
        self.best = max(self.best, bandwidth)
        if self.first_learned is None:
            self.first_learned = now
        self.learned = now

    def admit(self, bandwidth: float) -> None:
        """Let a bandwidth into the window the estimate is the median of."""
        self.recent.append(bandwidth)
        del self.recent[:-WINDOW]
        self.estimate = _median(self.recent)

    def add(self, bandwidth: float, now: float) -> None:
        """Record a measurement (bytes/s) taken at ``now``."""
        self.note(bandwidth, now)
        self.admit(bandwidth)

    def forget_recent(self) -> None:
        """Drop the estimate so that the arm is measured afresh (history is kept)."""
        self.recent.clear()
        self.estimate = None
        self.pending_bytes, self.pending_seconds = 0, 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "recent_bps": list(self.recent),
            "count": self.count,
            "best_bps": self.best,
            "last_bps": self.last,
            "failures": self.failures,
            "unavailable": self.unavailable,
            "failed_at": self.failed_at,
            "first_learned": self.first_learned,
            "learned": self.learned,
        }

    @classmethod
    def from_json(cls, data: Any) -> ArmStats:
        """Raises ValueError (or TypeError) for anything but what :meth:`to_json` writes."""
        _expect(data, dict, "arm")
        recent = _expect(data.get("recent_bps", []), list, "recent_bps")
        return cls(
            recent=[_rate(value, "recent_bps") for value in recent],
            count=_count(data.get("count", 0), "count"),
            best=_rate(data.get("best_bps", 0.0), "best_bps"),
            last=_rate(data.get("last_bps", 0.0), "last_bps"),
            failures=_count(data.get("failures", 0), "failures"),
            unavailable=_optional(data.get("unavailable"), str, "unavailable"),
            failed_at=_time(data.get("failed_at"), "failed_at"),
            first_learned=_time(data.get("first_learned"), "first_learned"),
            learned=_time(data.get("learned"), "learned"),
        )


@dataclasses.dataclass(slots=True)
class ContextEntry:
    """What the policy knows about one context.

    Attributes
    ----------
    attributes
        The context's fields (direction, memory, size_class, storage, cache, load...), so
        that a new context can be seeded from its nearest learned neighbour after a reload.
    phase
        ``"exploring"`` or ``"exploiting"``.
    chosen
        Label of the arm with the best estimate (provisional while exploring), or ``None``.
    seed
        Label of the neighbour's winner that was explored first, or ``None``.
    drift
        Consecutive measurements of the chosen arm below ``drift_ratio`` times its estimate.
    held
        Those measurements, kept out of the estimate until the drift resolves (they are then
        admitted) or is confirmed (everything is re-explored).
    reexplorations
        Times the context went back to exploring (drift, or the winner failed).
    created, updated
        Table-clock times.
    arms
        Label to :class:`ArmStats`.
    """

    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)
    phase: str = EXPLORING
    chosen: str | None = None
    seed: str | None = None
    drift: int = 0
    held: list[float] = dataclasses.field(default_factory=list)
    reexplorations: int = 0
    created: float = 0.0
    updated: float = 0.0
    arms: dict[str, ArmStats] = dataclasses.field(default_factory=dict)
    # Transient: table-clock time the policy last re-derived phase and choice.
    refreshed: float = dataclasses.field(default=-math.inf, compare=False, repr=False)
    # Transient: exploiting calls since the last timed one (see Policy's ``sample_every``).
    untimed: int = dataclasses.field(default=0, compare=False, repr=False)

    def arm(self, label: str) -> ArmStats:
        """The stats of ``label``, created empty on first use."""
        stats = self.arms.get(label)
        if stats is None:
            stats = self.arms[label] = ArmStats()
        return stats

    def to_json(self) -> dict[str, Any]:
        return {
            "attributes": dict(self.attributes),
            "phase": self.phase,
            "chosen": self.chosen,
            "seed": self.seed,
            "drift": self.drift,
            "held_bps": list(self.held),
            "reexplorations": self.reexplorations,
            "created": self.created,
            "updated": self.updated,
            "arms": {label: stats.to_json() for label, stats in self.arms.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> ContextEntry:
        _expect(data, dict, "context")
        phase = data.get("phase")
        if phase not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {phase!r}")
        attributes = _expect(data.get("attributes", {}), dict, "attributes")
        for name, value in attributes.items():
            if value is not None and not isinstance(value, (str, int, float, bool)):
                raise ValueError(f"attribute {name!r} must be a JSON scalar, got {value!r}")
        arms = _expect(data.get("arms", {}), dict, "arms")
        return cls(
            attributes=dict(attributes),
            phase=phase,
            chosen=_optional(data.get("chosen"), str, "chosen"),
            seed=_optional(data.get("seed"), str, "seed"),
            drift=_count(data.get("drift", 0), "drift"),
            held=[_rate(v, "held_bps") for v in _expect(data.get("held_bps", []), list, "held")],
            reexplorations=_count(data.get("reexplorations", 0), "reexplorations"),
            created=_time(data.get("created", 0.0), "created") or 0.0,
            updated=_time(data.get("updated", 0.0), "updated") or 0.0,
            arms={
                _expect(label, str, "arm label"): ArmStats.from_json(stats)
                for label, stats in arms.items()
            },
        )


class Table:
    """The learned table: context key to :class:`ContextEntry`; see the module docstring.

    Parameters
    ----------
    clock
        Wall clock for the "when learned" times (``time.time``-like).
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self._entries: dict[str, ContextEntry] = {}

    def __len__(self) -> int:
        with self.lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self.lock:
            return key in self._entries

    def __repr__(self) -> str:
        from ..runtime._units import format_count

        return f"<arrayio dispatch table, {format_count(len(self), 'context')}>"

    def get(self, key: str) -> ContextEntry | None:
        """The entry of ``key``, or ``None``; hold :attr:`lock` while using it."""
        return self._entries.get(key)

    def entry(self, key: str, attributes: dict[str, Any] | None = None) -> ContextEntry:
        """The entry of ``key``, created (with ``attributes``) if new; hold :attr:`lock`."""
        entry = self._entries.get(key)
        if entry is None:
            now = self.clock()
            entry = self._entries[key] = ContextEntry(
                attributes=dict(attributes or {}), created=now, updated=now
            )
        return entry

    def items(self) -> list[tuple[str, ContextEntry]]:
        """A list of (key, entry) pairs; hold :attr:`lock` while using the entries."""
        with self.lock:
            return list(self._entries.items())

    def forget(self, key: str | None = None) -> None:
        """Forget one context, or everything when ``key`` is ``None``."""
        with self.lock:
            if key is None:
                self._entries.clear()
            else:
                self._entries.pop(key, None)

    def to_json(self) -> dict[str, Any]:
        """The table as the JSON-compatible object that :meth:`save` writes."""
        with self.lock:
            return {
                "format": FORMAT,
                "version": VERSION,
                "contexts": {key: entry.to_json() for key, entry in self._entries.items()},
            }

    def dumps(self) -> str:
        """The text :meth:`save` writes."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, data: Any, *, clock: Callable[[], float] = time.time) -> Table:
        """A table from what :meth:`to_json` returned.

        Raises
        ------
        ValueError
            For a foreign object, a newer version (the message says so), or bad values.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f'not an arrayio dispatch table (no "format": {FORMAT!r})')
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"bad version {version!r}")
        if version > VERSION:
            raise _NewerVersion(
                f"written by a newer arrayio (version {version}, this one reads {VERSION})"
            )
        contexts = _expect(data.get("contexts"), dict, "contexts")
        table = cls(clock=clock)
        for key, entry in contexts.items():
            table._entries[_expect(key, str, "context key")] = ContextEntry.from_json(entry)
        return table

    def save(self, path: str | os.PathLike[str], *, durable: bool = True) -> None:
        """Write the table to ``path`` atomically, creating its directory if needed; with
        ``durable=False``, without waiting for the disk (no fsync, see
        :func:`arrayio.integrity._atomic.atomic_write`).

        Raises
        ------
        OSError
            When the file cannot be written (the old file, if any, is left intact).
        """
        data = self.dumps().encode()
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_write(path, durable=durable) as fd:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> Table:
        """The table saved at ``path``; an empty one if there is none or it cannot be used.

        A missing file is silent; a file that cannot be read, is not valid JSON, is not an
        arrayio dispatch table, holds bad values or comes from a newer version is ignored
        with a WARNING on the ``arrayio.dispatch`` logger.
        """
        path = os.fspath(path)
        try:
            with open(path, "rb") as file:
                text = file.read()
        except FileNotFoundError:
            return cls(clock=clock)
        except OSError as error:
            logger.warning("ignoring the dispatch table %s: cannot read it (%s)", path, error)
            return cls(clock=clock)
        try:
            return cls.from_json(json.loads(text, parse_constant=_refuse_constant), clock=clock)
        except _NewerVersion as error:
            logger.warning("ignoring the dispatch table %s: %s", path, error)
        except (ValueError, TypeError, KeyError, RecursionError) as error:
            # json.JSONDecodeError and UnicodeDecodeError are ValueErrors.
            logger.warning(
                "ignoring the dispatch table %s: damaged or foreign file (%s)", path, error
            )
        return cls(clock=clock)


class _NewerVersion(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a bandwidth")


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{what} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _optional(value: Any, kind: type, what: str) -> Any:
    return None if value is None else _expect(value, kind, what)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _rate(value: Any, what: str) -> float:
    rate = _number(value, what)
    if rate < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return rate


def _time(value: Any, what: str) -> float | None:
    return None if value is None else _number(value, what)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value
