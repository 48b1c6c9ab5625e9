"""A pipeline of pinned host buffers between the file and GPU memory.

The range is cut into chunks of at most ``chunk_size`` (smaller when that spreads a request
over more workers, see :func:`~arrayio.tools._io.task_bytes`), dealt round-robin to
``threads`` workers. Each worker borrows pinned buffers of its task's chunk from the
process's pool (:mod:`~arrayio.tools._pinned`; concurrent calls never share one, and the
second is taken for the second chunk) and has one CUDA stream, and double-buffers: while
the copy of one chunk to the device is in flight, it reads the next chunk from the file
into its other buffer (``pread``, or ``O_DIRECT`` with ``direct=True``, which keeps cold
reads off the page cache and keeps the disk's queue full) and checksums it while it is in
cache. Writes run the same pipeline the other way: device to pinned buffer, checksum,
``pwrite`` (``O_DIRECT`` for the whole blocks with ``direct=True``; the partial blocks at
either end go through the page cache, since ``O_DIRECT`` cannot write part of a block).
With several workers, disk I/O, checksums and
PCIe copies of different chunks overlap. :meth:`StagedTool.pwritev` writes several device
buffers that follow each other in the file as one range, its chunks cut across their
boundaries: a batch of 16 MiB arrays reaches the disk in 64 MiB requests, as the raw write
ceiling's do.

Needs a GPU and its driver, no framework: the copies go through the CUDA driver
(:mod:`~arrayio.arrays._cuda`) on raw device addresses, so a torch or JAX process never
imports CuPy for them.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np

from ..arrays import _cuda
from ..arrays._buffers import DeviceBuffer, synchronize_device
from ..integrity._checksum import ChecksumParts
from ._io import (
    BLOCK,
    align_down,
    align_up,
    batched,
    open_direct,
    pread_checksummed,
    pread_direct,
    pread_full,
    pwrite_direct,
    pwrite_full,
    task_bytes,
)
from ._pinned import SLACK, Borrowed
from ._pinned import pool as pinned_pool
from ._threaded import ThreadedTool
from .base import Availability, Buffer, Capabilities, DeviceRanges, IOFuture, one_gpu

__all__ = ["StagedTool"]

logger = logging.getLogger(__name__)

_PREPARE_PAUSE = 0.02  # seconds between the pinned buffers prepare() allocates


class StagedTool(DeviceRanges, ThreadedTool):
    """Pinned-buffer pipeline for device memory; see the module docstring.

    Parameters
    ----------
    threads
        Workers, each with up to two pinned buffers of a chunk and one CUDA stream.
    chunk_size
        Bytes per chunk (rounded up to 4096).
    direct
        Read, and write whole blocks, with ``O_DIRECT``.
    """

    name = "staged"
    capabilities = Capabilities(frozenset({"cuda"}), alignment=BLOCK)

    def __init__(
        self, threads: int = 4, chunk_size: int = 16 << 20, direct: bool = False, **params: Any
    ) -> None:
        if threads < 1 or chunk_size < 1:
            raise ValueError(f"threads and chunk_size must be positive: {threads}, {chunk_size}")
        chunk_size = align_up(chunk_size)
        super().__init__(threads, chunk_size=chunk_size, direct=direct, **params)
        self.chunk_size, self.direct = chunk_size, direct
        self._events = threading.local()  # each worker thread's two events per device

    @classmethod
    @functools.cache
    def availability(cls) -> Availability:
        try:
            count = _cuda.device_count()
        except OSError:
            return Availability(False, "no libcuda.so.1: the pipeline needs the NVIDIA driver")
        except Exception as error:  # noqa: BLE001 - any CUDA failure means "not here"
            return Availability(False, f"CUDA is not usable: {error}")
        return Availability(True) if count > 0 else Availability(False, "no CUDA device")

    def _stream(self, device_index: int) -> tuple[_cuda.Stream, list[_cuda.Event]]:
        """This worker thread's stream on ``device_index`` (its context made current), and
        the thread's two events there (one per buffer: made once, not per chunk)."""
        stream = _cuda.thread_stream(device_index)
        events = getattr(self._events, "by_device", None)
        if events is None:
            events = self._events.by_device = {}
        pair = events.get(device_index)
        if pair is None:
            pair = events[device_index] = [_cuda.Event(), _cuda.Event()]
        return stream, pair

    def prepare(self) -> None:
        """Start the workers and pin a full pipeline's buffers into the shared pool (two of
        a chunk per worker): pinning is the costly part of a first call."""
        with self.set_up_step("threads"):
            super().prepare()
        with self.set_up_step("pinning"), contextlib.ExitStack() as loans:
            for _ in range(2 * self.threads):
                if sys.is_finalizing():  # a background thread must not pin during teardown
                    return
                loans.enter_context(pinned_pool.lend(self.chunk_size + SLACK))
                # Pinning holds the CUDA driver, and the user's transfers run meanwhile:
                # a buffer at a time, with pauses, rather than all at once.
                time.sleep(_PREPARE_PAUSE)

    def _fan_out(
        self,
        pool: concurrent.futures.ThreadPoolExecutor,
        worker: Any,
        count: int,
        own_fd: int | None,
    ) -> IOFuture[int]:
        """Run ``worker(k)`` for the first ``count`` workers; the future
        sums their byte counts and closes ``own_fd`` (an O_DIRECT descriptor) when done."""

        def finish(total: int) -> int:
            if own_fd is not None:
                os.close(own_fd)
            return total

        try:
            futures = [IOFuture(pool.submit(worker, k)) for k in range(count)]
        except BaseException:
            finish(0)
            raise
        return IOFuture.gather(futures, finish)

    def preadv(
        self,
        fd: int,
        requests: Sequence[tuple[int, Buffer]],
        *,
        checksums: Sequence[ChecksumParts | None] | None = None,
    ) -> IOFuture[int]:
        """:meth:`DeviceRanges.preadv`: the range's chunks are cut across the buffers'
        boundaries (one read fills several small buffers' pinned copies, and the bytes
        between requests are read and dropped), and each chunk's pieces are copied to their
        buffers."""
        one_gpu(self.name, requests)
        pieces = _Pieces.at(requests, checksums)
        if pieces.nbytes == 0:
            return IOFuture.completed(0)
        device_index = pieces.views[0].device_index
        file_offset = pieces.offset
        pool = self._executor()
        nbytes = pieces.nbytes
        read_fd = open_direct(fd, os.O_RDONLY) if self.direct else fd
        chunk = task_bytes(nbytes, self.threads, self.chunk_size)
        chunks = range(0, nbytes, chunk)
        checksummed = any(parts is not None for parts in pieces.checksums)

        def read_chunk(slot: np.ndarray, start: int) -> tuple[np.ndarray, int]:
            """The chunk at ``start`` of the range, read into ``slot``; and its length."""
            length = min(chunk, nbytes - start)
            position = file_offset + start
            if self.direct:
                aligned = align_down(position)
                skip = position - aligned
                span = align_up(skip + length)
                got = max(0, min(pread_direct(read_fd, slot[:span], aligned) - skip, length))
                data = slot[skip : skip + got]
                pieces.checksum(start, data)
                return data, length
            if not checksummed:
                return slot[: pread_full(read_fd, slot[:length], position)], length
            # Each piece checksummed as it is read, while in cache (no DRAM trip of its own);
            # the bytes between pieces are not read.
            got = 0
            for i, inside, at, size in pieces.overlapping(start, length):
                view = slot[at : at + size]
                parts = pieces.checksums[i]
                if parts is None:
                    done = pread_full(read_fd, view, position + at)
                else:
                    done, crc = pread_checksummed(read_fd, view, position + at)
                    parts.add(inside, done, crc)
                got = at + done
                if done < size:
                    break
            else:
                got = length  # every piece whole (and a gap at the end is not needed)
            return slot[:got], length

        workers = _workers(self.threads, len(chunks))

        def worker(k: int) -> int:
            total = 0
            # Pinned buffers of this transfer's chunk, the second taken for the second chunk.
            with Borrowed(chunk + SLACK) as slots:
                stream, events = self._stream(device_index)
                with _copies_done(stream):  # before the buffers go back, on failure too
                    for j, start in enumerate(chunks[k::workers]):
                        if j >= 2:
                            events[j % 2].synchronize()  # its previous copy has left it
                        data, length = read_chunk(slots[j % 2], start)
                        pieces.copy_to_device(start, data, stream)
                        events[j % 2].record(stream)
                        total += data.nbytes
                        if data.nbytes < length:
                            break  # end of file
            return total

        return self._fan_out(pool, worker, workers, read_fd if read_fd != fd else None)

    def pread_each_device(self, requests: Sequence[tuple[int, int, Buffer]]) -> IOFuture[list[int]]:
        """Start filling the device buffers of ``requests`` (``(fd, file_offset, buffer)``,
        of any files, on one GPU) one after another, as one task on the tool's threads: a
        Zarr array's chunk files, a transfer each, cost more in tasks and waits than in
        copies. The files are read into a pinned buffer, packed one after another, and
        copied to their device buffers while the next are read into the other buffer (two
        in turn); the future gives each buffer's count (short only where its file ends)."""
        one_gpu(self.name, [(offset, buffer) for _, offset, buffer in requests])
        views = [cast(DeviceBuffer, buffer) for _, _, buffer in requests]
        if not views:
            return IOFuture.completed([])
        device_index = views[0].device_index

        def room(nbytes: int) -> int:
            # the file's blocks, one block to start inside of (O_DIRECT reads whole blocks
            # from a block boundary), one to align the region's start
            return align_up(nbytes) + 2 * BLOCK

        slot_bytes = max(self.chunk_size, max(room(view.nbytes) for view in views))

        def read_one(
            fd: int, offset: int, nbytes: int, region: np.ndarray, direct_fds: dict[int, int]
        ) -> np.ndarray:
            """One request's bytes, read into ``region`` of a pinned buffer (through an
            ``O_DIRECT`` descriptor of ``fd``'s file, opened once a bundle, where direct)."""
            pad = -region.ctypes.data % BLOCK
            if not self.direct:
                data = region[pad : pad + nbytes]
                return data[: pread_full(fd, data, offset)]
            aligned = align_down(offset)
            skip = offset - aligned
            blocks = region[pad : pad + align_up(skip + nbytes)]
            direct_fd = direct_fds.get(fd)
            if direct_fd is None:
                direct_fd = direct_fds[fd] = open_direct(fd, os.O_RDONLY)
            got = max(0, min(pread_direct(direct_fd, blocks, aligned) - skip, nbytes))
            return blocks[skip : skip + got]

        def task() -> list[int]:
            counts: list[int] = []
            direct_fds: dict[int, int] = {}
            with Borrowed(slot_bytes + SLACK) as slots:
                stream, events = self._stream(device_index)
                try:
                    with _copies_done(stream):  # before the buffers go back, on failure too
                        turn, used = 0, 0
                        for (fd, offset, _), view in zip(requests, views, strict=True):
                            size = room(view.nbytes)
                            if used + size > slot_bytes:  # this buffer is full: the other
                                events[turn % 2].record(stream)
                                turn, used = turn + 1, 0
                                if turn >= 2:
                                    events[turn % 2].synchronize()  # its copies have left it
                            region = slots[turn % 2][used : used + size]
                            data = read_one(fd, offset, view.nbytes, region, direct_fds)
                            if data.nbytes:
                                _cuda.copy_host_address_to_device(
                                    view.data_ptr, data.ctypes.data, data.nbytes, stream
                                )
                            counts.append(data.nbytes)
                            used += size
                finally:
                    for direct_fd in direct_fds.values():
                        os.close(direct_fd)
            return counts

        return IOFuture(self._executor().submit(task))

    def pwrite(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        return self.pwritev(fd, [buffer], file_offset, checksums=[checksum])  # checks it

    def pwritev(
        self,
        fd: int,
        buffers: Sequence[Buffer],
        file_offset: int,
        *,
        checksums: Sequence[ChecksumParts | None] | None = None,
    ) -> IOFuture[int]:
        """Start writing ``buffers`` (device memory, one GPU) back to back from
        ``file_offset``, as one range: its chunks are cut across the buffers' boundaries,
        several buffers copied into one pinned buffer, so that many small arrays go to the
        disk in requests of ``chunk_size``, as one large array does. ``checksums[i]``, when
        given, receives buffer ``i``'s bytes. The future gives the byte count."""
        devices = [buffer for buffer in buffers if not isinstance(buffer, np.ndarray)]
        if len(devices) < len(buffers):
            raise TypeError("staged moves device memory; use another tool for host memory")
        if len({buffer.device_index for buffer in devices}) > 1:
            raise ValueError("pwritev takes buffers of one GPU")
        pieces = _Pieces(devices, checksums)
        if pieces.nbytes == 0:
            return IOFuture.completed(0)
        device_index = devices[0].device_index
        synchronize_device(devices[0])  # the producer's kernels must be done
        pool = self._executor()
        nbytes = pieces.nbytes
        write_fd = open_direct(fd, os.O_WRONLY) if self.direct else fd
        chunk = task_bytes(nbytes, self.threads, self.chunk_size)
        chunks = range(0, nbytes, chunk)

        def write_chunk(slot: np.ndarray, start: int, length: int) -> int:
            position = file_offset + start
            skip = position % BLOCK if self.direct else 0
            data = slot[skip : skip + length]
            pieces.checksum(start, data)
            if not self.direct:
                return pwrite_full(fd, data, position)
            # Whole blocks with O_DIRECT (memory and file offsets are both block-aligned
            # there), the partial blocks at the ends through the page cache.
            first = align_up(position)
            last = max(first, align_down(position + length))
            head, middle = first - position, last - first
            if middle:
                pwrite_full(fd, data[: min(head, length)], position)
                pwrite_direct(write_fd, fd, data[head : head + middle], first)
                pwrite_full(fd, data[head + middle :], last)
            else:
                pwrite_full(fd, data, position)
            return length

        workers = _workers(self.threads, len(chunks))

        def worker(k: int) -> int:
            total = 0
            pending: tuple[np.ndarray, int, int, _cuda.Event] | None = None
            with Borrowed(chunk + SLACK) as slots:
                stream, events = self._stream(device_index)
                # A failed write leaves the next chunk's copy into the other buffer in flight:
                # waited for before the buffers go back, as a read's copies are.
                with _copies_done(stream):
                    for j, start in enumerate(chunks[k::workers]):
                        length = min(chunk, nbytes - start)
                        slot = slots[j % 2]
                        skip = (file_offset + start) % BLOCK if self.direct else 0
                        pieces.copy_to_host(start, slot[skip : skip + length], stream)
                        event = events[j % 2].record(stream)
                        if pending is not None:  # write the previous chunk while this copies
                            previous, previous_start, previous_length, previous_event = pending
                            previous_event.synchronize()
                            total += write_chunk(previous, previous_start, previous_length)
                        pending = (slot, start, length, event)
                    if pending is not None:
                        pending[3].synchronize()
                        total += write_chunk(pending[0], pending[1], pending[2])
            return total

        return self._fan_out(pool, worker, workers, write_fd if write_fd != fd else None)


@contextlib.contextmanager
def _copies_done(stream: _cuda.Stream) -> Iterator[None]:
    """Wait for ``stream``'s copies when the block ends, however it ends: the pinned
    buffers they read from or write into go back to the pool after it, for other transfers
    to fill. A
    failed wait after a failure is logged, not raised over the first error."""
    try:
        yield
    except BaseException:
        try:
            stream.synchronize()
        except Exception:  # the block's own error is the one to raise
            logger.warning("waiting for a failed transfer's copies failed too", exc_info=True)
        raise
    stream.synchronize()


def _workers(threads: int, chunks: int) -> int:
    """How many of the pool's workers share a transfer's ``chunks``: all that have one,
    up to ``threads``; within a batch (whose other transfers keep the pool busy) each gets
    two chunks at least, so that its reads overlap its copies, and a task's costs are
    shared by more bytes."""
    if batched():
        return max(1, min(threads, chunks // 2))
    return max(1, min(threads, chunks))


class _Pieces:
    """Device buffers at positions of one range of bytes (end to end for a write, with gaps
    between them for a read): copies a span of the range to or from them, and checksums a
    span into each buffer's own CRC."""

    def __init__(
        self,
        buffers: Sequence[DeviceBuffer],
        checksums: Sequence[ChecksumParts | None] | None,
        starts: Sequence[int] | None = None,
    ) -> None:
        self.offset = 0  # the range's first byte in the file (set by at())
        self.starts: list[int] = []
        self.views: list[DeviceBuffer] = []
        self.checksums: list[ChecksumParts | None] = []
        position = 0
        for i, buffer in enumerate(buffers):
            if buffer.nbytes == 0:
                continue
            if starts is not None:
                if starts[i] < position:
                    raise ValueError("the requests must be in file order and not overlap")
                position = starts[i]
            self.starts.append(position)
            self.views.append(buffer)
            self.checksums.append(checksums[i] if checksums is not None else None)
            position += buffer.nbytes
        self.nbytes = position

    @classmethod
    def at(
        cls,
        requests: Sequence[tuple[int, Buffer]],
        checksums: Sequence[ChecksumParts | None] | None,
    ) -> _Pieces:
        """The pieces of ``(file_offset, buffer)`` requests, their range starting at the
        first nonempty one's offset."""
        offsets = [offset for offset, buffer in requests if buffer.nbytes]
        first = offsets[0] if offsets else 0
        pieces = cls(
            [cast(DeviceBuffer, buffer) for _, buffer in requests],
            checksums,
            [offset - first for offset, _ in requests],
        )
        pieces.offset = first
        return pieces

    def overlapping(self, start: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """(piece, first byte in the piece, first byte in the span, length) of each piece
        the span ``[start, start + length)`` covers."""
        end = start + length
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.starts) and self.starts[i] < end:
            first = max(start, self.starts[i])
            stop = min(end, self.starts[i] + self.views[i].nbytes)
            if stop > first:
                yield i, first - self.starts[i], first - start, stop - first
            i += 1

    def copy_to_host(self, start: int, out: np.ndarray, stream: _cuda.Stream) -> None:
        for i, inside, at, length in self.overlapping(start, out.nbytes):
            _cuda.copy_to_host(out[at : at + length], self.views[i].data_ptr + inside, stream)

    def copy_to_device(self, start: int, data: np.ndarray, stream: _cuda.Stream) -> None:
        """Queue the copies of ``data`` (the range's bytes from ``start``, in pinned memory)
        into the pieces it covers."""
        host = data.ctypes.data
        for i, inside, at, length in self.overlapping(start, data.nbytes):
            _cuda.copy_host_address_to_device(
                self.views[i].data_ptr + inside, host + at, length, stream
            )

    def checksum(self, start: int, data: np.ndarray) -> None:
        for i, inside, at, length in self.overlapping(start, data.nbytes):
            parts = self.checksums[i]
            if parts is not None:
                parts.add_data(inside, data[at : at + length])
