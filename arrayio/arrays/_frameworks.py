"""Frameworks: detection through ``sys.modules``, export of bytes, allocation of results.

arrayio never imports a framework the caller has not imported: an array can only belong to
a framework that is already in ``sys.modules`` (array-api-compat's rule), and asking for
``like="jax"`` is the caller's explicit request to import JAX.

Two directions meet the byte mover (:mod:`arrayio.dispatch._transfer`) here:

* :func:`export` turns an array into its dtype, shape and a flat, C-ordered byte buffer
  (a NumPy ``uint8`` array on the host, or a :class:`DeviceBuffer` on a GPU), zero-copy
  whenever the array is already contiguous.
* :func:`allocate` makes an empty result for a framework and device and hands out a
  writable byte buffer over it; ``finish()`` returns the array to give the caller.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    DeviceError,
    FrameworkNotAvailableError,
    UnsupportedDtypeError,
    UnsupportedObjectError,
)
from ..runtime._units import format_count
from . import _dtypes
from ._buffers import CupyDeviceBuffer, DeviceBuffer, TorchDeviceBuffer, aligned_empty, result_empty
from ._dtypes import DType
from ._jax_import import imports_in_place, to_jax
from ._shards import Pieces

if TYPE_CHECKING:
    from types import ModuleType

    from ._driver_buffers import DriverDeviceBuffer

__all__ = [
    "FRAMEWORKS",
    "Exported",
    "Placement",
    "Target",
    "allocate",
    "export",
    "framework_of",
    "is_array",
    "jax_uncommitted",
    "parse_target",
    "require",
    "writable_view",
]

FRAMEWORKS = ("numpy", "jax", "torch", "cupy")

# --------------------------------------------------------------------------- placement


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where an array lives: ``("cpu", 0)`` or ``("cuda", index)``."""

    kind: str
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


CPU = Placement("cpu")


def _module(name: str) -> ModuleType | None:
    return sys.modules.get(name)


def _parse_device(device: Any) -> tuple[Placement, str | None, Any]:
    """Return (placement, framework implied by the device object or None, the jax Device)."""
    if device is None:
        return CPU, None, None
    if isinstance(device, str):
        text = device.strip().lower()
        kind, _, index = text.partition(":")
        if kind in ("cpu", "host"):
            return CPU, None, None
        if kind in ("cuda", "gpu"):
            try:
                return Placement("cuda", int(index) if index else 0), None, None
            except ValueError:
                pass
        raise DeviceError(f"cannot parse device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
    if isinstance(device, int) and not isinstance(device, bool):
        return Placement("cuda", device), None, None
    module = type(device).__module__.split(".")[0]
    if module == "torch":
        if device.type == "cpu":
            return CPU, "torch", None
        if device.type == "cuda":
            return Placement("cuda", device.index or 0), "torch", None
    if module in ("jax", "jaxlib"):
        if device.platform == "cpu":
            return CPU, "jax", device
        if device.platform in ("gpu", "cuda"):
            return Placement("cuda", device.local_hardware_id or 0), "jax", device
    if module == "cupy":
        return Placement("cuda", device.id), "cupy", None
    raise DeviceError(f"cannot use {device!r} as a device")


def framework_of(x: Any) -> str | None:
    """Name the framework that owns ``x``, looking only at frameworks already imported."""
    if isinstance(x, np.ndarray | np.generic):
        return "numpy"
    torch = _module("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    jax = _module("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    cupy = _module("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    return None


def is_array(x: Any) -> bool:
    """Whether arrayio saves ``x`` as an array (rather than a container or a constant)."""
    return framework_of(x) is not None or hasattr(x, "__dlpack__")


def placement_of(x: Any) -> Placement:
    """Return the device an array lives on."""
    framework = framework_of(x)
    if framework == "torch":
        return Placement("cuda", x.device.index or 0) if x.device.type == "cuda" else CPU
    if framework == "jax":
        devices = x.devices()
        device = next(iter(devices))
        if len(devices) == 1 and device.platform in ("gpu", "cuda"):
            return Placement("cuda", device.local_hardware_id or 0)
        return CPU
    if framework == "cupy":
        return Placement("cuda", x.device.id)
    if framework is None and hasattr(x, "__dlpack_device__"):
        kind, index = x.__dlpack_device__()
        if int(kind) == 2:  # kDLCUDA
            return Placement("cuda", int(index))
    return CPU


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """What the caller asked a load to return: a framework, a placement, a jax Device."""

    framework: str
    placement: Placement
    jax_device: Any = None


def parse_target(like: Any, device: Any) -> Request:
    """Resolve ``like`` and ``device`` into a framework and placement.

    Raises
    ------
    DeviceError
        For an unparseable device, one that does not fit the framework (NumPy on a GPU), or
        a GPU this machine cannot use (no NVIDIA driver, no such GPU, a CPU-only build of
        torch or JAX).
    FrameworkNotAvailableError
        For a framework that is not installed.
    """
    placement, implied, jax_device = _parse_device(device)
    if like is None:
        framework = implied or ("cupy" if placement.is_cuda else "numpy")
    elif isinstance(like, str):
        framework = like.strip().lower()
        if framework not in FRAMEWORKS:
            raise ValueError(f"like={like!r}: expected one of {FRAMEWORKS} or an example array")
    else:
        framework = framework_of(like)
        if framework is None:
            raise ValueError(f"like={type(like).__name__} is not an array of {FRAMEWORKS}")
        if device is None:
            placement = placement_of(like)
            if framework == "jax":
                jax_device = next(iter(like.devices()))
    if framework == "numpy" and placement.is_cuda:
        raise DeviceError(
            f"NumPy arrays live on the CPU; device={device!r} needs like='cupy', 'jax' or 'torch'"
        )
    if framework == "cupy" and not placement.is_cuda:
        raise DeviceError("CuPy arrays live on a GPU: pass device='cuda' (or 'cuda:N')")
    if placement.is_cuda:
        jax_device = _check_cuda(framework, placement, jax_device)
    require(framework)
    return Request(framework, placement, jax_device)


def _check_cuda(framework: str, placement: Placement, jax_device: Any) -> Any:
    """Refuse a GPU this machine cannot use, before any data is read: first the driver
    (through ctypes, importing no framework), then the framework's own build. Returns the
    JAX device to use, if JAX."""
    count, problem = _cuda_driver()
    if problem is not None:
        raise DeviceError(
            f"cannot use {placement}: this machine has no usable CUDA GPU "
            f"({problem}); arrays can go to the CPU (device='cpu')"
        )
    if placement.index >= count:
        raise DeviceError(
            f"cannot use {placement}: this machine has "
            f"{format_count(count, 'CUDA GPU')} (cuda:0 to cuda:{count - 1})"
        )
    if framework == "torch":
        torch = require("torch")
        if torch.version.cuda is None:
            raise DeviceError(
                f"cannot use {placement}: this is a CPU-only build of torch "
                f"({torch.__version__}); install a CUDA build "
                "(https://pytorch.org/get-started/locally/)"
            )
    if framework == "jax" and jax_device is None:
        return _jax_device(require("jax"), placement)
    return jax_device


@functools.cache
def _cuda_driver() -> tuple[int, str | None]:
    """How many GPUs the NVIDIA driver sees, or why none can be used.

    Asks the driver library itself through ctypes (``cuInit``, ``cuDeviceGetCount``), as
    KvikIO's availability check loads it: milliseconds, and no framework is imported. A
    caller asking for a GPU is about to initialise CUDA anyway.
    """
    import ctypes

    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            driver = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return 0, f"no NVIDIA driver is installed: {names[0]} not found"
    status = driver.cuInit(0)
    if status != 0:
        text = ctypes.c_char_p()
        driver.cuGetErrorString(status, ctypes.byref(text))
        reason = text.value.decode(errors="replace") if text.value else f"error {status}"
        return 0, f"the NVIDIA driver did not start: {reason}"
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return 0, "the NVIDIA driver sees no GPU"
    return count.value, None


def require(framework: str, purpose: str | None = None) -> ModuleType:
    """Import a framework the caller asked for by name (or that ``purpose`` needs), with an
    install hint if missing."""
    module = _module(framework)
    if module is not None:
        return module
    import importlib

    try:
        return importlib.import_module(framework)
    except ImportError:
        extra = {"cupy": "gpu"}.get(framework, framework)
        needs = f"{purpose} needs {framework}, which" if purpose else framework
        raise FrameworkNotAvailableError(
            f"{needs} is not installed: pip install 'arrayio[{extra}]'"
        ) from None


def _driver_memory(nbytes: int, device: int) -> DriverDeviceBuffer | None:
    """``nbytes`` of device memory from the CUDA driver (JAX's loads: no framework to
    import); None where the driver cannot give it (the caller then goes through the host)."""
    from ._driver_buffers import DriverDeviceBuffer  # GPU code: not on ``import arrayio``

    try:
        return DriverDeviceBuffer.allocate(nbytes, device)
    except OSError:  # no libcuda: no CUDA here at all
        return None


def _cupy() -> ModuleType | None:
    """CuPy, if importable: the GPU byte mover's workhorse, never required."""
    module = _module("cupy")
    if module is not None:
        return module
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def _flat_bytes_numpy(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _torch_flat_bytes(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True, slots=True)
class Exported:
    """An array ready to be written: its bytes in C order, on the host or a device."""

    dtype: DType
    shape: tuple[int, ...]
    # Pieces only from export_for_save: a sharded jax.Array's shards, left on their devices.
    data: np.ndarray | DeviceBuffer | Pieces
    framework: str


def export_for_save(x: Any) -> Exported:
    """:func:`export`, except that a ``jax.Array`` sharded over several devices by whole rows
    keeps each unique shard on its device (:class:`~arrayio.arrays._shards.Pieces`): a
    save writes them in place instead of gathering the array on the host first."""
    if framework_of(x) == "jax":
        from ._shards import sharded_pieces

        pieces = sharded_pieces(x, _export_jax)
        if pieces is not None:
            return Exported(_dtypes.dtype_of(x.dtype), tuple(x.shape), pieces, "jax")
    return export(x)


def export(x: Any) -> Exported:
    """Return the bytes of ``x`` in C order, zero-copy where ``x`` is already contiguous.

    Raises
    ------
    UnsupportedDtypeError
        For a dtype arrayio does not store.
    UnsupportedObjectError
        For an object that is not an array of a known framework nor a DLPack producer.
    """
    framework = framework_of(x)
    if framework == "numpy":
        return _export_numpy(np.asarray(x), "numpy")
    if framework == "torch":
        return _export_torch(x)
    if framework == "jax":
        return _export_jax(x)
    if framework == "cupy":
        return _export_cupy(x, "cupy")
    if hasattr(x, "__dlpack__"):
        if placement_of(x).is_cuda and (cupy := _cupy()) is not None:
            return _export_cupy(cupy.from_dlpack(x), "dlpack")
        return _export_numpy(np.from_dlpack(x), "dlpack")
    raise UnsupportedObjectError(f"cannot save an object of type {type(x).__name__}")


def _export_numpy(a: np.ndarray, framework: str) -> Exported:
    if a.dtype.hasobject or a.dtype.fields is not None:
        raise UnsupportedDtypeError(f"cannot save arrays of dtype {a.dtype}")
    dtype = _dtypes.dtype_of(a.dtype)
    shape = tuple(a.shape)
    if not a.flags.c_contiguous:  # a copy only for strided or Fortran-ordered input
        a = np.ascontiguousarray(a)
    return Exported(dtype, shape, _flat_bytes_numpy(a), framework)


def _export_torch(t: Any) -> Exported:
    dtype = _dtypes.dtype_of(t.dtype)
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    shape = tuple(t.shape)
    if t.device.type == "cuda":
        return Exported(dtype, shape, TorchDeviceBuffer(_torch_flat_bytes(t)), "torch")
    if t.device.type != "cpu":
        t = t.cpu()
    return Exported(dtype, shape, _torch_flat_bytes(t).numpy(), "torch")


def _export_jax(x: Any) -> Exported:
    dtype = _dtypes.dtype_of(x.dtype)
    placement = placement_of(x)
    cupy = _cupy() if placement.is_cuda else None
    if cupy is None:
        # CPU arrays: np.asarray is a zero-copy, read-only view. GPU arrays without CuPy
        # (or sharded over several devices): a device-to-host copy.
        return _export_numpy(np.asarray(x), "jax")
    if dtype.name.startswith("float8"):  # CuPy has no float8: move the bits as uint8.
        import jax

        x = jax.lax.bitcast_convert_type(x, np.uint8)
        return Exported(dtype, tuple(x.shape), _export_cupy(cupy.from_dlpack(x), "jax").data, "jax")
    return _export_cupy(cupy.from_dlpack(x), "jax", dtype)


def _export_cupy(a: Any, framework: str, dtype: DType | None = None) -> Exported:
    import cupy

    dtype = dtype or _dtypes.dtype_of(a.dtype)
    shape = tuple(a.shape)
    with a.device:
        a = cupy.ascontiguousarray(a)
        flat = a.reshape(-1).view(cupy.uint8)
    return Exported(dtype, shape, CupyDeviceBuffer(flat), framework)


# --------------------------------------------------------------------------- allocation


@dataclasses.dataclass
class Target:
    """An empty result: fill ``data`` (host ``uint8`` or device bytes), then ``finish()``."""

    data: np.ndarray | DeviceBuffer
    finish: Callable[[], Any]
    # Whether finish() copies ``data`` elsewhere (host bytes put on a device by JAX): a load
    # then holds ``data`` and the copy at once, and bounds how much it reads before finishing.
    copies: bool = False
    # Whether finish() only wraps ``data`` and reads none of its bytes, so that it may run
    # while they are still moving (a JAX array made from device memory through DLPack costs
    # tens of microseconds: hundreds of them, a tenth of a warm load, hide behind its reads).
    wraps: bool = False


def allocate(request: Request, dtype: DType, shape: tuple[int, ...]) -> Target:
    """Allocate an empty ``shape``/``dtype`` result for the requested framework and device.

    Raises
    ------
    UnsupportedDtypeError
        When the framework has no such dtype (CuPy and float8, JAX without x64 and 64-bit
        types...).
    """
    nbytes = dtype.itemsize * math.prod(shape)
    framework, placement = request.framework, request.placement
    if framework == "numpy":
        host = result_empty(nbytes)
        return Target(
            host, lambda: host.view(_dtypes.numpy_dtype(dtype)).reshape(shape), wraps=True
        )
    if framework == "torch":
        return _allocate_torch(dtype, shape, nbytes, placement)
    if framework == "jax":
        return _allocate_jax(dtype, shape, nbytes, request)
    if framework == "cupy":
        cupy = require("cupy")
        np_dtype = _cupy_dtype(cupy, dtype)
        with cupy.cuda.Device(placement.index):
            array = cupy.empty(shape, dtype=np_dtype)
            flat = array.reshape(-1).view(cupy.uint8)
        return Target(CupyDeviceBuffer(flat), lambda: array, wraps=True)
    raise AssertionError(framework)


def torch_dtype(dtype: DType) -> Any:
    """Return torch's dtype for ``dtype`` or raise UnsupportedDtypeError."""
    torch = require("torch")
    result = getattr(torch, dtype.name, None)
    if result is None or not isinstance(result, torch.dtype):
        raise UnsupportedDtypeError(f"torch {torch.__version__} has no {dtype.name} dtype")
    return result


def _allocate_torch(dtype: DType, shape: tuple[int, ...], nbytes: int, placement: Placement):
    torch = require("torch")
    t_dtype = torch_dtype(dtype)
    if placement.is_cuda:
        tensor = torch.empty(shape, dtype=t_dtype, device=_torch_cuda(placement.index))
        return Target(TorchDeviceBuffer(_torch_flat_bytes(tensor)), lambda: tensor, wraps=True)
    if nbytes == 0:  # torch cannot reinterpret an empty byte tensor
        return Target(result_empty(0), lambda: torch.empty(shape, dtype=t_dtype))
    host = result_empty(nbytes)
    return Target(host, lambda: torch.from_numpy(host).view(t_dtype).reshape(shape))


@functools.cache
def _torch_cuda(index: int) -> Any:
    """torch's device object for GPU ``index``, made once: a device given as a string is
    parsed again on every allocation."""
    return require("torch").device("cuda", index)


def _cupy_dtype(cupy: ModuleType, dtype: DType) -> np.dtype:
    np_dtype = _dtypes.numpy_dtype(dtype)
    try:
        cupy.empty((0,), dtype=np_dtype)
    except (TypeError, ValueError, NotImplementedError):
        raise UnsupportedDtypeError(f"CuPy {cupy.__version__} has no {dtype.name} dtype") from None
    return np_dtype


_JAX_X64_ONLY = frozenset({"int64", "uint64", "float64", "complex128"})


def _allocate_jax(dtype: DType, shape: tuple[int, ...], nbytes: int, request: Request) -> Target:
    jax = require("jax")
    if dtype.name in _JAX_X64_ONLY and not jax.config.jax_enable_x64:
        raise UnsupportedDtypeError(
            f"JAX would silently narrow {dtype.name} to 32 bits: enable 64-bit types with "
            "jax.config.update('jax_enable_x64', True), or load with like='numpy'"
        )
    np_dtype = _dtypes.numpy_dtype(dtype)
    placement = request.placement
    flat = _driver_memory(nbytes, placement.index) if placement.is_cuda else None
    if flat is not None:
        memory = flat  # (for the closure: mypy keeps ``flat`` optional)
        from ._driver_buffers import DLPackExport

        def finish_cuda() -> Any:
            device = request.jax_device or _jax_device(jax, placement)
            if dtype.name.startswith("float8"):  # DLPack has no float8: bitcast inside JAX.
                as_bytes = to_jax(jax, DLPackExport(memory, (*shape, 1), np.uint8), device)
                return jax.lax.bitcast_convert_type(as_bytes, np_dtype).reshape(shape)
            return to_jax(jax, DLPackExport(memory, shape, np_dtype), device)  # zero-copy

        # Made while the bytes move only where JAX takes the memory as it is (float8 is
        # converted by a computation on the bytes; the public import may copy).
        wraps = imports_in_place() and not dtype.name.startswith("float8")
        return Target(memory, finish_cuda, wraps=wraps)

    host = aligned_empty(nbytes)
    copies = placement.is_cuda or request.jax_device is not None or not dtype.numpy_native

    def finish_host() -> Any:
        array = host.view(np_dtype).reshape(shape)
        if copies:
            device = request.jax_device or _jax_device(jax, placement)
            return jax.device_put(array, device)
        return jax.dlpack.from_dlpack(array)  # zero-copy: the buffer is 4096-aligned

    return Target(host, finish_host, copies)


def jax_uncommitted(array: Any) -> Any:
    """``array``, a JAX array on one device, as an uncommitted one: as JAX holds an array it
    placed by default (``jnp.ones``, a jitted function's output of such arrays). Jitted
    functions cache their compilations by whether each argument is committed, so an array
    moved and moved back by ``jax.device_put`` (which commits it) would make every function
    it reaches compile again. JAX offers no public way back: this builds the array from its
    buffers with JAX's array type, and returns ``array`` as it is where that fails."""
    if not getattr(array, "committed", False):
        return array
    try:
        from jax._src.array import ArrayImpl

        return ArrayImpl(array.aval, array.sharding, array._arrays, committed=False)
    except Exception:  # noqa: BLE001 - another JAX: committed costs compilations, not results
        return array


def _jax_device(jax: ModuleType, placement: Placement) -> Any:
    if not placement.is_cuda:
        return jax.devices("cpu")[0]
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # "Unknown backend: 'gpu' requested...": a CPU-only jaxlib
        raise DeviceError(
            f"cannot use {placement}: JAX {jax.__version__} has no GPU backend here (a "
            "CPU-only jaxlib); install one with CUDA: pip install 'jax[cuda13]' (or cuda12)"
        ) from None
    for device in gpus:
        if device.local_hardware_id == placement.index:
            return device
    raise DeviceError(f"JAX sees no GPU {placement}")


def writable_view(out: Any) -> tuple[DType, tuple[int, ...], np.ndarray | DeviceBuffer]:
    """Return the dtype, shape and a writable byte view of an array the caller allocated.

    Raises
    ------
    UnsupportedObjectError
        For an immutable (JAX) or non-contiguous ``out``: filling it would need a second
        full-size allocation.
    """
    framework = framework_of(out)
    if framework == "jax":
        raise UnsupportedObjectError(
            "JAX arrays are immutable: use arrayio.load(..., like='jax') instead of read_into"
        )
    if framework is None:
        raise UnsupportedObjectError(
            f"read_into needs a NumPy, CuPy or torch array, got {type(out).__name__}"
        )
    dtype = _dtypes.dtype_of(out.dtype)
    shape = tuple(out.shape)
    if framework == "numpy":
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise UnsupportedObjectError("read_into needs a writable, C-contiguous NumPy array")
        return dtype, shape, _flat_bytes_numpy(out)
    if framework == "torch":
        if not out.is_contiguous():
            raise UnsupportedObjectError("read_into needs a contiguous torch tensor")
        flat = _torch_flat_bytes(out.detach())
        if out.device.type == "cuda":
            return dtype, shape, TorchDeviceBuffer(flat)
        if out.device.type != "cpu":
            raise UnsupportedObjectError(f"read_into cannot fill a tensor on {out.device}")
        return dtype, shape, flat.numpy()
    import cupy

    if not out.flags.c_contiguous:
        raise UnsupportedObjectError("read_into needs a C-contiguous CuPy array")
    with out.device:
        return dtype, shape, CupyDeviceBuffer(out.reshape(-1).view(cupy.uint8))
