"""The device budget: the arrays an offloader holds, and which of them leave to make room.

The *held bytes* are those of every resident array plus those of every read in flight (its
destination is allocated when the read starts). :class:`Residents` counts them, keeps the
resident entries least recently used first, and decides what the offloader does next to fit
more bytes; it does no I/O and takes no lock (the offloader holds its own). The budget's
full definition is in ``docs/design/offload.md``.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable

from ..errors import ArrayioError
from ._entries import Entry

__all__ = ["OffloadBudgetError", "Residents", "Step"]


class OffloadBudgetError(ArrayioError, MemoryError):
    """The budget cannot be met: arrays put with ``hint="keep"`` fill it."""


class Step(enum.Enum):
    """What to do next to make room (see :meth:`Residents.next_step`)."""

    DROP = "drop"  # the entry's file is complete: stop holding its array
    EVICT = "evict"  # the entry is being written: drop its array once the write completes
    WRITE = "write"  # write the entry out, then drop its array


class Residents:
    """The resident entries against a budget of ``limit`` bytes.

    Parameters
    ----------
    limit
        ``device_budget_bytes``.
    writeback_bytes
        Dirty bytes beyond ``limit - writeback_bytes`` are written ahead of need.
    """

    def __init__(self, limit: int, writeback_bytes: int) -> None:
        self.limit = limit
        self.writeback_bytes = writeback_bytes
        self.lru: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.held = 0
        self.reading = 0  # reads in flight (held, but not droppable until done)
        self.peak = 0

    # ------------------------------------------------------------------ the books

    def fits(self, need: int) -> bool:
        """Whether ``need`` more bytes fit beside the held ones."""
        return self.held + need <= self.limit

    def read_size(self, entry: Entry) -> int:
        """The room a read of ``entry`` waits for: an array larger than the whole budget is
        read once nothing else is held."""
        return min(entry.nbytes, self.limit)

    def hold(self, entry: Entry) -> None:
        """Hold a newly put array, as the most recently used."""
        self.lru[entry.id] = entry
        self._add(entry.nbytes)

    def release(self, entry: Entry) -> None:
        """Stop holding a resident entry's array."""
        self.held -= entry.nbytes
        self.lru.pop(entry.id, None)

    def touch(self, entry: Entry) -> None:
        """Make a resident entry the most recently used."""
        self.lru.move_to_end(entry.id)

    def start_read(self, entry: Entry) -> None:
        """Hold the bytes of a read that starts now."""
        self.reading += 1
        self._add(entry.nbytes)

    def finish_read(self, entry: Entry, *, resident: bool) -> None:
        """A read is done: its array is resident now, or (failed, freed) its bytes go."""
        self.reading -= 1
        if resident:
            self.lru[entry.id] = entry
        else:
            self.held -= entry.nbytes

    def clear(self) -> None:
        self.lru.clear()
        self.held = 0

    def _add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    # ------------------------------------------------------------------ the policy

    def first(self, predicate: Callable[[Entry], bool]) -> Entry | None:
        """The least recently used resident entry that may be spilled and fits
        ``predicate``."""
        for entry in self.lru.values():
            if entry.hint != "keep" and entry.nbytes and not entry.waiters and predicate(entry):
                return entry
        return None

    def next_step(self, need: int) -> tuple[Step, Entry] | None:
        """What to do next so that ``need`` more bytes fit, once they do not; None: wait,
        as writes, reads or get() calls in flight will make room.

        Clean arrays go first (no write needed), prefetched ones not used yet last among
        them (they were asked for); then arrays being written are marked to leave when
        written; then dirty ones are written out, least recently used first.

        Raises
        ------
        OffloadBudgetError
            If nothing in flight can make room: arrays put with ``hint="keep"`` fill it.
        """
        victim = self.first(lambda e: e.clean and not e.prefetched) or self.first(lambda e: e.clean)
        if victim is not None:
            return Step.DROP, victim
        leaving = sum(e.nbytes for e in self.lru.values() if e.writing and e.evict)
        if self.held - leaving + need > self.limit:
            victim = self.first(lambda e: e.writing and not e.evict)
            if victim is not None:
                return Step.EVICT, victim
            victim = self.first(lambda e: not e.on_disk and not e.writing)
            if victim is not None:
                return Step.WRITE, victim
            # Writes, reads and get() calls in flight will all make room (or make arrays
            # droppable) when done; only with none of them is the budget full.
            busy = leaving or self.reading or any(e.waiters for e in self.lru.values())
            if not busy:
                kept = sum(e.nbytes for e in self.lru.values() if e.hint == "keep")
                raise OffloadBudgetError(
                    f"cannot fit {need} more bytes in a budget of {self.limit}: "
                    f"{self.held} bytes are held, {kept} of them put with hint='keep'"
                )
        return None

    def prefetch_victim(self) -> Entry | None:
        """A clean array to drop for a prefetch: never one prefetched and not used yet, or
        prefetches would chase each other out."""
        return self.first(lambda e: e.clean and not e.prefetched)

    def writeback(self) -> list[Entry]:
        """Dirty entries to write ahead of need, oldest first, so that the dirty bytes come
        down to ``limit - writeback_bytes``."""
        limit = self.limit - self.writeback_bytes
        dirty = sum(e.nbytes for e in self.lru.values() if not e.on_disk and not e.writing)
        chosen = []
        for entry in self.lru.values():
            if dirty <= limit:
                break
            if entry.hint != "keep" and entry.nbytes and not entry.on_disk and not entry.writing:
                chosen.append(entry)
                dirty -= entry.nbytes
        return chosen
