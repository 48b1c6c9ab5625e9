"""Which files this process reads again: the cache-admission rule keeps a re-read file in the
page cache when it fits in the memory available once, not only twice.

A file is known by its device, inode, size and modification time (a rewritten file is a new
one); a directory by its device and inode. A file read before is a re-read; so is every file
of a directory one of whose files was re-read (an evaluation loop over a model's shards, a
notebook re-running a cell).

Writes get the same thought: a file this process wrote and then read (a checkpoint saved,
then loaded for an evaluation or a test) marks its directory, and the next files written
there stay in the page cache, so that their loads are page-cache loads. A written file is
known by its device and inode alone (its size and time change as it is written; an atomic
save's rename keeps its inode).

What is remembered is bounded (the latest :data:`REMEMBERED` files of each kind) and lives
as long as the process.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["REMEMBERED", "ReReads"]

REMEMBERED = 4096

# A file's directory not yet looked up (None: it could not be).
_UNKNOWN: Any = object()

# Within untracked(): transfers that are nobody's use of their files (tune()'s scratch files).
_untracked: contextvars.ContextVar[bool] = contextvars.ContextVar("untracked", default=False)


class ReReads:
    """The files and directories this process has read, and re-read."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self.remembered = remembered
        # Each file read, with its directory once looked up: a batch of a Zarr array's
        # chunks re-reads a thousand files, and a lookup costs a readlink and a stat.
        self._files: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()
        self._reread_directories: set[tuple[int, int]] = set()
        self._written: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self._read_after_write: set[tuple[int, int]] = set()  # directories
        self._lock = threading.Lock()

    @staticmethod
    @contextlib.contextmanager
    def untracked() -> Iterator[None]:
        """Within the block (in this thread), transfers are neither recorded nor answered
        as re-reads: :func:`arrayio.tune`'s scratch files say nothing of what a program
        reads again."""
        token = _untracked.set(True)
        try:
            yield
        finally:
            _untracked.reset(token)

    def _remember(
        self, latest: collections.OrderedDict[Any, Any], key: tuple[int, ...], value: Any = 1
    ) -> None:
        """Mark ``key`` (with ``value``) the newest of ``latest``, forgetting the oldest past
        the bound (called with the lock held)."""
        latest[key] = value
        latest.move_to_end(key)
        while len(latest) > self.remembered:
            latest.popitem(last=False)

    def wrote(self, fd: int) -> bool:
        """Record a write to ``fd``'s file; return whether this process has read back a file
        it wrote into the same directory (so this one is likely read soon too)."""
        stat = _tracked_stat(fd)
        if stat is None:
            return False
        with self._lock:
            self._remember(self._written, (stat.st_dev, stat.st_ino))
            if not self._read_after_write:
                return False
        return _directory_of(fd) in self._read_after_write

    def read(self, fd: int, *, ask: bool = True) -> str | None:
        """Record a read of ``fd``'s file; with ``ask``, say whether it is a re-read:
        ``"file"`` (read before), ``"directory"`` (a file of its directory was re-read), or
        None. Without ``ask`` (a read from the page cache, where nothing is to be decided)
        the directory is only looked up to mark it, on a re-read: ``fstat`` alone costs a
        microsecond, the directory's lookup ten."""
        stat = _tracked_stat(fd)
        if stat is None:
            return None
        key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            written = self._written.pop((stat.st_dev, stat.st_ino), None) is not None
        if written:  # read back after this process wrote it
            folder = _directory_of(fd)
            if folder is not None:
                with self._lock:
                    self._read_after_write.add(folder)
        with self._lock:
            folder = self._files.get(key, _UNKNOWN)
            seen = key in self._files
            self._remember(self._files, key, folder)
        if not seen and not ask:
            return None
        if folder is _UNKNOWN:
            # Looked up once per file: a file moved to another directory since keeps the
            # first, which only marks the wrong directory as re-read.
            folder = _directory_of(fd)
        with self._lock:
            if key in self._files:  # a failed lookup is tried again next time
                self._files[key] = _UNKNOWN if folder is None else folder
            if seen:
                if folder is not None:
                    self._reread_directories.add(folder)
                return "file"
            return "directory" if folder in self._reread_directories else None


def _tracked_stat(fd: int) -> os.stat_result | None:
    """``fd``'s status, or None where it cannot be had or transfers are untracked here."""
    if _untracked.get():
        return None
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _directory_of(fd: int) -> tuple[int, int] | None:
    try:
        directory = os.stat(os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")))
    except OSError:
        return None
    return directory.st_dev, directory.st_ino
