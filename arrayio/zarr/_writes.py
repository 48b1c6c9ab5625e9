"""Writes and deletes of store values, relative to an open directory's descriptor.

A write is atomic and durable (a temporary file, fsync, then a rename, as
:mod:`arrayio.integrity._atomic` does), so that a write that fails leaves the previous value
in place; a value in GPU memory goes through the dispatcher's device tools.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat

import numpy as np
from zarr.core.buffer import Buffer

from ..arrays._buffers import CupyDeviceBuffer
from ..dispatch import _transfer
from ..integrity import _atomic

__all__ = [
    "clean_once",
    "delete_at",
    "discard_at",
    "is_file_at",
    "publish_at",
    "stage_at",
    "sync_directory",
    "write_at",
]


def _host_bytes(value: Buffer) -> np.ndarray | None:
    """A value's bytes as a flat host ``uint8`` array; None if they live on a GPU."""
    data = value.as_array_like()
    if hasattr(data, "__cuda_array_interface__"):
        return None
    if not isinstance(data, np.ndarray):
        data = value.as_numpy_array()
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _write_value(fd: int, value: Buffer) -> None:
    host = _host_bytes(value)
    if host is not None:
        _transfer.write_from(fd, 0, host)
        return
    import cupy

    data = cupy.asarray(value.as_array_like()).reshape(-1).view(cupy.uint8)
    with data.device:
        # The producer's kernels may run on any stream, the tools' copies on their own.
        cupy.cuda.runtime.deviceSynchronize()
        _transfer.write_from(fd, 0, CupyDeviceBuffer(data))


def write_at(
    directory_fd: int,
    name: str,
    value: Buffer,
    exclusive: bool,
    cleaned: set[tuple[int, int]],
    path: str,
) -> None:
    """Store ``value`` as ``name`` in the open directory, atomically and durably.

    As :func:`arrayio.integrity._atomic.atomic_write` does by path, but relative to the directory's
    descriptor, so that the write lands in the directory that was checked. The complete
    file is renamed over ``name`` (a link there is replaced, never written through) or,
    ``exclusive``, linked to it, which raises ``FileExistsError`` if ``name`` exists: of two
    concurrent creators exactly one wins, and nobody sees a partial file.
    """
    clean_once(directory_fd, cleaned)
    temporary, fd = stage_at(directory_fd, name, value, path)
    try:
        publish_at(directory_fd, temporary, name, exclusive, path)
        sync_directory(directory_fd)
    finally:
        os.close(fd)


def stage_at(directory_fd: int, name: str, value: Buffer, path: str) -> tuple[str, int]:
    """The first half of a write: ``value`` in a new temporary file beside ``name``, on disk
    (fsynced). Returns the temporary's name and its descriptor, open (its lock held) until
    :func:`publish_at` has put it in place; on failure nothing is left behind."""
    temporary: str | None = None
    fd = -1
    try:
        temporary, fd = _atomic.create_temporary(name, dir_fd=directory_fd)
        _write_value(fd, value)
        os.fsync(fd)
        return temporary, fd
    except BaseException as error:
        discard_at(directory_fd, temporary, fd)
        if isinstance(error, OSError):  # a full disk, and errors naming the key's file
            _atomic.raise_described(error, path, temporary)
        raise


def publish_at(directory_fd: int, temporary: str, name: str, exclusive: bool, path: str) -> None:
    """The second half: the staged ``temporary`` renamed over ``name`` or, ``exclusive``,
    linked to it (``FileExistsError`` if ``name`` exists). The temporary is gone either way."""
    try:
        if exclusive:
            try:
                os.link(temporary, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary, dir_fd=directory_fd)
        else:
            os.replace(temporary, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
    except FileExistsError:
        raise
    except OSError as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=directory_fd)
        _atomic.raise_described(error, path, temporary)


def discard_at(directory_fd: int, temporary: str | None, fd: int) -> None:
    """Close and remove a staged temporary that will not be published."""
    if fd >= 0:
        os.close(fd)
    if temporary is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=directory_fd)


def sync_directory(directory_fd: int) -> None:
    """Make the directory's renames durable."""
    with contextlib.suppress(OSError):  # some file systems cannot fsync a directory; the
        os.fsync(directory_fd)  # rename is atomic all the same


def clean_once(directory_fd: int, cleaned: set[tuple[int, int]]) -> None:
    """Remove the temporaries that dead writers left in a directory, the first time a store
    writes there (``cleaned`` holds the directories it has cleaned): a chunk directory can
    hold many thousands of files, and listing it on every write would cost more than the
    write, while a store opened after a crash still cleans what the crash left."""
    status = os.fstat(directory_fd)
    directory = (status.st_dev, status.st_ino)
    if directory not in cleaned:
        _atomic.remove_stale_temporaries(directory_fd)
        cleaned.add(directory)


def delete_at(directory_fd: int, name: str) -> None:
    """Remove ``name`` from the open directory if it is there: a directory with everything
    below it (as LocalStore does), anything else by itself; a link, never what it points to."""
    try:
        status = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(status.st_mode):
        shutil.rmtree(name, dir_fd=directory_fd)  # removes links below, never follows them
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=directory_fd)


def is_file_at(directory_fd: int, name: str) -> bool:
    """Whether ``name`` in the open directory is a file (not a link to one)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=directory_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False
