"""Device memory allocated through the CUDA driver, and handed to a framework by DLPack.

A JAX user's load needs device memory that JAX will own. JAX cannot allocate memory without
filling it (a compiled computation per shape), and CuPy, which can, costs a fresh process
more to import than a warm load of a gigabyte takes. So a load into JAX allocates each array
with ``cuMemAlloc`` (:class:`DriverDeviceBuffer`), fills it like any device buffer, then
gives it to JAX zero-copy as a DLPack capsule made here (:class:`DLPackExport`), whose
deleter frees the memory once JAX no longer needs it.

The capsule follows the DLPack convention: it is named ``"dltensor"``; a consumer renames it
``"used_dltensor"`` and calls the deleter when done; a capsule never consumed calls it when
collected.

The deleter is Python (a ``ctypes`` callback), and a consumer may call it after Python is
gone: JAX frees the arrays still alive at exit in its runtime's own teardown, after the
interpreter's, and a callback into a finalized interpreter kills the process with a
segmentation fault. So at exit every capsule still held is disarmed (:func:`_disarm_at_exit`):
its deleter becomes a C function that does nothing, and its structures and memory are left
to the process's end, which frees them.

Allocating device memory maps its pages, a cost a load of a model would pay again on every
reload where the frameworks' own pools (CuPy's, torch's) reuse what the last one freed. So
memory JAX gives back goes to a pool (:class:`_Pool`, at most a quarter of the device's
memory), and the next allocation of the same size takes it, once the device has finished
the work queued before (JAX's kernels may still read an array it has just dropped).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import threading
from typing import Any

import numpy as np

from . import _cuda
from ._buffers import DeviceBytes

__all__ = ["DLPackExport", "DriverDeviceBuffer", "dlpack_dtype"]

_KDLCUDA = 2
# DLPack's type codes (dlpack.h): kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex, kDLBool
_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
_BFLOAT = 4


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _ManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_ManagedTensor))
_ManagedTensor._fields_ = [
    ("dl_tensor", _Tensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_GRANULE = 512  # sizes are rounded up to it, so that equal arrays share their blocks
POOL_SHARE = 4  # the pool keeps at most 1 / POOL_SHARE of a device's memory


class _Pool:
    """Device memory given back by JAX, by device and size, for the next allocations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, int], list[_cuda.DeviceMemory]] = {}
        self._bytes: dict[int, int] = {}
        self._unsynchronized: set[int] = set()  # devices given memory since their last wait
        # Allocations served from the pool, and those the driver made: whether a load's
        # outputs paid for new memory (the first-calls benchmark records them per call).
        self._reused = self._allocated = 0

    def take(self, nbytes: int, device: int) -> _cuda.DeviceMemory:
        size = -(-max(nbytes, 1) // _GRANULE) * _GRANULE
        with self._lock:
            blocks = self._free.get((device, size))
            if blocks:
                memory = blocks.pop()
                self._bytes[device] -= size
                self._reused += 1
                if device in self._unsynchronized:  # (under the lock: no one takes a block
                    _cuda.synchronize_context(device)  # before the wait is over)
                    self._unsynchronized.discard(device)
                return memory
            self._allocated += 1
        return _cuda.DeviceMemory(size, device)

    def counts(self) -> dict[str, int]:
        """Allocations so far: served from the pool (``reused``) and new (``allocated``)."""
        with self._lock:
            return {"reused": self._reused, "allocated": self._allocated}

    def give(self, memory: _cuda.DeviceMemory) -> None:
        device = memory.device
        limit = _cuda.total_memory(device) // POOL_SHARE
        with self._lock:
            if self._bytes.get(device, 0) + memory.nbytes > limit:
                return  # freed when the last reference goes
            self._free.setdefault((device, memory.nbytes), []).append(memory)
            self._bytes[device] = self._bytes.get(device, 0) + memory.nbytes
            self._unsynchronized.add(device)


_pool = _Pool()

# What each capsule's memory and structures are kept alive by, until its deleter runs, and
# how many capsules of each memory are alive: memory goes back to the pool when the last
# consumer lets it go (a capsule collected unconsumed may have been replaced by another).
_alive: dict[int, tuple[Any, ...]] = {}
_exports: dict[int, int] = {}
_alive_lock = threading.Lock()


def _forget(address: int) -> _cuda.DeviceMemory | None:
    """Drop the capsule at ``address``; its memory where no other capsule holds it."""
    with _alive_lock:
        entry = _alive.pop(address, None)
        if entry is None:
            return None
        memory = entry[2]
        left = _exports[id(memory)] = _exports.get(id(memory), 1) - 1
        if left > 0:
            return None
        del _exports[id(memory)]
        return memory  # type: ignore[no-any-return]


def _delete(managed: Any) -> None:
    memory = _forget(ctypes.addressof(managed.contents))
    if memory is not None:
        _pool.give(memory)


_deleter = _Deleter(_delete)


def _inert_deleter() -> Any:
    """A C function that reads nothing and changes nothing, as a deleter: C's
    ``sched_yield``. It takes no argument; called with one (the managed tensor's address, in
    a register), it ignores it, as the C calling conventions of the platforms CUDA runs on
    allow."""
    return ctypes.cast(ctypes.CDLL(None).sched_yield, _Deleter)


_left_at_exit: list[Any] = []


def _disarm_at_exit() -> None:
    """Give each capsule a consumer still holds a deleter that does not call Python, and
    keep its structures and memory for the rest of the process (see the module docstring)."""
    inert = _inert_deleter()
    with _alive_lock:
        entries = list(_alive.values())
        _alive.clear()
        _exports.clear()
    for entry in entries:
        managed, _, memory = entry
        managed.deleter = inert
        memory.keep_at_exit()
        # Never collected, even as the interpreter clears its modules: the consumer reads
        # the deleter's address from this structure when it frees the array.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(entry))
        _left_at_exit.append(entry)


atexit.register(_disarm_at_exit)

_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    # Consumed capsules are renamed: their consumer calls the deleter. (The capsule is being
    # destroyed: it is passed as a bare pointer, never as an object.)
    if _capsule_is_valid(capsule, _NAME):
        _forget(_capsule_pointer(capsule, _NAME))


@functools.lru_cache(maxsize=64)  # a dtype's name is Python code in NumPy: once per dtype
def dlpack_dtype(dtype: np.dtype[Any]) -> tuple[int, int]:
    """DLPack's (type code, bits) of a NumPy dtype (bfloat16 included)."""
    if dtype.name == "bfloat16":
        return _BFLOAT, 16
    if dtype.kind not in _CODES or dtype.name.startswith("float8"):
        raise TypeError(f"no DLPack type for {dtype}")
    return _CODES[dtype.kind], dtype.itemsize * 8


@dataclasses.dataclass
class DriverDeviceBuffer:
    """A flat range of device memory from the driver (``offset`` bytes into ``memory``)."""

    memory: _cuda.DeviceMemory
    offset: int = 0
    nbytes: int = -1
    device_index: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = self.memory.nbytes - self.offset
        self.device_index = self.memory.device

    @classmethod
    def allocate(cls, nbytes: int, device: int) -> DriverDeviceBuffer:
        """``nbytes`` on ``device``, from the pool where it has a block of that size."""
        return cls(_pool.take(nbytes, device), 0, nbytes)

    @property
    def data_ptr(self) -> int:
        return self.memory.address + self.offset

    @property
    def cuda_array(self) -> Any:
        return DeviceBytes(self.data_ptr, self.nbytes)

    def copy_from_host(self, offset: int, src: np.ndarray) -> None:
        stream = _cuda.thread_stream(self.device_index)
        _cuda.copy_host_address_to_device(
            self.data_ptr + offset, src.ctypes.data, src.nbytes, stream
        )
        stream.synchronize()

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        stream = _cuda.thread_stream(self.device_index)
        _cuda.copy_to_host(dst, self.data_ptr + offset, stream)
        stream.synchronize()

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        from ..tools._pinned import allocate_pinned

        return allocate_pinned(nbytes)

    def part(self, start: int, stop: int) -> DriverDeviceBuffer:
        return DriverDeviceBuffer(self.memory, self.offset + start, stop - start)


class DLPackExport:
    """A whole :class:`DriverDeviceBuffer` as an array of ``shape`` and ``dtype`` that a
    framework takes over through DLPack (``__dlpack__``). Each capsule keeps the memory
    alive until its consumer's deleter runs (or until it is collected unconsumed)."""

    __slots__ = ("_buffer", "device_index", "dtype", "pointer", "shape", "size")

    def __init__(self, buffer: DriverDeviceBuffer, shape: tuple[int, ...], dtype: Any) -> None:
        self._buffer = buffer
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.device_index, self.pointer = buffer.device_index, buffer.data_ptr
        if self.size * self.dtype.itemsize != buffer.nbytes:
            raise ValueError(f"{self.shape} {self.dtype} is not the buffer's {buffer.nbytes} bytes")

    def __dlpack_device__(self) -> tuple[int, int]:
        return _KDLCUDA, self.device_index

    def __dlpack__(self, *, stream: Any = None, **_: Any) -> Any:
        # The bytes are final when a load hands them over (its transfers have returned):
        # no stream needs to wait, whichever the consumer names.
        code, bits = dlpack_dtype(self.dtype)
        shape = (ctypes.c_int64 * max(1, len(self.shape)))(*self.shape)
        managed = _ManagedTensor()
        managed.dl_tensor = _Tensor(
            ctypes.c_void_p(self.pointer),
            _Device(_KDLCUDA, self.device_index),
            len(self.shape),
            _DataType(code, bits, 1),
            shape,
            None,  # compact, row-major
            0,
        )
        managed.manager_ctx = None
        managed.deleter = _deleter
        address = ctypes.addressof(managed)
        memory = self._buffer.memory
        with _alive_lock:
            _alive[address] = (managed, shape, memory)
            _exports[id(memory)] = _exports.get(id(memory), 0) + 1
        return _capsule_new(address, _NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
