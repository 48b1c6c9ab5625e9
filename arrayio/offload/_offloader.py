"""The offload manager: arrays kept on their device under a byte budget, the rest on NVMe.

How it works
------------
Each array given to :meth:`Offloader.put` becomes an entry. An entry's array is *resident*
(the offloader holds it) or *spilled* (only its file holds it); a resident entry is
*clean* when its file is complete too (it was written, or read back), *dirty* otherwise.

The **held bytes** are those of every resident array plus those of every read in flight
(its destination is allocated when the read starts). The budget is about them:

* After :meth:`~Offloader.put` returns, the held bytes are at most ``device_budget_bytes``.
  ``put`` makes room by dropping clean arrays (free: their file is complete), then by
  writing dirty ones out, least recently used first, and waits for those writes: an array
  being written is still held (the tool is reading it), so it is dropped only once its
  file is complete.
* A read (:meth:`~Offloader.prefetch`, :meth:`~Offloader.get`) starts only when its bytes fit
  under the budget. ``prefetch`` never waits: what does not fit is queued and started as room
  appears. ``get`` waits for room (an array larger than the whole budget is read once
  nothing else is held).
* With ``writeback_bytes`` > 0, dirty arrays are written in the background ahead of need
  ("writeback", oldest first) whenever the dirty bytes exceed ``device_budget_bytes -
  writeback_bytes``, so that ``put`` waits less; they stay resident, now clean, until room
  is needed. The default, 0, writes only what must leave (see :class:`Offloader`).

Arrays ``put`` with ``hint="keep"`` are never spilled; ``hint="spill"`` writes the array out at
once and drops it when written.

Where "device" means the host: NumPy, JAX-on-CPU and torch-on-CPU arrays count against the
budget like GPU arrays do; the budget is then one on host memory held by arrays.

I/O, threads and streams
------------------------
Every byte goes through the dispatcher (:mod:`arrayio.dispatch._transfer`), which picks the transfer
tool, on the offloader's own threads (``write_workers`` for spills, ``read_workers`` for
reads, so that a ``get`` never queues behind writes). Each array is one file of raw bytes in
the offloader's directory (see :mod:`arrayio.offload._directory`), checksummed (CRC-32C)
unless ``verify=False``. Files are removed when their handle is freed, and the directory on
:meth:`~Offloader.close`, or by the next offloader after a crash.

Transfers run in parallel, device memory included: the tools lend their staging buffers to
one call at a time (``arrayio.tools._lending``).

Nothing is ever queued on the caller's compute stream:

* **torch (CUDA)**: ``put`` records a CUDA event on the current stream; the writer waits for
  that event (on the host, in its own thread) before reading the tensor, and the
  dispatcher's GPU tools copy through pinned buffers on their own streams. Reads allocate
  their destination on a side stream of the offloader's, so the caching allocator never
  hands it a block the compute stream may still use; ``get`` then calls
  ``record_stream(current_stream)`` so the block is not reused before the compute stream is
  done with it.
* **CuPy (CUDA)**: ``put`` records an event on the current stream, which the writer waits
  for. Reads allocate on the offloader's own CuPy stream and wait (on the host, in the
  reader thread) for earlier work on the device before filling, since CuPy's memory pool
  has no ``record_stream``.
* **JAX (CUDA)**: arrays are immutable, and exporting them through DLPack orders the copy
  after their computation. Reads go to host memory, then ``jax.device_put`` on the array's
  device: JAX owns the result's memory (its allocator counts it, its streams order it).
* **Host arrays**: plain threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from .. import config
from ..arrays import _dtypes
from ..arrays._frameworks import CPU, Request, allocate, export, framework_of, placement_of
from ..dispatch import _transfer
from ..errors import ArrayioError, ChecksumError, UnsupportedObjectError
from ..runtime._units import format_count
from ._directory import SpillDirectory

__all__ = ["Handle", "OffloadBudgetError", "OffloadStats", "Offloader"]

_HINTS = (None, "keep", "spill")


class OffloadBudgetError(ArrayioError, MemoryError):
    """The budget cannot be met: arrays put with ``hint="keep"`` fill it."""


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
    bytes_written, bytes_read
        Totals moved to and from disk.
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
    bytes_written: int
    bytes_read: int
    writes: int
    reads: int
    arrays: int


class Handle:
    """A reference to an array given to :meth:`Offloader.put`.

    Dropping the last reference to a handle frees its array and file, as
    :meth:`Offloader.free` does.

    Attributes
    ----------
    nbytes : int
    shape : tuple of int
    dtype : str
        The arrayio dtype name (``"float32"``, ``"bfloat16"``...).
    framework : str
        ``"numpy"``, ``"jax"``, ``"torch"`` or ``"cupy"``.
    """

    __slots__ = ("__weakref__", "_offloader", "dtype", "framework", "id", "nbytes", "shape")

    def __init__(self, offloader: Offloader, entry: _Entry) -> None:
        self._offloader = weakref.ref(offloader)
        self.id = entry.id
        self.nbytes = entry.nbytes
        self.shape = entry.shape
        self.dtype = entry.dtype.name
        self.framework = entry.framework

    def __del__(self) -> None:
        offloader = self._offloader()
        if offloader is not None:
            offloader._release(self.id)

    def __repr__(self) -> str:
        return (f"<arrayio.offload.Handle #{self.id} {self.framework} "
                f"{self.dtype}{list(self.shape)}>")


@dataclasses.dataclass(eq=False, repr=False)
class _Entry:
    id: int
    nbytes: int
    dtype: _dtypes.DType
    shape: tuple[int, ...]
    framework: str
    request: Request
    hint: str | None
    file: str
    array: Any = None
    ready: Any = None  # a CUDA event the writer waits for before reading the array
    on_disk: bool = False
    writing: bool = False
    reading: bool = False
    evict: bool = False  # drop the array once its write is complete
    freed: bool = False
    crc: int | None = None
    read_error: BaseException | None = None
    from_read: bool = False  # the array was read back (torch: record_stream on get)
    prefetched: bool = False  # read back by prefetch() and not used by get() since
    waiters: int = 0  # get() calls waiting for this array: it must not be dropped meanwhile

    @property
    def clean(self) -> bool:
        return self.on_disk and not self.writing


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
        where the disk is slower than the compute (on the H200 VM, a torch step at 95% of
        its activations' budget took 129 ms with 0, 211 ms with 5% of the budget and 564 ms
        with 25%, against 21 ms without offloading), writing ahead costs more than it saves.
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
    ``put`` takes the array over: do not modify it afterwards (the spilled copy could hold
    either version). The offloader is thread-safe. See the module docstring of
    :mod:`arrayio.offload._offloader` for the budget's exact definition and for what is done
    per framework on the GPU.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        device_budget_bytes: int,
        writeback_bytes: int | None = None,
        write_workers: int = 2,
        read_workers: int = 2,
        verify: bool | None = None,
        tool: Any = None,
    ) -> None:
        if device_budget_bytes < 0:
            raise ValueError(f"device_budget_bytes must be >= 0, got {device_budget_bytes}")
        self.budget = int(device_budget_bytes)
        self.writeback_bytes = (0 if writeback_bytes is None
                                else min(int(writeback_bytes), self.budget))
        self._verify = config.get().verify_checksums if verify is None else verify
        self._tool = tool
        self._directory = SpillDirectory(directory)
        self.directory = self._directory.path
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: dict[int, _Entry] = {}
        self._lru: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._prefetch_queue: collections.deque[_Entry] = collections.deque()
        self._released: collections.deque[int] = collections.deque()
        self._next_id = 0
        self._held = 0
        self._reading = 0  # reads in flight (held, but not droppable until done)
        self._peak = 0
        self._written = self._read = self._writes = self._reads = 0
        self._write_error: BaseException | None = None
        self._closed = False
        self._close_done = threading.Event()
        self._writers = concurrent.futures.ThreadPoolExecutor(
            write_workers, thread_name_prefix="arrayio-offload-write")
        self._readers = concurrent.futures.ThreadPoolExecutor(
            read_workers, thread_name_prefix="arrayio-offload-read")
        self._side_streams: dict[tuple[str, int], Any] = {}
        self._finalizer = weakref.finalize(self, _finalize, self._writers, self._readers,
                                           self._directory)

    # ------------------------------------------------------------------ public API

    def put(self, array: Any, *, hint: str | None = None) -> Handle:
        """Hand an array to the offloader; spill older ones (or this one) if over budget.

        Parameters
        ----------
        array
            A NumPy, JAX, torch or CuPy array (or another DLPack producer) on the CPU or one
            GPU. The offloader keeps a reference; do not modify it afterwards.
        hint
            ``None`` (least recently used arrays are spilled first), ``"keep"`` (never
            spilled) or ``"spill"`` (written out at once, dropped when written).

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
        array = _as_known_array(array)
        framework = framework_of(array)
        dtype = _dtypes.dtype_of(array.dtype)
        shape = tuple(int(n) for n in array.shape)
        placement = placement_of(array)
        jax_device = None
        if framework == "jax":
            devices = array.devices()
            if len(devices) != 1:
                raise UnsupportedObjectError("the offloader takes arrays on one device; this "
                                             f"JAX array spans {len(devices)}")
            jax_device = next(iter(devices)) if placement.is_cuda else None
        ready = _record_ready(array, framework, placement.is_cuda)
        with self._locked():
            self._check_open()
            entry = _Entry(self._next_id, dtype.itemsize * math.prod(shape), dtype, shape,
                           framework, Request(framework, placement, jax_device), hint,
                           self._directory.file(f"{self._next_id}.bin"), array=array,
                           ready=ready)
            self._next_id += 1
            self._entries[entry.id] = entry
            self._lru[entry.id] = entry
            self._add_held(entry.nbytes)
            handle = Handle(self, entry)
            try:
                if hint == "spill" and entry.nbytes:
                    entry.evict = True
                    self._start_write(entry)
                self._make_room(0)
                self._writeback()
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
                    self._lru.move_to_end(entry.id)
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

    def _get(self, entry: _Entry) -> Any:
        while True:
            if entry.freed:  # by another thread while this one waited
                raise ValueError(f"array #{entry.id} was freed while get() waited for it")
            if entry.array is not None:
                self._lru.move_to_end(entry.id)
                entry.prefetched = False
                array = entry.array
                if entry.from_read:
                    entry.from_read = False
                    _record_stream(array, entry.framework)
                return array
            if entry.read_error is not None:
                error, entry.read_error = entry.read_error, None
                raise error
            if entry.reading:
                self._wait()
                continue
            if entry in self._prefetch_queue:
                self._prefetch_queue.remove(entry)
            self._make_room(min(entry.nbytes, self.budget))
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
            spilled = sum(e.nbytes for e in self._entries.values()
                          if e.array is None and e.on_disk)
            disk = sum(e.nbytes for e in self._entries.values() if e.on_disk)
            return OffloadStats(self.budget, self._held, self._peak, spilled, disk,
                                self._written, self._read, self._writes, self._reads,
                                len(self._entries))

    def peek(self, handle: Handle) -> Any:
        """The handle's array if it is resident now, else None; reads nothing, and does
        not count as a use."""
        with self._locked():
            entry = self._entries.get(handle.id)
            return None if entry is None else entry.array

    def resident(self, handle: Handle) -> bool:
        """Whether the handle's array is resident now (held by the offloader)."""
        with self._locked():
            return self._entry(handle).array is not None

    def wait(self) -> None:
        """Wait until no write or read is in flight (queued prefetches that do not fit yet
        are not waited for).

        Raises
        ------
        OSError
            If a background write failed since the last call.
        """
        with self._locked():
            while not self._closed and any(e.writing or e.reading
                                           for e in self._entries.values()):
                self._process_releases()
                self._cond.wait()
            self._raise_write_error()

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
                self._entries.clear()
                self._lru.clear()
                self._held = 0
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
        state = "closed" if self._closed else (
            f"{format_count(len(self._entries), 'array')}, {self._held}/{self.budget} bytes held")
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

    def _entry(self, handle: Handle) -> _Entry:
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

    def _add_held(self, nbytes: int) -> None:
        self._held += nbytes
        self._peak = max(self._peak, self._held)

    def _drop(self, entry: _Entry) -> None:
        """Stop holding the entry's array (its file, if any, stays)."""
        if entry.array is not None:
            entry.array = None
            entry.ready = None
            entry.from_read = False
            self._held -= entry.nbytes
            self._lru.pop(entry.id, None)
            self._cond.notify_all()

    def _free_entry(self, entry: _Entry) -> None:
        entry.freed = True
        # Not remove() within suppress(ValueError): its message would format the entry's
        # repr, and with it the array's (a device-to-host copy for a GPU tensor).
        if entry in self._prefetch_queue:
            self._prefetch_queue.remove(entry)
        if entry.writing or entry.reading:
            return  # the worker finishes the job when it is done
        self._drop(entry)
        if entry.on_disk:
            # Any OSError: this also runs in the workers, where raising would skip the
            # bookkeeping below (and close() removes the file anyway).
            with contextlib.suppress(OSError):
                os.unlink(entry.file)
            entry.on_disk = False
        self._entries.pop(entry.id, None)
        self._cond.notify_all()
        self._pump_prefetch()

    # ------------------------------------------------------------------ policy

    def _make_room(self, need: int) -> None:
        """Make the held bytes plus ``need`` fit the budget; wait for writes if needed."""
        while self._held + need > self.budget:
            # Clean arrays first (no write needed), prefetched ones not used yet last among
            # them (they were asked for).
            victim = (self._first(lambda e: e.clean and not e.prefetched)
                      or self._first(lambda e: e.clean))
            if victim is not None:
                self._drop(victim)
                continue
            leaving = sum(e.nbytes for e in self._lru.values() if e.writing and e.evict)
            if self._held - leaving + need > self.budget:
                victim = self._first(lambda e: e.writing and not e.evict)
                if victim is not None:
                    victim.evict = True
                    continue
                victim = self._first(lambda e: not e.on_disk and not e.writing)
                if victim is not None:
                    victim.evict = True
                    self._start_write(victim)
                    continue
                # Writes, reads and get() calls in flight will all make room (or make
                # arrays droppable) when done; only with none of them is the budget full.
                busy = leaving or self._reading or any(e.waiters for e in self._lru.values())
                if not busy:
                    kept = sum(e.nbytes for e in self._lru.values() if e.hint == "keep")
                    raise OffloadBudgetError(
                        f"cannot fit {need} more bytes in a budget of {self.budget}: "
                        f"{self._held} bytes are held, {kept} of them put with hint='keep'")
            self._wait()
            self._raise_write_error()

    def _first(self, predicate: Any) -> _Entry | None:
        """The least recently used resident entry that may be spilled and fits
        ``predicate``."""
        for entry in self._lru.values():
            if (entry.hint != "keep" and entry.nbytes and not entry.waiters
                    and predicate(entry)):
                return entry
        return None

    def _writeback(self) -> None:
        """Write dirty arrays ahead of need, oldest first (see ``writeback_bytes``)."""
        limit = self.budget - self.writeback_bytes
        dirty = sum(e.nbytes for e in self._lru.values() if not e.on_disk and not e.writing)
        for entry in list(self._lru.values()):
            if dirty <= limit:
                break
            if entry.hint != "keep" and entry.nbytes and not entry.on_disk and not entry.writing:
                self._start_write(entry)
                dirty -= entry.nbytes

    def _pump_prefetch(self) -> None:
        """Start queued prefetches that fit, dropping clean arrays (never waiting)."""
        while self._prefetch_queue and not self._closed:
            entry = self._prefetch_queue[0]
            if entry.freed or entry.array is not None or entry.reading:
                self._prefetch_queue.popleft()
                continue
            need = min(entry.nbytes, self.budget)
            while self._held + need > self.budget:
                # Not an array prefetched for use and not used yet: prefetches would chase
                # each other out.
                victim = self._first(lambda e: e.clean and not e.prefetched)
                if victim is None:
                    break
                self._drop(victim)
            if self._held + need > self.budget:
                return  # wait for room: a get, a free or a finished write calls again
            self._prefetch_queue.popleft()
            entry.prefetched = True
            self._start_read(entry)

    # ------------------------------------------------------------------ I/O

    def _start_write(self, entry: _Entry) -> None:
        try:  # refused at interpreter exit: the entry must not stay "writing" forever
            self._writers.submit(self._write, entry, entry.array, entry.ready)
        except BaseException:
            entry.evict = False
            raise
        entry.writing = True

    def _write(self, entry: _Entry, array: Any, ready: Any) -> None:
        crc, error = None, None
        try:
            if ready is not None:
                ready.synchronize()  # the producer's kernels are done (host wait, our thread)
            data = export(array).data
            del array
            fd = os.open(entry.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                         0o600)
            try:
                crc = _transfer.write_from(fd, 0, data, with_checksum=self._verify,
                                           tool=self._tool)
            finally:
                os.close(fd)
        except BaseException as caught:  # noqa: BLE001 - reported through the offloader
            error = caught
        with self._locked():
            entry.writing = False
            if error is None:
                entry.on_disk, entry.crc = True, crc
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

    def _start_read(self, entry: _Entry) -> None:
        # Submitted first, state after (under the lock, the task cannot look before): a
        # refused task (interpreter exit) must not leave the entry "reading" forever.
        self._readers.submit(self._read_back, entry)
        entry.reading = True
        entry.read_error = None
        self._reading += 1
        self._add_held(entry.nbytes)

    def _read_back(self, entry: _Entry) -> None:
        array, error = None, None
        try:
            array = self._read_file(entry)
        except BaseException as caught:  # noqa: BLE001 - reported by get()
            error = caught
        with self._locked():
            entry.reading = False
            self._reading -= 1
            if error is None and not entry.freed:
                entry.array, entry.from_read = array, True
                self._lru[entry.id] = entry
                self._read += entry.nbytes
                self._reads += 1
            else:
                self._held -= entry.nbytes
                entry.read_error = error
            if entry.freed:
                self._free_entry(entry)
            self._cond.notify_all()
            self._pump_prefetch()

    def _read_file(self, entry: _Entry) -> Any:
        request = entry.request
        to_jax_device = request.framework == "jax" and request.placement.is_cuda
        if to_jax_device:  # through the host, then device_put: JAX owns the memory
            request = Request("numpy", CPU)
        with self._allocation_stream(entry):
            target = allocate(request, entry.dtype, entry.shape)
        _wait_for_device(entry)
        fd = os.open(entry.file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            check = self._verify and entry.crc is not None
            crc = _transfer.read_into(fd, 0, target.data, path=entry.file,
                                      with_checksum=check, tool=self._tool)
        finally:
            os.close(fd)
        if check and crc != entry.crc:
            raise ChecksumError(f"{entry.file}: spilled array #{entry.id} has CRC-32C "
                                f"{crc:08x}, {entry.crc:08x} was written: the disk damaged it")
        if to_jax_device:
            import jax

            return jax.device_put(target.finish(), entry.request.jax_device).block_until_ready()
        return target.finish()

    def _allocation_stream(self, entry: _Entry) -> Any:
        """A context in which the destination of a read is allocated (see module docstring)."""
        placement = entry.request.placement
        if not placement.is_cuda or entry.framework == "jax":
            return contextlib.nullcontext()
        if entry.framework == "torch":
            import torch

            key = ("torch", placement.index)
            with self._lock:
                if key not in self._side_streams:
                    self._side_streams[key] = torch.cuda.Stream(device=placement.index)
                stream = self._side_streams[key]
            return torch.cuda.stream(stream)
        import cupy

        key = ("cupy", placement.index)
        with self._lock:
            if key not in self._side_streams:
                with cupy.cuda.Device(placement.index):
                    self._side_streams[key] = cupy.cuda.Stream(non_blocking=True)
            stream = self._side_streams[key]
        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(placement.index))
        stack.enter_context(stream)
        return stack


def _finalize(writers: Any, readers: Any, directory: SpillDirectory) -> None:
    # An offloader dropped by the user can die in one of its own workers (the last
    # reference being a task's), which cannot wait for itself.
    own = threading.current_thread().name.startswith("arrayio-offload")
    writers.shutdown(wait=not own, cancel_futures=True)
    readers.shutdown(wait=not own, cancel_futures=True)
    directory.close()


def _as_known_array(x: Any) -> Any:
    """``x`` if a framework arrayio knows owns it; a DLPack producer becomes NumPy or CuPy."""
    if framework_of(x) is not None:
        return x
    if hasattr(x, "__dlpack__"):
        if placement_of(x).is_cuda:
            import cupy

            return cupy.from_dlpack(x)
        import numpy as np

        return np.from_dlpack(x)
    raise UnsupportedObjectError(f"cannot offload an object of type {type(x).__name__}")


def _record_ready(array: Any, framework: str | None, cuda: bool) -> Any:
    """An event on the current stream marking the array as produced (CUDA torch, CuPy)."""
    if not cuda:
        return None
    if framework == "torch":
        import torch

        with torch.cuda.device(array.device):
            return torch.cuda.current_stream().record_event()
    if framework == "cupy":
        import cupy

        with array.device:
            return cupy.cuda.get_current_stream().record()
    return None  # JAX: exporting through DLPack waits until the array is ready


def _wait_for_device(entry: _Entry) -> None:
    """Before a read fills a fresh CuPy-pool block: wait for earlier work on the device."""
    placement = entry.request.placement
    if placement.is_cuda and entry.framework == "cupy":
        import cupy

        with cupy.cuda.Device(placement.index):
            cupy.cuda.runtime.deviceSynchronize()


def _record_stream(array: Any, framework: str) -> None:
    """Tell torch's caching allocator that the compute stream uses a tensor we allocated on
    a side stream."""
    if framework == "torch" and array.device.type == "cuda":
        import torch

        array.record_stream(torch.cuda.current_stream(array.device))
