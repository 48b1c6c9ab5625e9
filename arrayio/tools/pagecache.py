"""The GPU's copy engine reads the page cache itself: one pass over host memory.

A read from the page cache into GPU memory through pinned staging buffers moves each byte
through host memory three times: the kernel's copy out of the page cache reads it and
writes the pinned buffer, and the copy engine reads the buffer. Where host memory is the
bound (several GPUs loading at once), only one pass does better. This tool maps the file
read-only and registers the mapped pages with CUDA, read-only, a window at a time
(``cuMemHostRegister`` with ``CU_MEMHOSTREGISTER_READ_ONLY``): the driver pins the page
cache's own pages, and the copy engine reads them. While one window's copy is in flight,
the worker registers its next; ``threads`` workers take the windows in turn.

It pays only for files wholly in the page cache: registering faults missing pages in, one
at a time. The CPU never touches the mapping, so a file that shrinks under a read cannot
raise SIGBUS: pinning a page past the new end fails instead, and the read's count is cut
to the file's size after the copies. A window's pages are registered once per read
(windows are aligned to pages, not to the buffers).

The dispatcher does not offer it: registering and unregistering every read's windows
costs more than the pass it saves when one GPU loads from the page cache
(docs/design/tools.md has the measurements). It serves reads that name it
(``tool="pagecache"``, ``ARRAYIO_TOOL=pagecache``). Reads only, into device memory only,
and it cannot checksum bytes it never sees (arrayio then verifies on the GPU). Needs a GPU
that takes read-only registrations (``CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED``)
and its driver, no framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arrays import _cuda
from ..errors import ToolUnavailableError
from ..integrity._checksum import ChecksumParts
from ._threaded import ThreadedTool
from .base import (
    Availability,
    Buffer,
    Capabilities,
    DeviceRanges,
    IOFuture,
    ReadsOnly,
    one_gpu,
)

__all__ = ["PagecacheTool", "Copy", "Window", "plan"]

PAGE = mmap.PAGESIZE


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    """Bytes of one request within a window: from ``source`` (an offset into the mapping)
    to ``target`` (an offset into request ``request``'s buffer)."""

    request: int
    source: int
    target: int
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """Pages registered together (``start``, ``length``: offsets into the mapping, whole
    pages), and the copies out of them."""

    start: int
    length: int
    copies: tuple[Copy, ...]


def plan(
    requests: Sequence[tuple[int, int]], file_size: int, window: int, page: int = PAGE
) -> tuple[int, int, list[Window]]:
    """The mapping (its file offset, a page's, and its length, to the end of the last page
    read or of the file, whichever comes first) and windows that copy each
    ``(file_offset, nbytes)`` of ``requests`` (in file order, none overlapping) up to the end
    of the file; windows with nothing to copy (gaps between requests) are left out.

    Windows are whole pages: the last may reach past the mapping's length to the end of its
    page, which the kernel maps with the rest (``mmap`` refuses a length past the file's
    end, but maps whole pages)."""
    spans = [(offset, min(offset + nbytes, file_size)) for offset, nbytes in requests]
    live = [(start, end) for start, end in spans if end > start]
    if not live:
        return 0, 0, []
    first, last = live[0][0], live[-1][1]
    map_start = first - first % page
    map_end = -(-last // page) * page
    step = max(page, window - window % page)
    windows = []
    for low in range(map_start, map_end, step):
        high = min(low + step, map_end)
        copies = []
        for index, ((offset, _), (start, end)) in enumerate(zip(requests, spans, strict=True)):
            begin, finish = max(start, low), min(end, high)
            if finish > begin:
                copies.append(Copy(index, begin - map_start, begin - offset, finish - begin))
        if copies:
            windows.append(Window(low - map_start, high - low, tuple(copies)))
    return map_start, min(map_end, file_size) - map_start, windows


class PagecacheTool(ReadsOnly, DeviceRanges, ThreadedTool):
    """Reads into GPU memory straight from the page cache; see the module docstring.

    Parameters
    ----------
    threads
        Workers, each registering its windows and queueing their copies on its own stream.
    window
        Bytes registered at once (rounded down to whole pages).
    """

    name = "pagecache"
    capabilities = Capabilities(
        frozenset({"cuda"}), directions=frozenset({"read"}), checksums=False
    )

    def __init__(self, threads: int = 2, window: int = 64 << 20, **params: Any) -> None:
        if window < PAGE:
            raise ValueError(f"window must be at least a page ({PAGE} bytes), got {window}")
        super().__init__(threads, window=window, **params)
        self.window = window

    @classmethod
    @functools.cache
    def availability(cls) -> Availability:
        try:
            count = _cuda.device_count()
        except OSError:
            return Availability(
                False, "no libcuda.so.1: registering the page cache needs the NVIDIA driver"
            )
        except Exception as error:  # noqa: BLE001 - any CUDA failure means "not here"
            return Availability(False, f"CUDA is not usable: {error}")
        if count == 0:
            return Availability(False, "no CUDA device")
        if not any(_cuda.registers_read_only(device) for device in range(count)):
            return Availability(False, "no GPU here takes read-only host registrations")
        return Availability(True)

    def preadv(
        self,
        fd: int,
        requests: Sequence[tuple[int, Buffer]],
        *,
        checksums: Sequence[ChecksumParts | None] | None = None,
    ) -> IOFuture[int]:
        """:meth:`DeviceRanges.preadv`, from one mapping of the range the requests span,
        registered a window at a time."""
        buffers = one_gpu(self.name, requests)
        if checksums is not None and any(parts is not None for parts in checksums):
            raise ToolUnavailableError("pagecache cannot checksum bytes the CPU never reads")
        devices = {buffer.device_index for buffer in buffers if buffer.nbytes}
        size = os.fstat(fd).st_size
        nonempty = [(offset, buffer) for offset, buffer in requests if buffer.nbytes]
        map_start, map_length, windows = plan(
            [(offset, buffer.nbytes) for offset, buffer in requests], size, self.window
        )
        if not windows:
            return IOFuture.completed(0)
        (device,) = devices
        if not _cuda.registers_read_only(device):
            raise ToolUnavailableError(f"GPU {device} does not take read-only host registrations")
        first = nonempty[0][0]
        last = min(nonempty[-1][0] + nonempty[-1][1].nbytes, size)
        try:
            mapping = mmap.mmap(
                fd, map_length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=map_start
            )
        except OSError as error:  # a descriptor that cannot be mapped (not readable, a pipe)
            raise ToolUnavailableError(f"pagecache cannot map the file: {error}") from None
        view = np.frombuffer(mapping, dtype=np.uint8)
        base = view.ctypes.data
        targets = [buffer.data_ptr for buffer in buffers]
        shares = [windows[k :: self.threads] for k in range(min(self.threads, len(windows)))]

        def worker(mine: list[Window]) -> int:
            return _copy_windows(device, base, targets, mine)

        def finish(_: int) -> int:
            nonlocal view
            del view  # the mapping exports no buffer any more: it can close
            with contextlib.suppress(BufferError):  # else it closes when collected
                mapping.close()
            # A file cut short during the read: the bytes past its new end are not the file's.
            now = os.fstat(fd).st_size
            return max(0, min(last, now) - first)

        pool = self._executor()
        try:
            futures = [IOFuture(pool.submit(worker, mine)) for mine in shares]
        except BaseException:
            finish(0)
            raise
        return IOFuture.gather(futures, finish)


def _copy_windows(device: int, base: int, targets: list[int], windows: list[Window]) -> int:
    """Register each window, queue its copies, and unregister the one before once its
    copies are done (so that one window's copies overlap the next's registration)."""
    stream = _cuda.thread_stream(device)
    events = (_cuda.Event(), _cuda.Event())
    pending: tuple[int, _cuda.Event] | None = None
    copied = 0
    try:
        for index, window in enumerate(windows):
            address = base + window.start
            try:
                _cuda.register_read_only(address, window.length)
            except _cuda.CudaError as error:
                raise ToolUnavailableError(
                    f"pagecache: the driver would not register the file's pages ({error})"
                ) from None
            try:
                for copy in window.copies:
                    _cuda.copy_host_address_to_device(
                        targets[copy.request] + copy.target, base + copy.source, copy.nbytes, stream
                    )
                    copied += copy.nbytes
                event = events[index % 2].record(stream)
            except BaseException:
                stream.synchronize()
                _cuda.unregister(address)
                raise
            if pending is not None:
                pending[1].synchronize()
                _cuda.unregister(pending[0])
            pending = (address, event)
    finally:
        if pending is not None:
            pending[1].synchronize()
            _cuda.unregister(pending[0])
    return copied
