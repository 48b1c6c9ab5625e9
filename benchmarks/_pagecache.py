"""Page-cache control shared by the benchmarks: durable files, cold reads."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

__all__ = ["drop_caches", "evict", "fsync_path"]


def fsync_path(path: str) -> None:
    """fsync a file or a directory by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_caches() -> bool:
    """Write back and drop the whole page cache (root only); return whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(paths: str | Iterable[str], drop: bool = False) -> bool:
    """Push the files' pages out of the page cache (written back first, then
    ``posix_fadvise(DONTNEED)``: no root needed); with ``drop`` also drop every cache.
    Return whether the caches were dropped."""
    # A page arrayio's second pass is reading cannot be evicted: where arrayio runs in this
    # process, its passes end first (another process's cannot be waited for).
    second_pass = sys.modules.get("arrayio.dispatch.second_pass")
    if second_pass is not None:
        second_pass.wait_all()
    for path in [paths] if isinstance(paths, str) else paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return drop_caches() if drop else False


def page_activations() -> int | None:
    """Pages the kernel has moved to its active list since boot, on the whole machine
    (``pgactivate`` in /proc/vmstat; None where there is none). A page read from the disk
    moves at its second read, so a read right after a cold one pays a move per page."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("pgactivate "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
