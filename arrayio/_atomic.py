"""Atomic file replacement: the old file stays intact until the new one is complete on disk.

The new content goes to a hidden temporary file in the same directory
(``.NAME.arrayio-tmp-XXXXXXXXXXXX``), is fsynced, and is renamed over the target; the directory
is fsynced so that the rename itself survives a crash. Any Python-level failure removes the
temporary file; a process killed outright (SIGKILL, power loss) can leave it behind, never a
damaged target. (``O_TMPFILE`` would avoid even that, but linking it into place through
``/proc/self/fd`` is refused in some sandboxes, so it is not relied on.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

__all__ = ["atomic_write", "TEMP_MARKER"]

TEMP_MARKER = ".arrayio-tmp-"


def _temporary_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}{TEMP_MARKER}{secrets.token_hex(6)}")


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


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[int]:
    """Yield a writable file descriptor whose content replaces ``path`` on success.

    On an exception inside the block the target is left as it was and the partial file is
    removed. The descriptor is closed by this function. With ``durable=False`` neither the
    file nor the directory is fsynced: readers still see the old content or the new, never
    a mix, but a crash may lose the new content (for caches, which must not wait on the
    disk).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    temp_name: str | None = _temporary_name(path)
    # 0o666 filtered by the umask, as for any new file (mkstemp would give 0o600).
    fd = os.open(temp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                 0o666)
    try:
        yield fd
        if durable:
            os.fsync(fd)
        os.replace(temp_name, path)
        temp_name = None
        if durable:
            _fsync_directory(directory)
    finally:
        os.close(fd)
        if temp_name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)
