"""The CUDA driver through ``ctypes``: what the transfer pipelines need (contexts, pinned
host memory, streams, events, asynchronous copies), without importing a GPU framework.

Importing CuPy costs a fresh process about 0.2 s, more than a warm load of a gigabyte takes,
and a torch or JAX user would pay it for a few copies. The driver library is loaded already
wherever a framework runs CUDA, and every framework (torch, CuPy, JAX) works in each device's
primary context, so raw device addresses from any of them are valid here once that context
is current in the calling thread (:func:`make_current`). ``ctypes`` releases the GIL for
every call, so worker threads copy in parallel.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import weakref
from typing import Any

import numpy as np

__all__ = [
    "CudaError",
    "CudaOutOfMemoryError",
    "DeviceMemory",
    "Event",
    "Stream",
    "alloc_pinned",
    "check",
    "compute_capability",
    "copy_to_device",
    "copy_to_host",
    "device_count",
    "driver",
    "driver_cuda_major",
    "make_current",
    "register_read_only",
    "registers_read_only",
    "synchronize_context",
    "total_memory",
    "unregister",
]

_PORTABLE = 0x01  # CU_MEMHOSTALLOC_PORTABLE: pinned for every context, not one
_NON_BLOCKING = 0x01  # CU_STREAM_NON_BLOCKING: no implicit wait on the legacy stream
_DISABLE_TIMING = 0x02  # CU_EVENT_DISABLE_TIMING: the cheapest event


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


@functools.cache
def driver() -> Any:
    """The CUDA driver library, initialized (raises :class:`OSError` where there is none)."""
    library = ctypes.CDLL("libcuda.so.1")
    pointer, size, handle = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
    signatures: dict[str, list[Any]] = {
        "cuInit": [ctypes.c_uint],
        "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(handle), ctypes.c_int],
        "cuCtxSetCurrent": [handle],
        "cuCtxGetCurrent": [ctypes.POINTER(handle)],
        "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
        "cuMemHostAlloc": [ctypes.POINTER(pointer), size, ctypes.c_uint],
        "cuMemFreeHost": [pointer],
        "cuMemHostRegister_v2": [pointer, size, ctypes.c_uint],
        "cuMemHostUnregister": [pointer],
        "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), size],
        "cuMemFree_v2": [ctypes.c_uint64],
        "cuMemsetD32Async": [ctypes.c_uint64, ctypes.c_uint, size, handle],
        "cuCtxSynchronize": [],
        "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
        "cuDeviceTotalMem_v2": [ctypes.POINTER(size), ctypes.c_int],
        "cuStreamCreate": [ctypes.POINTER(handle), ctypes.c_uint],
        "cuStreamDestroy_v2": [handle],
        "cuStreamSynchronize": [handle],
        "cuEventCreate": [ctypes.POINTER(handle), ctypes.c_uint],
        "cuEventDestroy_v2": [handle],
        "cuEventRecord": [handle, handle],
        "cuEventSynchronize": [handle],
        "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, pointer, size, handle],
        "cuMemcpyDtoHAsync_v2": [pointer, ctypes.c_uint64, size, handle],
        "cuModuleLoadData": [ctypes.POINTER(handle), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(handle), handle, ctypes.c_char_p],
        "cuLaunchKernel": [handle, *[ctypes.c_uint] * 7, handle, pointer, pointer],
    }
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    check(library.cuInit(0), "cuInit")
    return library


class CudaOutOfMemoryError(CudaError, MemoryError):
    """The device (or pinned host memory) has not the memory asked for."""


_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


def check(result: int, what: str) -> None:
    if result == _OUT_OF_MEMORY:
        raise CudaOutOfMemoryError(f"{what} failed: out of memory (CUDA error {result})")
    if result != 0:
        raise CudaError(f"{what} failed: CUDA error {result}")


def device_count() -> int:
    """The CUDA devices visible here (raises :class:`OSError` or :class:`CudaError` where
    CUDA cannot run)."""
    count = ctypes.c_int()
    check(driver().cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    return count.value


_contexts: dict[int, ctypes.c_void_p] = {}
_contexts_lock = threading.Lock()


def compute_capability(device: int) -> tuple[int, int]:
    """``device``'s compute capability (major, minor)."""
    values = []
    for attribute in (75, 76):  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _MINOR
        value = ctypes.c_int()
        check(
            driver().cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
            "cuDeviceGetAttribute",
        )
        values.append(value.value)
    return values[0], values[1]


@functools.cache
def total_memory(device: int) -> int:
    """``device``'s memory, bytes."""
    total = ctypes.c_size_t()
    check(driver().cuDeviceTotalMem_v2(ctypes.byref(total), device), "cuDeviceTotalMem")
    return total.value


def driver_cuda_major() -> int:
    """The major CUDA version the driver supports (13 for a CUDA 13 driver)."""
    version = ctypes.c_int()
    check(driver().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value // 1000


_REGISTER_READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY
_READ_ONLY_HOST_REGISTER_SUPPORTED = 113  # CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED


@functools.cache
def registers_read_only(device: int) -> bool:
    """Whether ``device`` can take host memory registered read-only (pages the process may
    only read, such as a read-only mapping of a file) as the source of its copies."""
    value = ctypes.c_int()
    check(
        driver().cuDeviceGetAttribute(
            ctypes.byref(value), _READ_ONLY_HOST_REGISTER_SUPPORTED, device
        ),
        "cuDeviceGetAttribute",
    )
    return bool(value.value)


def register_read_only(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``address`` (page-aligned) for the current
    context's copies, read-only: the driver pins the pages behind it, faulting in any that
    are missing, and the copy engine reads them directly."""
    check(driver().cuMemHostRegister_v2(address, nbytes, _REGISTER_READ_ONLY), "cuMemHostRegister")


def unregister(address: int) -> None:
    """Undo :func:`register_read_only` of the range at ``address``."""
    check(driver().cuMemHostUnregister(address), "cuMemHostUnregister")


def synchronize_context(device: int) -> None:
    """Wait for all work queued on ``device``'s primary context."""
    make_current(device)
    check(driver().cuCtxSynchronize(), "cuCtxSynchronize")


def make_current(device: int) -> None:
    """Make ``device``'s primary context (the one the frameworks use) current in this
    thread: a thread no framework has run CUDA in has none."""
    library = driver()
    context = _contexts.get(device)
    if context is None:
        with _contexts_lock:
            context = _contexts.get(device)
            if context is None:
                handle, context = ctypes.c_int(), ctypes.c_void_p()
                check(library.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
                check(
                    library.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
                    "cuDevicePrimaryCtxRetain",
                )
                _contexts[device] = context  # retained for the process's life, as theirs are
    check(library.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def _has_context() -> bool:
    current = ctypes.c_void_p()
    return driver().cuCtxGetCurrent(ctypes.byref(current)) == 0 and bool(current.value)


def _free_host(address: int) -> None:
    try:
        driver().cuMemFreeHost(address)
    except Exception:  # noqa: BLE001 - at exit the driver may be gone: the OS frees it
        pass


def _unregister(address: int) -> None:
    try:
        unregister(address)
    except Exception:  # noqa: BLE001 - as _free_host
        pass


_HUGE_PAGE = 2 << 20
_REGISTER_PORTABLE = 0x01  # CU_MEMHOSTREGISTER_PORTABLE


def alloc_pinned(nbytes: int) -> np.ndarray:
    """``nbytes`` of pinned (page-locked) host memory as a NumPy byte array, usable by every
    device; freed when the array and its views are.

    The memory is an anonymous mapping that the kernel is asked to back with huge pages,
    registered with the driver, rather than ``cuMemHostAlloc``'s: pinning costs about as much
    per page as a fault and a mapping (more in a virtual machine, where the hypervisor maps
    each page too), and a 2 MiB page costs about what a 4 KiB one does. Pinning a fresh
    process's staging buffers is a large part of its first load. Where registering fails,
    ``cuMemHostAlloc``."""
    if not _has_context():
        make_current(0)  # portable memory: any context will do for the allocation
    try:
        memory = _registered(max(nbytes, 1))
    except (CudaError, OSError, ValueError):
        memory = _host_alloc(max(nbytes, 1))
    return np.frombuffer(memoryview(memory).cast("B"), np.uint8, nbytes)  # keeps ``memory`` alive


def _registered(nbytes: int) -> Any:
    """``nbytes`` of a huge-page-aligned anonymous mapping, registered with the driver, as a
    ctypes array that keeps the mapping (unregistered before the mapping goes)."""
    size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    mapping = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    skip = -base % _HUGE_PAGE  # only aligned 2 MiB ranges can be huge pages
    madvise = getattr(mmap, "MADV_HUGEPAGE", None)
    if madvise is not None:
        mapping.madvise(madvise, skip, size)
    address = base + skip
    # Untouched: the driver faults the pages in as it locks them, once.
    check(driver().cuMemHostRegister_v2(address, size, _REGISTER_PORTABLE), "cuMemHostRegister")
    memory = (ctypes.c_ubyte * nbytes).from_address(address)
    memory.mapping = mapping  # type: ignore[attr-defined]  # unmapped after the finalizer ran
    weakref.finalize(memory, _unregister, address)
    return memory


def _host_alloc(nbytes: int) -> Any:
    address = ctypes.c_void_p()
    check(driver().cuMemHostAlloc(ctypes.byref(address), nbytes, _PORTABLE), "cuMemHostAlloc")
    if not address.value:
        raise CudaError("cuMemHostAlloc returned no memory")
    memory = (ctypes.c_ubyte * nbytes).from_address(address.value)
    weakref.finalize(memory, _free_host, address.value)
    return memory


class DeviceMemory:
    """``nbytes`` of device memory on ``device`` (by default the calling thread's current
    context's, or device 0's where it has none), freed by :meth:`free` or when the object is
    collected."""

    __slots__ = ("__weakref__", "_finalizer", "address", "device", "nbytes")

    def __init__(self, nbytes: int, device: int | None = None) -> None:
        if device is not None:
            make_current(device)
        elif not _has_context():
            make_current(0)
        address, current = ctypes.c_uint64(), ctypes.c_int()
        check(driver().cuMemAlloc_v2(ctypes.byref(address), max(nbytes, 1)), "cuMemAlloc")
        self.address, self.nbytes = address.value, nbytes
        if device is None:
            check(_current_device(ctypes.byref(current)), "cuCtxGetDevice")
            device = current.value
        self.device = device
        self._finalizer = weakref.finalize(self, _free_device, device, address.value)

    def free(self) -> None:
        self._finalizer()

    def keep_at_exit(self) -> None:
        """Leave the memory allocated at exit (the process's end frees it): for memory that
        a framework may still use while it tears down."""
        self._finalizer.atexit = False

    def fill_uint32(self, value: int, stream: Stream) -> None:
        """Queue filling the memory with 32-bit ``value`` on ``stream``."""
        check(
            driver().cuMemsetD32Async(self.address, value, self.nbytes // 4, stream.handle),
            "cuMemsetD32Async",
        )


class Stream:
    """A non-blocking stream on ``device`` (made current in the calling thread)."""

    __slots__ = ("__weakref__", "device", "handle")

    def __init__(self, device: int) -> None:
        make_current(device)
        self.device = device
        self.handle = ctypes.c_void_p()
        check(driver().cuStreamCreate(ctypes.byref(self.handle), _NON_BLOCKING), "cuStreamCreate")
        weakref.finalize(self, _destroy, "cuStreamDestroy_v2", self.handle.value)

    def synchronize(self) -> None:
        check(driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")


_thread_streams = threading.local()


def thread_stream(device: int) -> Stream:
    """The calling thread's own stream on ``device``, made on first use, with ``device``'s
    context made current: an I/O thread's copies queue on no framework's stream."""
    streams = getattr(_thread_streams, "by_device", None)
    if streams is None:
        streams = _thread_streams.by_device = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = Stream(device)
    else:
        make_current(device)
    return stream


class Event:
    """An event, recorded again and again (:meth:`record`)."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self) -> None:
        self.handle = ctypes.c_void_p()
        check(driver().cuEventCreate(ctypes.byref(self.handle), _DISABLE_TIMING), "cuEventCreate")
        weakref.finalize(self, _destroy, "cuEventDestroy_v2", self.handle.value)

    def record(self, stream: Stream) -> Event:
        check(driver().cuEventRecord(self.handle, stream.handle), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        check(driver().cuEventSynchronize(self.handle), "cuEventSynchronize")


def _current_device(device: Any) -> int:
    return int(driver().cuCtxGetDevice(device))


def _free_device(device: int, address: int) -> None:
    """Free device memory from any thread (the driver needs its context current)."""
    try:
        make_current(device)
        driver().cuMemFree_v2(address)
    except Exception:  # noqa: BLE001 - at exit the driver may be gone: the OS frees it
        pass


def _destroy(function: str, handle: int | None) -> None:
    try:
        getattr(driver(), function)(handle)
    except Exception:  # noqa: BLE001 - at exit the context may be gone with it
        pass


def copy_to_device(address: int, source: np.ndarray, stream: Stream) -> None:
    """Queue a copy of ``source`` (pinned, for the copy to be asynchronous) to device memory
    at ``address`` on ``stream``."""
    copy_host_address_to_device(address, source.ctypes.data, source.nbytes, stream)


def copy_host_address_to_device(address: int, host: int, nbytes: int, stream: Stream) -> None:
    """:func:`copy_to_device` from the host address ``host`` (no array made for a piece of a
    pipeline's buffer: its microseconds add up over thousands of pieces)."""
    check(driver().cuMemcpyHtoDAsync_v2(address, host, nbytes, stream.handle), "cuMemcpyHtoDAsync")


def copy_to_host(target: np.ndarray, address: int, stream: Stream) -> None:
    """Queue a copy of ``target.nbytes`` from device memory at ``address`` into ``target``
    (pinned) on ``stream``."""
    check(
        driver().cuMemcpyDtoHAsync_v2(target.ctypes.data, address, target.nbytes, stream.handle),
        "cuMemcpyDtoHAsync",
    )
