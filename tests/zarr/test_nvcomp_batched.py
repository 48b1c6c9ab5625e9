"""nvCOMP's batched zstd decompression through its C library: the argument plumbing, checked
on the host against a stand-in for the library that keeps its contract (it reads the
device arrays of addresses and sizes it is given, decodes each chunk with libzstd, and
writes the decoded sizes and statuses where it is told), and which libraries are called at
all. The GPU tests in ``test_codecs.py`` (and the reads of ``test_gpu.py``) decode through the
real one."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

numcodecs = pytest.importorskip("numcodecs")

from numcodecs import Zstd  # noqa: E402

from arrayio.zarr import _nvcomp_batched  # noqa: E402


class HostArray:
    """A NumPy array posing as a CuPy one: its host address stands for a device address."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.data = types.SimpleNamespace(ptr=array.ctypes.data)
        self.itemsize = array.itemsize
        self.size = array.size

    def __getitem__(self, index):
        return HostArray(self.array[index])

    def get(self) -> np.ndarray:
        return self.array.copy()


class HostCupy:
    """What :class:`BatchedZstd` asks of CuPy, on host memory."""

    def __init__(self) -> None:
        self.kept: list[HostArray] = []

    def _keep(self, array: np.ndarray) -> HostArray:
        self.kept.append(HostArray(array))
        return self.kept[-1]

    def asarray(self, array: np.ndarray) -> HostArray:
        return self._keep(np.array(array))

    def full(self, n: int, value: int, dtype) -> HostArray:
        return self._keep(np.full(n, value, dtype=dtype))

    def empty(self, n: int, dtype) -> HostArray:
        return self._keep(np.empty(n, dtype=dtype))


def words(address: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(address))


class HostNvcomp:
    """The two C functions, keeping nvCOMP's contract on host memory."""

    CANNOT_DECOMPRESS = 12

    def __init__(self, temp_bytes: int = 64, refuse: int = 0) -> None:
        self.temp_bytes, self.refuse = temp_bytes, refuse
        self.calls: list[tuple] = []

    def nvcompBatchedZstdDecompressGetTempSize(self, n, largest, opts, temp, total, stream):
        self.calls.append(("temp", n, largest, total, stream))
        temp._obj.value = self.temp_bytes
        return 0

    def nvcompBatchedZstdDecompressAsync(
        self, src, src_sizes, out_sizes, decoded, n, temp, temp_bytes, outs, opts, statuses, stream
    ):
        self.calls.append(("decompress", n, temp_bytes, stream, opts.backend))
        if self.refuse:
            return self.refuse
        got = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(statuses))
        for i in range(n):
            source = ctypes.string_at(int(words(src, n)[i]), int(words(src_sizes, n)[i]))
            try:
                plain = Zstd().decode(source)
            except Exception:  # noqa: BLE001 - as nvCOMP reports a chunk it cannot decode
                got[i] = self.CANNOT_DECOMPRESS
                continue
            if len(plain) > words(out_sizes, n)[i]:
                got[i] = self.CANNOT_DECOMPRESS
                continue
            ctypes.memmove(int(words(outs, n)[i]), plain, len(plain))
            words(decoded, n)[i] = len(plain)
            got[i] = 0
        return 0


def batch(chunks: list[bytes], sizes: list[int]):
    cupy = HostCupy()
    sources = [cupy.asarray(np.frombuffer(c, dtype=np.uint8)) for c in chunks]
    outputs = [cupy.empty(size, np.uint8) for size in sizes]
    return cupy, sources, outputs


def addresses(arrays) -> np.ndarray:
    return np.array([a.data.ptr for a in arrays], dtype=np.uint64)


STREAM = types.SimpleNamespace(ptr=1234, synchronize=lambda: None)


def test_each_chunk_is_decoded_into_its_own_output_and_its_size_reported() -> None:
    rng = np.random.default_rng(0)
    plains = [rng.integers(0, 4, size, dtype=np.uint8).tobytes() for size in (1000, 5, 70000)]
    chunks = [Zstd(level=1).encode(p) for p in plains]
    sizes = [len(p) for p in plains]
    cupy, sources, outputs = batch(chunks, sizes)
    lib = HostNvcomp()
    decoded = _nvcomp_batched.BatchedZstd(lib, cupy).decompress(
        addresses(sources), [len(c) for c in chunks], addresses(outputs), sizes, STREAM
    )
    assert decoded.tolist() == sizes
    for plain, output in zip(plains, outputs, strict=True):
        assert output.array.tobytes() == plain
    # One call each, with the batch's shape, the caller's stream and nvCOMP's own backend.
    assert lib.calls == [
        ("temp", 3, 70000, sum(sizes), 1234),
        ("decompress", 3, 64, 1234, 0),
    ]


def test_a_chunk_nvcomp_fails_on_reports_minus_one_and_the_others_decode() -> None:
    plains = [b"a" * 3000, b"b" * 3000]
    chunks = [Zstd().encode(plains[0]), b"\x28\xb5\x2f\xfd not a frame"]
    cupy, sources, outputs = batch(chunks, [3000, 3000])
    decoded = _nvcomp_batched.BatchedZstd(HostNvcomp(), cupy).decompress(
        addresses(sources), [len(c) for c in chunks], addresses(outputs), [3000, 3000], STREAM
    )
    assert decoded.tolist() == [3000, -1]
    assert outputs[0].array.tobytes() == plains[0]


def test_a_refused_batch_raises_for_the_caller_to_decode_otherwise() -> None:
    chunks = [Zstd().encode(b"x" * 100)]
    cupy, sources, outputs = batch(chunks, [100])
    with pytest.raises(RuntimeError, match="status 11"):
        _nvcomp_batched.BatchedZstd(HostNvcomp(refuse=11), cupy).decompress(
            addresses(sources), [len(chunks[0])], addresses(outputs), [100], STREAM
        )


def test_an_empty_batch_calls_nothing() -> None:
    lib = HostNvcomp()
    decoded = _nvcomp_batched.BatchedZstd(lib, HostCupy()).decompress(
        np.zeros(0, dtype=np.uint64), [], np.zeros(0, dtype=np.uint64), [], STREAM
    )
    assert decoded.size == 0 and lib.calls == []


def test_the_arguments_must_pair_up() -> None:
    with pytest.raises(ValueError, match="one source size"):
        _nvcomp_batched.pack(
            np.zeros(2, dtype=np.uint64), [1], np.zeros(2, dtype=np.uint64), [1, 2]
        )


class Function:
    """A C function as ``ctypes.CDLL`` gives it: callable, its signature set by assignment."""

    def __init__(self, body=None) -> None:
        self.body = body

    def __call__(self, *args):
        return self.body(*args)


class LoadedNvcomp:
    """nvCOMP's library as ``ctypes.CDLL`` loads it, reporting ``version``."""

    def __init__(self, version: int) -> None:
        def properties(pointer) -> int:
            pointer._obj.version = version
            return 0

        self.nvcompGetProperties = Function(properties)
        self.nvcompBatchedZstdDecompressGetTempSize = Function()
        self.nvcompBatchedZstdDecompressAsync = Function()


@pytest.fixture
def nvcomp_package(monkeypatch):
    """A stand-in ``nvidia.libnvcomp.load`` whose ``load_library`` gives what the test sets."""
    loaded: dict = {"lib": None}
    module = types.ModuleType("nvidia.libnvcomp.load")
    module.load_library = lambda: loaded["lib"]
    monkeypatch.setitem(sys.modules, "nvidia.libnvcomp.load", module)
    _nvcomp_batched.library.cache_clear()
    yield loaded
    _nvcomp_batched.library.cache_clear()


def test_nvcomp_6_is_called_with_its_signatures_declared(nvcomp_package) -> None:
    lib = nvcomp_package["lib"] = LoadedNvcomp(6001)  # 6.0.1
    assert _nvcomp_batched.library() is lib
    decompress = lib.nvcompBatchedZstdDecompressAsync
    assert len(decompress.argtypes) == 11 and decompress.restype is ctypes.c_int
    assert decompress.argtypes[8] is _nvcomp_batched.DecompressOpts  # (by value)
    assert len(lib.nvcompBatchedZstdDecompressGetTempSize.argtypes) == 6


@pytest.mark.parametrize("version", [5004, 7000])
def test_another_nvcomp_major_version_is_not_called(nvcomp_package, version) -> None:
    nvcomp_package["lib"] = LoadedNvcomp(version)
    assert _nvcomp_batched.library() is None


def test_without_nvcomps_library_there_is_no_batched_path(nvcomp_package, monkeypatch) -> None:
    assert _nvcomp_batched.library() is None  # load_library found none
    _nvcomp_batched.library.cache_clear()
    monkeypatch.setitem(sys.modules, "nvidia.libnvcomp.load", None)  # (import fails)
    assert _nvcomp_batched.library() is None


def test_the_options_are_nvcomps_64_bytes_zeroed() -> None:
    opts = _nvcomp_batched.DecompressOpts()
    assert ctypes.sizeof(opts) == 64 and bytes(opts) == bytes(64)
