"""Memory the byte mover fills and drains: aligned host arrays and flat device byte ranges.

A host buffer is a flat, C-contiguous NumPy ``uint8`` array. Device memory is wrapped in a
:class:`DeviceBuffer`, through CuPy when the array is CuPy's (or JAX's, zero-copy) and
through torch for torch tensors, so that torch users need no CuPy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

__all__ = ["HOST_ALIGNMENT", "CupyDeviceBuffer", "DeviceBuffer", "TorchDeviceBuffer",
           "aligned_empty", "synchronize_device"]

# Host buffers are aligned for O_DIRECT (4096) and, as a by-product, for JAX's zero-copy
# import of host memory (which needs 64).
HOST_ALIGNMENT = 4096


def aligned_empty(nbytes: int, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """Return an uninitialised host ``uint8`` array of ``nbytes`` starting on ``alignment``."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


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


@dataclasses.dataclass
class CupyDeviceBuffer:
    """Device bytes held as a flat CuPy ``uint8`` array."""

    array: Any

    @property
    def cuda_array(self) -> Any:
        return self.array

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def device_index(self) -> int:
        return int(self.array.device.id)

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
        import cupyx

        return cupyx.empty_pinned((nbytes,), dtype=np.uint8)


@dataclasses.dataclass
class TorchDeviceBuffer:
    """Device bytes held as a flat torch ``uint8`` CUDA tensor (no CuPy needed)."""

    tensor: Any

    @property
    def cuda_array(self) -> Any:
        return self.tensor

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def device_index(self) -> int:
        return int(self.tensor.device.index or 0)

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


def synchronize_device(buffer: DeviceBuffer) -> None:
    """Wait for all work on the buffer's GPU, so that its bytes are final before a tool that
    runs on its own streams or threads reads them."""
    if isinstance(buffer, TorchDeviceBuffer):
        import torch

        torch.cuda.synchronize(buffer.device_index)
        return
    import cupy

    with cupy.cuda.Device(buffer.device_index):
        cupy.cuda.runtime.deviceSynchronize()
