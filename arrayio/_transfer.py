"""The one place where bytes move between a file and memory.

Everything else in arrayio calls :func:`read_into` and :func:`write_from` with a file
descriptor, a byte offset and a buffer: a host ``uint8`` NumPy array, or a
:class:`~arrayio._buffers.DeviceBuffer`. This simple path (``pread``/``pwrite`` loops; GPU
memory staged through one pinned host buffer) is correct everywhere; the transfer-tools
dispatcher replaces it with faster tools behind the same two functions.

Both functions can compute the CRC-32C of the bytes they move while those bytes are on the
host anyway, so that checksums never cost a second pass over the data.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import crc32c as _crc32c
import numpy as np

from . import config
from .errors import TruncatedFileError

if TYPE_CHECKING:
    from ._buffers import DeviceBuffer

__all__ = ["Staging", "checksum", "read_into", "write_from"]

# Linux moves at most 0x7FFFF000 bytes per read or write call; chunking host I/O also lets the
# checksum run on data that is still in cache.
_HOST_CHUNK = 64 << 20


def checksum(data: np.ndarray, value: int = 0) -> int:
    """Extend the CRC-32C ``value`` with the bytes of ``data`` (a ``uint8`` host array)."""
    return _crc32c.crc32c(data, value) if data.nbytes else value


class Staging:
    """Pinned host buffers for GPU transfers, reused across the arrays of one save or load."""

    def __init__(self) -> None:
        self._buffers: dict[int, np.ndarray] = {}

    def host_for(self, device: DeviceBuffer) -> np.ndarray:
        need = min(config.get().staging_bytes, max(device.nbytes, 1))
        buffer = self._buffers.get(device.device_index)
        if buffer is None or buffer.nbytes < need:
            buffer = device.pinned_empty(need)
            self._buffers[device.device_index] = buffer
        return buffer


def _pread_exact(fd: int, view: np.ndarray, file_offset: int, path: str) -> None:
    done = 0
    memory = memoryview(view)
    while done < view.nbytes:
        got = os.preadv(fd, [memory[done:]], file_offset + done)
        if got == 0:
            raise TruncatedFileError(
                f"{path}: file ends at byte {file_offset + done}, expected "
                f"{view.nbytes - done} more bytes (truncated while reading?)"
            )
        done += got


def _pwrite_all(fd: int, view: np.ndarray, file_offset: int) -> None:
    done = 0
    memory = memoryview(view)
    while done < view.nbytes:
        done += os.pwritev(fd, [memory[done:]], file_offset + done)


def read_into(
    fd: int,
    file_offset: int,
    dest: np.ndarray | DeviceBuffer,
    *,
    path: str = "<file>",
    with_checksum: bool = False,
    staging: Staging | None = None,
) -> int | None:
    """Fill ``dest`` with ``dest.nbytes`` bytes read from ``fd`` at ``file_offset``.

    Parameters
    ----------
    fd
        An open file descriptor, readable.
    file_offset
        Where the bytes start in the file.
    dest
        A flat host ``uint8`` array, or device bytes.
    path
        The file's name, for error messages.
    with_checksum
        Also return the CRC-32C of the bytes read.
    staging
        Pinned buffers to reuse for device destinations.

    Returns
    -------
    int or None
        The CRC-32C of the bytes, if ``with_checksum``.

    Raises
    ------
    TruncatedFileError
        If the file ends before ``dest`` is full.
    """
    crc = 0
    if isinstance(dest, np.ndarray):
        for start in range(0, dest.nbytes, _HOST_CHUNK):
            chunk = dest[start : start + _HOST_CHUNK]
            _pread_exact(fd, chunk, file_offset + start, path)
            if with_checksum:
                crc = checksum(chunk, crc)
        return crc if with_checksum else None

    host = (staging or Staging()).host_for(dest)
    for start in range(0, dest.nbytes, host.nbytes):
        chunk = host[: min(host.nbytes, dest.nbytes - start)]
        _pread_exact(fd, chunk, file_offset + start, path)
        if with_checksum:
            crc = checksum(chunk, crc)
        dest.copy_from_host(start, chunk)
    return crc if with_checksum else None


def write_from(
    fd: int,
    file_offset: int,
    src: np.ndarray | DeviceBuffer,
    *,
    with_checksum: bool = False,
    staging: Staging | None = None,
) -> int | None:
    """Write all bytes of ``src`` to ``fd`` at ``file_offset``; see :func:`read_into`.

    Returns
    -------
    int or None
        The CRC-32C of the bytes, if ``with_checksum``.
    """
    crc = 0
    if isinstance(src, np.ndarray):
        for start in range(0, src.nbytes, _HOST_CHUNK):
            chunk = src[start : start + _HOST_CHUNK]
            if with_checksum:
                crc = checksum(chunk, crc)
            _pwrite_all(fd, chunk, file_offset + start)
        return crc if with_checksum else None

    host = (staging or Staging()).host_for(src)
    for start in range(0, src.nbytes, host.nbytes):
        chunk = host[: min(host.nbytes, src.nbytes - start)]
        src.copy_to_host(start, chunk)
        if with_checksum:
            crc = checksum(chunk, crc)
        _pwrite_all(fd, chunk, file_offset + start)
    return crc if with_checksum else None
