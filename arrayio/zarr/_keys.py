"""Store keys, and the part of the file system they may reach.

A key is a relative path below the store's root: :func:`check_key` refuses one that would
leave it (``..``, an absolute path, a backslash or NUL), and :class:`Boundary` opens keys so
that none leads out of the root through a symbolic link, unless the store follows links.
Where the kernel runs ``openat2`` with ``RESOLVE_NO_SYMLINKS``, a key with no link in its
path costs one system call and no check.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ..errors import ArrayioError
from ..integrity import _atomic

__all__ = [
    "CLOEXEC",
    "DIRECTORY",
    "LOOKUP",
    "MISSING",
    "Boundary",
    "InvalidKeyError",
    "check_key",
    "check_prefix",
    "files_below",
    "split_key",
]

MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | CLOEXEC
# Only to look at a file (fstat, where it is): opening it this way has no side effect, even
# on a FIFO or a device.
LOOKUP = getattr(os, "O_PATH", os.O_RDONLY | os.O_NONBLOCK) | CLOEXEC


class InvalidKeyError(ArrayioError, ValueError):
    """A store key that does not name a path inside the store's root."""


def check_key(key: object, *, what: str = "key") -> str:
    """Return ``key`` if it is a relative path below the root; raise otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"store {what}s are strings, got {type(key).__name__}: {key!r}")
    if "\x00" in key or "\\" in key:
        raise InvalidKeyError(f"store {what} {key!r} contains a NUL or a backslash")
    if key.startswith("/"):
        raise InvalidKeyError(f"store {what} {key!r} is absolute; keys are relative to the root")
    parts = key.split("/")
    if any(part in ("..", ".") for part in parts):
        raise InvalidKeyError(
            f"store {what} {key!r} has a '.' or '..' component; keys cannot leave the root"
        )
    return key


def check_prefix(prefix: object) -> str:
    """Return a listing's ``prefix`` if it is a relative path below the root, ``""`` for one
    made of slashes alone (``"/"``: the root, as zarr's stores list it); raise otherwise."""
    if isinstance(prefix, str) and prefix and not prefix.strip("/"):
        return ""
    return check_key(prefix, what="prefix")


def split_key(key: str) -> tuple[str, str]:
    """``(directory, name)`` of a checked key, empty components dropped (``"c//0"`` is
    ``c/0``, as the file system reads it)."""
    parts = [part for part in key.split("/") if part]
    return "/".join(parts[:-1]), parts[-1] if parts else ""


# openat2(2) with RESOLVE_NO_SYMLINKS (Linux >= 5.6) opens a path only if none of its
# components is a symbolic link: one system call, with no moment between a check and the open
# in which a link could appear. Python has no binding for it; it goes through libc's syscall().
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
_RESOLVE_NO_SYMLINKS = 0x04


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.cache
def _how(flags: int) -> Any:
    """openat2's ``struct open_how`` for ``flags``, made once: building ctypes objects costs
    more than the call."""
    return ctypes.byref(_OpenHow(flags, 0, _RESOLVE_NO_SYMLINKS))


@functools.cache
def _openat2() -> Callable[[bytes, Any], int] | None:
    """openat2 relative to the working directory, taking a path and a :func:`_how`; None
    where the kernel does not run it (Linux before 5.6, a seccomp filter that refuses it,
    another system)."""
    if _SYS_OPENAT2 is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    # syscall() takes variadic longs: the arguments go typed, as argtypes cannot say so.
    number, here, size = (
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(-100),  # -100: AT_FDCWD
        ctypes.c_size_t(ctypes.sizeof(_OpenHow)),
    )

    def openat2(path: bytes, how: Any) -> int:
        return syscall(number, here, path, how, size)

    probe = openat2(b"/", _how(LOOKUP))
    if probe < 0:
        return None
    os.close(probe)
    return openat2


def _open_without_links(path: str, flags: int) -> int | None:
    """``os.open(path, flags)`` if no component of ``path`` is a symbolic link; None if one
    is, where openat2 is not available, or where it fails otherwise than for a missing file
    (the caller's :func:`os.open` then gives the error as it would).

    Raises
    ------
    FileNotFoundError, NotADirectoryError
        If ``path`` is missing, or a file stands where a directory should.
    """
    openat2 = _openat2()
    if openat2 is None:
        return None
    fd = openat2(os.fsencode(path), _how(flags))
    if fd >= 0:
        return fd
    error = ctypes.get_errno()
    if error in (errno.ENOENT, errno.ENOTDIR):  # asked for often: zarr's missing chunks
        raise OSError(error, os.strerror(error), path)
    return None


def _real_path_of(fd: int, opened_as: str) -> str:
    """Where the file open at ``fd`` really is.

    Linux's ``/proc/self/fd`` gives the path the kernel resolved when it opened ``fd``:
    checking that path, not ``opened_as`` again, leaves no moment in which a link could be
    changed between the check and the use. Without procfs, ``opened_as`` is resolved again,
    which does leave one.
    """
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(opened_as)


class _RealRoot(NamedTuple):
    path: str  # with no link in it
    below: str  # the path and a separator: what every path below it starts with


class Boundary:
    """The part of the file system a store's keys may reach: below the real path of its root,
    or anywhere when the store follows symbolic links."""

    def __init__(self, root: str, follow_symlinks: bool) -> None:
        self.root = root
        self.follow_symlinks = follow_symlinks
        # Resolved once, as resolving the root for every key would walk each of its
        # components; one tuple, replaced whole, so that threads never see half of it.
        self._real_root: _RealRoot | None = None

    def _resolved(self, *, again: bool = False) -> _RealRoot:
        real_root = None if again else self._real_root
        if real_root is None:
            path = os.path.realpath(self.root)
            real_root = self._real_root = _RealRoot(path, os.path.join(path, ""))
        return real_root

    def _holds(self, real_path: str, *, again: bool = False) -> bool:
        real_root = self._resolved(again=again)
        return real_path.startswith(real_root.below) or real_path == real_root.path

    def holds(self, real_path: str) -> bool:
        """Whether ``real_path`` (a path with no links in it) lies in the root."""
        # Before refusing, the root is resolved again: it (or a link to it) may have moved.
        return self._holds(real_path) or self._holds(real_path, again=True)

    def open(self, relative: str, flags: int, name: str) -> tuple[int, str]:
        """Open ``relative`` (a checked key or prefix; ``""``: the root) below the root with
        ``flags``; return the descriptor and the real path of what it opened (the path
        unresolved, when following links).

        The common case, no link below the root, costs one system call: the path from the
        root's real path, opened only if it holds no link. Where it does (or openat2 is not
        available), the path is opened as the kernel resolves it, and where it landed is
        checked (:meth:`admit`).

        Raises
        ------
        InvalidKeyError
            If it lands outside the root, naming ``name``.
        OSError
            As :func:`os.open` does.
        """
        if self.follow_symlinks:
            path = os.path.join(self.root, relative)
            return os.open(path, flags), path
        real_path = (self._real_root or self._resolved()).below + relative
        fd = _open_without_links(real_path, flags)
        if fd is not None:
            return fd, real_path
        path = os.path.join(self.root, relative)
        fd = os.open(path, flags)
        return fd, self.admit(fd, path, name)

    def admit(self, fd: int, opened_as: str, name: str) -> str:
        """The real path of the file open at ``fd`` (opened as the path ``opened_as``, for
        the key or prefix ``name``); if it lies outside the root, close ``fd`` and raise
        :class:`InvalidKeyError`. When following links, ``opened_as`` itself, unchecked."""
        if self.follow_symlinks:
            return opened_as
        where = _real_path_of(fd, opened_as)
        if self.holds(where):
            return where
        os.close(fd)
        raise InvalidKeyError(
            f"store key {name!r} leads out of the store through a symbolic link: it resolves "
            f"to {where!r}, outside the root {os.path.realpath(self.root)!r}; "
            f"NVMeStore(..., follow_symlinks=True) follows links out of the root"
        )

    def leads_inside(self, real_directory: str, link: str) -> bool:
        """Whether the link named ``link`` in the directory whose real path is
        ``real_directory`` resolves inside the root (always, when following links)."""
        return self.follow_symlinks or self.holds(
            os.path.realpath(os.path.join(real_directory, link))
        )


def files_below(
    directory_fd: int, real_directory: str, prefix: str, boundary: Boundary
) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """The keys below an open directory (``prefix`` is its key prefix) with their entries,
    which can be stat'ed until the next key is asked for.

    Linked directories are not walked into (a link may form a cycle; ``os.walk`` and
    LocalStore do not either); a linked file is a key if the link stays inside
    ``boundary``. A link that leads out is skipped rather than refused: zarr lists to find
    a hierarchy's members and count its chunks, and one stray link should not make the rest
    of the store unlistable (reading it by name is refused). Directories are opened relative
    to their parent without following links, so that no link put in place of one while the
    walk runs leads it out of the root.
    """
    with os.scandir(directory_fd) as scan:
        entries = list(scan)
    for entry in entries:
        if entry.is_symlink():
            if (
                not _atomic.is_temporary(entry.name)
                and boundary.leads_inside(real_directory, entry.name)
                and entry.is_file()
            ):
                yield prefix + entry.name, entry
        elif entry.is_dir(follow_symlinks=False):
            try:
                child = os.open(entry.name, DIRECTORY | os.O_NOFOLLOW, dir_fd=directory_fd)
            except OSError as error:
                if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # gone, or replaced by a file or a link since the scan
                raise
            try:
                yield from files_below(
                    child,
                    os.path.join(real_directory, entry.name),
                    f"{prefix}{entry.name}/",
                    boundary,
                )
            finally:
                os.close(child)
        elif entry.is_file(follow_symlinks=False) and not _atomic.is_temporary(entry.name):
            yield prefix + entry.name, entry
