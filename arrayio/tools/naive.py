"""The baseline: one thread, one ``pread``/``pwrite`` loop; device memory staged through a
single pinned host buffer, one chunk at a time, with no overlap.

It is what arrayio did before it had a dispatcher, and what every other tool is measured
against. It serves every memory kind and never fails for a reason other than the file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np

from .. import config
from ..arrays._buffers import DeviceBuffer
from ..integrity._checksum import ChecksumParts
from . import _pinned as pinned
from ._io import pread_checksummed, pread_full, pread_scattered, pwrite_full
from .base import Buffer, Capabilities, IOFuture, Tool

__all__ = ["NaiveTool"]

_HOST_CHUNK = 64 << 20  # writes go out in pieces this size, each checksummed first


class NaiveTool(Tool):
    """Read everything to the host, then copy; see the module docstring."""

    name = "naive"
    capabilities = Capabilities(frozenset({"host", "cuda"}))

    @staticmethod
    @contextlib.contextmanager
    def _host_for(device: DeviceBuffer) -> Iterator[np.ndarray]:
        """Pinned staging of at most ``staging_bytes``, from the process's pool."""
        need = min(config.get().staging_bytes, max(device.nbytes, 1))
        with pinned.pool.lend(need, device.pinned_empty) as host:
            yield host[:need]

    def pread(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if isinstance(buffer, np.ndarray):
            return IOFuture.completed(self._read_host(fd, buffer, file_offset, checksum))
        done = 0
        with self._host_for(buffer) as host:
            for start in range(0, buffer.nbytes, host.nbytes):
                chunk = host[: min(host.nbytes, buffer.nbytes - start)]
                if checksum is None:
                    got = pread_full(fd, chunk, file_offset + start)
                else:
                    got, crc = pread_checksummed(fd, chunk, file_offset + start)
                    checksum.add(start, got, crc)
                buffer.copy_from_host(start, chunk[:got])
                done += got
                if got < chunk.nbytes:
                    break
        return IOFuture.completed(done)

    @staticmethod
    def read_scattered(
        fd: int, offsets: Sequence[int], views: Sequence[np.ndarray], scratch: np.ndarray
    ) -> bool:
        """Read host ``views``, neighbours in the file at ``offsets``, with one ``preadv``
        (see :func:`~arrayio.tools._io.pread_scattered`); whether every one was filled."""
        return pread_scattered(fd, offsets, views, scratch)

    @staticmethod
    def _read_host(
        fd: int, buffer: np.ndarray, file_offset: int, checksum: ChecksumParts | None
    ) -> int:
        if checksum is None:
            return pread_full(fd, buffer, file_offset)
        got, crc = pread_checksummed(fd, buffer, file_offset)
        checksum.add(0, got, crc)
        return got

    def pwrite(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if isinstance(buffer, np.ndarray):
            for start in range(0, buffer.nbytes, _HOST_CHUNK):
                chunk = buffer[start : start + _HOST_CHUNK]
                if checksum is not None:
                    checksum.add_data(start, chunk)
                pwrite_full(fd, chunk, file_offset + start)
            return IOFuture.completed(buffer.nbytes)
        with self._host_for(buffer) as host:
            for start in range(0, buffer.nbytes, host.nbytes):
                chunk = host[: min(host.nbytes, buffer.nbytes - start)]
                buffer.copy_to_host(start, chunk)
                if checksum is not None:
                    checksum.add_data(start, chunk)
                pwrite_full(fd, chunk, file_offset + start)
        return IOFuture.completed(buffer.nbytes)
