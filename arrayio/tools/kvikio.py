"""cuFile through KvikIO: GPUDirect Storage where the driver has it, KvikIO's POSIX
compatibility mode otherwise, into device or host memory, on KvikIO's thread pool sized by
arrayio.

KvikIO moves bytes straight into device memory and never exposes them on the host, so it
cannot checksum what it moves (``checksums=False``): the dispatcher offers it only when the
caller does not verify checksums. :attr:`KvikioTool.mode` says which path ran: ``"gds"`` or
``"compat"``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..arrays import _cuda
from ..arrays._buffers import DeviceBytes, synchronize_device
from ..errors import ToolUnavailableError
from ..integrity._checksum import ChecksumParts
from ..runtime import _read_ahead
from .base import Availability, Buffer, Capabilities, IOFuture, Tool

__all__ = ["KvikioTool"]

logger = logging.getLogger("arrayio.tools")

# KvikIO's thread pool and task size are process-wide: set them under a lock, only on change.
_settings_lock = threading.Lock()
_bounce_sized = False  # whether arrayio has set KvikIO's bounce buffer size yet


def _nothing() -> None:
    """A handle already given back."""


class _Future(IOFuture[int]):
    """A KvikIO future that gives its file handle back once the transfer is done."""

    __slots__ = ("_kvikio_future", "_release")

    def __init__(self, kvikio_future: Any, release: Callable[[], None]) -> None:
        super().__init__()
        self._kvikio_future, self._release = kvikio_future, release

    def get(self) -> int:
        try:
            return int(self._kvikio_future.get())
        finally:
            release, self._release = self._release, _nothing
            release()

    def done(self) -> bool:
        return bool(self._kvikio_future.done())


# What ``import kvikio`` reads: its package, the C++ library and the logger it loads, and the
# standard modules its Python imports (see ``read_ahead``; one missing here costs only time).
IMPORTS = (
    "kvikio",
    "libkvikio",
    "rapids_logger",
    "cuda.pathfinder",
    "http.server",
    "socketserver",
    "html",
    "mimetypes",
)


class KvikioTool(Tool):
    """KvikIO ``CuFile.pread``/``pwrite``; see the module docstring.

    Parameters
    ----------
    threads
        KvikIO's thread pool size (process-wide in KvikIO, set before each transfer).
    task_size
        Bytes per KvikIO task.
    """

    name = "kvikio"
    capabilities = Capabilities(frozenset({"host", "cuda"}), alignment=4096, checksums=False)

    def __init__(self, threads: int = 16, task_size: int = 4 << 20, **params: Any) -> None:
        super().__init__(threads=threads, task_size=task_size, **params)
        self.threads, self.task_size = threads, task_size
        # One handle per descriptor and mode while transfers through it are in flight: a
        # batch's hundred arrays share one instead of opening the file a hundred times.
        self._handles: dict[tuple[int, str], list[Any]] = {}
        self._handles_lock = threading.Lock()

    # Importing KvikIO loads its libraries and CUDA's (tens of milliseconds), and pinning its
    # bounce buffers (prepare) takes about as long again. Declared above that: a set-up also
    # slows the calls that run beside it, and a stand-in's calls must have taken this long
    # before it starts (see arrayio.dispatch.policy).
    setup_seconds = 0.2

    @classmethod
    @functools.cache
    def availability(cls) -> Availability:
        # Found, not imported: the dispatcher asks every candidate's availability before a
        # call, and importing KvikIO costs more than a warm load of a model. An install that
        # cannot be imported fails its first transfer instead, as a tool failure.
        if importlib.util.find_spec("kvikio") is None:
            return Availability(False, "kvikio is not installed (pip install 'arrayio[gpu]')")
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return Availability(False, "no libcuda.so.1: KvikIO needs the NVIDIA driver")
        return Availability(True)

    @classmethod
    def read_ahead(cls) -> None:
        """Ask for the files ``import kvikio`` reads (see :mod:`arrayio.runtime._read_ahead`)."""
        _read_ahead.ask_for(_read_ahead.files_of(IMPORTS))

    def prepare(self) -> None:
        """Import KvikIO, start its threads and pin its bounce buffers."""
        with self.set_up_step("import"):
            kvikio = _import_kvikio()
        with self.set_up_step("threads"), _settings_lock:
            self._use_threads(kvikio)
        try:
            with self.set_up_step("pinning"):
                self._pin_bounce_buffers()
        except Exception as error:  # noqa: BLE001 - the first transfer pins them instead
            logger.info("kvikio: pinning the bounce buffers ahead failed: %s", error)

    def _pin_bounce_buffers(self) -> None:
        """Read a task for each thread from a file of zeros into scratch device memory.

        In compatibility mode each of KvikIO's threads stages its tasks through a pinned
        bounce buffer, pinned on the thread's first task and kept in a pool: a fresh
        process's first read pays for pinning them all, which takes longer than a warm read
        of a gigabyte. Done here, as part of the set-up, the first read runs at its rate.
        The file is a hole (nothing written, nothing on the disk)."""
        nbytes = self.threads * self.task_size
        scratch = _cuda.DeviceMemory(nbytes)
        try:
            with tempfile.NamedTemporaryFile(prefix="arrayio-kvikio-") as zeros:
                os.ftruncate(zeros.fileno(), nbytes)
                handle, release = self._open(zeros.fileno(), "r")
                try:
                    target = DeviceBytes(scratch.address, nbytes)
                    handle.pread(target, nbytes, 0, self.task_size).get()
                finally:
                    release()
        finally:
            scratch.free()

    def _use_threads(self, kvikio: Any) -> None:
        """Size KvikIO's process-wide thread pool for this tool (lock held)."""
        if kvikio.defaults.get("num_threads") != self.threads:
            kvikio.defaults.set("num_threads", self.threads)

    @property
    def mode(self) -> str:
        """``"gds"`` when cuFile drives GPUDirect Storage, ``"compat"`` for POSIX I/O."""
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults

        if kvikio.defaults.is_compat_mode_preferred():
            return "compat"
        try:
            return "gds" if kvikio.cufile_driver.get("is_gds_available") else "compat"
        except RuntimeError:
            return "compat"

    def _open(self, fd: int, flags: str) -> tuple[Any, Callable[[], None]]:
        """A handle on ``fd``'s file (shared with the transfers in flight on it), and the
        function that gives it back."""
        if not self.availability():
            raise ToolUnavailableError(self.availability().reason)
        kvikio = _import_kvikio()

        with _settings_lock:
            self._use_threads(kvikio)
            if kvikio.defaults.get("task_size") != self.task_size:
                kvikio.defaults.set("task_size", self.task_size)
            # In compatibility mode every thread stages its task through a pinned bounce
            # buffer, and pinning is slow (a fresh process pays it on its first read): the
            # first transfer pins buffers of its own task size, not KvikIO's larger default;
            # later ones only grow them, since a change frees KvikIO's buffers and pins
            # them all again, and a larger buffer than the task serves it as well.
            global _bounce_sized
            bounce = kvikio.defaults.get("bounce_buffer_size")
            if bounce < self.task_size or (not _bounce_sized and bounce != self.task_size):
                kvikio.defaults.set("bounce_buffer_size", self.task_size)
            _bounce_sized = True
        key = (fd, flags)
        with self._handles_lock:
            entry = self._handles.get(key)
            if entry is None:
                entry = self._handles[key] = [
                    kvikio.CuFile(os.readlink(f"/proc/self/fd/{fd}"), flags),
                    0,
                ]
            entry[1] += 1

        def release() -> None:
            with self._handles_lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._handles[key]
                    entry[0].close()

        return entry[0], release

    @staticmethod
    def _target(buffer: Buffer) -> Any:
        if isinstance(buffer, np.ndarray):
            return buffer
        return DeviceBytes(buffer.data_ptr, buffer.nbytes)

    def pread(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if checksum is not None:
            raise ToolUnavailableError("kvikio cannot checksum the bytes it moves")
        # KvikIO does not report a short read at the end of the file in every mode: clamp the
        # request to the file so the count returned is the truth.
        size = max(0, min(buffer.nbytes, os.fstat(fd).st_size - file_offset))
        if size == 0:
            return IOFuture.completed(0)
        handle, release = self._open(fd, "r")
        try:
            future = handle.pread(self._target(buffer), size, file_offset, self.task_size)
        except BaseException:
            release()
            raise
        return _Future(future, release)

    def pwrite(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        if checksum is not None:
            raise ToolUnavailableError("kvikio cannot checksum the bytes it moves")
        if buffer.nbytes == 0:
            return IOFuture.completed(0)
        if not isinstance(buffer, np.ndarray):
            synchronize_device(buffer)  # the producer's kernels must be done
        handle, release = self._open(fd, "r+")
        try:
            future = handle.pwrite(self._target(buffer), buffer.nbytes, file_offset, self.task_size)
        except BaseException:
            release()
            raise
        return _Future(future, release)


def _import_kvikio() -> Any:
    """The kvikio module; a broken install is the tool's failure (the dispatcher falls back)
    rather than the caller's."""
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as error:  # found by availability(), but not importable
        raise ToolUnavailableError(f"kvikio cannot be imported: {error}") from error
    return kvikio
