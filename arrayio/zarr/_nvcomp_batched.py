"""nvCOMP's low-level batched zstd decompression, called on its C library.

nvCOMP's Python codec takes each chunk as an array object of its own: wrapping a batch of
a thousand 1 MiB chunks, and their outputs, cost about as long as decoding them. The C
function underneath takes the whole batch as device arrays of addresses and sizes, which
are built here with one NumPy pass and one copy to the device, whatever the batch's length.

The library is the one nvCOMP's Python package loads (``nvidia-libnvcomp``, its
``libnvcomp.so.6``); where it cannot be loaded, or a call is refused, the caller falls back
to the Python codec.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BatchedZstd", "library", "major_version", "pack"]

logger = logging.getLogger(__name__)

SUCCESS = 0  # nvcompSuccess


class DecompressOpts(ctypes.Structure):
    """``nvcompBatchedZstdDecompressOpts_t``: the backend (0, nvCOMP's choice) and reserved
    bytes that must be zero."""

    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class Properties(ctypes.Structure):
    """``nvcompProperties_t``: the library's version (major * 1000 + minor * 100 + patch)
    and the CUDA runtime's it was built with."""

    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


MAJOR = 6  # the nvCOMP whose signatures _declare gives
_size_t, _ptr = ctypes.c_size_t, ctypes.c_void_p


def major_version(lib: Any) -> int | None:
    """The loaded library's major version (``nvcompGetProperties``), or None where it does
    not say."""
    properties = Properties()
    get = lib.nvcompGetProperties
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.POINTER(Properties)]
    if get(ctypes.byref(properties)) != SUCCESS:
        return None
    return int(properties.version) // 1000


def _declare(lib: Any) -> Any:
    """Declare the two functions' signatures, as nvCOMP 6's ``nvcomp/zstd.h`` gives them."""
    temp = lib.nvcompBatchedZstdDecompressGetTempSize
    temp.restype = ctypes.c_int
    temp.argtypes = [
        _size_t,  # num_chunks
        _size_t,  # max_uncompressed_chunk_bytes
        DecompressOpts,
        ctypes.POINTER(_size_t),  # temp_bytes (host)
        _size_t,  # max_total_uncompressed_bytes
        _ptr,  # stream
    ]
    decompress = lib.nvcompBatchedZstdDecompressAsync
    decompress.restype = ctypes.c_int
    decompress.argtypes = [
        _ptr,  # device_compressed_chunk_ptrs
        _ptr,  # device_compressed_chunk_bytes
        _ptr,  # device_uncompressed_buffer_bytes
        _ptr,  # device_uncompressed_chunk_bytes (out)
        _size_t,  # num_chunks
        _ptr,  # device_temp_ptr
        _size_t,  # temp_bytes
        _ptr,  # device_uncompressed_chunk_ptrs
        DecompressOpts,
        _ptr,  # device_statuses (out)
        _ptr,  # stream
    ]
    return lib


@functools.cache
def library() -> Any | None:
    """nvCOMP's C library with the functions declared, or None where it cannot be loaded or
    is of another major version than the signatures declared here (another version's could
    differ, and a call through the wrong one would not fail cleanly)."""
    try:
        from nvidia.libnvcomp.load import load_library

        lib = load_library()
        if lib is None:
            return None
        major = major_version(lib)
        if major != MAJOR:
            logger.info("nvCOMP's C library is version %s, not %d: not called", major, MAJOR)
            return None
        return _declare(lib)
    except (ImportError, OSError, AttributeError) as error:
        logger.info("nvCOMP's C library is not available: %s", error)
        return None


def pack(
    source_ptrs: np.ndarray,
    source_sizes: Sequence[int],
    output_ptrs: np.ndarray,
    output_sizes: Sequence[int],
) -> np.ndarray:
    """The batch's arguments as one host array of ``5 * n`` 64-bit words, in the order of
    :meth:`BatchedZstd.decompress`'s device views: the sources' addresses and sizes, the
    outputs' sizes, the outputs' addresses, then room for the decoded sizes."""
    n = len(source_ptrs)
    if not (len(source_sizes) == len(output_ptrs) == len(output_sizes) == n):
        raise ValueError("a batch needs one source size, output and output size per source")
    words = np.zeros(5 * n, dtype=np.uint64)
    words[:n] = source_ptrs
    words[n : 2 * n] = np.asarray(source_sizes, dtype=np.uint64)
    words[2 * n : 3 * n] = np.asarray(output_sizes, dtype=np.uint64)
    words[3 * n : 4 * n] = output_ptrs
    return words


class BatchedZstd:
    """Batched zstd decompression of device chunks into device outputs, on one stream."""

    def __init__(self, lib: Any, cupy: Any) -> None:
        self.lib, self.cupy = lib, cupy
        self.opts = DecompressOpts()  # zeroed: nvCOMP chooses the backend

    def decompress(
        self,
        source_ptrs: np.ndarray,
        source_sizes: Sequence[int],
        output_ptrs: np.ndarray,
        output_sizes: Sequence[int],
        stream: Any,
    ) -> np.ndarray:
        """Decode chunk ``i`` (``source_sizes[i]`` bytes at device address ``source_ptrs[i]``)
        into ``output_sizes[i]`` bytes at ``output_ptrs[i]``, all in one call queued on
        ``stream`` (a CuPy stream), and wait for it. Returns each chunk's decoded size, or -1
        where nvCOMP reported a failure for it. Raises RuntimeError where nvCOMP refuses the
        call (the caller then decodes the batch otherwise)."""
        cupy, n = self.cupy, len(source_ptrs)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        words = cupy.asarray(pack(source_ptrs, source_sizes, output_ptrs, output_sizes))
        statuses = cupy.full(n, -1, dtype=np.int32)
        temp_bytes = ctypes.c_size_t(0)
        largest, total = int(max(output_sizes)), int(sum(output_sizes))
        status = self.lib.nvcompBatchedZstdDecompressGetTempSize(
            n, largest, self.opts, ctypes.byref(temp_bytes), total, stream.ptr
        )
        if status != SUCCESS:
            raise RuntimeError(f"nvCOMP refused the batch's temporary size: status {status}")
        temp = cupy.empty(max(1, temp_bytes.value), dtype=np.uint8)
        base, word = words.data.ptr, words.itemsize
        status = self.lib.nvcompBatchedZstdDecompressAsync(
            base,
            base + n * word,
            base + 2 * n * word,
            base + 4 * n * word,
            n,
            temp.data.ptr,
            temp_bytes.value,
            base + 3 * n * word,
            self.opts,
            statuses.data.ptr,
            stream.ptr,
        )
        if status != SUCCESS:
            raise RuntimeError(f"nvCOMP refused the batch: status {status}")
        # CuPy lets go of the interpreter's lock while it waits (threads decoding on the
        # host need it between their chunks); temp, words and statuses live until then.
        stream.synchronize()
        decoded = words[4 * n :].get().view(np.int64)
        decoded[statuses.get() != SUCCESS] = -1
        return decoded
