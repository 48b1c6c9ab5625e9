"""Memory the byte mover fills and drains: aligned host arrays and flat device byte ranges.

A host buffer is a flat, C-contiguous NumPy ``uint8`` array. Device memory is wrapped in a
:class:`DeviceBuffer`, through CuPy when the array is CuPy's (or JAX's, zero-copy) and
through torch for torch tensors, so that torch users need no CuPy.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "HOST_ALIGNMENT",
    "CupyDeviceBuffer",
    "DeviceBuffer",
    "DeviceBytes",
    "TorchDeviceBuffer",
    "aligned_empty",
    "driver_copyable",
    "result_empty",
    "scatter_from_host",
    "synchronize_device",
    "wait_for_current_streams",
]

# Host buffers are aligned for O_DIRECT (4096) and, as a by-product, for JAX's zero-copy
# import of host memory (which needs 64).
HOST_ALIGNMENT = 4096


def aligned_empty(nbytes: int, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """Return an uninitialised host ``uint8`` array of ``nbytes`` starting on ``alignment``."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


# Below this, a result's bytes move with one plain read (never O_DIRECT), and 4 KiB of
# alignment would only multiply the memory of a file of many small arrays.
_ALIGNED_FROM = 64 << 10


def result_empty(nbytes: int) -> np.ndarray:
    """An uninitialised host ``uint8`` array for a result of ``nbytes``: aligned for O_DIRECT
    where it is large enough to be read that way."""
    if nbytes >= _ALIGNED_FROM:
        return aligned_empty(nbytes)
    return np.empty(nbytes, dtype=np.uint8)


class DeviceBuffer(Protocol):
    """A flat range of GPU memory that the byte mover copies to and from through the host."""

    nbytes: int
    device_index: int

    @property
    def cuda_array(self) -> Any:
        """The memory as an object with ``__cuda_array_interface__`` (for KvikIO, CuPy)."""
        ...

    @property
    def data_ptr(self) -> int:
        """The device address of the first byte (cheaper than ``cuda_array`` for kernels:
        torch builds its ``__cuda_array_interface__`` in Python on every call)."""
        ...

    def copy_from_host(self, offset: int, src: np.ndarray) -> None: ...

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None: ...

    def pinned_empty(self, nbytes: int) -> np.ndarray: ...

    def part(self, start: int, stop: int) -> DeviceBuffer:
        """Bytes ``start`` to ``stop`` of the buffer, as a buffer of the same memory."""
        ...


@dataclasses.dataclass
class CupyDeviceBuffer:
    """Device bytes held as a flat CuPy ``uint8`` array."""

    array: Any
    # Read once: a load asks each buffer's size and device a dozen times.
    nbytes: int = dataclasses.field(init=False)
    device_index: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = int(self.array.nbytes)
        self.device_index = int(self.array.device.id)

    @property
    def cuda_array(self) -> Any:
        return self.array

    @property
    def data_ptr(self) -> int:
        return int(self.array.data.ptr)

    # CuPy copies to and from pinned memory asynchronously on the current stream: wait, or
    # the caller would reuse the staging buffer while the copy is still reading it.
    def copy_from_host(self, offset: int, src: np.ndarray) -> None:
        import cupy

        with self.array.device:
            stream = cupy.cuda.get_current_stream()
            self.array[offset : offset + src.nbytes].set(src, stream=stream)
            stream.synchronize()

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        import cupy

        with self.array.device:
            stream = cupy.cuda.get_current_stream()
            self.array[offset : offset + dst.nbytes].get(stream=stream, out=dst)
            stream.synchronize()

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        from ..tools._pinned import allocate_pinned

        return allocate_pinned(nbytes)

    def part(self, start: int, stop: int) -> CupyDeviceBuffer:
        return CupyDeviceBuffer(self.array[start:stop])


@dataclasses.dataclass
class TorchDeviceBuffer:
    """Device bytes held as a flat torch ``uint8`` CUDA tensor (no CuPy needed)."""

    tensor: Any
    nbytes: int = dataclasses.field(init=False)  # read once, as CupyDeviceBuffer's
    device_index: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = int(self.tensor.numel())
        self.device_index = int(self.tensor.device.index or 0)

    @property
    def cuda_array(self) -> Any:
        return self.tensor

    @property
    def data_ptr(self) -> int:
        return int(self.tensor.data_ptr())

    def copy_from_host(self, offset: int, src: np.ndarray) -> None:
        import torch

        self.tensor[offset : offset + src.nbytes].copy_(torch.from_numpy(src))

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        import torch

        torch.from_numpy(dst).copy_(self.tensor[offset : offset + dst.nbytes])

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def part(self, start: int, stop: int) -> TorchDeviceBuffer:
        return TorchDeviceBuffer(self.tensor[start:stop])


class DeviceBytes:
    """Device bytes as a bare ``__cuda_array_interface__`` (for KvikIO, CuPy): torch builds a
    tensor's in Python on every access, a cost paid per array of a checkpoint. No stream is
    named: a write's producer is synchronized before a tool runs, and a read fills memory
    nothing else uses yet."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


def synchronize_device(buffer: DeviceBuffer) -> None:
    """Wait for all work on the buffer's GPU, so that its bytes are final before a tool that
    runs on its own streams or threads reads them."""
    if isinstance(buffer, TorchDeviceBuffer):
        import torch

        torch.cuda.synchronize(buffer.device_index)
        return
    if not isinstance(buffer, CupyDeviceBuffer):  # the driver's own memory (a JAX load's)
        from . import _cuda

        _cuda.synchronize_context(buffer.device_index)
        return
    import cupy

    with cupy.cuda.Device(buffer.device_index):
        cupy.cuda.runtime.deviceSynchronize()


def wait_for_current_streams(buffers: Sequence[Any]) -> None:
    """Wait, once per framework and device, for the work queued on the calling thread's
    current stream of each torch or CuPy device buffer of ``buffers``.

    A read fills device memory from the tools' own (non-blocking) streams, which are not
    ordered after the caller's: a kernel still queued that writes the buffer (``out.zero_()``
    before ``read_into(out)``, or the producer of a block the caching allocator handed to a
    new array) would land after the file's bytes and overwrite them. Memory arrayio
    allocated itself through the driver (a JAX load's) has no such work, and host buffers
    none at all."""
    waited: set[tuple[type, int]] = set()
    for buffer in buffers:
        kind = type(buffer)
        if kind not in (TorchDeviceBuffer, CupyDeviceBuffer):
            continue
        key = (kind, buffer.device_index)
        if key in waited:
            continue
        waited.add(key)
        if kind is TorchDeviceBuffer:
            import torch

            torch.cuda.current_stream(buffer.device_index).synchronize()
        else:
            import cupy

            with cupy.cuda.Device(buffer.device_index):
                cupy.cuda.get_current_stream().synchronize()


def driver_copyable(buffer: Any) -> bool:
    """Whether ``buffer`` is device memory the CUDA driver can copy into by its address (a
    torch or CuPy array's, or the driver's own), not a stand-in of tests."""
    kinds: tuple[type, ...] = (TorchDeviceBuffer, CupyDeviceBuffer)
    driver = sys.modules.get(f"{__package__}._driver_buffers")  # only made by a JAX load
    if driver is not None:
        kinds += (driver.DriverDeviceBuffer,)
    return isinstance(buffer, kinds)


def scatter_from_host(
    span: np.ndarray, pieces: Sequence[tuple[int, DeviceBuffer]], *, pinned: bool = False
) -> None:
    """Fill each device buffer of ``pieces`` with ``span[start : start + buffer.nbytes]``;
    return once every byte is in place.

    From ``pinned`` memory, each buffer the driver can copy into takes an asynchronous copy
    of its own, and each device one wait: copies from pinned memory queue without waiting.
    From pageable memory, torch and CuPy buffers take one host-to-device copy of the span per
    device, then a device-to-device copy each and one wait: a copy from pageable host memory
    waits for the GPU every time, so hundreds of small arrays copied one by one cost a
    checkpoint's load milliseconds of waiting. Other buffers are filled one by one.
    """
    if pinned:
        from . import _cuda

        streams: dict[int, _cuda.Stream] = {}
        rest = []
        for start, buffer in pieces:
            if not driver_copyable(buffer):
                rest.append((start, buffer))
                continue
            stream = streams[buffer.device_index] = _cuda.thread_stream(buffer.device_index)
            _cuda.copy_host_address_to_device(
                buffer.data_ptr, span.ctypes.data + start, buffer.nbytes, stream
            )
        for stream in streams.values():
            stream.synchronize()
        pieces = rest
    groups: dict[tuple[type, int], list[tuple[int, Any]]] = {}
    for start, buffer in pieces:
        kind = type(buffer)
        if kind not in (TorchDeviceBuffer, CupyDeviceBuffer) or len(pieces) == 1:
            buffer.copy_from_host(0, span[start : start + buffer.nbytes])
        else:
            groups.setdefault((kind, buffer.device_index), []).append((start, buffer))
    for (kind, device), group in groups.items():
        first = min(start for start, _ in group)
        end = max(start + buffer.nbytes for start, buffer in group)
        if kind is TorchDeviceBuffer:
            _scatter_torch(span[first:end], device, [(s - first, b) for s, b in group])
        else:
            _scatter_cupy(span[first:end], device, [(s - first, b) for s, b in group])


def _scatter_torch(
    span: np.ndarray, device: int, group: list[tuple[int, TorchDeviceBuffer]]
) -> None:
    import torch

    with torch.cuda.device(device):
        staged = torch.from_numpy(span).to(torch.device("cuda", device))
        for start, buffer in group:
            buffer.tensor.copy_(staged[start : start + buffer.nbytes])
        torch.cuda.current_stream().synchronize()


def _scatter_cupy(span: np.ndarray, device: int, group: list[tuple[int, CupyDeviceBuffer]]) -> None:
    import cupy

    with cupy.cuda.Device(device):
        stream = cupy.cuda.get_current_stream()
        staged = cupy.empty(span.nbytes, dtype=cupy.uint8)
        staged.set(span, stream=stream)
        for start, buffer in group:
            cupy.cuda.runtime.memcpyAsync(
                buffer.data_ptr,
                staged.data.ptr + start,
                buffer.nbytes,
                cupy.cuda.runtime.memcpyDeviceToDevice,
                stream.ptr,
            )
        stream.synchronize()
