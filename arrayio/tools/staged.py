"""A pipeline of pinned host buffers between the file and GPU memory.

The range is cut into chunks. ``threads`` workers each own one pinned buffer and one CUDA
stream; a worker reads a chunk from the file into its buffer (``pread``, or ``O_DIRECT``
with ``direct=True``, which keeps cold reads off the page cache and lets several streams
keep the disk's queue full), checksums it while it is in cache, and copies it to the device
asynchronously, then waits for that copy before reusing the buffer. With several workers,
disk reads, checksums and PCIe copies of different chunks overlap. Writes run the same
pipeline the other way (device to pinned buffer, checksum, ``pwrite``).

Needs CuPy and a GPU; device buffers owned by torch are viewed through CuPy, zero-copy.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import os
import threading
from typing import Any

import numpy as np

from .._buffers import DeviceBuffer, synchronize_device
from .._checksum import ChecksumParts
from ..errors import ToolUnavailableError
from ._io import pread_full, pwrite_full
from .base import Availability, Buffer, Capabilities, IOFuture, Tool

__all__ = ["StagedTool"]

_BLOCK = 4096


class StagedTool(Tool):
    """Pinned-buffer pipeline for device memory; see the module docstring.

    Parameters
    ----------
    threads
        Workers, each with one pinned buffer of ``chunk_size`` bytes and one CUDA stream.
    chunk_size
        Bytes per chunk (rounded up to 4096).
    direct
        Read with ``O_DIRECT`` (writes always go through the page cache).
    """

    name = "staged"
    capabilities = Capabilities(frozenset({"cuda"}), alignment=_BLOCK)

    def __init__(self, threads: int = 4, chunk_size: int = 16 << 20, direct: bool = False,
                 **params: Any) -> None:
        if threads < 1 or chunk_size < 1:
            raise ValueError(f"threads and chunk_size must be positive: {threads}, {chunk_size}")
        chunk_size = -(-chunk_size // _BLOCK) * _BLOCK
        super().__init__(threads=threads, chunk_size=chunk_size, direct=direct, **params)
        self.threads, self.chunk_size, self.direct = threads, chunk_size, direct
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pinned: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    @classmethod
    @functools.cache
    def availability(cls) -> Availability:
        try:
            import cupy
        except ImportError:
            return Availability(False, "CuPy is not installed (pip install 'arrayio[gpu]')")
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                return Availability(False, "no CUDA device")
        except Exception as error:  # noqa: BLE001 - any CUDA failure means "not here"
            return Availability(False, f"CUDA is not usable: {error}")
        return Availability(True)

    def _resources(self, device_index: int) -> tuple[concurrent.futures.ThreadPoolExecutor,
                                                     list[np.ndarray]]:
        import cupyx

        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix="arrayio-staged")
            if device_index not in self._pinned:
                # One block of slack so an O_DIRECT read can start on the block boundary
                # before an unaligned offset, plus one after for the rounded-up length.
                self._pinned[device_index] = [
                    cupyx.empty_pinned((self.chunk_size + 2 * _BLOCK,), dtype=np.uint8)
                    for _ in range(self.threads)
                ]
            return self._pool, self._pinned[device_index]

    @staticmethod
    def _device_bytes(buffer: DeviceBuffer) -> Any:
        import cupy

        return cupy.asarray(buffer.cuda_array).reshape(-1).view(cupy.uint8)

    def _open_direct(self, fd: int) -> int:
        try:
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as error:
            if error.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                raise ToolUnavailableError(
                    error.errno, f"O_DIRECT refused by this file system ({error.strerror})"
                ) from error
            raise

    def pread(self, fd: int, buffer: Buffer, file_offset: int, *,
              checksum: ChecksumParts | None = None) -> IOFuture[int]:
        if isinstance(buffer, np.ndarray):
            raise TypeError("staged moves device memory; use another tool for host memory")
        if buffer.nbytes == 0:
            return IOFuture.completed(0)
        import cupy

        pool, pinned = self._resources(buffer.device_index)
        device = self._device_bytes(buffer)
        nbytes = buffer.nbytes
        read_fd = self._open_direct(fd) if self.direct else fd
        chunks = list(range(0, nbytes, self.chunk_size))

        def worker(k: int) -> int:
            slot = pinned[k]
            total = 0
            with cupy.cuda.Device(buffer.device_index):
                stream = cupy.cuda.Stream(non_blocking=True)
                for start in chunks[k :: self.threads]:
                    length = min(self.chunk_size, nbytes - start)
                    position = file_offset + start
                    if self.direct:
                        aligned = position - position % _BLOCK
                        skip = position - aligned
                        span = -(-(skip + length) // _BLOCK) * _BLOCK
                        got = max(0, min(pread_full(read_fd, slot[:span], aligned) - skip,
                                         length))
                        data = slot[skip : skip + got]
                    else:
                        got = pread_full(read_fd, slot[:length], position)
                        data = slot[:got]
                    if checksum is not None:
                        checksum.add_data(start, data)
                    device[start : start + got].set(data, stream=stream)
                    stream.synchronize()  # the slot is reused for the next chunk
                    total += got
            return total

        futures = [IOFuture(pool.submit(worker, k)) for k in range(min(self.threads, len(chunks)))]

        def finish(total: int) -> int:
            if read_fd != fd:
                os.close(read_fd)
            return total

        return IOFuture.gather(futures, finish)

    def pwrite(self, fd: int, buffer: Buffer, file_offset: int, *,
               checksum: ChecksumParts | None = None) -> IOFuture[int]:
        if isinstance(buffer, np.ndarray):
            raise TypeError("staged moves device memory; use another tool for host memory")
        if buffer.nbytes == 0:
            return IOFuture.completed(0)
        import cupy

        synchronize_device(buffer)  # the producer's kernels must be done
        pool, pinned = self._resources(buffer.device_index)
        device = self._device_bytes(buffer)
        nbytes = buffer.nbytes
        chunks = list(range(0, nbytes, self.chunk_size))

        def worker(k: int) -> int:
            slot = pinned[k]
            total = 0
            with cupy.cuda.Device(buffer.device_index):
                stream = cupy.cuda.Stream(non_blocking=True)
                for start in chunks[k :: self.threads]:
                    length = min(self.chunk_size, nbytes - start)
                    data = slot[:length]
                    device[start : start + length].get(stream=stream, out=data)
                    stream.synchronize()
                    if checksum is not None:
                        checksum.add_data(start, data)
                    total += pwrite_full(fd, data, file_offset + start)
            return total

        return IOFuture.gather(
            [IOFuture(pool.submit(worker, k)) for k in range(min(self.threads, len(chunks)))]
        )

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self._pinned.clear()
