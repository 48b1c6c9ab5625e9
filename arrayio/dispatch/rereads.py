"""Which files this process reads again: the cache-admission rule keeps a re-read file in the
page cache when it fits in the memory available once, not only twice.

A file is known by its device, inode, size and modification time (a rewritten file is a new
one); a directory by its device and inode. A file read before is a re-read; so is every file
of a directory one of whose files was re-read (an evaluation loop over a model's shards, a
notebook re-running a cell). What is remembered is bounded (the latest :data:`REMEMBERED`
files) and lives as long as the process.
"""

from __future__ import annotations

import collections
import os
import threading

__all__ = ["REMEMBERED", "ReReads"]

REMEMBERED = 4096


class ReReads:
    """The files and directories this process has read, and re-read."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self.remembered = remembered
        self._files: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
        self._reread_directories: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def read(self, fd: int, *, ask: bool = True) -> str | None:
        """Record a read of ``fd``'s file; with ``ask``, say whether it is a re-read:
        ``"file"`` (read before), ``"directory"`` (a file of its directory was re-read), or
        None. Without ``ask`` (a read from the page cache, where nothing is to be decided)
        the directory is only looked up to mark it, on a re-read: ``fstat`` alone costs a
        microsecond, the directory's lookup ten."""
        try:
            stat = os.fstat(fd)
        except OSError:
            return None
        key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            seen = key in self._files
            self._files[key] = 1
            self._files.move_to_end(key)
            while len(self._files) > self.remembered:
                self._files.popitem(last=False)
        if not seen and not ask:
            return None
        folder = _directory_of(fd)
        with self._lock:
            if seen:
                if folder is not None:
                    self._reread_directories.add(folder)
                return "file"
            return "directory" if folder in self._reread_directories else None


def _directory_of(fd: int) -> tuple[int, int] | None:
    try:
        directory = os.stat(os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")))
    except OSError:
        return None
    return directory.st_dev, directory.st_ino
