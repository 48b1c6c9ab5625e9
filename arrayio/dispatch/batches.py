"""Batches of transfers, and where checksums are computed.

A batch moves many ``(file_offset, buffer)`` requests with one tool, every transfer in flight
at once (up to :data:`BATCH_WINDOW`), and checksums the device buffers on the GPU while the
transfers move (a read's kernel starts as it lands), with one wait at the end. Small requests
that are neighbours in the file are laid out in one host buffer and move with one read or
write (:func:`runs`, :func:`span`); a tool that writes several device buffers as one range
(``pwritev``) gets a write batch's neighbours that way, and one that reads several as one
range (``preadv``) a read batch's. The dispatcher
(:mod:`arrayio.dispatch.dispatcher`) decides which tool a batch uses and learns from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from ..arrays._buffers import DeviceBuffer, aligned_empty, synchronize_device
from ..errors import ToolUnavailableError, TruncatedFileError
from ..integrity import _device_checksum
from ..integrity._checksum import ChecksumParts
from ..runtime import _stages
from ..tools import Buffer, IOFuture, Tool
from ..tools._io import flush_range, in_batch

__all__ = [
    "BATCH_WINDOW",
    "GATHER_BYTES",
    "GPU_CHECKSUM_MIN_BYTES",
    "RUN_BYTES",
    "RUN_GAP",
    "Request",
    "SCATTER_BYTES",
    "cannot_checksum",
    "checksum_on_gpu",
    "Division",
    "divide",
    "extent",
    "read_batch",
    "read_batch_of_files",
    "read_files",
    "read_one",
    "runs",
    "span",
    "submit_windowed",
    "truncated",
    "write_batch",
    "write_one",
]

T = TypeVar("T")

# A batch keeps at most this many of its transfers submitted at once: enough to keep every
# worker of any tool busy, few enough to bound what they hold (O_DIRECT and KvikIO open a
# descriptor per transfer).
BATCH_WINDOW = 64

Request = tuple[int, Buffer]
"""One transfer of a batch: the file offset and the buffer."""


# A GPU checksum costs a kernel launch and a wait (tens of microseconds) whatever the size; a
# tool checksumming on the host as the bytes pass pays tens of microseconds a megabyte. Below
# this size the tool does it, where it can.
GPU_CHECKSUM_MIN_BYTES = 4 << 20


def checksum_on_gpu(buffer: Buffer, tool: Tool, from_disk: bool = False) -> bool:
    """Whether the checksum of ``buffer`` moved by ``tool`` is computed on the GPU.

    A read ``from_disk`` (some of its bytes not in the page cache) is checksummed by a tool
    that can, on the host as the bytes pass: the disk bounds it, at a fraction of what one
    core checksums, so the host's work hides behind it, while the GPU's needs its kernel
    built or loaded and its launcher set up, which a fresh process's first cold load paid
    for (about a fifth of it, measured against the same load unverified:
    ``benchmarks/results/first_calls_checksums``)."""
    if isinstance(buffer, np.ndarray) or not _device_checksum.available():
        return False
    if not tool.capabilities.checksums:
        return True
    return buffer.nbytes >= GPU_CHECKSUM_MIN_BYTES and not from_disk


# Small reads are merged into one when the file holds them within this many bytes of each
# other, up to this many bytes a read: the bytes between them cost less than a disk seek.
# (Small writes are merged only where they touch, up to as many bytes.)
RUN_GAP = 64 << 10
RUN_BYTES = 4 << 20

# A tool that writes several device buffers as one range (``pwritev``) gets a batch's
# neighbours in runs of about this many bytes: long enough for whole chunks on every
# worker, short enough that progress (and a cancelled save) is seen every fraction of a
# second.
GATHER_BYTES = 1 << 30

# A tool that reads several device buffers as one range (``preadv``) gets a read batch's
# neighbours in runs of about this many bytes: several chunks for each of a pipeline's
# workers, and runs short enough that the GPU checksums of one start while later ones move.
SCATTER_BYTES = 64 << 20


def runs(
    requests: Sequence[Request], indices: Sequence[int], gap: int, limit: int = RUN_BYTES
) -> list[list[int]]:
    """Group ``indices`` into runs of requests that are neighbours in the file (at most
    ``gap`` bytes apart), of at most ``limit`` bytes (a larger request alone), in file
    order; requests that overlap start runs of their own."""
    runs: list[list[int]] = []
    start = end = 0
    for i in sorted(indices, key=lambda i: requests[i][0]):
        offset, buffer = requests[i]
        stop = offset + buffer.nbytes
        if runs and end <= offset <= end + gap and stop - start <= limit:
            runs[-1].append(i)
            end = stop
        else:
            runs.append([i])
            start, end = offset, stop
    return runs


def extent(requests: Sequence[Request]) -> tuple[int, int]:
    """The file range ``requests`` cover together: their first byte, and the end of the last."""
    return (
        min(offset for offset, _ in requests),
        max(offset + buffer.nbytes for offset, buffer in requests),
    )


def span(
    requests: Sequence[Request], run: list[int]
) -> tuple[int, np.ndarray, list[tuple[int, np.ndarray, Buffer]]]:
    """A host buffer covering a run's bytes in the file: its file offset, the buffer, and
    each request's piece of it."""
    start = requests[run[0]][0]
    end = max(requests[i][0] + requests[i][1].nbytes for i in run)
    span = aligned_empty(end - start)
    pieces = [
        (
            i,
            span[requests[i][0] - start : requests[i][0] - start + requests[i][1].nbytes],
            requests[i][1],
        )
        for i in run
    ]
    return start, span, pieces


def submit_windowed(
    starts: Sequence[Callable[[], IOFuture[T]]],
    report: Callable[[int], None],
    meanwhile: Callable[[], None] | None = None,
) -> list[T]:
    """Start each transfer, keeping at most :data:`BATCH_WINDOW` in flight; return their byte
    counts. ``meanwhile`` runs once the window is full (or every transfer started), while
    they move. After a failure nothing more starts, and every started transfer is waited
    for before the error is raised: a fallback tool must not race a failed one's
    stragglers."""
    counts: list[Any] = [0] * len(starts)
    pending: deque[tuple[int, IOFuture[T]]] = deque()
    error: BaseException | None = None

    def side_work() -> None:
        nonlocal meanwhile, error
        work, meanwhile = meanwhile, None
        if work is not None and error is None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - re-raised once all are done
                error = exc

    def settle() -> None:
        nonlocal error
        index, future = pending.popleft()
        try:
            counts[index] = future.get()
            report(index)  # may raise too (a cancelled save): stop the same way
        except BaseException as exc:  # noqa: BLE001 - re-raised once all are done
            error = error or exc

    for index, start in enumerate(starts):
        if len(pending) >= BATCH_WINDOW:
            side_work()
            settle()
        if error is not None:
            break
        try:
            # The batch keeps the tool's threads busy: no spreading. A transfer alone spreads
            # over them (and one task runs in the caller's thread).
            with in_batch() if len(starts) > 1 else contextlib.nullcontext():
                pending.append((index, start()))
        except BaseException as exc:  # noqa: BLE001 - re-raised once all are done
            error = exc
            break
    side_work()
    while pending:
        settle()
    if error is not None:
        raise error
    return counts


@dataclasses.dataclass(frozen=True, slots=True)
class Division:
    """A batch shared between two arms: its requests, one of them possibly cut in two on
    views of its buffer (``owners[k]``: the batch's request that piece ``k`` is part of),
    and the pieces each arm moves."""

    pieces: list[Request]
    owners: list[int]
    rival: list[int]
    incumbent: list[int]


# A rival's part is a whole number of MiB, one at least: a smaller part measures a tool's
# setup more than its rate.
_PART_ALIGNMENT = 1 << 20


def _split_at(buffer: Buffer, at: int) -> tuple[Buffer, Buffer] | None:
    """The buffer's bytes before and from ``at``, as views of the same memory; None for a
    buffer that cannot be viewed in parts."""
    if isinstance(buffer, np.ndarray):
        return buffer[:at], buffer[at:]
    part = getattr(buffer, "part", None)
    if part is None:
        return None
    return part(0, at), part(at, buffer.nbytes)


def divide(batch: Sequence[Request], share: float) -> Division | None:
    """About ``share`` of the batch's bytes for a rival (a whole number of MiB, at most the
    share), taken from its end: whole requests, then the tail of the next one; the rest for
    the incumbent. None where that is less than a MiB, or every byte."""
    total = sum(buffer.nbytes for _, buffer in batch)
    need = int(share * total) // _PART_ALIGNMENT * _PART_ALIGNMENT
    if need <= 0 or need >= total:
        return None
    pieces: list[Request] = list(batch)
    owners = list(range(len(batch)))
    rival: list[int] = []
    for i in range(len(batch) - 1, -1, -1):
        offset, buffer = batch[i]
        if buffer.nbytes <= need:
            rival.append(i)
            need -= buffer.nbytes
        else:
            tail = need // _PART_ALIGNMENT * _PART_ALIGNMENT
            halves = _split_at(buffer, buffer.nbytes - tail) if tail else None
            if halves is not None:
                pieces[i] = (offset, halves[0])
                pieces.insert(i + 1, (offset + halves[0].nbytes, halves[1]))
                owners.insert(i + 1, i)
                rival = [k + 1 for k in rival]  # they followed request i
                rival.append(i + 1)
            break
        if need < _PART_ALIGNMENT:
            break
    if not rival or len(rival) == len(pieces):
        return None
    rival.sort()
    taken = set(rival)
    return Division(pieces, owners, rival, [k for k in range(len(pieces)) if k not in taken])


def read_one(t: Tool, fd: int, request: Request, path: str, with_checksum: bool) -> int | None:
    """A small read alone, with no batch's lists, window or GPU kernels around it (their
    microseconds count for transfers this small): the tool checksums the bytes as they
    pass, which is where :func:`checksum_on_gpu` puts the checksum of any transfer below
    :data:`GPU_CHECKSUM_MIN_BYTES` by a tool that can."""
    offset, buffer = request
    if with_checksum and not t.capabilities.checksums:
        raise cannot_checksum(t)
    parts = ChecksumParts(buffer.nbytes) if with_checksum else None
    got = t.read(fd, buffer, offset, checksum=parts)
    if got != buffer.nbytes:
        raise truncated(path, offset, buffer.nbytes, got)
    return parts.value() if parts is not None else None


def write_one(t: Tool, fd: int, request: Request, with_checksum: bool) -> int | None:
    """A small write alone (see :func:`read_one`), left to the final ``fsync``: waiting for
    each would serialise thousands of small arrays on the disk."""
    offset, buffer = request
    parts = ChecksumParts(buffer.nbytes) if with_checksum and t.capabilities.checksums else None
    t.write(fd, buffer, offset, checksum=parts)
    return parts.value() if parts is not None else None


def cannot_checksum(t: Tool) -> ToolUnavailableError:
    """The failure of a tool asked to verify a read it cannot checksum (so that the
    dispatcher falls back to one that can)."""
    return ToolUnavailableError(
        f"{t.name} cannot checksum what it reads: load with verify=False to use it"
    )


def truncated(path: str, file_offset: int, nbytes: int, got: int) -> TruncatedFileError:
    """The data error of a read that found ``got`` of ``nbytes`` bytes before the end."""
    return TruncatedFileError(
        f"{path}: file ends at byte {file_offset + got}, {nbytes - got} bytes short of the "
        "array (truncated while reading?)"
    )


def read_batch(
    t: Tool,
    fd: int,
    batch: list[Request],
    path: str,
    with_checksum: bool,
    report: Callable[[int], None],
    meanwhile: Callable[[], None] | None = None,
    from_disk: bool = False,
) -> list[int | None]:
    """Fill each ``(file_offset, buffer)`` of ``batch`` from ``fd`` with tool ``t``, every
    transfer in flight at once; return their CRC-32Cs if asked (see
    :func:`read_batch_of_files`)."""
    count = len(batch)
    return read_batch_of_files(
        t, [fd] * count, batch, [path] * count, with_checksum, report, meanwhile, from_disk
    )


def read_batch_of_files(
    t: Tool,
    fds: Sequence[int],
    batch: list[Request],
    paths: Sequence[str],
    with_checksum: bool,
    report: Callable[[int], None],
    meanwhile: Callable[[], None] | None = None,
    from_disk: bool = False,
) -> list[int | None]:
    """Fill each ``(file_offset, buffer)`` of ``batch`` from its file (``fds[i]``, named
    ``paths[i]``) with tool ``t``, every transfer in flight at once (up to
    :data:`BATCH_WINDOW`), neighbours in a file as one range where the tool reads ranges;
    return their CRC-32Cs if asked, checksummed on the GPU as they land where
    :func:`checksum_on_gpu` says so. ``report(i)`` as request ``i`` completes;
    ``meanwhile()`` runs while the transfers move."""
    on_gpu = [with_checksum and checksum_on_gpu(buffer, t, from_disk) for _, buffer in batch]
    if with_checksum and not t.capabilities.checksums and not all(on_gpu):
        raise cannot_checksum(t)
    if with_checksum and from_disk and not any(on_gpu):
        # The reloads that follow, from the page cache, checksum on the GPU: its kernel is
        # built now, beside a read the disk bounds, rather than in their first call.
        devices = {buffer.device_index for _, buffer in batch if not isinstance(buffer, np.ndarray)}
        _device_checksum.build_ahead(sorted(devices))
    parts = [
        ChecksumParts(buffer.nbytes) if with_checksum and not gpu else None
        for (_, buffer), gpu in zip(batch, on_gpu, strict=True)
    ]
    gpu = [i for i, flag in enumerate(on_gpu) if flag]
    kernel_of = {i: k for k, i in enumerate(gpu)}
    with _device_checksum.DeviceChecksums(_on_device(batch, gpu), own_stream=True) as device_crcs:

        def landed(index: int) -> None:
            # Checksum the arrays on the GPU as they are read (in groups, see
            # DeviceChecksums), while the rest are moving: the kernels overlap the reads
            # instead of following the batch.
            if index in kernel_of:
                device_crcs.launch(kernel_of[index])
            report(index)

        scatter = getattr(t, "preadv", None)
        if not callable(scatter) or len(batch) < 2:
            counts = submit_windowed(
                [
                    functools.partial(t.pread, fds[i], buffer, offset, checksum=parts[i])
                    for i, (offset, buffer) in enumerate(batch)
                ],
                landed,
                meanwhile,
            )
        else:
            # Neighbours in a file as one range each (the bytes between them read and
            # dropped): a checkpoint's tensors move in whole chunks, as one large array does.
            by_file: dict[int, list[int]] = {}
            for i, fd in enumerate(fds):
                by_file.setdefault(fd, []).append(i)
            groups = [
                group
                for indices in by_file.values()
                for group in runs(batch, indices, RUN_GAP, SCATTER_BYTES)
            ]

            counts = _submit_runs(
                batch,
                groups,
                [
                    functools.partial(
                        scatter,
                        fds[group[0]],
                        [batch[i] for i in group],
                        checksums=[parts[i] for i in group],
                    )
                    for group in groups
                ],
                landed,
                meanwhile,
            )
        for i, ((offset, buffer), got) in enumerate(zip(batch, counts, strict=True)):
            if got != buffer.nbytes:
                raise truncated(paths[i], offset, buffer.nbytes, got)
        return _merged(parts, gpu, device_crcs)


def read_files(
    t: Tool,
    requests: Sequence[tuple[int, int, Buffer]],
    paths: Sequence[str],
    report: Callable[[int], None],
) -> None:
    """Fill each ``(fd, file_offset, buffer)`` of ``requests`` (of several files) with one
    tool, every transfer in flight at once (up to :data:`BATCH_WINDOW`): a Zarr array's
    chunk files read as one batch instead of one dispatcher call each.

    A request costs a task and a system call, which for chunks of a few hundred kilobytes
    took longer than the copy. So host buffers that follow one another in a file (a shard's
    inner chunks) are read as one request each run, where the tool reads runs into host
    memory (``preadv_host``), and the small requests left alone (a chunk file each) are
    read a bundle per task, where the tool reads bundles into the batch's kind of memory
    (``pread_each_host``, ``pread_each_device``; see :func:`_bundles`).

    Raises
    ------
    TruncatedFileError
        If a file ends before its buffer is full.
    """
    pieces = [(offset, buffer) for _, offset, buffer in requests]
    host = bool(requests) and isinstance(requests[0][2], np.ndarray)  # (one kind a batch)
    read_run: Callable[..., Any] | None = getattr(t, "preadv_host", None)
    if callable(read_run):
        groups = _host_runs([fd for fd, _, _ in requests], pieces)
    else:
        groups = [[i] for i in range(len(requests))]
    read_bundle: Callable[..., Any] | None = getattr(
        t, "pread_each_host" if host else "pread_each_device", None
    )
    bundles: list[list[int]] = []
    if callable(read_bundle):
        groups, bundles = _bundles(groups, pieces, int(getattr(t, "threads", 1)))

    def run(group: list[int]) -> IOFuture[int]:
        fd, offset, buffer = requests[group[0]]
        if len(group) == 1:
            return t.pread(fd, buffer, offset)
        assert read_run is not None  # (a run of several: the tool reads runs)
        return cast(IOFuture[int], read_run(fd, [pieces[i] for i in group]))

    def bundle(group: list[int]) -> IOFuture[list[int]]:
        assert read_bundle is not None  # (bundles: the tool reads them)
        return cast(IOFuture[list[int]], read_bundle([requests[i] for i in group]))

    counts = _submit_runs(
        pieces,
        groups + bundles,
        [functools.partial(run, g) for g in groups]
        + [functools.partial(bundle, g) for g in bundles],
        report,
    )
    for (_, offset, buffer), got, path in zip(requests, counts, paths, strict=True):
        if got != buffer.nbytes:
            raise truncated(path, offset, buffer.nbytes, got)


# Requests alone of at most this many bytes are read in bundles: larger ones keep their own
# transfer, which the tool may spread over its threads.
BUNDLE_BYTES = RUN_BYTES

# Bundles per thread of the tool: several, so that a thread whose files read slowly (from
# the disk) leaves the rest to the others.
BUNDLES_PER_THREAD = 4


def _bundles(
    groups: list[list[int]], pieces: Sequence[Request], threads: int
) -> tuple[list[list[int]], list[list[int]]]:
    """``groups`` less the requests alone of at most :data:`BUNDLE_BYTES`, and those gathered
    into bundles of several, of about equal bytes, at most :data:`BUNDLES_PER_THREAD` per
    thread of the tool, in the order of the requests (a bundle of one stays a group; no
    bundles where there are no more such requests than threads)."""
    small = [
        group[0]
        for group in groups
        if len(group) == 1 and 0 < pieces[group[0]][1].nbytes <= BUNDLE_BYTES
    ]
    if len(small) <= threads:
        return groups, []
    taken = set(small)
    kept = [group for group in groups if not (len(group) == 1 and group[0] in taken)]
    count = min(len(small), threads * BUNDLES_PER_THREAD)
    share = -(-sum(pieces[i][1].nbytes for i in small) // count)
    # A bundle closes once it holds its share: each closed one holds at least a share of
    # the bytes, so there are at most ``count``.
    bundles: list[list[int]] = [[]]
    held = 0
    for i in small:
        bundles[-1].append(i)
        held += pieces[i][1].nbytes
        if held >= share:
            bundles.append([])
            held = 0
    return kept + [b for b in bundles if len(b) == 1], [b for b in bundles if len(b) > 1]


def _submit_runs(
    requests: Sequence[Request],
    groups: list[list[int]],
    starts: Sequence[Callable[[], IOFuture[int] | IOFuture[list[int]]]],
    report: Callable[[int], None],
    meanwhile: Callable[[], None] | None = None,
) -> list[int]:
    """Run each group of ``requests`` as one transfer, ``starts[j]()`` for ``groups[j]``,
    whose future gives either each request's bytes (a bundle) or the bytes of the group's
    range read from its first request's offset (a run of one file, in file order; see
    :func:`submit_windowed`); ``report(i)`` for each request of a group once it is done.
    Returns each request's bytes read."""

    def landed(j: int) -> None:
        for i in groups[j]:
            report(i)

    totals = submit_windowed(cast(Sequence[Callable[[], IOFuture[Any]]], starts), landed, meanwhile)
    counts = [0] * len(requests)
    for group, total in zip(groups, totals, strict=True):
        if isinstance(total, list):
            for i, got in zip(group, total, strict=True):
                counts[i] = got
            continue
        first = requests[group[0]][0]
        for i in group:
            offset, buffer = requests[i]
            counts[i] = max(0, min(buffer.nbytes, total - (offset - first)))
    return counts


def _host_runs(fds: Sequence[int], pieces: Sequence[Request]) -> list[list[int]]:
    """The requests (``pieces[i]`` of file ``fds[i]``) grouped into runs of host buffers of
    one file, each starting where the one before ends, of at most :data:`RUN_BYTES` (device
    buffers, and requests with no neighbour, alone), each run in file order, the runs by
    their first request's index."""
    by_file: dict[int, list[int]] = {}
    alone: list[list[int]] = []
    for i, (fd, (_, buffer)) in enumerate(zip(fds, pieces, strict=True)):
        if isinstance(buffer, np.ndarray) and buffer.nbytes:
            by_file.setdefault(fd, []).append(i)
        else:
            alone.append([i])
    groups = alone + [
        run for indices in by_file.values() for run in runs(pieces, indices, 0, RUN_BYTES)
    ]
    return sorted(groups, key=lambda group: group[0])


def write_batch(
    t: Tool, fd: int, batch: list[Request], with_checksum: bool, report: Callable[[int], None]
) -> list[int | None]:
    on_gpu = [with_checksum and checksum_on_gpu(buffer, t) for _, buffer in batch]
    gpu = [i for i, flag in enumerate(on_gpu) if flag]
    parts = [
        ChecksumParts(buffer.nbytes)
        if with_checksum and not gpu_crc and t.capabilities.checksums
        else None
        for (_, buffer), gpu_crc in zip(batch, on_gpu, strict=True)
    ]
    with _device_checksum.DeviceChecksums(_on_device(batch, gpu), own_stream=True) as device_crcs:
        if gpu:
            synchronize_device(_on_device(batch, gpu[:1])[0])  # one device
            for k in range(len(gpu)):  # the kernels read the arrays while the tool writes
                device_crcs.launch(k)
        gather = getattr(t, "pwritev", None)
        if gather is None or len(batch) < 2:
            submit_windowed(
                [
                    functools.partial(t.pwrite, fd, buffer, offset, checksum=part)
                    for (offset, buffer), part in zip(batch, parts, strict=True)
                ],
                report,
            )
        else:
            # Neighbours in the file as one range each: a checkpoint's 16 MiB tensors reach
            # the disk in whole chunks, as one large array does.
            groups = runs(batch, range(len(batch)), 0, GATHER_BYTES)

            def report_group(j: int) -> None:
                for i in groups[j]:
                    report(i)

            submit_windowed(
                [
                    functools.partial(
                        gather,
                        fd,
                        [batch[i][1] for i in group],
                        batch[group[0]][0],
                        checksums=[parts[i] for i in group],
                    )
                    for group in groups
                ],
                report_group,
            )
        first, end = extent(batch)
        flush_range(fd, first, end - first)  # as for one transfer: durable, honestly timed
        return _merged(parts, gpu, device_crcs)


def _on_device(batch: list[Request], indices: list[int]) -> list[DeviceBuffer]:
    """The buffers at ``indices``, which :func:`checksum_on_gpu` chose: device memory."""
    return [cast(DeviceBuffer, batch[i][1]) for i in indices]


def _merged(
    parts: list[ChecksumParts | None], gpu: list[int], device_crcs: _device_checksum.DeviceChecksums
) -> list[int | None]:
    """Each request's CRC: from its host parts, or (at the indices ``gpu``) from the GPU."""
    crcs = [part.value() if part is not None else None for part in parts]
    on_gpu = _stages.stage("checksums on the GPU") if gpu else contextlib.nullcontext()
    with on_gpu:  # the kernels' build, last launch and wait
        computed = device_crcs.results()
    for i, crc in zip(gpu, computed, strict=True):
        crcs[i] = crc
    return crcs
