"""CUDA kernels for zstd chunks on the GPU: the frame scan (the checks of
:func:`arrayio.zarr._frames.scan_frames`, on the device) and XXH64 content checksums,
compiled by CuPy on first use. One CUDA thread per chunk: chunks are what runs in parallel,
as in nvCOMP.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "DeviceSpan",
    "address",
    "addresses",
    "as_array",
    "kernels",
    "launch",
    "pointer_array",
    "size_array",
]

CUDA_SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

// out[3*i]: 0 when chunk i is one zstd frame nvCOMP can decode here (content size declared,
// no dictionary, well-formed blocks, nothing after it), 1 otherwise (the host decides).
// out[3*i+1]: declared content size; out[3*i+2]: offset of the content checksum or -1.
extern "C" __global__ void arrayio_zstd_scan(const u64* ptrs, const long long* sizes,
                                             long long* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u8* p = (const u8*)ptrs[i];
    long long size = sizes[i];
    long long* o = out + 3 * (long long)i;
    o[0] = 1; o[1] = -1; o[2] = -1;
    if (size < 6) return;
    u32 magic = p[0] | (p[1] << 8) | (p[2] << 16) | ((u32)p[3] << 24);
    if (magic != 0xFD2FB528u) return;
    u32 fhd = p[4];
    int fcs_flag = fhd >> 6, single = (fhd >> 5) & 1;
    if ((fhd & 0x08) || (fhd & 0x03)) return;  // reserved bit, dictionary
    int fcs_bytes = fcs_flag == 0 ? (single ? 1 : 0) : (1 << fcs_flag);
    if (fcs_bytes == 0) return;
    long long pos = 5 + (single ? 0 : 1);
    if (pos + fcs_bytes > size) return;
    u64 fcs = 0;
    for (int k = 0; k < fcs_bytes; ++k) fcs |= (u64)p[pos + k] << (8 * k);
    if (fcs_bytes == 2) fcs += 256;
    pos += fcs_bytes;
    u64 least = 0, most = 0;
    for (;;) {
        if (pos + 3 > size) return;
        u32 bh = p[pos] | (p[pos + 1] << 8) | ((u32)p[pos + 2] << 16);
        pos += 3;
        u32 kind = (bh >> 1) & 3, bsize = bh >> 3;
        if (kind == 3 || bsize > 131072u) return;
        if (kind == 1) { pos += 1; least += bsize; most += bsize; }
        else if (kind == 0) { pos += bsize; least += bsize; most += bsize; }
        else { pos += bsize; most += 131072u; }
        if (pos > size) return;
        if (bh & 1) break;
    }
    long long checksum_at = -1;
    if (fhd & 0x04) {
        if (pos + 4 > size) return;
        checksum_at = pos;
        pos += 4;
    }
    if (pos != size || fcs < least || fcs > most) return;
    o[0] = 0; o[1] = (long long)fcs; o[2] = checksum_at;
}

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

__device__ __forceinline__ u64 rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
__device__ __forceinline__ u64 xxh_round(u64 acc, u64 input) {
    acc += input * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}
__device__ __forceinline__ u64 xxh_merge(u64 acc, u64 v) {
    acc ^= xxh_round(0, v);
    return acc * P1 + P4;
}

// XXH64 (seed 0) of each chunk; zstd's content checksum is its low 32 bits, little-endian.
// write == 0: ok[i] = whether the 4 bytes at check_ptrs[i] match.
// write == 1: store them there, and set the checksum flag in the header byte at flag_ptrs[i].
// Data pointers are 8-byte aligned (the caller copies any that are not).
extern "C" __global__ void arrayio_xxh64(const u64* data_ptrs, const long long* sizes,
                                         const u64* check_ptrs, const u64* flag_ptrs,
                                         int write, int* ok, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u8* p = (const u8*)data_ptrs[i];
    long long len = sizes[i];
    const u8* end = p + len;
    u64 h;
    if (len >= 32) {
        const u8* limit = end - 32;
        u64 v1 = P1 + P2, v2 = P2, v3 = 0, v4 = 0ULL - P1;
        do {
            const u64* q = (const u64*)p;
            v1 = xxh_round(v1, q[0]);
            v2 = xxh_round(v2, q[1]);
            v3 = xxh_round(v3, q[2]);
            v4 = xxh_round(v4, q[3]);
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xxh_merge(h, v1);
        h = xxh_merge(h, v2);
        h = xxh_merge(h, v3);
        h = xxh_merge(h, v4);
    } else {
        h = P5;
    }
    h += (u64)len;
    while (p + 8 <= end) {
        h ^= xxh_round(0, *(const u64*)p);
        h = rotl64(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (u64)(*(const u32*)p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (u64)(*p) * P5;
        h = rotl64(h, 11) * P1;
        ++p;
    }
    h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
    u32 c = (u32)h;
    u8* at = (u8*)check_ptrs[i];
    if (write) {
        at[0] = (u8)c; at[1] = (u8)(c >> 8); at[2] = (u8)(c >> 16); at[3] = (u8)(c >> 24);
        *(u8*)flag_ptrs[i] |= 0x04;
    } else {
        ok[i] = (at[0] | (at[1] << 8) | (at[2] << 16) | ((u32)at[3] << 24)) == c;
    }
}
"""

THREADS = 128  # per CUDA block


@functools.cache
def kernels() -> tuple[Any, Any]:
    """The frame scan and XXH64 kernels, compiled once per process."""
    import cupy

    return (
        cupy.RawKernel(CUDA_SOURCE, "arrayio_zstd_scan"),
        cupy.RawKernel(CUDA_SOURCE, "arrayio_xxh64"),
    )


def launch(kernel: Any, n: int, *args: Any) -> None:
    """Run ``kernel`` over ``n`` chunks, one thread each; ``n`` is its last argument."""
    kernel(((n + THREADS - 1) // THREADS,), (THREADS,), (*args, np.int32(n)))


class DeviceSpan:
    """``nbytes`` of device memory at address ``ptr`` on GPU ``device_id``, inside
    ``owner`` (a CuPy array the span keeps alive): a chunk's bytes or place, without a CuPy
    view of them. A view costs microseconds to make, and a read of a Zarr array can have
    thousands of chunks; nvCOMP and the kernels need only the addresses and sizes."""

    __slots__ = ("device_id", "nbytes", "owner", "ptr")

    def __init__(self, owner: Any, ptr: int, nbytes: int, device_id: int) -> None:
        self.owner, self.ptr, self.nbytes, self.device_id = owner, ptr, nbytes, device_id

    def __repr__(self) -> str:
        return f"DeviceSpan(ptr={self.ptr:#x}, nbytes={self.nbytes}, device_id={self.device_id})"

    @property
    def size(self) -> int:
        """Its bytes (as a CuPy ``uint8`` array's ``size``)."""
        return self.nbytes

    def array(self) -> Any:
        """The bytes as a CuPy ``uint8`` array (a view of the owner, which is contiguous:
        a reshape of any other would be a copy, and a decode into it lost)."""
        assert self.owner.flags.c_contiguous
        flat = self.owner.reshape(-1).view(np.uint8)
        offset = self.ptr - self.owner.data.ptr
        return flat[offset : offset + self.nbytes]


def as_array(chunk: Any) -> Any:
    """``chunk`` as a CuPy array: a :class:`DeviceSpan`'s view, or the array itself."""
    return chunk.array() if type(chunk) is DeviceSpan else chunk


def address(chunk: Any) -> int:
    """The device address of a CuPy array or a :class:`DeviceSpan`."""
    return int(chunk.ptr) if type(chunk) is DeviceSpan else int(chunk.data.ptr)


def addresses(arrays: Sequence[Any]) -> np.ndarray:
    """The device addresses of CuPy ``arrays`` (or of :class:`DeviceSpan` objects), as a
    host array."""
    return np.fromiter((address(a) for a in arrays), dtype=np.uint64, count=len(arrays))


def pointer_array(cupy: Any, arrays: Sequence[Any], offsets: Sequence[int] | None = None) -> Any:
    """The device addresses of ``arrays`` (plus ``offsets`` bytes), as a device array."""
    ptrs = addresses(arrays)
    if offsets is not None:
        ptrs += np.asarray(offsets, dtype=np.uint64)
    return cupy.asarray(ptrs)


def size_array(cupy: Any, sizes: Sequence[int]) -> Any:
    """``sizes`` as a device array of int64."""
    return cupy.asarray(np.asarray(sizes, dtype=np.int64))
