"""Atomic file replacement: the old file stays intact until the new one is complete on disk.

New content goes to a hidden temporary beside the target (``.NAME.arrayio-tmp-PID-RANDOM``),
is fsynced and renamed over it. The writer holds an ``flock`` on its temporary, which the
kernel drops when the process dies however it dies, so a temporary nobody holds is a dead
writer's and :func:`remove_stale_temporaries` removes it (the next save into the directory
does). A replaced file keeps its mode and owner, and a symbolic link is written through, as
``open(path, "w")`` does. ``docs/reliability.md`` says why each choice was made.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Iterator
from typing import NoReturn

from ..errors import DiskFullError

__all__ = [
    "TEMP_MARKER",
    "atomic_write",
    "create_temporary",
    "describe_write_error",
    "is_temporary",
    "raise_described",
    "remove_stale_temporaries",
    "remove_stale_temporaries_below",
]

TEMP_MARKER = ".arrayio-tmp-"
# Longest file name most file systems take (NAME_MAX); a temporary's name must fit too.
_NAME_MAX = 255
_SPACE_ERRNOS = frozenset(
    code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if code is not None
)


def is_temporary(name: str) -> bool:
    """Whether a file name (not a path) is one of arrayio's temporary files."""
    return name.startswith(".") and TEMP_MARKER in name


def _temporary_name(path: str) -> str:
    directory, name = os.path.split(path)
    suffix = f"{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(6)}"
    # Cut the target's name (on a character boundary) so that a target whose own name is near
    # the limit can still be written.
    room = _NAME_MAX - 1 - len(suffix.encode())
    encoded = os.fsencode(name)
    if len(encoded) > room:
        name = os.fsdecode(encoded[:room].decode("utf-8", "ignore").encode())
    return os.path.join(directory, f".{name}{suffix}")


def create_temporary(path: str, *, dir_fd: int | None = None) -> tuple[str, int]:
    """Create and lock a new temporary for ``path`` (relative to ``dir_fd`` if given); return
    its name and a writable descriptor, which holds the lock until it is closed."""
    while True:
        name = _temporary_name(path)
        # 0o666 filtered by the umask, as for any new file (mkstemp would give 0o600).
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666, dir_fd=dir_fd
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a cleaner took it between our open and our lock
            os.close(fd)
            continue
        except OSError:  # no locks on this file system: nobody will take it for a dead one's
            return name, fd
        try:
            ours = os.stat(name, dir_fd=dir_fd).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # a cleaner removed it before we held the lock
            ours = False
        if ours:
            return name, fd
        os.close(fd)


def remove_stale_temporaries(directory: str | os.PathLike[str] | int) -> list[str]:
    """Remove the temporaries in ``directory`` (a path or an open directory's descriptor)
    that no live process is writing.

    A temporary is stale when nobody holds its lock (see the module docstring); those of live
    writers, in this process or another, are left alone, as is anything that cannot be opened
    or locked. Errors (a directory that vanished or cannot be listed) are not raised.

    Returns
    -------
    list of str
        What was removed: paths, or names within the descriptor's directory.
    """
    dir_fd = directory if isinstance(directory, int) else None
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        where = entry.name if dir_fd is not None else entry.path
        if is_temporary(entry.name) and _remove_if_stale(where, dir_fd):
            removed.append(where)
    return removed


def remove_stale_temporaries_below(
    root: str | os.PathLike[str], *, dry_run: bool = False
) -> list[str]:
    """:func:`remove_stale_temporaries` in ``root`` and every directory below it (symbolic
    links are not followed); with ``dry_run``, only list what would be removed."""
    found: list[str] = []
    for directory, _, names in os.walk(root):
        if not any(is_temporary(name) for name in names):
            continue
        if not dry_run:
            found += remove_stale_temporaries(directory)
            continue
        found += [
            os.path.join(directory, name)
            for name in names
            if is_temporary(name) and _is_stale(os.path.join(directory, name))
        ]
    return found


def _is_stale(path: str) -> bool:
    return _remove_if_stale(path, None, remove=False)


def _remove_if_stale(path: str, dir_fd: int | None, *, remove: bool = True) -> bool:
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
        )
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Held by us now, so its writer is dead: the name is random and used once.
        if remove:
            os.unlink(path, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # some platforms cannot open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def resolve_target(path: str | os.PathLike[str]) -> str:
    """The file a write to ``path`` replaces: ``path`` itself, or what its chain of symbolic
    links ends at (which need not exist yet), as ``open(path, "w")`` would write."""
    path = os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else path


def _keep_mode_and_owner(fd: int, target: str) -> None:
    """Give the new file the permission bits, owner and group of the file it replaces."""
    try:
        old = os.stat(target)
    except OSError:
        return  # a new file: the umask decides, as for any new file
    if stat.S_ISDIR(old.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory; cannot save over it", target)
    os.fchmod(fd, stat.S_IMODE(old.st_mode))
    mine = os.fstat(fd)
    if (old.st_uid, old.st_gid) != (mine.st_uid, mine.st_gid):
        with contextlib.suppress(OSError):  # only root may give a file away
            os.fchown(fd, old.st_uid, old.st_gid)
        os.fchmod(fd, stat.S_IMODE(old.st_mode))  # chown clears set-user/group-ID bits


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str],
    *,
    durable: bool = True,
    exclusive: bool = False,
    clean: bool = True,
) -> Iterator[int]:
    """Yield a writable file descriptor whose content replaces ``path`` on success.

    On an exception inside the block the target is left as it was and the partial file is
    removed. The descriptor is closed by this function.

    Parameters
    ----------
    path
        The file to replace or create; a symbolic link is written through (its target is
        replaced), and an existing file's permission bits and owner are kept.
    durable
        With False, neither the file nor the directory is fsynced: readers still see the old
        content or the new, never a mix, but a crash may lose the new content (for caches,
        which must not wait on the disk).
    exclusive
        Link the new file into place only if ``path`` does not exist yet
        (``FileExistsError`` otherwise), so that of two concurrent creators exactly one wins.
    clean
        First remove the temporaries that dead writers left in the directory.

    Raises
    ------
    DiskFullError
        When the file system runs out of space or quota; the previous file is intact.
    OSError
        Other failures, naming ``path`` rather than the temporary file.
    """
    path = resolve_target(path)
    directory = os.path.dirname(os.path.abspath(path))
    if clean:
        remove_stale_temporaries(directory)
    temporary: str | None = None
    fd = -1
    try:
        temporary, fd = create_temporary(path)
        if not exclusive:
            _keep_mode_and_owner(fd, path)
        yield fd
        if durable:
            os.fsync(fd)
        if exclusive:
            os.link(temporary, path)  # fails if the target exists, unlike a rename
        else:
            os.replace(temporary, path)
            temporary = None
        if durable:
            _fsync_directory(directory)
    except OSError as error:
        raise_described(error, path, temporary)
    finally:
        if fd >= 0:
            os.close(fd)
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)


def raise_described(error: OSError, path: str, temporary: str | None) -> NoReturn:
    """Raise what :func:`describe_write_error` says ``error`` is."""
    described = describe_write_error(error, path, temporary)
    if described is error:
        raise error
    raise described from error


def describe_write_error(error: OSError, path: str, temporary: str | None) -> OSError:
    """What to raise for ``error`` in a write of ``path`` through ``temporary``: a
    :class:`DiskFullError` for a full disk or quota, else ``error`` itself, made to name
    ``path`` (the user's file) rather than the temporary one, or none."""
    if error.errno in _SPACE_ERRNOS and not isinstance(error, DiskFullError):
        return DiskFullError(
            error.errno,
            f"{error.strerror} while saving (the previous file, if any, is intact)",
            path,
        )
    named = error.filename
    if error.errno is not None and (
        named is None or named == temporary or is_temporary(os.path.basename(os.fsdecode(named)))
    ):
        error.filename = path
        error.filename2 = None
    return error
