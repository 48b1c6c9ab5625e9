"""The offloader: arrays kept on their device under a byte budget, the rest in spill files.

:class:`Offloader` holds the lock, the entries and the I/O threads, and acts on the budget's
decisions (:mod:`arrayio.offload._budget`), moving bytes through the spill files
(:mod:`arrayio.offload._spills`) off the caller's compute stream
(:mod:`arrayio.offload._streams`). ``docs/design/offload.md`` explains the design.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .. import config
from ..runtime._units import format_count
from ._budget import Residents, Step
from ._directory import SpillDirectory
from ._entries import Entry, Handle, describe
from ._explain import OffloadExplanation
from ._host import HostTier
from ._spills import SpillFiles
from ._streams import arrived, record_ready, record_stream

if TYPE_CHECKING:
    from ._step_plan import StepPlan

__all__ = ["OffloadStats", "Offloader"]

_HINTS = (None, "keep", "spill")
_TIERS = (None, "host", "disk")


logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadStats:
    """What an :class:`Offloader` holds, and what it moved.

    Attributes
    ----------
    budget_bytes
        ``device_budget_bytes``.
    resident_bytes
        Held bytes now: resident arrays plus reads in flight.
    peak_resident_bytes
        The most held bytes seen (while ``put`` makes room it may briefly exceed the
        budget: the new array is already allocated before older ones are written out).
    spilled_bytes
        Bytes of arrays whose only copy is on disk.
    disk_bytes
        Bytes in spill files now (spilled arrays, and clean copies of resident ones).
    host_bytes
        Bytes in the host tier now (likewise).
    bytes_written, bytes_read
        Totals spilled and read back (host tier and disk).
    writes, reads
        Number of spills and of reads back.
    arrays
        Live handles.
    """

    budget_bytes: int
    resident_bytes: int
    peak_resident_bytes: int
    spilled_bytes: int
    disk_bytes: int
    host_bytes: int
    bytes_written: int
    bytes_read: int
    writes: int
    reads: int
    arrays: int


class Offloader:
    """Keep arrays on their device under a byte budget; spill the rest to files.

    Parameters
    ----------
    directory
        Where spill files go (an NVMe file system, ideally); created if missing. The
        offloader works in a subdirectory of its own, removed on :meth:`close`; creating an
        offloader also removes those of offloaders that died.
    device_budget_bytes
        The most bytes of arrays the offloader keeps resident once :meth:`put` returns.
    writeback_bytes
        Start writing least recently used arrays in the background once the bytes that
        would need a write before they could be dropped exceed
        ``device_budget_bytes - writeback_bytes``, so that ``put`` finds clean arrays to
        drop instead of waiting for writes. Default 0: write only when room is needed.
        Every array written ahead that is freed before it had to leave is a wasted write:
        where the disk is slower than the compute, writing ahead costs more than it saves.
    host_budget_bytes
        Pinned host memory for spilled GPU arrays (default 0: none): a spill goes there
        while it has room, and to its file after that. Copies to and from it run at PCIe
        rates (tens of GB/s) where a disk runs at one or two. Host arrays skip it.
    write_workers, read_workers
        Threads for spills and for reads back.
    verify
        Checksum spilled bytes and check them when read back (default: the
        ``verify_checksums`` setting, on).
    tool
        Force a transfer tool (see :func:`arrayio.save`); default: the dispatcher chooses.

    Raises
    ------
    OSError
        If ``directory`` cannot be created or written.

    Notes
    -----
    The budget is about the *held bytes*: those of every array the offloader holds plus
    those of every read in flight. Once ``put`` returns they are at most
    ``device_budget_bytes``: it drops arrays whose file is complete, then writes others out,
    least recently used first, and waits for those writes. A read starts only when its
    bytes fit: ``prefetch`` queues what does not and never waits, ``get`` waits for room.
    Host arrays (NumPy, JAX or torch on the CPU) count like GPU arrays do: the budget is
    then one on host memory.

    ``put`` takes the array over: do not modify it afterwards (the spilled copy could hold
    either version). The offloader is thread-safe. ``docs/design/offload.md`` explains the
    budget, the I/O threads and what is done per framework on the GPU.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        device_budget_bytes: int,
        writeback_bytes: int | None = None,
        host_budget_bytes: int = 0,
        write_workers: int = 2,
        read_workers: int = 2,
        verify: bool | None = None,
        tool: Any = None,
    ) -> None:
        if device_budget_bytes < 0:
            raise ValueError(f"device_budget_bytes must be >= 0, got {device_budget_bytes}")
        self.host_tier = HostTier(host_budget_bytes)
        self.budget = int(device_budget_bytes)
        self.writeback_bytes = (
            0 if writeback_bytes is None else min(int(writeback_bytes), self.budget)
        )
        self._spills = SpillFiles(
            verify=config.get().verify_checksums if verify is None else verify,
            tool=tool,
            host=self.host_tier if host_budget_bytes else None,
        )
        self._directory = SpillDirectory(directory)
        self.directory = self._directory.path
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: dict[int, Entry] = {}
        self._residents = Residents(self.budget, self.writeback_bytes)
        self._prefetch_queue: collections.deque[Entry] = collections.deque()
        self._released: collections.deque[int] = collections.deque()
        self._next_id = 0
        self._written = self._read = self._writes = self._reads = 0
        self._write_error: BaseException | None = None
        self._closed = False
        self._close_done = threading.Event()
        self._step_plan: StepPlan | None = None  # the last one activations() ran
        self._writers = concurrent.futures.ThreadPoolExecutor(
            write_workers, thread_name_prefix="arrayio-offload-write"
        )
        self._readers = concurrent.futures.ThreadPoolExecutor(
            read_workers, thread_name_prefix="arrayio-offload-read"
        )
        self._finalizer = weakref.finalize(
            self,
            _finalize,
            self._writers,
            self._readers,
            self._directory,
            self._spills,
            os.getpid(),
        )

    # ------------------------------------------------------------------ public API

    def put(self, array: Any, *, hint: str | None = None, tier: str | None = None) -> Handle:
        """Hand an array to the offloader; spill older ones (or this one) if over budget.

        Parameters
        ----------
        array
            A NumPy, JAX, torch or CuPy array (or another DLPack producer) on the CPU or one
            GPU. The offloader keeps a reference; do not modify it afterwards.
        hint
            ``None`` (least recently used arrays are spilled first), ``"keep"`` (never
            spilled) or ``"spill"`` (written out at once, dropped when written).
        tier
            Where the array goes when spilled: ``None`` or ``"host"`` (the host tier while
            it has room, then its file), or ``"disk"`` (its file: a spill plan keeps the
            host tier for the arrays it chose).

        Returns
        -------
        Handle
            For :meth:`get`, :meth:`prefetch` and :meth:`free`.

        Raises
        ------
        OffloadBudgetError
            If arrays put with ``hint="keep"`` leave no room.
        OSError
            If a spill this call waited for failed, or an earlier background write failed
            (reported once, by the next call).
        """
        if hint not in _HINTS:
            raise ValueError(f"hint must be one of {_HINTS}, got {hint!r}")
        if tier not in _TIERS:
            raise ValueError(f"tier must be one of {_TIERS}, got {tier!r}")
        array, request, dtype, shape = describe(array)
        ready = record_ready(array, request.framework, request.placement.is_cuda)
        with self._locked():
            self._check_open()
            entry = Entry(
                self._next_id,
                dtype.itemsize * math.prod(shape),
                dtype,
                shape,
                request.framework,
                request,
                hint,
                self._directory.file(f"{self._next_id}.bin"),
                array=array,
                ready=ready,
                tier=tier,
                uncommitted=request.framework == "jax" and not getattr(array, "committed", True),
            )
            self._next_id += 1
            self._entries[entry.id] = entry
            self._residents.hold(entry)
            handle = Handle(self, entry)
            try:
                if hint == "spill" and entry.nbytes:
                    entry.evict = True
                    self._start_write(entry)
                self._make_room(0)
                self._writeback()
                self._pump_prefetch()  # a spill queued on the GPU made room at once
            except BaseException:
                self._free_entry(entry)
                raise
            return handle

    def prefetch(self, handles: Handle | Iterable[Handle]) -> None:
        """Start bringing spilled arrays back, in the order given; never waits.

        Reads start as soon as their bytes fit under the budget, dropping clean arrays if
        needed but never writing dirty ones out (in a backward pass, the resident arrays
        are the ones needed first; room comes as they are freed). The others are queued
        and start as room appears: when arrays are freed, dropped or written out.
        """
        if isinstance(handles, Handle):
            handles = [handles]
        with self._locked():
            self._check_open()
            for handle in handles:
                entry = self._entry(handle)
                if entry.array is not None:
                    self._residents.touch(entry)
                elif not entry.reading and entry not in self._prefetch_queue:
                    self._prefetch_queue.append(entry)
            self._pump_prefetch()

    def get(self, handle: Handle) -> Any:
        """Return the array: the same object while resident, else read back (waiting only
        for what :meth:`prefetch` has not finished).

        Returns
        -------
        The array, of its framework, dtype and shape, on its device (C-contiguous once it
        has been spilled; a torch tensor read back does not require grad).

        Raises
        ------
        ChecksumError, OSError
            If reading it back failed.
        """
        with self._locked():
            self._check_open()
            entry = self._entry(handle)
            entry.waiters += 1
            try:
                return self._get(entry)
            finally:
                entry.waiters -= 1
                self._cond.notify_all()  # it may be dropped now: a make-room may go on

    def _get(self, entry: Entry) -> Any:
        while True:
            if entry.freed:  # by another thread while this one waited
                raise ValueError(f"array #{entry.id} was freed while get() waited for it")
            if entry.array is not None:
                self._residents.touch(entry)
                entry.prefetched = False
                array = entry.array
                if entry.arrived is not None:  # its copy back, queued on a side stream:
                    arrived(array, entry.arrived)  # every get's stream waits (cheap once run)
                    record_stream(array, entry.framework)  # and its use is recorded
                if entry.from_read:
                    entry.from_read = False
                    record_stream(array, entry.framework)
                return array
            if entry.read_error is not None:
                error, entry.read_error = entry.read_error, None
                raise error
            if entry.reading:
                self._wait()
                continue
            if entry in self._prefetch_queue:
                self._prefetch_queue.remove(entry)
            self._make_room(self._residents.read_size(entry))
            if entry.array is None and not entry.reading:
                self._start_read(entry)

    def free(self, handle: Handle) -> None:
        """Drop the array and its file now (also done when the handle is garbage)."""
        with self._locked():
            if self._closed:
                return
            entry = self._entries.get(handle.id)
            if entry is not None and handle._offloader() is self:
                self._free_entry(entry)

    def stats(self) -> OffloadStats:
        """A snapshot of what is held and what was moved."""
        with self._locked():
            spilled = sum(e.nbytes for e in self._entries.values() if e.array is None and e.on_disk)
            disk = sum(e.nbytes for e in self._entries.values() if e.in_file)
            host = sum(e.nbytes for e in self._entries.values() if e.host is not None)
            return OffloadStats(
                self.budget,
                self._residents.held,
                self._residents.peak,
                spilled,
                disk,
                host,
                self._written,
                self._read,
                self._writes,
                self._reads,
                len(self._entries),
            )

    def explain(self) -> OffloadExplanation:
        """What the offloader holds and moved, and the spill plan that
        :func:`~arrayio.offload.activations` last ran through it: tensors and bytes per
        tier, the plain, predicted and measured step, and what bounds it. On the GPU, waits
        for the plan's last step to finish (to read its time)."""
        plan = self._step_plan
        return OffloadExplanation(
            self.stats(), self.host_tier.budget_bytes, None if plan is None else plan.explain()
        )

    def peek(self, handle: Handle) -> Any:
        """The handle's array if it is resident now, else None; reads nothing, and does
        not count as a use. A tensor being read back by a copy queued on the GPU may not
        be filled yet: compare it (its memory, shape, dtype), do not read it; :meth:`get`
        makes the caller's stream wait for the copy."""
        with self._locked():
            entry = self._entries.get(handle.id)
            return None if entry is None else entry.array

    def resident(self, handle: Handle) -> bool:
        """Whether the handle's array is resident now (held by the offloader)."""
        with self._locked():
            return self._entry(handle).array is not None

    def wait(self) -> None:
        """Wait until no write or read is in flight, copies queued on the GPU included
        (queued prefetches that do not fit yet are not waited for).

        Raises
        ------
        OSError
            If a background write failed since the last call.
        """
        with self._locked():
            while not self._closed and any(e.writing or e.reading for e in self._entries.values()):
                self._process_releases()
                self._cond.wait()
            self._raise_write_error()
        self._spills.synchronize()  # copies queued on the GPU

    def close(self) -> None:
        """Wait for I/O in flight, drop every array and remove the spill directory."""
        with self._locked():
            if self._closed:
                closing = self._close_done
            else:
                closing = None
                self._closed = True
                self._prefetch_queue.clear()
                self._cond.notify_all()  # calls waiting in other threads give up
        if closing is not None:  # closed, or being closed by another thread: wait for it
            if not threading.current_thread().name.startswith("arrayio-offload"):
                closing.wait()
            return
        try:
            # Queued I/O is pointless now; what is running finishes (a tool may be using
            # the arrays' memory).
            self._writers.shutdown(wait=True, cancel_futures=True)
            self._readers.shutdown(wait=True, cancel_futures=True)
            with self._lock:
                for entry in self._entries.values():
                    entry.array = None
                    if entry.host is not None:  # its pinned buffer back to the pool
                        entry.host.release()
                        entry.host = None
                self._entries.clear()
                self._residents.clear()
                self._spills.settle()  # buffers whose queued copies run still
                self._cond.notify_all()
            self._finalizer()
        finally:
            self._close_done.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = (
            "closed"
            if self._closed
            else (
                f"{format_count(len(self._entries), 'array')}, "
                f"{self._residents.held}/{self.budget} bytes held"
            )
        )
        return f"<arrayio.Offloader {self.directory!r} ({state})>"

    # ------------------------------------------------------------------ bookkeeping

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._process_releases()
            try:
                yield
            finally:
                self._process_releases()

    def _release(self, entry_id: int) -> None:
        """A handle died (maybe in a garbage collection inside our own lock): free it now if
        the lock is free, else when the lock's holder next looks."""
        self._released.append(entry_id)
        if self._lock.acquire(blocking=False):
            try:
                self._process_releases()
            finally:
                self._lock.release()

    def _process_releases(self) -> None:
        while self._released:
            entry = self._entries.get(self._released.popleft())
            if entry is not None and not self._closed:
                self._free_entry(entry)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("I/O on a closed arrayio Offloader")
        self._raise_write_error()

    def _raise_write_error(self) -> None:
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise error

    def _entry(self, handle: Handle) -> Entry:
        if not isinstance(handle, Handle) or handle._offloader() is not self:
            raise ValueError(f"{handle!r} is not a handle of this offloader")
        if self._closed:
            raise ValueError("I/O on a closed arrayio Offloader")
        entry = self._entries.get(handle.id)
        if entry is None or entry.freed:  # freed: its write may still be finishing
            raise ValueError(f"{handle!r} was freed")
        return entry

    def _wait(self) -> None:
        """Wait for a change; raise if the offloader was closed meanwhile (close() cancels
        queued I/O, so what the caller waits for may never come)."""
        self._process_releases()
        self._cond.wait()
        if self._closed:
            raise ValueError("the arrayio Offloader was closed while this call waited")
        self._process_releases()

    def _drop(self, entry: Entry) -> None:
        """Stop holding the entry's array (its file, if any, stays)."""
        if entry.array is not None:
            entry.array = None
            entry.ready = None
            entry.from_read = False
            entry.arrived = None
            self._residents.release(entry)
            self._cond.notify_all()

    def _free_entry(self, entry: Entry) -> None:
        entry.freed = True
        # Not remove() within suppress(ValueError): its message would format the entry's
        # repr, and with it the array's (a device-to-host copy for a GPU tensor).
        if entry in self._prefetch_queue:
            self._prefetch_queue.remove(entry)
        if entry.writing or entry.reading:
            return  # the worker finishes the job when it is done
        self._drop(entry)
        if entry.host is not None:
            entry.host.release()
            entry.host = None
        elif entry.on_disk:
            # Any OSError: this also runs in the workers, where raising would skip the
            # bookkeeping below (and close() removes the file anyway).
            with contextlib.suppress(OSError):
                os.unlink(entry.file)
        entry.on_disk = False
        self._entries.pop(entry.id, None)
        self._cond.notify_all()
        self._pump_prefetch()

    # ------------------------------------------------------------------ making room

    def _make_room(self, need: int) -> None:
        """Make the held bytes plus ``need`` fit the budget; wait for writes if needed."""
        while not self._residents.fits(need):
            step = self._residents.next_step(need)
            if step is None:  # what is in flight will make room
                self._wait()
                self._raise_write_error()
                continue
            action, entry = step
            if action is Step.DROP:
                self._drop(entry)
                continue
            entry.evict = True
            if action is Step.WRITE:
                self._start_write(entry)

    def _writeback(self) -> None:
        """Write dirty arrays ahead of need, oldest first (see ``writeback_bytes``)."""
        for entry in self._residents.writeback():
            self._start_write(entry)

    def _pump_prefetch(self) -> None:
        """Start queued prefetches that fit, dropping clean arrays (never waiting)."""
        residents = self._residents
        while self._prefetch_queue and not self._closed:
            entry = self._prefetch_queue[0]
            if entry.freed or entry.array is not None or entry.reading:
                self._prefetch_queue.popleft()
                continue
            need = residents.read_size(entry)
            while not residents.fits(need):
                victim = residents.prefetch_victim()
                if victim is None:
                    break
                self._drop(victim)
            if not residents.fits(need):
                return  # wait for room: a get, a free or a finished write calls again
            self._prefetch_queue.popleft()
            entry.prefetched = True
            self._start_read(entry)

    # ------------------------------------------------------------------ I/O

    def _start_write(self, entry: Entry) -> None:
        if self._queue_to_host(entry):
            return
        try:  # refused at interpreter exit: the entry must not stay "writing" forever
            self._writers.submit(self._write, entry, entry.array, entry.ready)
        except BaseException:
            entry.evict = False
            raise
        entry.writing = True

    def _write(self, entry: Entry, array: Any, ready: Any) -> None:
        """A writer thread's task: spill the array, then update the books."""
        crc, host, error = None, None, None
        try:
            crc, host = self._spills.write(entry, array, ready)
        except BaseException as caught:  # noqa: BLE001 - reported through the offloader
            error = caught
        del array  # dropping the entry's array below may free it: this frame must not keep it
        with self._locked():
            entry.writing = False
            if error is None:
                entry.on_disk, entry.crc, entry.host = True, crc, host
                self._written += entry.nbytes
                self._writes += 1
                if entry.evict:
                    self._drop(entry)
            else:
                entry.evict = False  # stays resident and dirty
                with contextlib.suppress(OSError):
                    os.unlink(entry.file)
                if not entry.freed:
                    self._write_error = error
            if entry.freed:
                self._free_entry(entry)
            self._cond.notify_all()
            self._pump_prefetch()

    def _queue_to_host(self, entry: Entry) -> bool:
        """Spill the entry to the host tier by a copy queued on the GPU, on the caller's
        thread, where it can go that way (:meth:`SpillFiles.queue_to_host`): the array is
        written as soon as the copy is queued, and dropped at once if it is to be evicted
        (its device memory is reused only after the copy has run). A failure to queue it
        leaves the entry to a writer thread, which reports what fails there."""
        try:
            copy = self._spills.queue_to_host(entry)
        except Exception:  # the writer's path says what is wrong, if anything
            logger.debug("queueing spill #%d failed; a writer takes it", entry.id, exc_info=True)
            return False
        if copy is None:
            return False
        entry.on_disk, entry.crc, entry.host = True, None, copy
        self._written += entry.nbytes
        self._writes += 1
        if entry.evict:
            self._drop(entry)
        self._cond.notify_all()
        return True

    def _start_read(self, entry: Entry) -> None:
        if self._spills.queues_back(entry):
            self._queue_from_host(entry)
            return
        # Submitted first, state after (under the lock, the task cannot look before): a
        # refused task (interpreter exit) must not leave the entry "reading" forever.
        self._readers.submit(self._read_back, entry)
        entry.reading = True
        entry.read_error = None
        self._residents.start_read(entry)

    def _queue_from_host(self, entry: Entry) -> None:
        """Read the entry back from its host copy by a copy queued on the GPU behind the copy
        out, on the caller's thread (nothing waits); a failure is the get's to raise, as a
        reader thread's is."""
        entry.read_error = None
        self._residents.start_read(entry)
        try:
            array, arrived_event = self._spills.queue_from_host(entry)
        except BaseException as error:  # the books first, whatever it is
            self._residents.finish_read(entry, resident=False)
            self._cond.notify_all()
            if not isinstance(error, Exception):
                raise
            entry.read_error = error  # reported by get(), as a reader's
            return
        self._residents.finish_read(entry, resident=not entry.freed)
        if not entry.freed:
            # (no from_read: get records the stream's use at every get of such a tensor)
            entry.array, entry.arrived = array, arrived_event
            self._read += entry.nbytes
            self._reads += 1
        self._cond.notify_all()

    def _read_back(self, entry: Entry) -> None:
        """A reader thread's task: read the array back, then update the books."""
        array, error = None, None
        try:
            array = self._spills.read(entry)
        except BaseException as caught:  # noqa: BLE001 - reported by get()
            error = caught
        with self._locked():
            entry.reading = False
            resident = error is None and not entry.freed
            self._residents.finish_read(entry, resident=resident)
            if resident:
                entry.array, entry.from_read = array, True
                self._read += entry.nbytes
                self._reads += 1
            else:
                entry.read_error = error
            if entry.freed:
                self._free_entry(entry)
            self._cond.notify_all()
            self._pump_prefetch()


def _finalize(
    writers: Any, readers: Any, directory: SpillDirectory, spills: SpillFiles, owner: int
) -> None:
    # An offloader dropped by the user can die in one of its own workers (the last
    # reference being a task's), which cannot wait for itself.
    own = threading.current_thread().name.startswith("arrayio-offload")
    writers.shutdown(wait=not own, cancel_futures=True)
    readers.shutdown(wait=not own, cancel_futures=True)
    # Copies queued on the GPU may still use pinned buffers that the dropped entries' loans
    # give back to the pool: they must have run first (not in a forked child, whose CUDA
    # context is not the parent's, nor while the interpreter exits).
    try:
        if os.getpid() == owner and not sys.is_finalizing():
            spills.settle()
    finally:
        directory.close()
