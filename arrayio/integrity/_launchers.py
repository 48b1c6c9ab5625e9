"""Three ways to run the device checksum's kernel: through CuPy, torch, or the bare driver.

CuPy compiles and launches raw kernels, but importing it costs a fresh process about as much
as a warm load of a gigabyte, a cost a torch user's first load would pay for a checksum
alone. Where torch already runs CUDA, the same source is built with NVRTC and launched with
the CUDA driver on torch's streams (:class:`TorchLauncher`), so such a process never imports
CuPy. Both work on raw device addresses, so either checksums any framework's memory.

A process that runs CUDA through neither (JAX) builds and launches it with the driver alone,
on arrayio's own streams and memory (:class:`DriverLauncher`), where an NVRTC library is found.

:func:`choose` picks one per process: CuPy where it is imported already, torch where it
runs CUDA, the driver where NVRTC is found, CuPy otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..arrays import _cuda

__all__ = [
    "CupyLauncher",
    "DriverLauncher",
    "Launcher",
    "TorchLauncher",
    "choice",
    "choose",
    "usable",
]


class Launcher:
    """What the checksum needs from a GPU framework. Device arrays are the framework's own;
    every method runs on the current device (:meth:`device`)."""

    name = ""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def current_stream(self, index: int) -> Any:
        raise NotImplementedError

    def new_stream(self, index: int) -> Any:
        raise NotImplementedError

    def own_stream(self, index: int) -> Any:
        """A non-blocking stream of arrayio's own on ``index``, made once."""
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = self.new_stream(index)
            return stream

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def upload(self, array: np.ndarray) -> Any:
        """``array`` copied to the current device, on the current stream."""
        raise NotImplementedError

    def zeros_uint32(self, shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def address(self, array: Any) -> int:
        raise NotImplementedError

    def download(self, array: Any, stream: Any) -> np.ndarray:
        """``array``'s values as ``uint32``, once ``stream`` has reached this point."""
        raise NotImplementedError

    def compile(self, source: str, name: str) -> Any:
        """Kernel ``name`` of ``source``, built for the current device."""
        raise NotImplementedError

    def launch(self, kernel: Any, grid: int, block: int, args: tuple[Any, ...]) -> None:
        """Launch ``kernel`` on the current stream; ``args`` are device arrays and ints
        (passed as C ``int``)."""
        raise NotImplementedError


class CupyLauncher(Launcher):
    name = "cupy"

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        return self.module.cuda.Device(index)

    def current_stream(self, index: int) -> Any:
        return self.module.cuda.get_current_stream()

    def new_stream(self, index: int) -> Any:
        with self.module.cuda.Device(index):
            return self.module.cuda.Stream(non_blocking=True)

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return stream  # type: ignore[no-any-return]

    def upload(self, array: np.ndarray) -> Any:
        return self.module.asarray(array)

    def zeros_uint32(self, shape: tuple[int, ...]) -> Any:
        return self.module.zeros(shape, self.module.uint32)

    def address(self, array: Any) -> int:
        return int(array.data.ptr)

    def download(self, array: Any, stream: Any) -> np.ndarray:
        return array.get(stream=stream)  # type: ignore[no-any-return]

    def compile(self, source: str, name: str) -> Any:
        return self.module.RawKernel(source, name)

    def launch(self, kernel: Any, grid: int, block: int, args: tuple[Any, ...]) -> None:
        kernel((grid,), (block,), tuple(np.int32(a) if isinstance(a, int) else a for a in args))


class TorchLauncher(Launcher):
    """Kernels built with NVRTC and launched with the CUDA driver (both through ``ctypes``,
    libraries torch has loaded already) on torch's streams. ``torch.cuda._compile_kernel``
    would do the same, but imports ``torch.utils.cpp_extension`` (and setuptools) first,
    which costs more than CuPy's import. The built binary is kept in arrayio's cache
    directory, so a later process loads it instead of compiling."""

    name = "torch"

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        return self.module.cuda.device(index)  # type: ignore[no-any-return]

    def current_stream(self, index: int) -> Any:
        return self.module.cuda.current_stream(index)

    def new_stream(self, index: int) -> Any:
        return self.module.cuda.Stream(device=index)  # torch's streams do not block on 0

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.module.cuda.stream(stream)  # type: ignore[no-any-return]

    def upload(self, array: np.ndarray) -> Any:
        torch = self.module
        host = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        return host.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)

    def zeros_uint32(self, shape: tuple[int, ...]) -> Any:
        torch = self.module
        return torch.zeros(shape, dtype=torch.int32, device=torch.cuda.current_device())

    def address(self, array: Any) -> int:
        return int(array.data_ptr())

    def download(self, array: Any, stream: Any) -> np.ndarray:
        with self.module.cuda.stream(stream):
            host = array.to("cpu")  # waits for the stream
        return host.numpy().view(np.uint32)  # type: ignore[no-any-return]

    def compile(self, source: str, name: str) -> Any:
        torch = self.module
        cuda_major = str(torch.version.cuda or "").split(".")[0]
        return _built(source, name, torch.cuda.current_device(), cuda_major)

    def launch(self, kernel: Any, grid: int, block: int, args: tuple[Any, ...]) -> None:
        torch = self.module
        _cuda.make_current(torch.cuda.current_device())
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _launch(kernel, grid, block, args, self.address, stream)


class _DriverArray:
    """Device memory of the driver's, with the shape of what it holds."""

    __slots__ = ("memory", "shape")

    def __init__(self, memory: _cuda.DeviceMemory, shape: tuple[int, ...]) -> None:
        self.memory, self.shape = memory, shape


class DriverLauncher(Launcher):
    """The kernel built with NVRTC and launched with the CUDA driver, on arrayio's own
    streams and memory: for a process that runs CUDA through no framework arrayio can use
    (JAX), so that a checksum imports none. Needs an NVRTC library (:func:`_nvrtc_library`);
    the built binary is kept as :class:`TorchLauncher`'s is."""

    name = "driver"

    def __init__(self) -> None:
        super().__init__(None)
        self._local = threading.local()

    @contextlib.contextmanager
    def device(self, index: int) -> Any:
        previous = getattr(self._local, "device", None)
        _cuda.make_current(index)
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = previous
            if previous is not None:
                _cuda.make_current(previous)

    def _device(self) -> int:
        device = getattr(self._local, "device", None)
        return 0 if device is None else int(device)

    def current_stream(self, index: int) -> Any:
        stream = getattr(self._local, "stream", None)
        return stream if stream is not None else _cuda.thread_stream(index)

    def new_stream(self, index: int) -> Any:
        return _cuda.Stream(index)

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Any:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def upload(self, array: np.ndarray) -> Any:
        host = np.ascontiguousarray(array)
        device = self._device()
        memory = _cuda.DeviceMemory(host.nbytes, device)
        # From pageable memory the call returns once the bytes are staged: ``host`` may go.
        _cuda.copy_to_device(
            memory.address, host.reshape(-1).view(np.uint8), self.current_stream(device)
        )
        return _DriverArray(memory, host.shape)

    def zeros_uint32(self, shape: tuple[int, ...]) -> Any:
        device = self._device()
        memory = _cuda.DeviceMemory(4 * int(np.prod(shape)), device)
        memory.fill_uint32(0, self.current_stream(device))
        return _DriverArray(memory, shape)

    def address(self, array: Any) -> int:
        return int(array.memory.address)

    def download(self, array: Any, stream: Any) -> np.ndarray:
        host = np.empty(array.shape, dtype=np.uint32)
        _cuda.copy_to_host(host.reshape(-1).view(np.uint8), array.memory.address, stream)
        stream.synchronize()
        return host

    def compile(self, source: str, name: str) -> Any:
        return _built(source, name, self._device(), str(_cuda.driver_cuda_major()))

    def launch(self, kernel: Any, grid: int, block: int, args: tuple[Any, ...]) -> None:
        device = self._device()
        _launch(kernel, grid, block, args, self.address, self.current_stream(device).handle)


def _launch(
    kernel: Any, grid: int, block: int, args: tuple[Any, ...], address: Any, stream: Any
) -> None:
    """``kernel`` on ``stream`` (a handle), ``args`` device arrays (their ``address``) and
    ints (C ``int``)."""
    values = [ctypes.c_int(a) if isinstance(a, int) else ctypes.c_void_p(address(a)) for a in args]
    params = (ctypes.c_void_p * len(values))(
        *(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values)
    )
    _cuda.check(
        _cuda.driver().cuLaunchKernel(
            kernel, grid, 1, 1, block, 1, 1, 0, stream, ctypes.cast(params, ctypes.c_void_p), None
        ),
        "cuLaunchKernel",
    )


def _built(source: str, name: str, device: int, cuda_major: str) -> ctypes.c_void_p:
    """Kernel ``name`` of ``source`` built for ``device`` (by NVRTC of ``cuda_major``, or
    from the cache directory) and loaded into its context."""
    major, minor = _cuda.compute_capability(device)
    _cuda.make_current(device)
    return _driver_kernel(_cubin(source, name, f"sm_{major}{minor}", cuda_major), name)


def _driver_kernel(binary: bytes, name: str) -> ctypes.c_void_p:
    """Kernel ``name`` of ``binary``, loaded into the current device's context."""
    libcuda = _cuda.driver()
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    _cuda.check(libcuda.cuModuleLoadData(ctypes.byref(module), binary), "cuModuleLoadData")
    _cuda.check(
        libcuda.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
        "cuModuleGetFunction",
    )
    return function  # the module stays loaded for the process's life, as CuPy's do


def _cubin(source: str, name: str, arch: str, cuda_major: str) -> bytes:
    """``source`` built by NVRTC for ``arch``, from arrayio's cache directory where a
    process built it before."""
    from .. import config

    key = hashlib.sha256(f"{source}\0{name}\0{arch}\0{cuda_major}".encode()).hexdigest()[:20]
    directory = config.get().cache_dir
    path = os.path.join(directory, f"kernel-{key}.cubin") if directory else None
    if path is not None:
        try:
            with open(path, "rb") as cached:
                return cached.read()
        except OSError:
            pass
    binary = _nvrtc(source, name, arch, cuda_major)
    if path is not None:
        try:  # a cache, written whole or not at all
            os.makedirs(directory, exist_ok=True)  # type: ignore[arg-type]
            partial = f"{path}.{os.getpid()}.partial"
            with open(partial, "wb") as out:
                out.write(binary)
            os.replace(partial, path)
        except OSError:
            pass
    return binary


@functools.cache
def _nvrtc_library(cuda_major: str) -> Any:
    """NVRTC: the one the process has loaded or the loader finds, else one installed as a
    Python wheel (``nvidia-cuda-nvrtc``, which JAX's and torch's CUDA wheels bring); None
    where there is none. The wheels' folders are searched only when the loader finds none."""
    for library in (f"libnvrtc.so.{cuda_major}", "libnvrtc.so", *_nvrtc_in_wheels(cuda_major)):
        try:
            return ctypes.CDLL(library)
        except OSError:
            continue
    return None


def _nvrtc_in_wheels(cuda_major: str) -> Iterator[str]:
    for root in sys.path:
        nvidia = os.path.join(root or ".", "nvidia")
        if os.path.isdir(nvidia):
            yield from sorted(
                glob.glob(os.path.join(nvidia, "*", "lib", f"libnvrtc.so.{cuda_major}*"))
            )
            yield from sorted(glob.glob(os.path.join(nvidia, "*", "lib", "libnvrtc.so.*")))


def _nvrtc(source: str, name: str, arch: str, cuda_major: str) -> bytes:
    nvrtc = _nvrtc_library(cuda_major)
    if nvrtc is None:
        raise RuntimeError("NVRTC is not found")
    program = ctypes.c_void_p()
    _cuda.check(
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None
        ),
        "nvrtcCreateProgram",
    )
    try:
        options = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        if nvrtc.nvrtcCompileProgram(program, 1, options) != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not build {name}: {log.value.decode()}")
        size = ctypes.c_size_t()
        _cuda.check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        binary = ctypes.create_string_buffer(size.value)
        _cuda.check(nvrtc.nvrtcGetCUBIN(program, binary), "nvrtcGetCUBIN")
        return binary.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _torch_running_cuda() -> Any:
    """torch, where it is imported and runs CUDA (not ROCm) already; else None."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.version.cuda and torch.cuda.is_initialized():
            return torch
    except Exception:  # noqa: BLE001 - a broken install is "not usable"
        pass
    return None


@functools.cache
def _driver_usable() -> bool:
    """Whether the driver and NVRTC can build and run the kernel with no framework (asked
    of every GPU transfer's candidates: found once)."""
    try:
        return _nvrtc_library(str(_cuda.driver_cuda_major())) is not None
    except Exception:  # noqa: BLE001 - no driver, or one that cannot start: not usable
        return False


def usable() -> bool:
    """Whether :func:`choose` can give a launcher here, without importing any framework."""
    if "cupy" in sys.modules or _torch_running_cuda() is not None:
        return True
    try:
        if importlib.util.find_spec("cupy") is not None:
            return True
    except (ImportError, ValueError):
        pass
    return _driver_usable()


def choice(avoid: frozenset[str] = frozenset()) -> str | None:
    """The name of the launcher :func:`choose` makes now, importing nothing: ``"cupy"``,
    ``"torch"``, ``"driver"``, or None where there is none to try."""
    if "cupy" not in avoid and "cupy" in sys.modules:
        return "cupy"
    if "torch" not in avoid and _torch_running_cuda() is not None:
        return "torch"
    if "driver" not in avoid and _driver_usable():
        return "driver"
    return "cupy" if "cupy" not in avoid else None  # imported, where it is installed


def choose(avoid: frozenset[str] = frozenset()) -> Launcher | None:
    """The launcher for this process (see the module docstring), other than those named in
    ``avoid`` (ones that failed); None where there is none."""
    name = choice(avoid)
    if name == "torch":
        return TorchLauncher(sys.modules["torch"])
    if name == "driver":
        return DriverLauncher()
    if name == "cupy":
        try:
            import cupy
        except ImportError:
            return None
        return CupyLauncher(cupy)
    return None
