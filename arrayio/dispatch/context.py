"""The context of a transfer: what the dispatcher learns a best tool for.

A context is the direction, the memory kind, the size class (powers of two), the storage
device the file lives on, whether the byte range sits in the page cache, and how many arrayio
transfers run at once; for a batch of transfers, also the size class of its typical piece
(a checkpoint of 16 and 32 MiB tensors moves best with other settings than one transfer of
its size). Each is cheap to find: the storage device is looked up once per file
system, and page-cache residency comes from ``cachestat(2)`` (Linux 6.5+: one system call for
the whole range), else from ``mincore(2)`` on a few sample pages of a mapping of the range.
Neither reads the file. (``preadv2(RWF_NOWAIT)`` is no probe: on a miss it fails with
``EAGAIN`` but starts reading the page, so looking would warm what it looks at.)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import mmap
import os
import platform
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Context", "InFlight", "cache_state", "piece_class", "size_class", "storage_of"]

_PAGE = 4096
_MAX_PROBES = 8
_BYTES_PER_PROBE = 8 << 20  # one probe per 8 MiB, up to _MAX_PROBES: a probe costs ~2 µs
_WINDOW_PAGES = 4


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """One situation the dispatcher learns a tool for; ``key()`` names it in the table."""

    direction: str  # "read" | "write"
    memory: str  # "host" | "cuda"
    size_class: int  # ceil(log2(nbytes)), at least 12 (4 KiB); 0 for empty transfers
    storage: str  # the storage device ("vda", "nvme0n1") or file system type ("tmpfs")
    cache: str  # "cold" | "warm" | "mixed" | "-" (writes, or unknown)
    load: int  # concurrent transfers, bucketed: 1, 2 or 4 (meaning 4 or more)
    # Whether the transfer must also produce a CRC-32C: tools that cannot (KvikIO into device
    # memory) are only candidates without it, and the cost differs, so it is learned apart.
    checksum: bool = False
    # A batch's typical piece (see :func:`piece_class`); 0 for one transfer, or a batch
    # whose typical piece is of its whole size's class.
    pieces: int = 0
    # Reads not yet in the page cache that fit in free memory twice over (once, for a file
    # read again, see dispatch.rereads), and writes into a directory whose written files this
    # process read back: through the cache (no O_DIRECT), so that the next read of the same
    # bytes is a page-cache read.
    keep: bool = False
    _key: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The key is asked for several times a call: build the string once.
        object.__setattr__(
            self,
            "_key",
            (
                f"{self.direction}/{self.memory}/2^{self.size_class}/{self.storage}/"
                f"{self.cache}/x{self.load}"
                + ("/crc" if self.checksum else "")
                + (f"/of2^{self.pieces}" if self.pieces else "")
                + ("/keep" if self.keep else "")
            ),
        )

    def key(self) -> str:
        return self._key


def size_class(nbytes: int) -> int:
    """``ceil(log2(nbytes))``, at least 12; 0 for an empty transfer."""
    return 0 if nbytes <= 0 else max(12, (nbytes - 1).bit_length())


def piece_class(sizes: list[int]) -> int:
    """The size class of a batch's typical piece, by bytes: the piece at which half of the
    batch's bytes are in pieces no larger. 0 when that is the size class of the whole batch
    (one piece dominates it, and it moves as one transfer of its size would)."""
    total = sum(sizes)
    if total <= 0:
        return 0
    seen = 0
    for size in sorted(sizes):
        seen += size
        if 2 * seen >= total:
            typical = size_class(size)
            return 0 if typical == size_class(total) else typical
    return 0  # not reached: the loop ends with seen == total


@functools.cache
def _storage_of_device(st_dev: int) -> str:
    major, minor = os.major(st_dev), os.minor(st_dev)
    block = f"/sys/dev/block/{major}:{minor}"
    if os.path.exists(block):
        resolved = os.path.realpath(block)
        # A partition's parent directory is its disk: .../nvme0n1/nvme0n1p1
        if os.path.exists(os.path.join(resolved, "partition")):
            resolved = os.path.dirname(resolved)
        return os.path.basename(resolved)
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                if fields[2] == f"{major}:{minor}" and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]  # the file system type
    except OSError:
        pass
    return f"dev{major}:{minor}"


def storage_of(fd: int) -> str:
    """The storage device (or, for memory file systems, the file system type) of ``fd``."""
    return _storage_of_device(os.fstat(fd).st_dev)


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())


@functools.cache
def _libc() -> Any:
    # The C library the interpreter already runs on: find_library("c") would start ldconfig,
    # a process of its own in a fresh process's first load.
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_cachestat_works = True


def _sample_pages(file_offset: int, nbytes: int) -> list[int]:
    """Pages at the middles of equal slices of the range: its first pages are a poor sample,
    since reading a file's header makes the kernel read ahead into the first array."""
    first, last = file_offset // _PAGE, (file_offset + nbytes - 1) // _PAGE
    probes = min(_MAX_PROBES, max(1, nbytes // _BYTES_PER_PROBE))
    count = last - first + 1
    if probes == 1:
        return [first + count // 2]
    return sorted({first + (2 * i + 1) * count // (2 * probes) for i in range(probes)})


class _CacheStatCall(threading.local):
    """A thread's reusable arguments for the ``cachestat`` system call: building ctypes
    objects costs more than the call itself."""

    def __init__(self) -> None:
        self.span, self.stat = _CacheStatRange(), _CacheStat()
        self.span_ref, self.stat_ref = ctypes.byref(self.span), ctypes.byref(self.stat)


_call = _CacheStatCall()


def _cached_pages(fd: int, first: int, pages: int) -> int | None:
    """How many of ``pages`` pages from page ``first`` of ``fd``'s file are in the page cache,
    asked of ``cachestat``; None where there is none (from then on: mincore is used)."""
    global _cachestat_works
    libc = _libc()
    if not _cachestat_works or libc is None or _SYS_CACHESTAT is None:
        return None
    call = _call
    call.span.off, call.span.len = first * _PAGE, pages * _PAGE
    if libc.syscall(_SYS_CACHESTAT, fd, call.span_ref, call.stat_ref, 0) != 0:
        _cachestat_works = False  # ENOSYS (older kernel) or refused: mincore from now on
        return None
    return min(int(call.stat.nr_cache), pages)


def _cached_fraction_cachestat(fd: int, file_offset: int, nbytes: int) -> float | None:
    # The kernel walks every page of the range asked about (~30 ns a page): ask about a few
    # windows of a few pages spread over the range, not about a whole gigabyte.
    last = (file_offset + nbytes - 1) // _PAGE
    cached = asked = 0
    for start in _sample_pages(file_offset, nbytes):
        pages = min(_WINDOW_PAGES, last - start + 1)
        found = _cached_pages(fd, start, pages)
        if found is None:
            return None
        cached += found
        asked += pages
    return cached / asked


def wholly_cached(fd: int, file_offset: int, nbytes: int) -> bool | None:
    """Whether every page of the range is in the page cache, asked of ``cachestat`` about
    the whole range (about 30 ns a page: for ranges of a few megabytes); None where there is
    no ``cachestat``."""
    if nbytes <= 0:
        return None
    first, last = file_offset // _PAGE, (file_offset + nbytes - 1) // _PAGE
    found = _cached_pages(fd, first, last - first + 1)
    return None if found is None else found == last - first + 1


def _cached_fraction_mincore(fd: int, file_offset: int, nbytes: int) -> float | None:
    libc = _libc()
    if libc is None:
        return None
    first, last = file_offset // _PAGE, (file_offset + nbytes - 1) // _PAGE
    size = os.fstat(fd).st_size
    last = min(last, (size - 1) // _PAGE) if size else first - 1
    if last < first:
        return None
    pages = [page for page in _sample_pages(file_offset, nbytes) if page <= last]
    try:
        mapping = mmap.mmap(
            fd, (last - first + 1) * _PAGE, offset=first * _PAGE, access=mmap.ACCESS_COPY
        )  # private: writable for ctypes, untouched
    except (OSError, ValueError):
        return None
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        vector = ctypes.c_ubyte()
        hits = 0
        for page in pages:
            if (
                libc.mincore(
                    ctypes.c_void_p(base + (page - first) * _PAGE),
                    ctypes.c_size_t(_PAGE),
                    ctypes.byref(vector),
                )
                != 0
            ):
                return None
            hits += vector.value & 1
        del vector
        return hits / len(pages)
    finally:
        mapping.close()


def cache_state(fd: int, file_offset: int, nbytes: int) -> str:
    """``"warm"``, ``"cold"`` or ``"mixed"``: how much of the range is in the page cache.

    ``"-"`` where the kernel cannot tell, or the range is empty. Never reads the file.
    """
    if nbytes <= 0:
        return "-"
    fraction = _cached_fraction_cachestat(fd, file_offset, nbytes)
    if fraction is None:
        fraction = _cached_fraction_mincore(fd, file_offset, nbytes)
    if fraction is None:
        return "-"
    return "warm" if fraction >= 0.95 else "cold" if fraction <= 0.05 else "mixed"


class InFlight:
    """Counts transfers under way, for the ``load`` field of contexts."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()
        self._fixed = threading.local()

    def bucket(self) -> int:
        """1, 2 or 4 (4 or more) transfers under way, this one included (or, in a thread of
        :meth:`counted_as`, the count given there)."""
        count = max(getattr(self._fixed, "count", None) or self._count, 1)
        return 1 if count == 1 else 2 if count < 4 else 4

    @contextlib.contextmanager
    def counted_as(self, count: int) -> Iterator[None]:
        """In this thread, transfers count ``count`` under way: the devices' batches of one
        read, started at once, are all learned in the context of that many, whichever of
        them the others' threads have entered yet."""
        before = getattr(self._fixed, "count", None)
        self._fixed.count = count
        try:
            yield
        finally:
            self._fixed.count = before

    def __enter__(self) -> InFlight:
        with self._lock:
            self._count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._count -= 1

    def busy(self) -> bool:
        """Whether any transfer is under way."""
        return self._count > 0
