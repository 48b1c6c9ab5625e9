"""Framework adapters for tests: build an array of any framework and device from raw bytes,
and read its bytes back, so that round trips compare bit for bit (NaN payloads included).

Nothing here imports a framework until a test asks for that framework.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from typing import Any

import numpy as np

from ..arrays._dtypes import DType, numpy_dtype

__all__ = ["FRAMEWORK_PARAMS", "Framework", "gpu_available", "random_array", "supports"]


@dataclasses.dataclass(frozen=True)
class Framework:
    """One framework on one device: ``numpy``, ``jax``, ``torch``, ``cupy`` x ``cpu``/``cuda``."""

    name: str
    device: str = "cpu"

    @property
    def id(self) -> str:
        return self.name if self.device == "cpu" else f"{self.name}-{self.device}"

    def usable(self) -> str | None:
        """Return why this framework cannot run here, or None; readies JAX for 64-bit types."""
        if importlib.util.find_spec(self.name) is None:
            return f"{self.name} is not installed"
        if self.device == "cuda" and not gpu_available():
            return "no CUDA GPU"
        if self.name == "jax":
            import jax

            # Round trips cover 64-bit dtypes; the x64-disabled error has a test of its own.
            jax.config.update("jax_enable_x64", True)
        return None

    def from_numpy(self, a: np.ndarray) -> Any:
        """Return an array of this framework and device holding exactly ``a``'s bytes."""
        if self.name == "numpy":
            return a
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if self.name == "jax":
            import jax

            device = jax.devices("gpu" if self.device == "cuda" else "cpu")[0]
            return jax.device_put(a, device)
        if self.name == "torch":
            import torch

            from ..arrays._dtypes import dtype_of
            from ..arrays._frameworks import torch_dtype

            t_dtype = torch_dtype(dtype_of(a.dtype))
            if not flat.nbytes:  # torch cannot reinterpret an empty byte tensor
                return torch.empty(a.shape, dtype=t_dtype, device=self.device)
            return torch.from_numpy(flat.copy()).view(t_dtype).reshape(a.shape).to(self.device)
        if self.name == "cupy":
            import cupy

            return cupy.asarray(flat).view(a.dtype).reshape(a.shape)
        raise AssertionError(self.name)

    def to_bytes(self, x: Any) -> bytes:
        """Return the C-ordered bytes of ``x``."""
        if self.name in ("numpy", "jax"):
            return np.ascontiguousarray(np.asarray(x)).tobytes()
        if self.name == "torch":
            import torch

            return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        import cupy

        return cupy.asnumpy(cupy.ascontiguousarray(x).reshape(-1).view(cupy.uint8)).tobytes()

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")


FRAMEWORK_PARAMS = (
    Framework("numpy"),
    Framework("jax"),
    Framework("torch"),
    Framework("cupy", "cuda"),
    Framework("jax", "cuda"),
    Framework("torch", "cuda"),
)


def supports(framework: Framework, dtype: DType) -> bool:
    """Whether ``framework`` can hold ``dtype`` (CuPy has no float8)."""
    if framework.name == "cupy":
        return not dtype.name.startswith("float8")
    if framework.name == "numpy" and not dtype.numpy_native:
        try:
            numpy_dtype(dtype)
        except ImportError:
            return False
    return True


def random_array(dtype: DType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """A C-ordered NumPy array of ``dtype`` with random bytes (booleans 0 or 1)."""
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = rng.integers(0, 2 if dtype.name == "bool" else 256, count, dtype=np.uint8)
    return raw.view(numpy_dtype(dtype)).reshape(shape)


@functools.cache
def gpu_available() -> bool:
    """Whether a CUDA GPU is usable, through whichever of CuPy or torch is installed."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        pass
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - same: any failure means no GPU
        return False
