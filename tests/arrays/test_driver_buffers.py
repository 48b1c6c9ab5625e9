"""DLPack capsules of driver memory (a JAX load's arrays): their types, and that the memory
lives exactly until the consumer's deleter runs or an unconsumed capsule is collected. The
device side (JAX takes them over, zero-copy, and frees them) runs in the GPU suite."""

from __future__ import annotations

import ctypes
import gc
import sys
import weakref

import ml_dtypes
import numpy as np
import pytest

from arrayio.arrays import _driver_buffers
from arrayio.arrays._driver_buffers import DLPackExport, dlpack_dtype


class FakeMemory:
    """Stands for a DeviceMemory: what matters is who keeps it alive."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes, self.device = address, nbytes, 0
        self.kept_at_exit = False

    def keep_at_exit(self) -> None:
        self.kept_at_exit = True


def export(nbytes: int, shape, dtype) -> tuple[DLPackExport, weakref.ref]:
    memory = FakeMemory(1 << 40, nbytes)
    buffer = _driver_buffers.DriverDeviceBuffer(memory)  # type: ignore[arg-type]
    return DLPackExport(buffer, shape, dtype), weakref.ref(memory)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (np.float32, (2, 32)),
        (np.float16, (2, 16)),
        (np.int8, (0, 8)),
        (np.uint64, (1, 64)),
        (np.complex64, (5, 64)),
        (np.bool_, (6, 8)),
        (ml_dtypes.bfloat16, (4, 16)),
    ],
)
def test_dlpack_type_codes(dtype, expected):
    assert dlpack_dtype(np.dtype(dtype)) == expected


def test_float8_has_no_dlpack_type():
    with pytest.raises(TypeError, match="no DLPack type"):
        dlpack_dtype(np.dtype(ml_dtypes.float8_e4m3fn))


def test_an_export_must_cover_its_buffer():
    with pytest.raises(ValueError, match="not the buffer's 24 bytes"):
        export(24, (2, 2), np.float32)


def test_an_unconsumed_capsule_gives_the_memory_back_when_collected():
    exported, memory = export(24, (2, 3), np.float32)
    capsule = exported.__dlpack__(stream=-1)
    del exported
    gc.collect()
    assert memory() is not None  # the capsule holds it
    del capsule
    gc.collect()
    assert memory() is None


@pytest.fixture
def given(monkeypatch):
    """What the deleters give back to the pool."""
    back: list[object] = []
    monkeypatch.setattr(_driver_buffers._pool, "give", back.append)
    return back


def test_an_unconsumed_capsule_is_not_given_to_the_pool(given):
    exported, memory = export(24, (2, 3), np.float32)
    first = exported.__dlpack__()
    second = exported.__dlpack__()  # a consumer that tried, failed, and tried again
    del first
    gc.collect()
    assert given == [] and _driver_buffers._exports  # the second capsule holds it
    del second
    gc.collect()
    assert given == [] and not _driver_buffers._exports


def test_a_consumed_capsule_holds_the_memory_until_the_deleter_runs(given):
    exported, memory = export(12, (3,), np.float32)
    capsule = exported.__dlpack__()
    assert exported.__dlpack_device__() == (2, 0)
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = pointer(capsule, b"dltensor")
    managed = _driver_buffers._ManagedTensor.from_address(address)
    tensor = managed.dl_tensor
    assert tensor.data == 1 << 40 and tensor.ndim == 1 and tensor.shape[0] == 3
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (2, 32, 1)
    assert not tensor.strides and tensor.device.device_type == 2
    # What a consumer does: rename the capsule, and call the deleter once it is done.
    rename = ctypes.pythonapi.PyCapsule_SetName
    rename.argtypes = [ctypes.py_object, ctypes.c_char_p]
    used = b"used_dltensor"
    assert rename(capsule, used) == 0
    del capsule, exported
    gc.collect()
    assert memory() is not None  # consumed: the consumer owns it now
    managed.deleter(ctypes.pointer(managed))
    assert len(given) == 1 and given[0] is memory()  # to the pool, for the next load
    given.clear()
    gc.collect()
    assert memory() is None
    assert sys.getrefcount(used) > 0  # (kept alive for the capsule's name until here)


def consumed(nbytes: int, shape, dtype):
    """An export whose capsule a consumer took over (renamed), and its managed tensor."""
    exported, memory = export(nbytes, shape, dtype)
    capsule = exported.__dlpack__()
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = _driver_buffers._ManagedTensor.from_address(pointer(capsule, b"dltensor"))
    rename = ctypes.pythonapi.PyCapsule_SetName
    rename.argtypes = [ctypes.py_object, ctypes.c_char_p]
    assert rename(capsule, b"used_dltensor") == 0
    return managed, memory


def test_at_exit_an_array_still_held_gets_a_deleter_that_never_calls_python(given):
    # JAX frees the arrays alive at exit after the interpreter is gone; a deleter that calls
    # Python then kills the process (SIGSEGV, found by the GPU suite running docs/zarr.md).
    managed, memory = consumed(12, (3,), np.float32)
    python_deleter = ctypes.cast(managed.deleter, ctypes.c_void_p).value
    _driver_buffers._disarm_at_exit()
    try:
        address = ctypes.cast(managed.deleter, ctypes.c_void_p).value
        assert address != python_deleter
        assert address == ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
        assert memory().kept_at_exit  # not freed by the exit handlers under the consumer
        managed.deleter(ctypes.pointer(managed))  # what the consumer does: nothing happens
        assert given == []
        gc.collect()
        assert memory() is not None  # left to the process's end, with its structure
        assert not _driver_buffers._alive and not _driver_buffers._exports
    finally:
        _driver_buffers._left_at_exit.clear()


class FakeDriver:
    """``DeviceMemory``, device totals and waits, counted."""

    def __init__(self, total: int) -> None:
        self.total, self.made, self.waits = total, 0, 0

    def memory(self, nbytes: int, device: int) -> FakeMemory:
        self.made += 1
        memory = FakeMemory(self.made << 20, nbytes)
        memory.device = device
        return memory


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver(total=64 << 20)
    cuda = _driver_buffers._cuda
    monkeypatch.setattr(cuda, "DeviceMemory", fake.memory)
    monkeypatch.setattr(cuda, "total_memory", lambda device: fake.total)
    monkeypatch.setattr(
        cuda, "synchronize_context", lambda device: setattr(fake, "waits", fake.waits + 1)
    )
    return fake


def test_the_pool_gives_a_block_back_to_an_equal_allocation_after_one_wait(driver):
    pool = _driver_buffers._Pool()
    a, b = pool.take(1000, 0), pool.take(1000, 0)
    assert a.nbytes == 1024 and driver.made == 2  # rounded up: equal arrays share blocks
    pool.give(a)
    pool.give(b)
    assert {id(pool.take(1024, 0)), id(pool.take(1001, 0))} == {id(a), id(b)}
    assert driver.made == 2
    assert driver.waits == 1  # once for the blocks given since the last wait, not per block
    assert pool.take(1000, 1) is not a and driver.made == 3  # another device's
    assert pool.take(4096, 0) and driver.made == 4  # another size
    assert pool.counts() == {"reused": 2, "allocated": driver.made}


def test_the_pool_keeps_at_most_a_share_of_the_device(driver):
    pool = _driver_buffers._Pool()
    share = driver.total // _driver_buffers.POOL_SHARE
    big, small = pool.take(share, 0), pool.take(1024, 0)
    pool.give(big)
    pool.give(small)  # over the share: let go (freed with its last reference)
    assert pool.take(1024, 0) is not small
    assert pool.take(share, 0) is big
