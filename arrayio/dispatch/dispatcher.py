"""The dispatcher every arrayio transfer goes through.

For each transfer it works out the :class:`~arrayio.dispatch.context.Context`, asks the
:class:`~arrayio.dispatch.policy.Policy` for the arm (tool and parameters) to use, which is
exploration for the first calls in a context and the fastest measured arm after that, runs
it, and falls back to the next arm if the tool fails. What it learns is kept in one JSON file
per machine under ``ARRAYIO_CACHE_DIR``, saved at most every few seconds (replaced atomically,
without an fsync: no transfer waits on the disk for it) and durably at exit and by
:meth:`Dispatcher.save`.

The candidate arms per context come from the table in :mod:`~arrayio.dispatch.candidates`;
``docs/design/dispatcher.md`` explains the policy and the table.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import inspect
import logging
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from .. import config, tools
from ..arrays._buffers import (
    DeviceBuffer,
    aligned_empty,
    driver_copyable,
    scatter_from_host,
    synchronize_device,
)
from ..errors import ConfigError, UnknownToolError
from ..integrity._checksum import checksum, combine
from ..runtime import _memory
from ..tools import Buffer, Tool, buffer_kind
from ..tools._io import preallocate
from ..tools._pinned import pool as pinned_pool
from ..tools.naive import NaiveTool
from . import batches
from .batches import Request
from .candidates import ON_DISK, candidate_arms
from .context import Context, InFlight, cache_state, piece_class, size_class, storage_of
from .failures import is_tool_failure
from .policy import Arm, Policy, Split
from .rereads import ReReads
from .second_pass import SecondPass
from .table import Table

__all__ = [
    "Dispatcher",
    "candidate_arms",
    "current",
    "get",
    "machine_fingerprint",
    "parse_arm",
    "reset",
]

logger = logging.getLogger("arrayio.dispatch")

_SAVE_INTERVAL = 5.0  # seconds between saves of the learned table
R = TypeVar("R")
T = TypeVar("T")

# Below this size a transfer is one system call's latency whatever the tool: it goes
# straight to the naive tool, with no context probe, no timing and no learning, whose cost
# (several microseconds) would exceed any difference between tools.
SMALL_TRANSFER = 1 << 20
# A read's small requests are gathered in host memory up to this many bytes at a time.
SMALL_GATHER_BYTES = 64 << 20


class _Once:
    """Work a batch does while its transfers move, at most once however often a tool
    failure makes the policy redo the batch. What the work raises leaves as
    :class:`_Abandoned`: the policy must not take it for the batch tool's failure."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work: Callable[[], None] | None = work
        # Batches of several devices run at once: whichever calls second waits until the
        # work is done, so that no batch reports a transfer before it. Reentrant: work that
        # reached a batch of its own on its thread finds nothing left to do, not a deadlock.
        self._lock = threading.RLock()

    def __call__(self) -> None:
        with self._lock:
            work, self._work = self._work, None
            if work is not None:
                try:
                    work()
                except BaseException as error:
                    raise _Abandoned(error) from error


class _Abandoned(BaseException):
    """Carries what a batch's ``done`` callback raised (a cancelled save) out of the policy,
    which would take an ``Exception`` from inside a transfer for the tool's failure: mark
    the tool unavailable and redo the batch with another."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


_SMALL_CHOICE = (None, Arm.of("naive"))

Operation = Callable[[Tool], list[int | None]]


def _files_share(requests: Sequence[tuple[int, int, Buffer]], share: float) -> list[int]:
    """Whole requests holding at most about ``share`` of the bytes, for a rival to read
    while the context explores: the smallest first (the last of equal ones), at least one,
    never all (empty where there is one request, or no share). The smallest, so that one
    large request (a checkpoint's output head, last in its file) does not hand the rival
    most of a call: the rival's bytes stay within ``share`` or one average request's."""
    if share <= 0 or len(requests) < 2:
        return []
    total = sum(buffer.nbytes for _, _, buffer in requests)
    by_size = sorted(range(len(requests)), key=lambda i: (requests[i][2].nbytes, -i))
    picked: list[int] = []
    taken = 0
    for index in by_size[:-1]:
        if picked and taken + requests[index][2].nbytes > share * total:
            break
        picked.append(index)
        taken += requests[index][2].nbytes
    return sorted(picked)


def _once_each(done: Callable[[int], None] | None, indices: Sequence[int]) -> Callable[[int], None]:
    """``report(k)``: ``done(indices[k])``, once per request even when a failing tool's batch
    is redone by another; what ``done`` raises leaves as :class:`_Abandoned`."""
    reported: set[int] = set()

    def report(k: int) -> None:
        if done is not None and indices[k] not in reported:
            reported.add(indices[k])
            try:
                done(indices[k])
            except BaseException as error:
                raise _Abandoned(error) from error

    return report


def _ignore(index: int) -> None:
    """The progress callback of a transfer alone."""


def _move_at_once(move: Callable[[list[int]], None], groups: list[list[int]]) -> None:
    """``move`` each group at once with the others (the first on this thread, each other on
    a thread of its own), and raise once every group has ended, an interrupt included: no
    transfer may still be filling a caller's buffer when this returns or raises.

    The groups of a read are its devices' transfers (and the host's): one after the other,
    each device's transfers would end before the next device's begin, every tool's pipeline
    filling and draining once per device, and one process driving several GPUs would read
    slower than it does onto one. Of several errors, an interrupt is raised first, then a
    data error (a truncated file), then a tool's failure; the others are noted on it."""
    errors: list[BaseException] = []
    pool = concurrent.futures.ThreadPoolExecutor(len(groups) - 1, "arrayio-devices")
    try:
        futures = [
            pool.submit(contextvars.copy_context().run, move, indices) for indices in groups[1:]
        ]
        try:
            move(groups[0])
        except BaseException as own:  # noqa: BLE001 - raised once every group has ended
            errors.append(own)
        for future in futures:
            while True:  # an interrupt while waiting: note it, and wait on
                try:
                    error = future.exception()
                    break
                except BaseException as interrupt:  # noqa: BLE001 - raised after the wait
                    errors.append(interrupt)
            if error is not None:
                errors.append(error)
    finally:
        pool.shutdown(wait=True)
    if errors:
        raise _first_of(errors)


def _one_at_a_time(done: Callable[[int], None]) -> Callable[[int], None]:
    """``done`` behind a lock: a progress bar's count is not safe from several threads."""
    lock = threading.Lock()

    def report(index: int) -> None:
        with lock:
            done(index)

    return report


def _first_of(errors: list[BaseException]) -> BaseException:
    """The error a read of several groups raises: an interrupt before a data error before a
    tool's failure; the others noted on it (they would otherwise vanish)."""

    def rank(error: BaseException) -> int:
        if not isinstance(error, Exception):
            return 0
        return 2 if is_tool_failure(error) else 1

    first = min(errors, key=rank)
    if hasattr(first, "add_note"):  # Python 3.11+
        for other in errors:
            if other is not first:
                first.add_note(f"arrayio: another device's transfers failed too: {other!r}")
    return first


def _settled_on_failure(operation: Callable[[Tool], R], buffer: Buffer) -> Callable[[Tool], R]:
    """``operation``, which on a device buffer waits, when its tool fails, for all work on
    the buffer's GPU before the failure reaches the policy: the failed tool may have queued
    writes into the buffers on streams of its own, which would otherwise land after the
    next tool's bytes and overwrite them."""
    if isinstance(buffer, np.ndarray):
        return operation

    def run(tool: Tool) -> R:
        try:
            return operation(tool)
        except Exception as failure:
            if is_tool_failure(failure):  # another tool is next: its bytes must land last
                try:
                    synchronize_device(buffer)
                except Exception as error:  # noqa: BLE001 - the tool's failure is raised
                    logger.warning("arrayio could not wait for the GPU after a failure: %s", error)
            raise

    return run


def _contiguous_host(buffer: Buffer) -> bool:
    """Whether ``buffer`` is host memory a ``preadv`` can fill as it is."""
    return isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous


def _placement(buffer: Buffer) -> tuple[str, int]:
    """The memory kind of ``buffer`` and its device (-1 for the host): a batch is of one."""
    return buffer_kind(buffer), -1 if isinstance(buffer, np.ndarray) else buffer.device_index


# A batch of up to this many files asks each file's cache state; of more, this many of its
# requests, spread over it, are asked (see _cache_probes).
CACHE_PROBES = 64


def _spread(items: Sequence[T], count: int) -> Sequence[T]:
    """``items``, or ``count`` of them spread evenly over it (the first and last among them)
    where there are more."""
    if len(items) <= count:
        return items
    last = len(items) - 1
    return [items[k * last // (count - 1)] for k in range(count)]


def _cache_probes(requests: Sequence[tuple[int, int, Buffer]]) -> list[tuple[int, int, int]]:
    """The ``(fd, offset, nbytes)`` ranges whose cache state stands for a batch of several
    files' ``requests``: the span of each file's requests, one question a file, where the
    files are at most :data:`CACHE_PROBES` (a checkpoint's shards: asking each of their
    tensors cost a 4-file load more than the file it adds); else :data:`CACHE_PROBES`
    requests spread over the batch (a Zarr array's thousand chunk files took longer to ask
    than to read from the page cache)."""
    spans: dict[int, tuple[int, int]] = {}
    for fd, offset, buffer in requests:
        start, end = spans.get(fd, (offset, offset))
        spans[fd] = (min(start, offset), max(end, offset + buffer.nbytes))
    if len(spans) <= CACHE_PROBES:
        return [(fd, start, end - start) for fd, (start, end) in spans.items()]
    return [(fd, offset, buffer.nbytes) for fd, offset, buffer in _spread(requests, CACHE_PROBES)]


def _keep_read(cache: str, span: int, reread: bool) -> bool:
    """Whether a read's bytes are to stay in the page cache: read from the disk, and fitting
    in free memory twice (once, for a file or directory that is read again)."""
    return cache != "warm" and fits_in_the_page_cache(span, 1 if reread else 2)


def fits_in_the_page_cache(nbytes: int, copies: int = 2) -> bool:
    """Whether ``nbytes`` read now can stay in the page cache for the next read: the memory
    available holds them ``copies`` times over (twice: a load also needs room for its
    results; once for a file read again, whose next read is likely)."""
    available = _memory.available_host_bytes(max_age=1.0)
    return available is not None and copies * nbytes <= available


def _preallocate_span(fd: int, requests: Sequence[Request]) -> None:
    """Reserve the blocks of a batch of writes, from its first byte to its last, once before
    any of them starts (see :func:`~arrayio.tools._io.preallocate`): reserving each
    request's range as it comes would wait for the writes in flight every time."""
    written = [request for request in requests if request[1].nbytes]
    if written:
        first, end = batches.extent(written)
        if end - first >= SMALL_TRANSFER:
            preallocate(fd, first, end - first)


def _available(arm: Arm) -> bool:
    try:
        return bool(tools.tool_class(arm.name).availability())
    except (UnknownToolError, ImportError):
        return False


_VALUE = re.compile(r"^-?\d+$")


def parse_arm(spec: str | Arm | Tool) -> Arm:
    """An arm from ``"posix"``, ``"posix(threads=4,task_size=1048576)"``, an Arm or a Tool.

    A specification names a registered tool and, in parentheses, values for keyword
    arguments of its constructor: whole numbers for integer parameters, ``true`` or
    ``false`` for boolean ones; the tool's own checks (positive sizes...) apply.

    Raises
    ------
    UnknownToolError
        For a tool name nobody registered.
    ConfigError
        For a malformed specification (unbalanced parentheses, a parameter the tool does
        not take, a value of the wrong kind or one the tool refuses); a ``ValueError``.
    """
    if isinstance(spec, Arm):
        return spec
    if isinstance(spec, Tool):
        return Arm.from_tool(spec)
    try:
        return _parse_spec(spec)
    except ConfigError as error:
        if isinstance(spec, str) and spec.strip() == os.environ.get("ARRAYIO_TOOL", "").strip():
            raise ConfigError(f"ARRAYIO_TOOL: {error}") from None
        raise


_SPEC = re.compile(r"\s*([\w.-]+)\s*(?:\(([^()]*)\))?\s*")
_SPEC_FORM = "expected NAME or NAME(key=value,...), e.g. 'posix(threads=4)'"


@functools.lru_cache(maxsize=64)
def _parse_spec(spec: str) -> Arm:
    # Cached: a forced tool (ARRAYIO_TOOL) is looked up on every transfer.
    match = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ConfigError(f"cannot parse tool {spec!r}: {_SPEC_FORM}")
    name, inner = match.group(1), match.group(2)
    cls = tools.tool_class(name)  # unknown names fail here, with the list of known ones
    accepted = _tool_parameters(cls)
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (inner or "").split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"cannot parse {item!r} in tool {spec!r}: expected key=value")
        if key in params:
            raise ConfigError(f"tool {spec!r} gives {key!r} twice")
        if key not in accepted:
            known = ", ".join(accepted) or "none"
            raise ConfigError(
                f"tool {spec!r}: {name} has no parameter {key!r} (its parameters: {known})"
            )
        params[key] = _parameter_value(spec, key, value, accepted[key])
    arm = Arm.of(name, **params)
    if params:  # the tool's own checks of its values (positive sizes...)
        try:
            arm.make().close()
        except (TypeError, ValueError) as error:
            raise ConfigError(f"tool {spec!r}: {error}") from None
    return arm


def _tool_parameters(cls: type[Tool]) -> dict[str, type | None]:
    """The keyword arguments of a tool's constructors (its class and bases) and the type
    each takes (int or bool, from the default or annotation; None: any)."""
    found: dict[str, type | None] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for parameter in list(inspect.signature(init).parameters.values())[1:]:
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            default, annotation = parameter.default, parameter.annotation
            kind = (
                type(default)
                if isinstance(default, bool | int)
                else {"int": int, "bool": bool, int: int, bool: bool}.get(annotation)
            )
            found.setdefault(parameter.name, kind)
    return found


def _parameter_value(spec: str, key: str, text: str, kind: type | None) -> Any:
    lowered = text.lower()
    if kind is bool:
        if lowered not in ("true", "false", "1", "0"):
            raise ConfigError(f"tool {spec!r}: {key} must be true or false, got {text!r}")
        return lowered in ("true", "1")
    if kind is int:
        if not _VALUE.match(text):
            raise ConfigError(f"tool {spec!r}: {key} must be a whole number, got {text!r}")
        return int(text)
    return int(text) if _VALUE.match(text) else {"true": True, "false": False}.get(lowered, text)


def machine_fingerprint() -> str:
    """A short hash of what makes tool speeds differ between machines."""
    parts = [platform.node(), platform.machine(), platform.release(), str(os.cpu_count())]
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            parts += [line for line in cpuinfo if line.startswith("model name")][:1]
    except OSError:
        pass
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class Dispatcher:
    """Chooses, runs and learns; see the module docstring.

    Parameters
    ----------
    table_path
        The JSON file to load and save what is learned; None keeps it in memory.
    clock
        Monotonic seconds, for timing transfers (tests pass a fake one).
    """

    def __init__(
        self, table_path: str | None, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.table_path = table_path
        self.table = Table.load(table_path) if table_path else Table()
        self._clock = clock
        self.policy = Policy(self.candidates, self.table, clock=clock, sample_every=4)
        self.in_flight = InFlight()
        self.rereads = ReReads()
        # Kept cold reads read once more between transfers: see second_pass.
        self.second_pass = SecondPass(self.in_flight.busy)
        self._last_save = time.monotonic()
        self._save_lock = threading.Lock()
        self._naive = tools.make("naive")  # small transfers: no lookup on their path
        # The latest choice, for benchmarks and tune(); no context for small transfers.
        self.last: tuple[Context | None, Arm] | None = None
        # The latest batch's choice: tune() learns a save or a load by its batch, whatever
        # small transfers come before or after it.
        self.last_batch: tuple[Context, Arm] | None = None

    def candidates(self, context: Context) -> list[Arm]:
        """The available arms for ``context``, best guess first."""
        return [arm for arm in candidate_arms(context) if _available(arm)]

    def context(
        self,
        direction: str,
        fd: int,
        file_offset: int,
        nbytes: int,
        memory: str,
        checksum: bool,
        span: int | None = None,
        pieces: int = 0,
    ) -> Context:
        """Describe a transfer of ``nbytes`` whose bytes lie within ``span`` bytes (default
        ``nbytes``) from ``file_offset``."""
        span = nbytes if span is None else span
        cache = cache_state(fd, file_offset, span) if direction == "read" else "-"
        if direction == "read":
            keep = _keep_read(cache, span, bool(self.rereads.read(fd, ask=cache != "warm")))
        else:
            keep = self.rereads.wrote(fd) and fits_in_the_page_cache(span, 2)
        return Context(
            direction,
            memory,
            size_class(nbytes),
            storage_of(fd),
            cache,
            self.in_flight.bucket(),
            checksum,
            pieces,
            keep=keep,
        )

    def batch_context(
        self,
        direction: str,
        fd: int,
        ranges: Sequence[tuple[int, int]],
        memory: str,
        checksum: bool,
    ) -> Context:
        """Describe a batch of transfers, ``(file_offset, nbytes)`` each: the context of
        their total size, over the span of the file they cover, and of their typical piece
        (:func:`~arrayio.dispatch.context.piece_class`). A 1 GiB checkpoint of 16 and 32 MiB
        tensors is a context of its own, apart from one 1 GiB transfer: the arm that writes
        one large buffer fastest keeps too few requests at the disk for many smaller ones."""
        sizes = [size for _, size in ranges]
        first = min(offset for offset, _ in ranges)
        end = max(offset + size for offset, size in ranges)
        return self.context(
            direction,
            fd,
            first,
            sum(sizes),
            memory,
            checksum,
            span=end - first,
            pieces=piece_class(sizes),
        )

    def forced_arm(self, tool: str | Arm | Tool | None) -> Arm | None:
        """The arm ``tool`` (or, if None, ``ARRAYIO_TOOL``) forces, or None."""
        spec = tool if tool is not None else config.get().tool
        return None if spec is None else parse_arm(spec)

    def read(
        self,
        fd: int,
        buffer: Buffer,
        file_offset: int,
        *,
        path: str = "<file>",
        with_checksum: bool = False,
        tool: str | Arm | Tool | None = None,
    ) -> int | None:
        """Fill ``buffer`` from ``fd`` at ``file_offset``; return its CRC-32C if asked.

        Raises
        ------
        TruncatedFileError
            If the file ends before the buffer is full (a data error: no fallback).
        """
        if buffer.nbytes == 0:
            return 0 if with_checksum else None
        forced = self.forced_arm(tool)
        request = (file_offset, buffer)
        if forced is None and buffer.nbytes < SMALL_TRANSFER:
            self.last = _SMALL_CHOICE
            return batches.read_one(self._naive, fd, request, path, with_checksum)
        return self._batch("read", fd, [request], path, with_checksum, forced, _ignore)[0]

    def read_files(
        self,
        requests: Sequence[tuple[int, int, Buffer]],
        *,
        paths: Sequence[str] | None = None,
        tool: str | Arm | Tool | None = None,
    ) -> None:
        """Fill each ``(fd, file_offset, buffer)`` of ``requests``, from several files, as
        one batch: one tool, every transfer in flight at once, chosen for and learned as one
        transfer in the context of :meth:`files_context`. The chunk files of a Zarr array
        are small: a dispatcher call each costs about as much as its read from the page
        cache, and the calls' threads contend for the interpreter.

        Raises
        ------
        TruncatedFileError
            If a file ends before its buffer is full.
        ValueError
            For buffers of more than one memory kind or device.
        """
        requests = [r for r in requests if r[2].nbytes]
        if not requests:
            return
        names = list(paths) if paths is not None else ["<file>"] * len(requests)
        if len({_placement(buffer) for _, _, buffer in requests}) > 1:
            raise ValueError("read_files takes buffers of one memory kind and device")
        forced = self.forced_arm(tool)

        def operation(part: list[int]) -> Callable[[Tool], None]:
            chosen = [requests[i] for i in part]
            chosen_names = [names[i] for i in part]
            return _settled_on_failure(
                lambda t: batches.read_files(t, chosen, chosen_names, _ignore), chosen[0][2]
            )

        with self.in_flight:
            context = self.files_context(requests, buffer_kind(requests[0][2]))
            arm = self._run_files(context, requests, forced, operation)
        self.last = self.last_batch = (context, arm)
        self._maybe_save()

    def _run_files(
        self,
        context: Context,
        requests: Sequence[tuple[int, int, Buffer]],
        forced: Arm | None,
        operation: Callable[[list[int]], Callable[[Tool], None]],
    ) -> Arm:
        """Run ``operation(part)`` over the requests of several files (indices into
        ``requests``) as one call of the context's arm, or ``forced``; while the context
        explores, whole requests holding about the rival's share of the bytes (see
        :func:`_files_share`) with the rival, then the rest with the incumbent (all of them
        where the rival's tool fails). Accounts the call's seconds to the policy; returns the arm
        that ran the call (the incumbent's)."""
        split = self.policy.split(context) if forced is None else None
        start = self._clock()
        explored = 0.0
        everything = list(range(len(requests)))
        rival = _files_share(requests, split.share) if split is not None else []
        if split is None or not rival:
            prefer = split.incumbent if split is not None else None
            nbytes = sum(buffer.nbytes for _, _, buffer in requests)
            _, arm = self.policy.run(
                context,
                nbytes,
                operation(everything),
                force=forced,
                prefer=prefer,
                waiting=split is not None and not split.share,  # its rival's set-up
            )
        else:  # the rival reads a share of the requests, the incumbent the rest
            taken = set(rival)
            rest = [i for i in everything if i not in taken]
            rival_bytes = sum(requests[i][2].nbytes for i in rival)
            if not self._rival_ran(
                context,
                split,
                lambda: self.policy.run(context, rival_bytes, operation(rival), force=split.rival),
            ):
                rest = everything
            explored = self._clock() - start
            _, arm = self.policy.run(
                context,
                sum(requests[i][2].nbytes for i in rest),
                operation(rest),
                prefer=split.incumbent,
            )
        if forced is None:
            self.policy.account(context, self._clock() - start, explored)
        return arm

    def files_context(
        self, requests: Sequence[tuple[int, int, Buffer]], memory: str, checksum: bool = False
    ) -> Context:
        """The context of reading ``requests`` of several files as one batch: their total
        size and typical piece, the first file's storage, and their cache state together
        (warm or cold where every file asked is, else mixed; see :func:`_cache_probes`)."""
        sizes = [buffer.nbytes for _, _, buffer in requests]
        states = {cache_state(*probe) for probe in _cache_probes(requests)}
        cache = states.pop() if len(states) == 1 else "mixed"
        reread = False
        for fd in dict.fromkeys(fd for fd, _, _ in requests):  # each file's read remembered
            reread = bool(self.rereads.read(fd, ask=cache != "warm")) or reread  # once
        total = sum(sizes)
        return Context(
            "read",
            memory,
            size_class(total),
            storage_of(requests[0][0]),
            cache,
            self.in_flight.bucket(),
            checksum,
            piece_class(sizes),
            keep=_keep_read(cache, total, reread),
        )

    def read_many_files(
        self,
        requests: Sequence[tuple[int, int, Buffer]],
        *,
        paths: Sequence[str],
        with_checksum: bool = False,
        tool: str | Arm | Tool | None = None,
        done: Callable[[int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> list[int | None]:
        """Fill each ``(fd, file_offset, buffer)`` of ``requests``, from several files (a
        checkpoint's shards, ``paths[i]`` naming request ``i``'s), as one batch; return
        their CRC-32Cs if asked. As :meth:`read_many` does for one file: transfers below
        :data:`SMALL_TRANSFER` go through the naive tool, neighbours in a file with one
        read, while the batch moves; the others move as one batch with one tool, every
        file's transfers in flight at once, chosen for and learned in the context of
        :meth:`files_context`. Loading the files one after another fills and drains the
        tool's pipeline, and waits for the GPU's checksums, once a file. ``done(i)`` and
        ``meanwhile()`` as for :meth:`read_many`.

        Raises
        ------
        TruncatedFileError
            If a file ends before its buffer is full.
        ValueError
            For buffers of more than one memory kind or device.
        """
        if len(paths) != len(requests):
            raise ValueError("read_many_files takes one path per request")
        return self._many(
            "read",
            [fd for fd, _, _ in requests],
            [(offset, buffer) for _, offset, buffer in requests],
            paths,
            with_checksum,
            tool,
            done,
            meanwhile,
            several_files=True,
        )

    def _files_batch(
        self,
        requests: list[tuple[int, int, Buffer]],
        paths: list[str],
        with_checksum: bool,
        forced: Arm | None,
        report: Callable[[int], None],
        side: _Once | None,
    ) -> list[int | None]:
        """A batch of several files' requests: one context, one tool (a rival reading a
        share of the requests while the context explores), the side work (if any) run while
        the bytes move; ``report(k)`` as request ``k`` completes (see :func:`_once_each`)."""
        crcs: list[int | None] = [None] * len(requests)

        def operation(part: list[int]) -> Callable[[Tool], None]:
            chosen = [(requests[k][1], requests[k][2]) for k in part]

            def run(t: Tool) -> None:
                found = batches.read_batch_of_files(
                    t,
                    [requests[k][0] for k in part],
                    chosen,
                    [paths[k] for k in part],
                    with_checksum,
                    lambda j: report(part[j]),
                    side,
                    from_disk=context.cache in ON_DISK,  # (the context is made below)
                )
                for k, crc in zip(part, found, strict=True):
                    crcs[k] = crc

            return _settled_on_failure(run, chosen[0][1])

        with self.in_flight:
            context = self.files_context(requests, buffer_kind(requests[0][2]), with_checksum)
            arm = self._run_files(context, requests, forced, operation)
        if side is not None:
            side()  # (run already, unless no tool reached it)
        by_file: dict[int, list[tuple[int, int]]] = {}
        for fd, offset, buffer in requests:
            by_file.setdefault(fd, []).append((offset, buffer.nbytes))
        for fd, ranges in by_file.items():
            self._read_again(context, fd, ranges)
        self.last = self.last_batch = (context, arm)
        self._maybe_save()
        return crcs

    def write(
        self,
        fd: int,
        buffer: Buffer,
        file_offset: int,
        *,
        with_checksum: bool = False,
        tool: str | Arm | Tool | None = None,
    ) -> int | None:
        """Write all of ``buffer`` at ``file_offset``; return its CRC-32C if asked and the
        tool could compute one (a forced tool without checksums gives None)."""
        if buffer.nbytes == 0:
            return 0 if with_checksum else None
        forced = self.forced_arm(tool)
        request = (file_offset, buffer)
        if forced is None and buffer.nbytes < SMALL_TRANSFER:
            self.last = _SMALL_CHOICE
            return batches.write_one(self._naive, fd, request, with_checksum)
        _preallocate_span(fd, [request])  # before any tool runs: every arm meets one file
        return self._batch("write", fd, [request], "<file>", with_checksum, forced, _ignore)[0]

    # ------------------------------------------------------------------ batches

    def read_many(
        self,
        fd: int,
        requests: Sequence[Request],
        *,
        path: str = "<file>",
        with_checksum: bool = False,
        tool: str | Arm | Tool | None = None,
        done: Callable[[int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> list[int | None]:
        """Fill each ``(file_offset, buffer)`` of ``requests``; return their CRC-32Cs if asked.

        The transfers of one memory kind and device run as one: one tool, every transfer in
        flight at once (up to :data:`~arrayio.dispatch.batches.BATCH_WINDOW`), one wait for
        the GPU checksums. Moving the tensors of a checkpoint one after the other leaves most
        workers idle between them, and a warm load reaches a fraction of the page cache's
        rate that way. A batch is chosen for, timed and learned as one transfer, in the
        context of :meth:`batch_context` (its total size and typical piece), the one
        :func:`arrayio.tune` with ``arrays`` teaches and :func:`arrayio.explain` of a file
        describes. Transfers below :data:`SMALL_TRANSFER` go through the naive tool, as they
        would alone, neighbours in the file with one read (or, touching, one write); a read's
        small transfers move while its first batch's transfers do.
        The transfers of several devices (and the host) move at once, each device's on a
        thread of its own (see :func:`_move_at_once`).
        ``done(i)`` is called once request ``i`` has completed (for progress bars; from
        the devices' threads, one call at a time). ``meanwhile()`` is the caller's work
        that needs the buffers but not their bytes (wrapping them as a framework's
        arrays): it runs once, on this thread or one of the devices', while the batches'
        transfers move (before the first of them is reported done), or after them where
        nothing is batched; what it raises is raised once every transfer has ended.

        Raises
        ------
        TruncatedFileError
            If the file ends before a buffer is full.
        """
        return self._many(
            "read",
            [fd] * len(requests),
            requests,
            [path] * len(requests),
            with_checksum,
            tool,
            done,
            meanwhile,
        )

    def write_many(
        self,
        fd: int,
        requests: Sequence[Request],
        *,
        with_checksum: bool = False,
        tool: str | Arm | Tool | None = None,
        done: Callable[[int], None] | None = None,
    ) -> list[int | None]:
        """Write each ``(file_offset, buffer)`` of ``requests`` as one batch (see
        :meth:`read_many`); return their CRC-32Cs if asked (None for a forced tool that
        cannot compute them)."""
        return self._many(
            "write",
            [fd] * len(requests),
            requests,
            ["<file>"] * len(requests),
            with_checksum,
            tool,
            done,
        )

    def _many(
        self,
        direction: str,
        fds: Sequence[int],
        requests: Sequence[Request],
        paths: Sequence[str],
        with_checksum: bool,
        tool: str | Arm | Tool | None,
        done: Callable[[int], None] | None,
        meanwhile: Callable[[], None] | None = None,
        *,
        several_files: bool = False,
    ) -> list[int | None]:
        """The one path of :meth:`read_many`, :meth:`write_many` and :meth:`read_many_files`:
        ``(file_offset, buffer)`` requests, request ``i`` of file ``fds[i]`` named
        ``paths[i]`` (a write's requests are all of one file; one file's requests pass
        through without a tuple made per request, where thousands of small arrays would
        wake the garbage collector). Empty requests are done at once; those below
        :data:`SMALL_TRANSFER` move through the naive tool, neighbours in a file together;
        the others in one batch per memory kind and device, the devices' at once, in
        :meth:`_batch`'s context (one file's span), or with ``several_files`` (a
        checkpoint's shards, whichever files its large requests turn out to be in) in one
        batch in :meth:`_files_batch`'s context, requests of several memory kinds or devices
        refused."""
        forced = self.forced_arm(tool)
        if direction == "write" and requests:
            _preallocate_span(fds[0], requests)
        results: list[int | None] = [None] * len(requests)
        groups: dict[tuple[str, int], list[int]] = {}
        small: dict[int, list[int]] = {}  # fd: its small requests
        for i, (_, buffer) in enumerate(requests):
            fd = fds[i]
            if buffer.nbytes == 0:
                results[i] = 0 if with_checksum else None
                if done is not None:
                    done(i)
            elif forced is None and buffer.nbytes < SMALL_TRANSFER:
                small.setdefault(fd, []).append(i)
            else:
                groups.setdefault(_placement(buffer), []).append(i)
        if several_files and len(groups) > 1:
            raise ValueError("read_many_files takes buffers of one memory kind and device")
        # Neighbours in a file move with one read or write and a copy each; writes only
        # join what touches (they would overwrite the bytes between).
        gap = batches.RUN_GAP if direction == "read" else 0
        runs = {fd: batches.runs(requests, indices, gap) for fd, indices in small.items()}

        def move_small() -> None:
            for fd, fd_runs in runs.items():
                if direction == "read":
                    path = paths[fd_runs[0][0]]
                    self._read_runs(fd, requests, fd_runs, path, with_checksum, results, done)
                    continue
                for run in fd_runs:
                    if len(run) > 1:
                        self._write_run(fd, requests, run, with_checksum, results)
                    else:
                        offset, buffer = requests[run[0]]
                        results[run[0]] = self._one(
                            direction, fd, offset, buffer, paths[run[0]], with_checksum, tool
                        )
                    if done is not None:
                        for i in run:
                            done(i)

        # A read's small arrays move while its first batch's transfers do (see
        # batches.submit_windowed): a checkpoint's hundreds of biases and norms would
        # otherwise hold the main thread for milliseconds before the batch starts.
        def side_work() -> None:
            move_small()
            if meanwhile is not None:
                meanwhile()

        batched = direction == "read" and any(len(indices) > 1 for indices in groups.values())
        side = _Once(side_work) if batched and (runs or meanwhile is not None) else None
        if side is None:
            move_small()

        def move(indices: list[int]) -> None:
            if len(indices) == 1:  # alone, a batch is just a transfer
                i = indices[0]
                offset, buffer = requests[i]
                results[i] = self._one(
                    direction, fds[i], offset, buffer, paths[i], with_checksum, tool
                )
                if done is not None:
                    done(indices[0])
                return
            report = _once_each(done, indices)
            try:
                if several_files:  # a checkpoint's shards: one batch across the files
                    crcs = self._files_batch(
                        [(fds[i], *requests[i]) for i in indices],
                        [paths[i] for i in indices],
                        with_checksum,
                        forced,
                        report,
                        side,
                    )
                else:
                    batch = [requests[i] for i in indices]
                    fd, path = fds[indices[0]], paths[indices[0]]
                    crcs = self._batch(
                        direction, fd, batch, path, with_checksum, forced, report, side
                    )
            except _Abandoned as abandoned:
                raise abandoned.error from None
            for i, crc in zip(indices, crcs, strict=True):
                results[i] = crc

        if direction == "read" and len(groups) > 1:
            if done is not None:  # the devices' threads report one at a time
                done = _one_at_a_time(done)
            at_once = len(groups)

            def move_among(indices: list[int]) -> None:
                with self.in_flight.counted_as(at_once):
                    move(indices)

            _move_at_once(move_among, list(groups.values()))
        else:
            for indices in groups.values():
                move(indices)
        if meanwhile is not None and not batched:
            meanwhile()
        return results

    def _read_runs(
        self,
        fd: int,
        requests: Sequence[Request],
        runs: list[list[int]],
        path: str,
        with_checksum: bool,
        results: list[int | None],
        done: Callable[[int], None] | None,
    ) -> None:
        """Read small requests, each run of neighbours in the file with one read. A run of
        host requests is read straight into their buffers (:meth:`_read_in_place`); a run
        with device requests into host memory laid end to end (up to
        :data:`SMALL_GATHER_BYTES` at a time), then each piece is checksummed and copied, the
        device pieces with one host-to-device copy per device and a copy on the device each
        (:func:`~arrayio.arrays._buffers.scatter_from_host`).
        A cold 4 KiB read costs a whole disk latency, and a copy from pageable host memory
        waits for the GPU: a checkpoint has hundreds of biases and norms, not neighbours of
        each other when each layer's weights lie between them.

        Reads go through the naive tool, as small transfers alone do, never the policy:
        this may run inside a batch, whose transfers would make this read's context one of
        two in flight, a context nothing was learned for."""
        self.last = _SMALL_CHOICE
        group: list[tuple[list[int], int, int]] = []  # (run, file offset, bytes)
        gathered = 0
        for run in runs:
            if all(_contiguous_host(requests[i][1]) for i in run):
                self._read_in_place(fd, requests, run, path, with_checksum, results)
                if done is not None:
                    for i in run:
                        done(i)
                continue
            first, end = batches.extent([requests[i] for i in run])
            if group and gathered + end - first > SMALL_GATHER_BYTES:
                self._read_gathered(fd, requests, group, gathered, path, with_checksum, results)
                self._report(group, done)
                group, gathered = [], 0
            group.append((run, first, end - first))
            gathered += end - first
        if group:
            self._read_gathered(fd, requests, group, gathered, path, with_checksum, results)
            self._report(group, done)

    def _read_in_place(
        self,
        fd: int,
        requests: Sequence[Request],
        run: list[int],
        path: str,
        with_checksum: bool,
        results: list[int | None],
    ) -> None:
        """Read a run of host requests straight into their buffers (one ``preadv`` for the
        run, the bytes between them into scratch), then checksum each there: no staging
        buffer and no copy, which cost a load of thousands of small arrays more than its
        reads. A file that ends first is read request by request, to say which is short."""
        offsets = [requests[i][0] for i in run]
        views = [cast(np.ndarray, requests[i][1]) for i in run]  # (_contiguous_host)
        scratch = np.empty(batches.RUN_GAP, np.uint8)  # the bytes between them
        if len(run) > 1 and NaiveTool.read_scattered(fd, offsets, views, scratch):
            for i, view in zip(run, views, strict=True):
                results[i] = checksum(view) if with_checksum else None
            return
        for i in run:
            offset, buffer = requests[i]
            results[i] = self.read(fd, buffer, offset, path=path, with_checksum=with_checksum)

    @staticmethod
    def _report(
        group: list[tuple[list[int], int, int]], done: Callable[[int], None] | None
    ) -> None:
        if done is not None:
            for run, _, _ in group:
                for i in run:
                    done(i)

    def _read_gathered(
        self,
        fd: int,
        requests: Sequence[Request],
        group: list[tuple[list[int], int, int]],
        gathered: int,
        path: str,
        with_checksum: bool,
        results: list[int | None],
    ) -> None:
        # Device pieces are copied from pinned memory: without waiting, one copy each.
        pinned = any(driver_copyable(requests[i][1]) for run, _, _ in group for i in run)
        with pinned_pool.lend(gathered) if pinned else contextlib.nullcontext(None) as staging:
            host = staging[:gathered] if staging is not None else aligned_empty(gathered)
            self._fill_gathered(fd, requests, group, host, path, with_checksum, results, pinned)

    def _fill_gathered(
        self,
        fd: int,
        requests: Sequence[Request],
        group: list[tuple[list[int], int, int]],
        host: np.ndarray,
        path: str,
        with_checksum: bool,
        results: list[int | None],
        pinned: bool,
    ) -> None:
        on_device: list[tuple[int, DeviceBuffer]] = []
        at = 0
        for run, first, length in group:
            span = host[at : at + length]
            if self._naive.read(fd, span, first) != length:
                # Say which array is short: read them one by one.
                for i in run:
                    offset, buffer = requests[i]
                    results[i] = self.read(
                        fd, buffer, offset, path=path, with_checksum=with_checksum
                    )
                at += length
                continue
            for i in run:
                offset, buffer = requests[i]
                piece = span[offset - first : offset - first + buffer.nbytes]
                if isinstance(buffer, np.ndarray):
                    np.copyto(buffer, piece)
                else:
                    on_device.append((at + offset - first, buffer))
                results[i] = checksum(piece) if with_checksum else None
            at += length
        scatter_from_host(host, on_device, pinned=pinned)

    def _write_run(
        self,
        fd: int,
        requests: Sequence[Request],
        run: list[int],
        with_checksum: bool,
        results: list[int | None],
    ) -> None:
        """Gather small requests that follow each other in the file into host memory (and
        checksum each piece there), then write them with one write: thousands of small
        arrays cost thousands of system calls otherwise."""
        start, span, pieces = batches.span(requests, run)
        for i, piece, buffer in pieces:
            if isinstance(buffer, np.ndarray):
                np.copyto(piece, buffer)
            else:
                buffer.copy_to_host(0, piece)
            results[i] = checksum(piece) if with_checksum else None
        self.write(fd, span, start)

    def _one(
        self,
        direction: str,
        fd: int,
        offset: int,
        buffer: Buffer,
        path: str,
        with_checksum: bool,
        tool: str | Arm | Tool | None,
    ) -> int | None:
        if direction == "read":
            return self.read(fd, buffer, offset, path=path, with_checksum=with_checksum, tool=tool)
        return self.write(fd, buffer, offset, with_checksum=with_checksum, tool=tool)

    def _batch(
        self,
        direction: str,
        fd: int,
        batch: list[Request],
        path: str,
        with_checksum: bool,
        forced: Arm | None,
        report: Callable[[int], None],
        meanwhile: _Once | None = None,
    ) -> list[int | None]:
        """Move ``batch`` (one transfer alone is a batch of one) with the arm the policy
        chooses in its context, or ``forced``; while the context explores, with the best arm
        so far and a rival sharing it (:meth:`_explore`). Returns each request's CRC-32C,
        when asked."""
        ranges = [(offset, buffer.nbytes) for offset, buffer in batch]
        nbytes = sum(size for _, size in ranges)

        def operation(requests: list[Request], report: Callable[[int], None]) -> Operation:
            if direction == "read":
                return _settled_on_failure(
                    lambda t: batches.read_batch(
                        t,
                        fd,
                        requests,
                        path,
                        with_checksum,
                        report,
                        meanwhile,
                        from_disk=context.cache in ON_DISK,  # (the context is made below)
                    ),
                    requests[0][1],
                )
            return lambda t: batches.write_batch(t, fd, requests, with_checksum, report)

        with self.in_flight:
            context = self.batch_context(
                direction, fd, ranges, buffer_kind(batch[0][1]), with_checksum
            )
            split = self.policy.split(context) if forced is None else None
            alone = direction == "read" and len(batch) == 1 and meanwhile is None
            quick = None
            if alone and forced is None and not with_checksum:
                quick = self._read_untimed(context, split, fd, batch[0], path)
            result: list[int | None]
            if quick is not None:
                arm, result = quick, [None]
                report(0)
            else:
                start = self._clock()
                if split is None:
                    result, arm = self.policy.run(
                        context, nbytes, operation(batch, report), force=forced
                    )
                    explored = 0.0
                else:
                    result, arm, explored = self._explore(
                        context, split, batch, with_checksum, report, operation
                    )
                if forced is None:
                    self.policy.account(context, self._clock() - start, explored)
        if direction == "read":
            self._read_again(context, fd, ranges)
        self.last = (context, arm)
        if len(batch) > 1:
            self.last_batch = self.last
        self._maybe_save()
        return result

    def _read_untimed(
        self, context: Context, split: Split | None, fd: int, request: Request, path: str
    ) -> Arm | None:
        """Fill one request without checksum through the tool the policy runs untimed in
        ``context`` (:meth:`Policy.untimed_arm
        <arrayio.dispatch.policy.Policy.untimed_arm>`), and account the call: the tool's
        read, none of a batch's machinery, which costs about as much as a megabyte's copy
        from the page cache (a Zarr store asks for its chunks one at a time). Returns the
        arm; None, nothing read: the call takes the full path (a tool that failed is marked
        so first, and the full path falls back)."""
        chosen = self.policy.untimed_arm(context, split)
        if chosen is None:
            return None
        arm, tool = chosen
        start = self._clock()
        try:
            _settled_on_failure(
                lambda t: batches.read_one(t, fd, request, path, False), request[1]
            )(tool)
        except Exception as error:
            if not is_tool_failure(error):
                raise
            self.policy.fail(context, arm, error)
            return None
        self.policy.account(context, self._clock() - start)
        return arm

    def _read_again(self, context: Context, fd: int, ranges: list[tuple[int, int]]) -> None:
        """After a read of ``ranges`` of ``fd`` in ``context``: where the context keeps its
        bytes in the page cache, the second pass reads them once more (see second_pass)."""
        if context.keep and config.get().second_pass:
            self.second_pass.after_cold_read(fd, ranges)

    def _rival_ran(self, context: Context, split: Split, run: Callable[[], object]) -> bool:
        """Run a rival's part of an exploring call; False, its failure marked, where its
        tool failed (the incumbent then takes the whole call)."""
        try:
            run()
        except Exception as error:
            if not is_tool_failure(error):
                raise
            self.policy.fail(context, split.rival, error)
            return False
        return True

    def _explore(
        self,
        context: Context,
        split: Split,
        batch: list[Request],
        with_checksum: bool,
        report: Callable[[int], None],
        operation: Callable[[list[Request], Callable[[int], None]], Operation],
    ) -> tuple[list[int | None], Arm, float]:
        """Move a batch of an exploring context in two parts, one after the other, each
        timed and recorded for its arm: about ``split.share`` of the bytes with the rival
        (whole requests from the batch's end, then the tail of one cut on views of its
        buffer: a transfer alone is cut too), the rest with the incumbent (all of it, where
        the rival fails). Learning within calls bounds what exploring costs a call (see
        :meth:`Policy.split <arrayio.dispatch.policy.Policy.split>`). A batch that cannot be
        divided goes whole to one arm (:meth:`Policy.undivided
        <arrayio.dispatch.policy.Policy.undivided>`). Returns the CRCs, the arm of the
        incumbent's part (or of the whole call) and the seconds the rival ran."""
        division = batches.divide(batch, split.share)
        nbytes = sum(buffer.nbytes for _, buffer in batch)
        start = self._clock()
        if division is None:
            if split.share and self.policy.undivided(context, split, nbytes) == split.rival:
                try:
                    result, arm = self.policy.run(
                        context, nbytes, operation(batch, report), force=split.rival
                    )
                    return result, arm, self._clock() - start
                except Exception as error:
                    if not is_tool_failure(error):
                        raise
                    self.policy.fail(context, split.rival, error)
            result, arm = self.policy.run(
                context,
                nbytes,
                operation(batch, report),
                prefer=split.incumbent,
                waiting=not split.share,  # the rival waits for its set-up: a whole call
            )
            return result, arm, 0.0
        pieces, owners = division.pieces, division.owners
        crcs: list[int | None] = [None] * len(pieces)
        left = collections.Counter(owners)  # pieces of each request still to land

        def run(indices: list[int], **choice: Any) -> Arm:
            def landed(k: int) -> None:
                left[owners[indices[k]]] -= 1
                if not left[owners[indices[k]]]:
                    report(owners[indices[k]])

            got, arm = self.policy.run(
                context,
                sum(pieces[k][1].nbytes for k in indices),
                operation([pieces[k] for k in indices], landed),
                **choice,
            )
            for k, crc in zip(indices, got, strict=True):
                crcs[k] = crc
            return arm

        incumbent = division.incumbent
        if not self._rival_ran(context, split, lambda: run(division.rival, force=split.rival)):
            left = collections.Counter(owners)
            incumbent = list(range(len(pieces)))
        explored = self._clock() - start
        arm = run(incumbent, prefer=split.incumbent)
        results: list[int | None] = [None] * len(batch)
        for k, owner in enumerate(owners):
            if with_checksum and k and owners[k - 1] == owner:  # a cut request's tail
                head = results[owner]
                tail = crcs[k]
                results[owner] = (
                    combine(head, tail, pieces[k][1].nbytes)
                    if head is not None and tail is not None
                    else None
                )
            else:
                results[owner] = crcs[k]
        return results, arm, explored

    def _maybe_save(self, force: bool = False) -> None:
        if self.table_path is None:
            return
        now = time.monotonic()
        if not force and now - self._last_save < _SAVE_INTERVAL:
            return
        with self._save_lock:
            self._last_save = now
            try:
                # The saves between transfers skip the fsyncs: they run inside a user's
                # save or load, and a table lost in a crash only costs a new exploration.
                self.table.save(self.table_path, durable=force)
            except OSError as error:
                logger.warning(
                    "arrayio could not save its dispatch table to %s: %s", self.table_path, error
                )

    def save(self) -> None:
        """Save what was learned now."""
        self._maybe_save(force=True)

    def close(self) -> None:
        """Save, and release the tools' threads and buffers."""
        self.save()
        self.second_pass.close()
        self.policy.close()
        self._naive.close()


_lock = threading.Lock()
_dispatcher: Dispatcher | None = None


def _table_path() -> str | None:
    directory = config.get().cache_dir
    if directory is None:
        return None
    return os.path.join(directory, f"dispatch-{machine_fingerprint()}.json")


def current() -> Dispatcher | None:
    """The process-wide dispatcher if one was made, without making one."""
    with _lock:
        return _dispatcher


def get() -> Dispatcher:
    """The process-wide dispatcher, created on first use."""
    global _dispatcher
    with _lock:
        if _dispatcher is None:
            _dispatcher = Dispatcher(_table_path())
        return _dispatcher


@atexit.register
def _close_at_exit() -> None:
    # Whichever dispatcher is current at exit saves: not one that reset() replaced, whose
    # older table would overwrite what its successor learned.
    with _lock:
        current = _dispatcher
    if current is not None:
        current.close()


def reset(dispatcher: Dispatcher | None = None) -> None:
    """Replace the process-wide dispatcher (None: a new one on next use), closing the old
    one's tools (their threads and pinned buffers)."""
    global _dispatcher
    with _lock:
        previous, _dispatcher = _dispatcher, dispatcher
    if previous is not None:
        previous.close()
