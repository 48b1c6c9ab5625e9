"""A zarr-python 3 store for local files whose bytes move through arrayio's dispatcher.

The layout on disk is :class:`zarr.storage.LocalStore`'s: a key is a path below the root,
one file per key. What differs is how the bytes move:

* every read lands in the memory the caller's buffer prototype asks for (NumPy memory for
  zarr's CPU buffers, CuPy memory under ``zarr.config.enable_gpu()``) and goes through
  :func:`arrayio._transfer.read_into`. A read alone (or nearly) lets the dispatcher pick the
  transfer tool it has learned is fastest (parallel ``pread``, ``O_DIRECT``, ``mmap``) for
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
* writes are atomic and durable (:mod:`arrayio._atomic`: temporary file, fsync, rename): a
  write that fails leaves the previous value in place;
* keys are checked: one that would leave the root (``..``, an absolute path, a backslash or
  NUL) raises :class:`InvalidKeyError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import stat
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

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

from .. import _atomic, _transfer, config
from .._buffers import CupyDeviceBuffer, aligned_empty
from ..dispatch.context import cache_state
from ..dispatch.dispatcher import SMALL_TRANSFER
from ..dispatch.policy import is_tool_failure
from ..errors import ArrayioError, ToolUnavailableError

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


def _is_temporary(name: str) -> bool:
    """Whether a file name is one of the atomic writes' temporary files."""
    return name.startswith(".") and _atomic.TEMP_MARKER in name


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


def _read(path: str, prototype: BufferPrototype, byte_range: ByteRequest | None
          ) -> Buffer | None:
    """The value at ``path`` (or part of it), or None if there is no such file."""
    _span(byte_range, 0)  # a malformed byte range fails on every path, present key or not
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
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


@contextlib.contextmanager
def _exclusive_write(path: str) -> Iterator[int]:
    """Like :func:`arrayio._atomic.atomic_write`, but the complete file is linked into place
    only if ``path`` does not exist yet (``FileExistsError`` otherwise), so that of two
    concurrent creators exactly one wins and nobody sees a partial file."""
    temporary: str | None = _atomic._temporary_name(path)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                 0o666)
    try:
        yield fd
        os.fsync(fd)
        os.link(temporary, path)  # fails if the target exists, unlike a rename
        _atomic._fsync_directory(os.path.dirname(os.path.abspath(path)))
    finally:
        os.close(fd)
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)


def _write(path: str, value: Buffer, exclusive: bool) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer = _exclusive_write if exclusive else _atomic.atomic_write
    with writer(path) as fd:
        _write_value(fd, value)


def _delete(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)  # as LocalStore: a key that is a directory goes with its content
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _files_below(directory: str, relative: str) -> list[str]:
    """Keys of every file below ``directory`` (``relative`` is its key prefix)."""
    keys: list[str] = []
    pending = [(directory, relative)]
    while pending:
        folder, prefix = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                pending.append((entry.path, f"{prefix}{entry.name}/"))
            elif entry.is_file() and not _is_temporary(entry.name):
                keys.append(prefix + entry.name)
    return keys


# --------------------------------------------------------------------------- the store


class NVMeStore(Store):
    """A local directory as a zarr v3 store, read and written through arrayio.

    Arrays written by :class:`zarr.storage.LocalStore` open with it and the reverse: the
    layout is the same. See the module docstring for what it does differently.

    Parameters
    ----------
    root
        The directory holding the keys; created on open unless ``read_only``.
    read_only
        Refuse writes and deletes.

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

    def __init__(self, root: str | os.PathLike[str], *, read_only: bool = False) -> None:
        super().__init__(read_only=read_only)
        if isinstance(root, str | os.PathLike):
            root = Path(root)
        else:
            raise TypeError(f"root must be a str or os.PathLike, got {type(root).__name__}")
        self.root = root
        self._root = os.fspath(root)

    # -- identity ---------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and self.root == other.root

    __hash__ = None  # type: ignore[assignment]  # mutable open state, like LocalStore

    def __str__(self) -> str:
        return f"file://{self.root.as_posix()}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}('{self}')"

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "read_only": self.read_only}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], read_only=state["read_only"])  # type: ignore[misc]

    def with_read_only(self, read_only: bool = False) -> Self:
        """A new, unopened store on the same root with this ``read_only``.

        Returns
        -------
        NVMeStore
        """
        return type(self)(self.root, read_only=read_only)

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    async def open(cls, root: str | os.PathLike[str], *, read_only: bool = False,
                   mode: str | None = None) -> Self:
        """Create and open a store (as :meth:`zarr.storage.LocalStore.open`).

        Parameters
        ----------
        root
            The directory.
        read_only
            The store's final read-only state.
        mode
            ``"r"`` or ``"r+"`` require the root to exist already.

        Returns
        -------
        NVMeStore

        Raises
        ------
        FileNotFoundError
            If the root does not exist and may not be created.
        """
        creating_read_only = mode in ("r", "r+") if mode is not None else read_only
        store = cls(root, read_only=creating_read_only)
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

    def _writable_path(self, key: str) -> str:
        self._check_writable()
        if not _check_key(key) or key.endswith("/"):
            raise InvalidKeyError(f"cannot write or delete key {key!r}: it names a directory")
        return self._path(key)

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
        return await _in_pool(_read, path, prototype or default_buffer_prototype(), byte_range)

    def get_sync(self, key: str, *, prototype: BufferPrototype | None = None,
                 byte_range: ByteRequest | None = None) -> Buffer | None:
        """Synchronous :meth:`get`, in the calling thread (zarr's fused pipeline calls it
        from its own thread pool)."""
        path = self._path(key)
        self._ensure_open_sync()
        return _read(path, prototype or default_buffer_prototype(), byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:
        """Every ``(key, byte_range)`` at once on the I/O pool; None for missing keys.

        Returns
        -------
        list of Buffer or None
            In the order of ``key_ranges``.
        """
        requests = [(self._path(key), byte_range) for key, byte_range in key_ranges]
        await self._ensure_open()
        loop, pool = asyncio.get_running_loop(), _executor()
        return list(await asyncio.gather(*(
            loop.run_in_executor(pool, _read, path, prototype, byte_range)
            for path, byte_range in requests)))

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
            return key, await loop.run_in_executor(pool, _read, path, prototype, byte_range)

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
            buffer = _read(path, prototype, request)
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
        if errors:
            # zarr 3 needs Python 3.11, which has exception groups.
            raise BaseExceptionGroup(  # noqa: F821
                f"reading ranges of {key!r} failed", errors)
        return results

    async def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value (a file, not a directory)."""
        path = self._path(key)
        return await _in_pool(os.path.isfile, path)

    async def getsize(self, key: str) -> int:
        """The size in bytes of the value at ``key``.

        Raises
        ------
        FileNotFoundError
            If there is no such key.
        """
        path = self._path(key)

        def size() -> int:
            try:
                status = os.stat(path)
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
        """
        prefix = _check_key(prefix, what="prefix").rstrip("/")
        directory = self._path(prefix, what="prefix")

        def total() -> int:
            base = f"{prefix}/" if prefix else ""
            return sum(os.path.getsize(os.path.join(self._root, key))
                       for key in _files_below(directory, base))

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
        path = self._prepare_write(key, value)
        await self._ensure_open()
        await _in_pool(_write, path, value, False)

    def set_sync(self, key: str, value: Buffer) -> None:
        """Synchronous :meth:`set`, in the calling thread."""
        path = self._prepare_write(key, value)
        self._ensure_open_sync()
        _write(path, value, False)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key`` unless it exists; of concurrent callers, one wins."""
        path = self._prepare_write(key, value)
        await self._ensure_open()
        with contextlib.suppress(FileExistsError):
            await _in_pool(_write, path, value, True)

    def _prepare_write(self, key: str, value: Buffer) -> str:
        path = self._writable_path(key)
        if not isinstance(value, Buffer):
            raise TypeError(f"{type(self).__name__}.set(): value must be a zarr Buffer, got "
                            f"{type(value).__name__}")
        return path

    async def delete(self, key: str) -> None:
        """Remove ``key`` (a directory key: everything below it); a missing key is fine."""
        path = self._writable_path(key)
        await _in_pool(_delete, path)

    def delete_sync(self, key: str) -> None:
        """Synchronous :meth:`delete`, in the calling thread."""
        path = self._writable_path(key)
        self._ensure_open_sync()
        _delete(path)

    async def delete_dir(self, prefix: str) -> None:
        """Remove every key below ``prefix`` (all of them for ``""``; the root stays).

        Raises
        ------
        ValueError
            If ``prefix`` is a key rather than a directory, or the store is read-only.
        """
        self._check_writable()
        prefix = _check_key(prefix, what="prefix").rstrip("/")
        path = self._path(prefix, what="prefix")

        def remove() -> None:
            if not prefix:
                for entry in os.scandir(path) if os.path.isdir(path) else ():
                    _delete(entry.path)
            elif os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.isfile(path):
                raise ValueError(f"delete_dir was given {prefix!r}, which is a key")

        await _in_pool(remove)

    async def clear(self) -> None:
        """Remove every key; the root directory stays."""
        await self.delete_dir("")

    # -- listing ----------------------------------------------------------------------------

    async def list(self) -> AsyncIterator[str]:
        """Every key in the store."""
        for key in await _in_pool(_files_below, self._root, ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key that starts with ``prefix`` (a string prefix: ``"fo"`` finds ``foo/a``)."""
        _check_key(prefix, what="prefix")
        # The directory to walk, spelled as list() spells keys ("c//0" walks "c", and no key
        # starts with "c//").
        folder = "/".join(part for part in prefix.rpartition("/")[0].split("/") if part)
        base = f"{folder}/" if folder else ""
        keys = await _in_pool(_files_below, self._path(folder, what="prefix"), base)
        for key in keys:
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """The names of the keys and directories directly below ``prefix``."""
        path = self._path(_check_key(prefix, what="prefix").rstrip("/"), what="prefix")

        def names() -> list[str]:
            try:
                return [e.name for e in os.scandir(path) if not _is_temporary(e.name)]
            except (FileNotFoundError, NotADirectoryError):
                return []

        for name in await _in_pool(names):
            yield name

