"""The offloader's spill directory: one per live offloader, reclaimed after a crash.

Each :class:`~arrayio.offload.Offloader` works in its own subdirectory
``arrayio-offload-<pid>-<random>`` of the directory it is given. The subdirectory holds a
``.lock`` file on which its owner keeps an exclusive ``flock`` for as long as it lives (the
file also names the owner's pid, host and start time, for people). The kernel drops the lock
when the owner exits, however it exits (SIGKILL, a crash, power loss), so a later offloader
that can take the lock knows the owner is gone and removes the subdirectory. A ``flock``
survives pid reuse and works across pid namespaces (containers sharing a disk), where
checking a pid would not. A subdirectory whose ``.lock`` is missing (its owner died between
creating the two) is removed once it is older than :data:`GRACE_SECONDS`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time

__all__ = ["GRACE_SECONDS", "PREFIX", "SpillDirectory", "reclaim"]

PREFIX = "arrayio-offload-"
LOCK_NAME = ".lock"
GRACE_SECONDS = 60.0


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def reclaim(parent: str) -> list[str]:
    """Remove the subdirectories of ``parent`` whose offloader is no longer running.

    Returns
    -------
    list of str
        The subdirectories removed.
    """
    removed = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and time.time() - os.stat(path).st_mtime > GRACE_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            continue
        except OSError:
            continue  # not ours to judge (permissions...)
        try:
            if _try_lock(fd):  # its owner is gone: the lock is ours while we delete
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


class SpillDirectory:
    """A fresh, locked subdirectory of ``parent`` (created if needed) for one offloader.

    Creating one first reclaims the subdirectories of offloaders that died.

    Raises
    ------
    OSError
        If ``parent`` cannot be created or written.
    """

    def __init__(self, parent: str | os.PathLike[str]) -> None:
        parent = os.fspath(parent)
        os.makedirs(parent, exist_ok=True)
        self.reclaimed = reclaim(parent)
        self.path = _make_directory(parent)
        self._pid = os.getpid()
        # The lock is taken on a temporary name and renamed into place, so that nobody sees
        # a .lock nobody holds.
        temporary = os.path.join(self.path, LOCK_NAME + ".new")
        self._lock_fd: int | None = os.open(
            temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        try:
            if not _try_lock(self._lock_fd):
                raise OSError(f"cannot lock {temporary}")
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.write(self._lock_fd, json.dumps(owner).encode())
            os.replace(temporary, os.path.join(self.path, LOCK_NAME))
        except BaseException:
            self.close()
            raise

    def file(self, name: str) -> str:
        """The path of a file in this directory."""
        return os.path.join(self.path, name)

    def close(self) -> None:
        """Remove the directory and everything in it; release the lock.

        In a process forked from the owner (which inherited this object), only the
        inherited descriptor is closed: the directory is the owner's, still in use, and its
        lock stays held by the owner's descriptor.
        """
        if self._lock_fd is None:
            return
        if os.getpid() == self._pid:
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None

    @property
    def closed(self) -> bool:
        return self._lock_fd is None


def _make_directory(parent: str) -> str:
    for _ in range(100):
        path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"could not create a spill directory in {parent}")
