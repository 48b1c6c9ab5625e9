"""A zarr-python 3 store for local files whose bytes move through arrayio's dispatcher.

The layout on disk is :class:`zarr.storage.LocalStore`'s: a key is a path below the root,
one file per key. What differs is how the bytes move:

* every read lands in the memory the caller's buffer prototype asks for (NumPy memory for
  zarr's CPU buffers, CuPy memory under ``zarr.config.enable_gpu()``) and goes through
  :func:`arrayio.dispatch._transfer.read_into`. A read alone (or nearly) lets the dispatcher
  pick the transfer tool it has learned is fastest (parallel ``pread``, ``O_DIRECT``) for
  its size and cache state. When many reads are in flight, as when zarr fetches the chunks
  of a selection, the parallelism is already there, one chunk per thread: each read then
  uses a one-thread tool chosen by the page-cache state of its bytes (``O_DIRECT`` when cold,
  one ``pread`` when cached), forced through the same dispatcher (see :func:`_read_host`);
* GPU reads of a chunk alone go through the dispatcher's device tools; in a crowd, cached
  chunks go through KvikIO's thread pool, and the others are staged through pinned host
  memory owned by the reading thread, two pieces in flight, so a chunk's next piece is read
  from the file while the previous one is copied to the device, and any number of chunks
  can be read at once (see :func:`_read_device`);
* reads and writes run on a pool of I/O threads, many requests in flight at once
  (``get_partial_values``, ``_get_many`` and ``get_ranges_sync`` submit a whole batch);
* the synchronous surface (``get_sync``, ``set_sync``, ``delete_sync``, ``get_ranges_sync``)
  that zarr-python's fused codec pipeline calls instead of the async methods is the same
  code, so no path falls back to plain host I/O;
* writes are atomic and durable (temporary file, fsync, rename, as :mod:`arrayio.integrity._atomic`
  does): a write that fails leaves the previous value in place;
* keys are checked: one that would leave the root (``..``, an absolute path, a backslash or
  NUL), or that leads out of it through a symbolic link, raises :class:`InvalidKeyError`
  unless the store follows links (see :class:`NVMeStore`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import logging
import os
import platform
import shutil
import stat
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, cpu
from zarr.core.buffer.core import default_buffer_prototype

from .. import config
from ..arrays._buffers import CupyDeviceBuffer, aligned_empty
from ..dispatch import _transfer
from ..dispatch.context import cache_state
from ..dispatch.dispatcher import SMALL_TRANSFER
from ..dispatch.policy import is_tool_failure
from ..errors import ArrayioError, ToolUnavailableError
from ..integrity import _atomic

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.buffer import BufferPrototype

__all__ = ["InvalidKeyError", "NVMeStore"]

T = TypeVar("T")

_BLOCK = 4096  # O_DIRECT granularity: host buffers start at the file offset's phase in it
logger = logging.getLogger("arrayio")
# GPU reads and writes go through the host in pieces of this size, two per thread: big
# enough for the dispatcher's multi-threaded tools, small enough that 32 threads hold 512 MiB
# of pinned memory at most.
_PIECE = 8 << 20
_MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC
# Only to look at a file (fstat, where it is): opening it this way has no side effect, even
# on a FIFO or a device.
_LOOKUP = getattr(os, "O_PATH", os.O_RDONLY | os.O_NONBLOCK) | _CLOEXEC


class InvalidKeyError(ArrayioError, ValueError):
    """A store key that does not name a path inside the store's root."""


# --------------------------------------------------------------------------- the I/O pool

# One pool of I/O threads per process, shared by every store (as zarr shares its event loop
# and thread pool): stores are cheap objects that zarr, Dask and pickling copy freely, and a
# pool each would multiply threads. It holds nothing but threads.
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
# Enough requests in flight to keep an NVMe queue busy and to overlap the copies to the GPU.
IO_THREADS = min(64, max(16, 2 * (os.cpu_count() or 8)))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                IO_THREADS, thread_name_prefix="arrayio-zarr")
        return _pool


def _forget_pool_after_fork() -> None:
    # A forked child inherits the pool object but none of its threads, nor the reads those
    # threads had in flight.
    global _pool, _pool_lock, _in_flight, _in_flight_lock
    _pool, _pool_lock = None, threading.Lock()
    _in_flight, _in_flight_lock = 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


async def _in_pool(function: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_executor(), function, *args)


# --------------------------------------------------------------------------- reads in flight

# At this many reads in flight (the store's, in every thread) a read counts as one of a
# crowd. The dispatcher times each call to learn which tool is fastest, and a call that
# shares the disk and the tools' thread pools with many others measures the crowd, not the
# tool: its choices drift and it keeps exploring. Within a crowd each read needs no threads
# of its own, only the right kind of request.
CROWD = 4
_ONE_DIRECT = "direct(threads=1,task_size=67108864)"  # one O_DIRECT request up to 64 MiB
_in_flight = 0
_in_flight_lock = threading.Lock()
_no_direct: set[int] = set()  # file systems (st_dev) that refused O_DIRECT


@contextlib.contextmanager
def _counted() -> Iterator[int]:
    """Count a read in flight; yield how many are, this one included."""
    global _in_flight
    with _in_flight_lock:
        _in_flight += 1
        count = _in_flight
    try:
        yield count
    finally:
        with _in_flight_lock:
            _in_flight -= 1


def _read_host(fd: int, file_offset: int, host: np.ndarray, path: str, crowded: bool,
               file_system: int) -> None:
    """Fill ``host`` from the file through the dispatcher.

    Alone, the dispatcher chooses the tool. In a crowd (and unless the user forced a tool),
    the read is forced to one thread: ``O_DIRECT`` for bytes not in the page cache, which
    sends the whole request to the disk at once and leaves the cache to others, one
    ``pread`` for cached bytes; the measurement is still recorded.
    """
    if crowded and host.nbytes >= SMALL_TRANSFER and config.get().tool is None:
        cold = (file_system not in _no_direct
                and cache_state(fd, file_offset, host.nbytes) == "cold")
        if cold:
            try:
                _transfer.read_into(fd, file_offset, host, path=path, tool=_ONE_DIRECT)
                return
            except ToolUnavailableError:
                _no_direct.add(file_system)  # e.g. tmpfs: buffered reads from now on
        _transfer.read_into(fd, file_offset, host, path=path, tool="naive")
        return
    _transfer.read_into(fd, file_offset, host, path=path)


# --------------------------------------------------------------------------- keys


def _check_key(key: object, *, what: str = "key") -> str:
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
            f"store {what} {key!r} has a '.' or '..' component; keys cannot leave the root")
    return key


def _split(key: str) -> tuple[str, str]:
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
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


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
    number, here, size = (ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(-100),  # -100: AT_FDCWD
                          ctypes.c_size_t(ctypes.sizeof(_OpenHow)))

    def openat2(path: bytes, how: Any) -> int:
        return syscall(number, here, path, how, size)

    probe = openat2(b"/", _how(_LOOKUP))
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


class _Boundary:
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
            f"NVMeStore(..., follow_symlinks=True) follows links out of the root")

    def leads_inside(self, real_directory: str, link: str) -> bool:
        """Whether the link named ``link`` in the directory whose real path is
        ``real_directory`` resolves inside the root (always, when following links)."""
        return self.follow_symlinks or self.holds(
            os.path.realpath(os.path.join(real_directory, link)))


# --------------------------------------------------------------------------- byte ranges


def _span(byte_range: ByteRequest | None, size: int) -> tuple[int, int]:
    """The ``(file_offset, nbytes)`` a byte range selects in a file of ``size`` bytes.

    As for LocalStore, a range that starts past the end is empty and one that ends past it
    stops at the end.

    Raises
    ------
    TypeError
        For something that is not a byte request.
    ValueError
        For negative offsets or lengths, or a range that ends before it starts.
    """
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        start, end = byte_range.start, byte_range.end
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}): need 0 <= start <= end")
        start = min(start, size)
        return start, min(end, size) - start
    if isinstance(byte_range, OffsetByteRequest):
        if byte_range.offset < 0:
            raise ValueError(f"invalid byte offset {byte_range.offset}: need 0 or more")
        start = min(byte_range.offset, size)
        return start, size - start
    if isinstance(byte_range, SuffixByteRequest):
        if byte_range.suffix < 0:
            raise ValueError(f"invalid suffix length {byte_range.suffix}: need 0 or more")
        start = max(0, size - byte_range.suffix)
        return start, size - start
    raise TypeError(f"Unexpected byte_range, got {byte_range!r}")


# --------------------------------------------------------------------------- memory


def _memory_of(prototype: BufferPrototype) -> str:
    """``"cuda"`` for zarr's GPU buffers, ``"host"`` for its CPU buffers, else ``"other"``."""
    buffer_class = prototype.buffer
    # A GPU buffer class can only come from an imported zarr.core.buffer.gpu: looking it up in
    # sys.modules keeps CuPy unimported on CPU paths.
    gpu = sys.modules.get("zarr.core.buffer.gpu")
    if gpu is not None and issubclass(buffer_class, gpu.Buffer):
        return "cuda"
    if issubclass(buffer_class, cpu.Buffer):
        return "host"
    return "other"


def _host_for(file_offset: int, nbytes: int) -> np.ndarray:
    """An uninitialised host buffer at the same phase in a 4096-byte block as
    ``file_offset`` is in the file, so that an ``O_DIRECT`` read needs no bounce buffer."""
    skew = file_offset % _BLOCK
    return aligned_empty(nbytes + skew)[skew:]


class _Staging(threading.local):
    """The calling thread's pinned host pieces and CUDA streams (one per device).

    Per thread, so that any number of threads (this module's pool, zarr's, Dask's) read to
    and write from the GPU at once without sharing a staging buffer.
    """

    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []
        self.streams: dict[int, Any] = {}

    def piece(self, index: int, nbytes: int) -> np.ndarray:
        """Pinned piece ``index`` (0 or 1), at least ``nbytes`` plus a block of slack."""
        import cupyx

        while len(self.pieces) <= index:
            self.pieces.append(np.empty(0, np.uint8))
        need = min(_PIECE, -(-nbytes // _BLOCK) * _BLOCK) + _BLOCK
        if self.pieces[index].nbytes < need:
            raw = cupyx.empty_pinned((need + _BLOCK,), dtype=np.uint8)
            start = -raw.ctypes.data % _BLOCK
            self.pieces[index] = raw[start : start + need]
        return self.pieces[index]

    def stream(self, device: int) -> Any:
        import cupy

        if device not in self.streams:
            # A blocking stream: it waits for work queued on the legacy default stream,
            # where zarr and CuPy run by default, so that memory freed there and reused for
            # a read is not overwritten while a kernel still uses it.
            self.streams[device] = cupy.cuda.Stream(non_blocking=False)
        return self.streams[device]


_staging = _Staging()


def _read_device(fd: int, file_offset: int, nbytes: int, path: str, crowded: bool,
                 file_system: int) -> Any:
    """Read ``nbytes`` at ``file_offset`` into a new CuPy ``uint8`` array on the current
    device.

    Alone, the chunk goes through the dispatcher's device tools, which learn the fastest way
    for its size and cache state. In a crowd, cached bytes go through KvikIO (its thread
    pool splits each chunk into tasks, every chunk in flight at once: how GDSStore reads
    twice as fast as one thread a chunk), and bytes that are not, or all of them without
    KvikIO, through this thread's two pinned pieces: while one piece's copy to the device
    runs, the next piece is read into the other (:func:`_read_pieces`).
    """
    import cupy

    stream = _staging.stream(cupy.cuda.Device().id)
    with stream:
        out = cupy.empty(nbytes, dtype=cupy.uint8)
    if nbytes >= SMALL_TRANSFER and config.get().tool is None:
        tool = None
        if crowded:
            warm = cache_state(fd, file_offset, nbytes) == "warm"
            tool = _CROWD_KVIKIO if warm and _kvikio_usable() else _PIECES
        if tool is not _PIECES:
            stream.synchronize()  # memory the legacy stream freed is free of its kernels
            try:
                _transfer.read_into(fd, file_offset, CupyDeviceBuffer(out), path=path,
                                    tool=tool)
                return out
            except Exception as error:
                if tool is None or not is_tool_failure(error):  # the dispatcher fell back
                    raise                                        # already, or a data error
                _no_kvikio.set()
                logger.warning("arrayio: NVMeStore reads cached chunks through its pinned "
                               "pieces from now on: KvikIO failed (%s)", error)
            # Into new memory: a failed KvikIO read may still have tasks writing into the
            # old one (KvikIO reports the first failed task without waiting for the others).
            with stream:
                out = cupy.empty(nbytes, dtype=cupy.uint8)
    return _read_pieces(fd, file_offset, out, path, crowded, file_system, stream)


_CROWD_KVIKIO = "kvikio(threads=16,task_size=4194304)"
_PIECES = "pieces"  # this module's own staging
_no_kvikio = threading.Event()  # KvikIO failed once here: the pieces from then on


def _kvikio_usable() -> bool:
    from ..tools.kvikio import KvikioTool

    return not _no_kvikio.is_set() and bool(KvikioTool.availability())


def _read_pieces(fd: int, file_offset: int, out: Any, path: str, crowded: bool,
                 file_system: int, stream: Any) -> Any:
    """Fill ``out`` through this thread's two pinned pieces; each thread has its own, so any
    number of chunks move at once, and the dispatcher still chooses how each piece leaves
    the file."""
    nbytes = out.nbytes
    events: list[Any] = [None, None]
    for index, start in enumerate(range(0, nbytes, _PIECE)):
        length = min(_PIECE, nbytes - start)
        slot = index % 2
        if events[slot] is not None:
            events[slot].synchronize()  # its previous copy has left the piece
        skew = (file_offset + start) % _BLOCK
        host = _staging.piece(slot, length)[skew : skew + length]
        _read_host(fd, file_offset + start, host, path, crowded, file_system)
        out[start : start + length].set(host, stream=stream)
        events[slot] = stream.record()
    stream.synchronize()
    return out


def _write_device(fd: int, data: Any) -> None:
    """Write a CuPy ``uint8`` array at offset 0 through this thread's pinned pieces."""
    import cupy

    with data.device:
        # The producer's kernels may run on any stream: wait for all of them.
        cupy.cuda.runtime.deviceSynchronize()
        stream = _staging.stream(data.device.id)
        for start in range(0, data.nbytes, _PIECE):
            length = min(_PIECE, data.nbytes - start)
            host = _staging.piece(0, length)[:length]
            data[start : start + length].get(stream=stream, out=host)
            stream.synchronize()
            _transfer.write_from(fd, start, host)


def _fill(fd: int, file_offset: int, nbytes: int, prototype: BufferPrototype, path: str,
          crowded: bool, file_system: int) -> Buffer:
    """Read ``nbytes`` at ``file_offset`` into a new buffer of ``prototype``."""
    memory = _memory_of(prototype)
    if memory == "cuda":
        return prototype.buffer.from_array_like(
            _read_device(fd, file_offset, nbytes, path, crowded, file_system))
    host = _host_for(file_offset, nbytes)
    _read_host(fd, file_offset, host, path, crowded, file_system)
    if memory == "host":
        return prototype.buffer.from_array_like(host)  # zero-copy
    return prototype.buffer.from_bytes(host)  # a buffer class we do not know: its own copy


def _read(path: str, prototype: BufferPrototype, byte_range: ByteRequest | None,
          boundary: _Boundary, key: str) -> Buffer | None:
    """The value at ``path`` (or part of it), or None if there is no such file.

    Raises
    ------
    InvalidKeyError
        If the file is outside ``boundary``.
    """
    _span(byte_range, 0)  # a malformed byte range fails on every path, present key or not
    try:
        fd, _ = boundary.open(key, os.O_RDONLY | _CLOEXEC, key)
    except _MISSING:
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            return None  # a directory: a prefix, not a key
        file_offset, nbytes = _span(byte_range, status.st_size)
        with _counted() as in_flight:
            return _fill(fd, file_offset, nbytes, prototype, path, in_flight >= CROWD,
                         status.st_dev)
    finally:
        os.close(fd)


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

    _write_device(fd, cupy.asarray(value.as_array_like()).reshape(-1).view(cupy.uint8))


def _write_at(directory_fd: int, name: str, value: Buffer, exclusive: bool,
              cleaned: set[tuple[int, int]], path: str) -> None:
    """Store ``value`` as ``name`` in the open directory, atomically and durably.

    As :func:`arrayio.integrity._atomic.atomic_write` does by path, but relative to the directory's
    descriptor, so that the write lands in the directory that was checked. The complete
    file is renamed over ``name`` (a link there is replaced, never written through) or,
    ``exclusive``, linked to it, which raises ``FileExistsError`` if ``name`` exists: of two
    concurrent creators exactly one wins, and nobody sees a partial file.
    """
    _clean_once(directory_fd, cleaned)
    temporary: str | None = None
    fd = -1
    try:
        temporary, fd = _atomic.create_temporary(name, dir_fd=directory_fd)
        _write_value(fd, value)
        os.fsync(fd)
        if exclusive:
            os.link(temporary, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
        else:
            os.replace(temporary, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
            temporary = None
        with contextlib.suppress(OSError):  # some file systems cannot fsync a directory; the
            os.fsync(directory_fd)           # rename is atomic all the same
    except OSError as error:  # a full disk, and errors naming the key's file
        described = _atomic.describe_write_error(error, path, temporary)
        if described is not error:
            raise described from error
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=directory_fd)


def _clean_once(directory_fd: int, cleaned: set[tuple[int, int]]) -> None:
    """Remove the temporaries that dead writers left in a directory, the first time a store
    writes there (``cleaned`` holds the directories it has cleaned): a chunk directory can
    hold many thousands of files, and listing it on every write would cost more than the
    write, while a store opened after a crash still cleans what the crash left."""
    status = os.fstat(directory_fd)
    directory = (status.st_dev, status.st_ino)
    if directory not in cleaned:
        _atomic.remove_stale_temporaries(directory_fd)
        cleaned.add(directory)


def _delete_at(directory_fd: int, name: str) -> None:
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


def _is_file_at(directory_fd: int, name: str) -> bool:
    """Whether ``name`` in the open directory is a file (not a link to one)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=directory_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _files_below(directory_fd: int, real_directory: str, prefix: str, boundary: _Boundary
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
            if (not _atomic.is_temporary(entry.name)
                    and boundary.leads_inside(real_directory, entry.name) and entry.is_file()):
                yield prefix + entry.name, entry
        elif entry.is_dir(follow_symlinks=False):
            try:
                child = os.open(entry.name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=directory_fd)
            except OSError as error:
                if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # gone, or replaced by a file or a link since the scan
                raise
            try:
                yield from _files_below(child, os.path.join(real_directory, entry.name),
                                        f"{prefix}{entry.name}/", boundary)
            finally:
                os.close(child)
        elif entry.is_file(follow_symlinks=False) and not _atomic.is_temporary(entry.name):
            yield prefix + entry.name, entry


# --------------------------------------------------------------------------- the store


class NVMeStore(Store):
    """A local directory as a zarr v3 store, read and written through arrayio.

    Arrays written by :class:`zarr.storage.LocalStore` open with it and the reverse: the
    layout is the same. See the module docstring for what it does differently.

    Parameters
    ----------
    root
        The directory holding the keys; created on open unless ``read_only``. It may be a
        link, or lie below one: the store resolves it once, when first used.
    read_only
        Refuse writes and deletes.
    follow_symlinks
        Let keys lead out of the root through symbolic links, as LocalStore does. By default
        a key whose file or directory resolves outside the root raises
        :class:`InvalidKeyError` (for reads, writes, deletes, sizes and listings below it),
        and listing skips links that lead out: a store unpacked from an archive, or written
        by someone else, then cannot make the program read, overwrite or delete other files
        through a link it holds. Links that stay inside the root are followed either way,
        and the root itself may be a link. A write replaces a link at its key and a delete
        removes it, never what it points to, whatever this says.

    Examples
    --------
    >>> import zarr
    >>> from arrayio.zarr import NVMeStore
    >>> z = zarr.create_array(NVMeStore("data.zarr"), shape=(1000, 1000), chunks=(100, 1000),
    ...                       dtype="f4")
    >>> with zarr.config.enable_gpu():          # chunks read straight into GPU memory
    ...     x = zarr.open_array(NVMeStore("data.zarr", read_only=True))[:]
    """

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True

    root: Path

    def __init__(self, root: str | os.PathLike[str], *, read_only: bool = False,
                 follow_symlinks: bool = False) -> None:
        super().__init__(read_only=read_only)
        if isinstance(root, str | os.PathLike):
            root = Path(root)
        else:
            raise TypeError(f"root must be a str or os.PathLike, got {type(root).__name__}")
        self.root = root
        self.follow_symlinks = follow_symlinks
        self._root = os.fspath(root)
        self._boundary = _Boundary(self._root, follow_symlinks)
        self._cleaned: set[tuple[int, int]] = set()  # directories cleaned of dead temporaries

    # -- identity ---------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, type(self)) and self.root == other.root
                and self.follow_symlinks == other.follow_symlinks)

    __hash__ = None  # type: ignore[assignment]  # mutable open state, like LocalStore

    def __str__(self) -> str:
        return f"file://{self.root.as_posix()}"

    def __repr__(self) -> str:
        following = ", follow_symlinks=True" if self.follow_symlinks else ""
        return f"{type(self).__name__}('{self}'{following})"

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "read_only": self.read_only,
                "follow_symlinks": self.follow_symlinks}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], read_only=state["read_only"],  # type: ignore[misc]
                      follow_symlinks=state.get("follow_symlinks", False))

    def with_read_only(self, read_only: bool = False) -> Self:
        """A new, unopened store on the same root with this ``read_only``.

        Returns
        -------
        NVMeStore
        """
        return type(self)(self.root, read_only=read_only, follow_symlinks=self.follow_symlinks)

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    async def open(cls, root: str | os.PathLike[str], *, read_only: bool = False,
                   mode: str | None = None, follow_symlinks: bool = False) -> Self:
        """Create and open a store (as :meth:`zarr.storage.LocalStore.open`).

        Parameters
        ----------
        root
            The directory.
        read_only
            The store's final read-only state.
        mode
            ``"r"`` or ``"r+"`` require the root to exist already.
        follow_symlinks
            As for the class.

        Returns
        -------
        NVMeStore

        Raises
        ------
        FileNotFoundError
            If the root does not exist and may not be created.
        """
        creating_read_only = mode in ("r", "r+") if mode is not None else read_only
        store = cls(root, read_only=creating_read_only, follow_symlinks=follow_symlinks)
        await store._open()
        if creating_read_only != read_only:
            store = store.with_read_only(read_only)
            await store._open()
        return store

    def _check_root(self) -> None:
        if not self.read_only:
            os.makedirs(self._root, exist_ok=True)
        if not os.path.isdir(self._root):
            raise FileNotFoundError(f"{self._root} does not exist or is not a directory")

    async def _open(self) -> None:
        self._check_root()
        await super()._open()

    async def _ensure_open(self) -> None:
        # Idempotent, unlike Store._open: the many concurrent sets of one batch each get
        # here before any has finished opening.
        self._ensure_open_sync()

    def _ensure_open_sync(self) -> None:
        if not self._is_open:
            self._check_root()
            self._is_open = True

    def _path(self, key: str, *, what: str = "key") -> str:
        return os.path.join(self._root, _check_key(key, what=what))

    def _check_writable_key(self, key: str) -> None:
        self._check_writable()
        if not _check_key(key) or key.endswith("/"):
            raise InvalidKeyError(f"cannot write or delete key {key!r}: it names a directory")

    def _open_directory(self, relative: str, *, name: str, create: bool = False
                        ) -> tuple[int, str]:
        """A descriptor of the directory ``relative`` (``"a/b"``; ``""``: the root), checked
        to be inside the root, and its real path.

        With ``create``, missing directories are made one at a time, each inside its checked
        parent's descriptor, so that none is made outside the root through a link.

        Raises
        ------
        InvalidKeyError
            For a directory outside the root, named ``name`` in the message.
        FileNotFoundError, NotADirectoryError
            If it is missing (and not ``create``) or a file.
        """
        try:
            return self._boundary.open(relative, _DIRECTORY, name)
        except FileNotFoundError:
            if not create or not relative:
                raise
        parent, _, base = relative.rpartition("/")
        parent_fd, _ = self._open_directory(parent, name=name, create=True)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(base, dir_fd=parent_fd)
            fd = os.open(base, _DIRECTORY, dir_fd=parent_fd)
        finally:
            os.close(parent_fd)
        return fd, self._boundary.admit(fd, os.path.join(self._root, relative), name)

    # -- reads ------------------------------------------------------------------------------

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        """The value of ``key`` (or the part ``byte_range`` selects), or None if missing.

        Parameters
        ----------
        key
            A relative path below the root.
        prototype
            Where the bytes land (zarr's default prototype if None).
        byte_range
            A ``RangeByteRequest``, ``OffsetByteRequest`` or ``SuffixByteRequest``.

        Returns
        -------
        Buffer or None

        Raises
        ------
        InvalidKeyError
            If ``key`` would leave the root.
        """
        path = self._path(key)
        _span(byte_range, 0)  # a malformed byte range fails here, present key or not
        await self._ensure_open()
        return await _in_pool(_read, path, prototype or default_buffer_prototype(), byte_range,
                              self._boundary, key)

    def get_sync(self, key: str, *, prototype: BufferPrototype | None = None,
                 byte_range: ByteRequest | None = None) -> Buffer | None:
        """Synchronous :meth:`get`, in the calling thread (zarr's fused pipeline calls it
        from its own thread pool)."""
        path = self._path(key)
        self._ensure_open_sync()
        return _read(path, prototype or default_buffer_prototype(), byte_range, self._boundary,
                     key)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:
        """Every ``(key, byte_range)`` at once on the I/O pool; None for missing keys.

        Returns
        -------
        list of Buffer or None
            In the order of ``key_ranges``.
        """
        requests = [(self._path(key), byte_range, key) for key, byte_range in key_ranges]
        await self._ensure_open()
        loop, pool = asyncio.get_running_loop(), _executor()
        return list(await asyncio.gather(*(
            loop.run_in_executor(pool, _read, path, prototype, byte_range, self._boundary, key)
            for path, byte_range, key in requests)))

    async def _get_many(self, requests: Iterable[tuple[str, BufferPrototype,
                                                       ByteRequest | None]]
                        ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        # All submitted at once, yielded as they complete (the base class awaits each get
        # before starting the next).
        jobs = [(key, self._path(key), prototype, byte_range)
                for key, prototype, byte_range in requests]
        await self._ensure_open()
        loop, pool = asyncio.get_running_loop(), _executor()

        async def one(key: str, path: str, prototype: BufferPrototype,
                      byte_range: ByteRequest | None) -> tuple[str, Buffer | None]:
            return key, await loop.run_in_executor(pool, _read, path, prototype, byte_range,
                                                   self._boundary, key)

        for done in asyncio.as_completed([one(*job) for job in jobs]):
            yield await done

    def get_ranges_sync(self, key: str, byte_ranges: Sequence[ByteRequest | None], *,
                        prototype: BufferPrototype, max_gap_bytes: int = 1 << 20,
                        max_coalesced_bytes: int = 16 << 20
                        ) -> Sequence[tuple[int, Buffer | None]]:
        """Many byte ranges of one key (zarr >= 3.4's sharded reads), ranges near each other
        merged as zarr merges them, and the merged reads run at once on the I/O pool.

        Returns
        -------
        list of (int, Buffer)
            ``(index in byte_ranges, buffer)`` pairs, in no particular order.

        Raises
        ------
        BaseExceptionGroup
            Holding a ``FileNotFoundError`` if ``key`` is missing, as zarr's own version.
        InvalidKeyError
            If ``key`` would leave the root.
        """
        path = self._path(key)
        self._ensure_open_sync()
        try:
            from zarr.core._coalesce import coalesce_ranges
        except ImportError:  # zarr without range coalescing: one read per range
            groups: list[list[tuple[int, RangeByteRequest]]] = []
            alone: list[tuple[int, ByteRequest | None]] = list(enumerate(byte_ranges))
        else:
            groups, alone = coalesce_ranges(byte_ranges, max_gap_bytes=max_gap_bytes,
                                            max_coalesced_bytes=max_coalesced_bytes)
        fetches: list[tuple[list[tuple[int, Any]], ByteRequest | None]] = [
            ([(index, request)], request) for index, request in alone]
        for members in groups:
            if len(members) == 1:
                fetches.append((list(members), members[0][1]))
            else:
                # Not members[0]: nothing here relies on the order of a group's members.
                start = min(r.start for _, r in members)
                fetches.append((list(members),
                                RangeByteRequest(start, max(r.end for _, r in members))))

        def fetch(job: tuple[list[tuple[int, Any]], ByteRequest | None]
                  ) -> list[tuple[int, Buffer]]:
            members, request = job
            buffer = _read(path, prototype, request, self._boundary, key)
            if buffer is None:
                raise FileNotFoundError(key)
            if len(members) == 1:
                return [(members[0][0], buffer)]
            start = request.start  # type: ignore[union-attr]
            return [(index, buffer[r.start - start : r.end - start]) for index, r in members]

        results: list[tuple[int, Buffer | None]] = []
        errors: list[BaseException] = []
        futures = [_executor().submit(fetch, job) for job in fetches]
        for future in futures:
            try:
                results.extend(future.result())
            except Exception as error:  # noqa: BLE001 - gathered, raised as one group
                errors.append(error)
        for error in errors:
            if isinstance(error, InvalidKeyError):
                raise error  # the key itself is refused: one error, not one per range
        if errors:
            # zarr 3 needs Python 3.11, which has exception groups.
            raise BaseExceptionGroup(  # noqa: F821
                f"reading ranges of {key!r} failed", errors)
        return results

    async def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value (a file, not a directory).

        Raises
        ------
        InvalidKeyError
            If ``key`` would leave the root.
        """
        _check_key(key)

        def is_file() -> bool:
            try:
                return stat.S_ISREG(self._status(key).st_mode)
            except OSError:  # as os.path.isfile: missing, below a file, a loop of links
                return False

        return await _in_pool(is_file)

    def _status(self, key: str) -> os.stat_result:
        """What ``fstat`` says of the file at the checked ``key``, opened only to look."""
        fd, _ = self._boundary.open(key, _LOOKUP, key)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    async def getsize(self, key: str) -> int:
        """The size in bytes of the value at ``key``.

        Raises
        ------
        FileNotFoundError
            If there is no such key.
        InvalidKeyError
            If ``key`` would leave the root.
        """
        _check_key(key)

        def size() -> int:
            try:
                status = self._status(key)
            except NotADirectoryError:  # "a/" or "a/b" below the key "a"
                raise FileNotFoundError(f"no key {key!r} in {self}") from None
            if not stat.S_ISREG(status.st_mode):
                raise FileNotFoundError(f"{key!r} is a prefix, not a key, of {self}")
            return status.st_size

        return await _in_pool(size)

    async def getsize_prefix(self, prefix: str) -> int:
        """The total size of the values below ``prefix``, taken as a directory (``"c"``
        counts ``c/0`` but not ``cc/0``), as zarr >= 3.4 does for every store.

        Returns
        -------
        int

        Raises
        ------
        InvalidKeyError
            If ``prefix`` would leave the root.
        """
        folder = _check_key(prefix, what="prefix").rstrip("/")

        def total() -> int:
            return sum(entry.stat().st_size
                       for _, entry in self._keys_below(folder, name=prefix))

        return await _in_pool(total)

    # -- writes -----------------------------------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key``, atomically and durably.

        Raises
        ------
        ValueError
            If the store is read-only.
        InvalidKeyError
            If ``key`` would leave the root or names a directory.
        TypeError
            If ``value`` is not a zarr Buffer.
        """
        self._prepare_write(key, value)
        await self._ensure_open()
        await _in_pool(self._write, key, value, False)

    def set_sync(self, key: str, value: Buffer) -> None:
        """Synchronous :meth:`set`, in the calling thread."""
        self._prepare_write(key, value)
        self._ensure_open_sync()
        self._write(key, value, False)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key`` unless it exists; of concurrent callers, one wins."""
        self._prepare_write(key, value)
        await self._ensure_open()
        with contextlib.suppress(FileExistsError):
            await _in_pool(self._write, key, value, True)

    def _prepare_write(self, key: str, value: Buffer) -> None:
        self._check_writable_key(key)
        if not isinstance(value, Buffer):
            raise TypeError(f"{type(self).__name__}.set(): value must be a zarr Buffer, got "
                            f"{type(value).__name__}")

    def _write(self, key: str, value: Buffer, exclusive: bool) -> None:
        folder, name = _split(key)
        directory, _ = self._open_directory(folder, name=key, create=True)
        try:
            _write_at(directory, name, value, exclusive, self._cleaned,
                      os.path.join(self._root, key))
        finally:
            os.close(directory)

    async def delete(self, key: str) -> None:
        """Remove ``key`` (a directory key: everything below it); a missing key is fine.

        A link at ``key`` is removed, never what it points to.
        """
        self._check_writable_key(key)
        await _in_pool(self._delete, key)

    def delete_sync(self, key: str) -> None:
        """Synchronous :meth:`delete`, in the calling thread."""
        self._check_writable_key(key)
        self._ensure_open_sync()
        self._delete(key)

    def _delete(self, key: str, *, refuse_keys: bool = False) -> None:
        """Remove ``key`` from its directory, if both are there; with ``refuse_keys``, raise
        ``ValueError`` for a file instead (for :meth:`delete_dir`)."""
        folder, name = _split(key)
        try:
            directory, _ = self._open_directory(folder, name=key)
        except _MISSING:
            return
        try:
            if refuse_keys and _is_file_at(directory, name):
                raise ValueError(f"delete_dir was given {key!r}, which is a key")
            _delete_at(directory, name)
        finally:
            os.close(directory)

    async def delete_dir(self, prefix: str) -> None:
        """Remove every key below ``prefix`` (all of them for ``""``; the root stays).

        A link at ``prefix`` is removed, never what it points to.

        Raises
        ------
        ValueError
            If ``prefix`` is a key rather than a directory, or the store is read-only.
        InvalidKeyError
            If ``prefix`` would leave the root.
        """
        self._check_writable()
        prefix = _check_key(prefix, what="prefix").rstrip("/")

        def remove() -> None:
            if prefix:
                self._delete(prefix, refuse_keys=True)
                return
            try:
                root, _ = self._open_directory("", name="")
            except _MISSING:
                return
            try:
                for entry in list(os.scandir(root)):
                    _delete_at(root, entry.name)
            finally:
                os.close(root)

        await _in_pool(remove)

    async def clear(self) -> None:
        """Remove every key; the root directory stays."""
        await self.delete_dir("")

    # -- listing ----------------------------------------------------------------------------

    def _keys_below(self, folder: str, *, name: str | None = None
                    ) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """The keys below the directory ``folder`` (``""``: the root) with their entries; no
        keys if it is missing or a file.

        Raises
        ------
        InvalidKeyError
            If ``folder`` is outside the root, naming ``name`` (``folder`` by default).
        """
        try:
            directory, real = self._open_directory(folder, name=folder if name is None else name)
        except _MISSING:
            return
        try:
            yield from _files_below(directory, real, f"{folder}/" if folder else "",
                                    self._boundary)
        finally:
            os.close(directory)

    def _key_list(self, folder: str, name: str | None = None) -> list[str]:
        return [key for key, _ in self._keys_below(folder, name=name)]

    async def list(self) -> AsyncIterator[str]:
        """Every key in the store."""
        for key in await _in_pool(self._key_list, ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key that starts with ``prefix`` (a string prefix: ``"fo"`` finds ``foo/a``).

        Raises
        ------
        InvalidKeyError
            If the directory ``prefix`` lies in would leave the root.
        """
        _check_key(prefix, what="prefix")
        # The directory to walk, spelled as list() spells keys ("c//0" walks "c", and no key
        # starts with "c//").
        folder = "/".join(part for part in prefix.rpartition("/")[0].split("/") if part)
        for key in await _in_pool(self._key_list, folder, prefix):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """The names of the keys and directories directly below ``prefix``; links that lead
        out of the root are none of them unless the store follows links.

        Raises
        ------
        InvalidKeyError
            If ``prefix`` would leave the root.
        """
        folder = _check_key(prefix, what="prefix").rstrip("/")

        def names() -> list[str]:
            try:
                directory, real = self._open_directory(folder, name=prefix)
            except _MISSING:
                return []
            try:
                with os.scandir(directory) as entries:
                    return [entry.name for entry in entries if not _atomic.is_temporary(entry.name)
                            and (not entry.is_symlink()
                                 or self._boundary.leads_inside(real, entry.name))]
            finally:
                os.close(directory)

        for name in await _in_pool(names):
            yield name
