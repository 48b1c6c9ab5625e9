"""The context of a transfer: what the dispatcher learns a best tool for.

A context is the direction, the memory kind, the size class (powers of two), the storage
device the file lives on, whether the byte range sits in the page cache, and how many arrayio
transfers run at once. Each is cheap to find: the storage device is looked up once per file
system, and page-cache residency is probed with ``preadv2(RWF_NOWAIT)`` on a few sample pages,
which copies a page if it is cached and fails with ``EAGAIN``, without I/O, if it is not.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading

import numpy as np

__all__ = ["Context", "InFlight", "cache_state", "size_class", "storage_of"]

_PAGE = 4096
_MAX_PROBES = 8
_BYTES_PER_PROBE = 8 << 20  # one probe per 8 MiB, up to _MAX_PROBES: a probe costs ~1 µs


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

    def key(self) -> str:
        return (f"{self.direction}/{self.memory}/2^{self.size_class}/{self.storage}/"
                f"{self.cache}/x{self.load}" + ("/crc" if self.checksum else ""))


def size_class(nbytes: int) -> int:
    """``ceil(log2(nbytes))``, at least 12; 0 for an empty transfer."""
    return 0 if nbytes <= 0 else max(12, (nbytes - 1).bit_length())


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


_scratch = threading.local()


def cache_state(fd: int, file_offset: int, nbytes: int) -> str:
    """``"warm"``, ``"cold"`` or ``"mixed"``: whether sample pages of the range are cached.

    ``"-"`` where the kernel cannot tell (no ``RWF_NOWAIT``) or the range is empty.
    """
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or nbytes <= 0:
        return "-"
    probe = getattr(_scratch, "page", None)
    if probe is None:
        probe = _scratch.page = memoryview(np.empty(1, dtype=np.uint8))
    first, last = file_offset // _PAGE, (file_offset + nbytes - 1) // _PAGE
    probes = min(_MAX_PROBES, max(1, nbytes // _BYTES_PER_PROBE))
    if probes == 1:
        pages = [(first + last) // 2]
    else:
        pages = sorted({first + (last - first) * i // (probes - 1) for i in range(probes)})
    hits = 0
    for page in pages:
        try:
            os.preadv(fd, [probe], page * _PAGE, flag)
            hits += 1
        except BlockingIOError:
            pass
        except OSError:  # EOPNOTSUPP on some file systems
            return "-"
    return "warm" if hits == len(pages) else "cold" if hits == 0 else "mixed"


class InFlight:
    """Counts transfers under way, for the ``load`` field of contexts."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def bucket(self) -> int:
        """1, 2 or 4 (4 or more) transfers under way, this one included."""
        count = max(self._count, 1)
        return 1 if count == 1 else 2 if count < 4 else 4

    def __enter__(self) -> InFlight:
        with self._lock:
            self._count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._count -= 1
