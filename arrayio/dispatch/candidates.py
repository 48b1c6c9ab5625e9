"""The arms the dispatcher tries in each context, best guess first: a table, read top down.

Each :class:`Row` names the contexts it covers (direction, memory, a band of size classes,
cache states, whether the transfer is a batch of smaller pieces) and the arms they get; the
first row that covers a context gives its list. Why each row holds what it holds is in
``docs/design/dispatcher.md``. The policy measures these arms on the real work and keeps the
fastest: the order only decides which are measured first.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from ..integrity import _device_checksum
from .arm import Arm
from .context import Context

__all__ = ["CANDIDATES", "Row", "Sizes", "candidate_arms", "usable_cores"]

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    """Size classes ``first`` to ``last`` (None: no limit). Class ``c`` holds transfers of
    more than ``2**(c - 1)`` and at most ``2**c`` bytes."""

    first: int = 0
    last: int | None = None

    def __contains__(self, size_class: object) -> bool:
        return (
            isinstance(size_class, int)
            and self.first <= size_class
            and (self.last is None or size_class <= self.last)
        )


UP_TO_1_MIB = Sizes(last=20)
OVER_1_MIB = Sizes(21)
OVER_1_MIB_TO_64_MIB = Sizes(21, 26)
OVER_1_MIB_TO_128_MIB = Sizes(21, 27)
OVER_64_MIB_TO_128_MIB = Sizes(27, 27)
OVER_128_MIB = Sizes(28)

ANY_CACHE = frozenset({"warm", "cold", "mixed", "-"})
ON_DISK = frozenset({"cold", "mixed"})  # some or all of the range must come from the disk
CACHED = frozenset({"warm"})
UNKNOWN = frozenset({"-"})  # the kernel could not tell


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """The arms, best guess first, of the contexts that match every field.

    ``pieces``: True for a batch whose typical piece is smaller than the whole
    (:func:`~arrayio.dispatch.context.piece_class`), False for anything else, None for both.
    ``keep``: True for reads whose bytes are to stay in the page cache
    (:attr:`~arrayio.dispatch.context.Context.keep`), False for the others, None for both.
    """

    direction: str
    memory: str
    sizes: Sizes
    arms: tuple[Arm, ...]
    cache: frozenset[str] = ANY_CACHE
    pieces: bool | None = None
    keep: bool | None = None

    def covers(self, context: Context) -> bool:
        return (
            context.direction == self.direction
            and context.memory == self.memory
            and context.size_class in self.sizes
            and context.cache in self.cache
            and (self.pieces is None or self.pieces == bool(context.pieces))
            and (self.keep is None or self.keep == context.keep)
        )


def _posix(threads: int, task_mib: int) -> Arm:
    return Arm.of("posix", threads=threads, task_size=task_mib * _MiB)


def _direct(threads: int, task_mib: int) -> Arm:
    return Arm.of("direct", threads=threads, task_size=task_mib * _MiB)


def _staged(threads: int, chunk_mib: int, *, direct: bool | None = None) -> Arm:
    # ``direct=False`` is part of the label where it is given, so it stays given there: a
    # learned table knows the arm by its label.
    if direct is None:
        return Arm.of("staged", threads=threads, chunk_size=chunk_mib * _MiB)
    return Arm.of("staged", threads=threads, chunk_size=chunk_mib * _MiB, direct=direct)


NAIVE = Arm.of("naive")
KVIKIO = Arm.of("kvikio", threads=16, task_size=4 * _MiB)
# Cold reads through the page cache: the disk reaches its rate with larger requests (buffered
# reads of 4 MiB ran at three quarters of 16 MiB ones on the GPU machine measured).
KVIKIO_LARGE = Arm.of("kvikio", threads=16, task_size=16 * _MiB)

# Tools that move the bytes without them passing through host memory, so that they cannot
# checksum them there (their capabilities say ``checksums=False``).
BLIND_TO_HOST = frozenset({"kvikio"})

# mmap is in no row: made safe against a file that shrinks under it (the kernel copies out of
# the map), it is no faster than threaded pread (docs/design/tools.md), and every candidate
# costs exploration. It serves the reads that name it.
CANDIDATES: tuple[Row, ...] = (
    # ---- host memory ----------------------------------------------------------------------
    Row("read", "host", UP_TO_1_MIB, cache=ON_DISK, arms=(NAIVE, _posix(1, 4), _direct(1, 4))),
    Row("read", "host", UP_TO_1_MIB, arms=(NAIVE, _posix(1, 4))),
    # Cold bytes to stay in the page cache: buffered, in requests large enough for the disk.
    Row("read", "host", OVER_1_MIB, keep=True, arms=(_posix(16, 16), _posix(16, 4), NAIVE, KVIKIO)),
    Row(
        "read",
        "host",
        OVER_1_MIB,
        cache=ON_DISK,
        arms=(_direct(4, 8), _direct(16, 8), _posix(16, 4), _posix(4, 8), NAIVE, KVIKIO),
    ),
    Row(
        "read", "host", OVER_1_MIB, cache=CACHED, arms=(_posix(16, 4), _posix(4, 8), NAIVE, KVIKIO)
    ),
    Row(
        "read",
        "host",
        OVER_1_MIB,
        cache=UNKNOWN,
        arms=(_posix(16, 4), _posix(4, 8), _direct(4, 8), _direct(16, 8), NAIVE, KVIKIO),
    ),
    Row("write", "host", UP_TO_1_MIB, arms=(NAIVE, _posix(1, 4), _direct(1, 4))),
    Row(
        "write",
        "host",
        OVER_1_MIB_TO_128_MIB,
        arms=(_posix(4, 8), _posix(16, 4), _direct(4, 8), NAIVE, KVIKIO),
    ),
    Row(
        "write",
        "host",
        OVER_128_MIB,
        arms=(_posix(4, 8), _posix(16, 4), _direct(4, 8), _direct(4, 64), NAIVE, KVIKIO),
    ),
    # ---- device memory --------------------------------------------------------------------
    Row(
        "read",
        "cuda",
        UP_TO_1_MIB,
        cache=ON_DISK,
        arms=(NAIVE, _staged(1, 4, direct=True), _staged(8, 8, direct=True), KVIKIO),
    ),
    Row("read", "cuda", UP_TO_1_MIB, arms=(NAIVE, _staged(1, 4, direct=False), KVIKIO)),
    # Bytes read through the page cache, whether there already (warm) or to stay there
    # (keep): KvikIO's threads read into its own bounce buffers and copy from there, ahead of
    # the staged pipeline on the GPU machines measured. Until a process has imported KvikIO
    # the staged pipeline stands in (Policy._stand_in): with 8 workers of 4 MiB it pins
    # the least memory, and pinning is most of a first call's cost beyond the transfer.
    Row("read", "cuda", OVER_1_MIB, cache=CACHED, arms=(KVIKIO, _staged(8, 4), NAIVE)),
    Row("read", "cuda", OVER_1_MIB, keep=True, arms=(KVIKIO_LARGE, _staged(16, 16), NAIVE)),
    Row(
        "read",
        "cuda",
        OVER_1_MIB_TO_128_MIB,
        cache=ON_DISK,
        arms=(
            _staged(16, 8, direct=True),
            _staged(4, 16, direct=True),
            _staged(16, 8),
            NAIVE,
            KVIKIO,
        ),
    ),
    Row(
        "read",
        "cuda",
        OVER_128_MIB,
        cache=ON_DISK,
        arms=(
            _staged(16, 8, direct=True),
            _staged(4, 16, direct=True),
            _staged(16, 16, direct=True),
            _staged(16, 8),
            NAIVE,
            KVIKIO,
        ),
    ),
    Row(
        "read",
        "cuda",
        OVER_1_MIB_TO_128_MIB,
        cache=UNKNOWN,
        arms=(
            _staged(16, 8),
            _staged(16, 8, direct=True),
            _staged(4, 16, direct=True),
            NAIVE,
            KVIKIO,
        ),
    ),
    Row(
        "read",
        "cuda",
        OVER_128_MIB,
        cache=UNKNOWN,
        arms=(
            _staged(16, 8),
            _staged(16, 8, direct=True),
            _staged(4, 16, direct=True),
            _staged(16, 16, direct=True),
            NAIVE,
            KVIKIO,
        ),
    ),
    Row(
        "write",
        "cuda",
        UP_TO_1_MIB,
        arms=(NAIVE, _staged(1, 4, direct=True), _staged(8, 8, direct=True), KVIKIO),
    ),
    Row(
        "write",
        "cuda",
        OVER_1_MIB_TO_64_MIB,
        arms=(
            _staged(4, 16, direct=True),
            _staged(8, 8, direct=True),
            _staged(4, 16),
            NAIVE,
            KVIKIO,
        ),
    ),
    Row(
        "write",
        "cuda",
        OVER_64_MIB_TO_128_MIB,
        arms=(
            _staged(4, 16, direct=True),
            _staged(8, 32, direct=True),
            _staged(4, 16),
            NAIVE,
            KVIKIO,
        ),
    ),
    Row(
        "write",
        "cuda",
        OVER_128_MIB,
        pieces=True,
        arms=(
            _staged(4, 16, direct=True),
            _staged(8, 32, direct=True),
            _staged(8, 64, direct=True),
            _staged(16, 16, direct=True),
            _staged(4, 64, direct=True),
            _staged(4, 16),
            NAIVE,
            KVIKIO,
        ),
    ),
    Row(
        "write",
        "cuda",
        OVER_128_MIB,
        arms=(
            _staged(4, 16, direct=True),
            _staged(8, 32, direct=True),
            _staged(4, 64, direct=True),
            _staged(4, 16),
            NAIVE,
            KVIKIO,
        ),
    ),
)


def bypasses_the_cache(arm: Arm) -> bool:
    """Whether ``arm`` reads with ``O_DIRECT``, leaving nothing in the page cache."""
    return arm.name == "direct" or dict(arm.params).get("direct") is True


@functools.cache
def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def within_cores(arms: tuple[Arm, ...], cores: int) -> tuple[Arm, ...]:
    """``arms`` with the threads of threaded ``pread`` capped at ``cores`` (repeats dropped).

    A read from the page cache is a memory copy on the CPU: threads beyond the cores add
    nothing to its rate, but each costs its start in a process's first call and switches
    in every call. Reads from the disk keep their threads, which wait on the device.
    """
    capped: list[Arm] = []
    for arm in arms:
        params = dict(arm.params)
        threads = params.get("threads")
        if arm.name == "posix" and isinstance(threads, int) and threads > cores:
            arm = Arm.of("posix", **{**params, "threads": cores})
        if arm not in capped:
            capped.append(arm)
    return tuple(capped)


def candidate_arms(context: Context) -> list[Arm]:
    """The arms worth trying in ``context``, best guess first (before availability): those
    of the first row of :data:`CANDIDATES` that covers it, with threaded ``pread`` held to
    the usable cores where the bytes are in the page cache (:func:`within_cores`), without
    the ``O_DIRECT`` arms where the bytes are to stay in the page cache (``context.keep``),
    and without the tools that cannot checksum where the context needs a checksum that the
    GPU cannot compute for them."""
    arms: tuple[Arm, ...] = next((row.arms for row in CANDIDATES if row.covers(context)), ())
    if context.direction == "read" and context.memory == "host" and context.cache in CACHED:
        arms = within_cores(arms, usable_cores())
    if context.keep:
        arms = tuple(arm for arm in arms if not bypasses_the_cache(arm))
    if context.checksum and not (context.memory == "cuda" and _device_checksum.available()):
        return [arm for arm in arms if arm.name not in BLIND_TO_HOST]
    return list(arms)
