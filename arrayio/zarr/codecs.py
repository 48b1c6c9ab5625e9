"""A zstd codec for zarr-python 3 that decodes and encodes chunks on the GPU with nvCOMP.

:class:`ZstdCodec` has the same name and JSON configuration as zarr's built-in ``zstd`` codec
(``{"name": "zstd", "configuration": {"level": 0, "checksum": false}}``), so arrays written
with it are plain Zarr, and zarr can be told to use it for every ``zstd`` chunk it reads::

    import arrayio.zarr.codecs  # registers the codec with zarr
    zarr.config.set({"codecs.zstd": "arrayio.zarr.codecs.ZstdCodec"})
    zarr.config.enable_gpu()    # chunks in GPU memory: decoded there by nvCOMP

Where a chunk lives decides where it is coded. A chunk in GPU memory (a
``zarr.core.buffer.gpu.Buffer``) goes to nvCOMP, all the GPU chunks of one batch in one
batched call; a chunk in host memory goes to numcodecs' ``Zstd``, exactly as zarr's own codec
does, so the codec works, and gives the same bytes, on a machine without a GPU. CuPy and
nvCOMP are imported only on the GPU path.

What the GPU path guarantees:

* **Standard frames both ways.** nvCOMP's RAW zstd bitstream is a plain zstd frame: numcodecs
  (libzstd) reads what it writes and it reads what numcodecs writes, bit for bit.
* **Frames are checked before anything is allocated.** A small kernel walks every frame's
  header and block headers on the GPU (:func:`_scan_frames` is the same walk on the host):
  the magic number, reserved bits, block types and sizes, the frame's length against the
  chunk's, and the declared content size against what the blocks can hold. A chunk that
  fails is decoded on the host, which raises :class:`~arrayio.errors.FormatError` with the
  reason: damaged framing is an error, never garbage or a huge allocation. (nvCOMP itself
  reports success on garbage input.)
* **Content checksums are honoured.** nvCOMP neither writes nor verifies zstd's content
  checksum (the low 32 bits of XXH64 of the decoded bytes, the ``checksum`` option). Frames
  that carry one are verified on the GPU by an XXH64 kernel after decoding
  (:class:`~arrayio.errors.ChecksumError` on a mismatch); with ``checksum=True`` the GPU
  encoder hashes each chunk the same way, sets the frame's checksum flag and appends it.
* **Anything unusual falls back to the host, per chunk**: several frames in one chunk,
  skippable frames, frames that do not declare their content size, dictionaries, or an
  nvCOMP failure. The result is the same; only the speed differs.

What it does not do: nvCOMP has no compression levels, so GPU encoding ignores ``level``
(the frames are valid, their size is nvCOMP's); encode host buffers to get libzstd at the
configured level. nvCOMP's zstd decoder trusts its input past the header checks above: a
chunk whose compressed payload was altered without breaking its structure is caught by
the content checksum when the frame has one; without one, no decoder can tell.

nvCOMP decodes each zstd frame with one thread block, so the GPU is fast only with many
frames at once: a 16 MiB frame decodes at well under 1 GB/s on its own. zarr hands a codec
the chunks of a read in batches of ``codec_pipeline.batch_size`` chunks (1 by default, up
to ``async.concurrency`` batches at a time). One worker thread per GPU runs all of this
codec's nvCOMP work and merges the requests waiting for it into one batch, which helps even
then; raising the batch size, e.g. ``zarr.config.set({"codec_pipeline.batch_size": 512})``,
hands it whole reads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import queue
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from zarr.codecs.zstd import ZstdCodec as _ZarrZstdCodec
from zarr.core.common import concurrent_map
from zarr.core.config import config as _zarr_config
from zarr.registry import register_codec

from ..errors import ChecksumError, FormatError, FrameworkNotAvailableError

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, BufferPrototype

__all__ = ["ZstdCodec"]

_INSTALL_HINT = (
    "decoding zstd chunks in GPU memory needs CuPy and nvCOMP: "
    "pip install 'arrayio[gpu]' (cupy-cuda13x, nvidia-nvcomp-cu13, nvidia-libnvcomp-cu13)"
)

# --------------------------------------------------------------------------- zstd frames
# RFC 8878. Only the framing is read here (headers, block headers, checksum), never the
# entropy-coded payload.

_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = 0x184D2A50  # 0x184D2A50 to 0x184D2A5F
_BLOCK_MAX = 128 << 10  # Block_Maximum_Size is at most 128 KiB whatever the window
_DICT_ID_BYTES = (0, 1, 2, 4)
_EMPTY_CHECKSUM = (0xEF46DB3751D8E999 & 0xFFFFFFFF).to_bytes(4, "little")  # XXH64(b"")


@dataclasses.dataclass(frozen=True, slots=True)
class _Frame:
    """One zstd frame of a chunk: where it is, and what its header declares."""

    start: int
    end: int  # just past the frame, content checksum included
    content_size: int | None  # Frame_Content_Size; None when the header leaves it out
    checksum: bool  # whether a content checksum ends the frame
    dictionary_id: int


def _scan_frames(data: bytes | bytearray | memoryview | np.ndarray) -> list[_Frame]:
    """Walk the frames of a zstd stream without decoding them; skippable frames are dropped.

    Raises
    ------
    FormatError
        The bytes are not a well-formed zstd stream: no frame at all, a bad magic number, a
        reserved bit or block type, a block larger than zstd allows, a frame cut short, or a
        declared content size its blocks cannot produce.
    """
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data).cast("B")
    size = len(view)
    if size == 0:
        raise FormatError("zstd chunk is empty: expected at least one frame, found 0 bytes")

    def need(at: int, count: int, what: str) -> None:
        if at + count > size:
            raise FormatError(f"zstd chunk of {size} bytes is cut short: its {what} at byte "
                              f"{at} needs {count} bytes")

    def read(at: int, count: int, what: str) -> int:
        need(at, count, what)
        return int.from_bytes(view[at:at + count], "little")

    frames: list[_Frame] = []
    pos = 0
    while pos < size:
        magic = read(pos, 4, "magic number")
        if magic & 0xFFFFFFF0 == _SKIPPABLE_MAGIC:
            length = read(pos + 4, 4, "skippable frame header")
            need(pos + 8, length, "skippable frame")
            pos += 8 + length
            continue
        if magic != _MAGIC:
            raise FormatError(
                f"not a zstd frame at byte {pos} of a {size}-byte chunk: magic number "
                f"0x{magic:08X}, expected 0x{_MAGIC:08X}")
        descriptor = read(pos + 4, 1, "frame header")
        if descriptor & 0x08:
            raise FormatError(f"zstd frame at byte {pos} sets the reserved header bit")
        fcs_flag, single_segment = descriptor >> 6, (descriptor >> 5) & 1
        dict_bytes = _DICT_ID_BYTES[descriptor & 0x03]
        fcs_bytes = (1 if single_segment else 0) if fcs_flag == 0 else 1 << fcs_flag
        cursor = pos + 5 + (0 if single_segment else 1)  # past the window descriptor
        dictionary_id = read(cursor, dict_bytes, "frame header")
        cursor += dict_bytes
        content_size = read(cursor, fcs_bytes, "frame header") if fcs_bytes else None
        if fcs_bytes == 2:
            content_size += 256  # type: ignore[operator]
        cursor += fcs_bytes
        least = most = 0  # how many bytes the blocks can decode to
        last = 0
        while not last:
            block = read(cursor, 3, "block header")
            last, kind, block_size = block & 1, (block >> 1) & 3, block >> 3
            if kind == 3:
                raise FormatError(f"zstd block at byte {cursor} has the reserved block type")
            if block_size > _BLOCK_MAX:
                raise FormatError(f"zstd block at byte {cursor} declares {block_size} bytes; "
                                  f"zstd blocks hold at most {_BLOCK_MAX}")
            stored = 1 if kind == 1 else block_size  # an RLE block stores one byte
            need(cursor + 3, stored, "block")
            cursor += 3 + stored
            least += 0 if kind == 2 else block_size
            most += _BLOCK_MAX if kind == 2 else block_size
        checksum = bool(descriptor & 0x04)
        if checksum:
            need(cursor, 4, "content checksum")
            cursor += 4
        if content_size is not None and not least <= content_size <= most:
            raise FormatError(
                f"zstd frame at byte {pos} declares {content_size} content bytes, but its "
                f"blocks hold between {least} and {most}")
        frames.append(_Frame(pos, cursor, content_size, checksum, dictionary_id))
        pos = cursor
    return frames


def _decode_on_host(zstd: Any, data: np.ndarray) -> bytes | np.ndarray:
    """Decode a zstd stream held in host memory with numcodecs, after checking its frames."""
    frames = _scan_frames(data)
    for frame in frames:
        if frame.dictionary_id:
            raise FormatError(
                f"zstd frame at byte {frame.start} needs dictionary {frame.dictionary_id}; "
                "zarr's zstd codec has no dictionaries")
    if all(frame.content_size == 0 for frame in frames):
        # Empty content (or skippable frames only), which libzstd's one-shot decoder, hence
        # numcodecs, refuses although it writes such frames itself.
        for frame in frames:
            stored = bytes(data[frame.end - 4:frame.end])
            if frame.checksum and stored != _EMPTY_CHECKSUM:
                raise ChecksumError(f"empty zstd frame at byte {frame.start} has content "
                                    f"checksum {stored.hex()}, expected {_EMPTY_CHECKSUM.hex()}")
        return b""
    try:
        return zstd.decode(data)
    except RuntimeError as error:  # numcodecs reports every libzstd failure as RuntimeError
        kind = ChecksumError if "checksum" in str(error).lower() else FormatError
        raise kind(f"zstd chunk of {data.nbytes} bytes could not be decoded: {error}") from error


# --------------------------------------------------------------------------- GPU kernels
# One CUDA thread per chunk: chunks are what runs in parallel, as in nvCOMP.

_CUDA_SOURCE = r"""
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

_THREADS = 128


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import cupy

    return (cupy.RawKernel(_CUDA_SOURCE, "arrayio_zstd_scan"),
            cupy.RawKernel(_CUDA_SOURCE, "arrayio_xxh64"))


def _launch(kernel: Any, n: int, *args: Any) -> None:
    kernel(((n + _THREADS - 1) // _THREADS,), (_THREADS,), (*args, np.int32(n)))


def _pointers(cupy: Any, arrays: Sequence[Any], offsets: Sequence[int] | None = None) -> Any:
    ptrs = np.fromiter((a.data.ptr for a in arrays), dtype=np.uint64, count=len(arrays))
    if offsets is not None:
        ptrs += np.asarray(offsets, dtype=np.uint64)
    return cupy.asarray(ptrs)


def _sizes(cupy: Any, sizes: Sequence[int]) -> Any:
    return cupy.asarray(np.asarray(sizes, dtype=np.int64))


class _Gpu:
    """nvCOMP's zstd codec, a CUDA stream and the kernels, for one device and one thread.

    The stream is a blocking one: it waits for work queued earlier on the legacy default
    stream, which is where zarr fills its CuPy buffers.
    """

    def __init__(self, device_id: int) -> None:
        import cupy
        from nvidia import nvcomp

        self.cupy, self.nvcomp, self.device_id = cupy, nvcomp, device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=False)
            # nvCOMP's ExecutionPolicy.LATENCY measured no faster, at any batch size.
            self.codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                                      device_id=device_id, cuda_stream=self.stream.ptr)
            self.scan, self.xxh64 = _kernels()
        self.alignment = max(8, int(self.codec.get_required_decompression_alignment()),
                             int(self.codec.get_required_compression_alignment()))
        self.carve = True  # whether nvcomp.as_arrays takes (buffer, offsets, sizes)

    def aligned(self, array: Any) -> Any:
        """``array`` as contiguous bytes at an address nvCOMP and the kernels accept."""
        if not (array.ndim == 1 and array.dtype == np.uint8 and array.strides == (1,)):
            array = self.cupy.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if array.data.ptr % self.alignment:
            array = array.copy()  # fresh CuPy allocations are 256-byte aligned
        return array

    def empty_batch(self, sizes: Sequence[int]) -> tuple[list[Any], Any]:
        """One allocation carved into arrays of ``sizes`` bytes, and the nvCOMP batch of them."""
        cupy = self.cupy
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum((np.asarray(sizes, dtype=np.int64) + 255) // 256 * 256, out=offsets[1:])
        whole = cupy.empty(int(offsets[-1]), dtype=np.uint8)
        arrays = [whole[start:start + size]
                  for start, size in zip(offsets.tolist(), sizes, strict=False)]
        if self.carve:
            try:
                return arrays, self.nvcomp.as_arrays(whole, offsets[:-1].tolist(), list(sizes),
                                                     cuda_stream=self.stream.ptr)
            except Exception:  # noqa: BLE001 - an nvCOMP without it: one array per entry
                self.carve = False
        return arrays, self.batch(arrays)

    def batch(self, arrays: Sequence[Any]) -> Any:
        return self.nvcomp.as_arrays(list(arrays), cuda_stream=self.stream.ptr)

    def frames(self, arrays: Sequence[Any], sizes: Sequence[int]) -> np.ndarray:
        """Run the frame scan: per array, (0 if nvCOMP can decode it, content size, checksum
        offset or -1)."""
        cupy = self.cupy
        info = cupy.empty((len(arrays), 3), dtype=np.int64)
        _launch(self.scan, len(arrays), _pointers(cupy, arrays), _sizes(cupy, sizes), info)
        return info.get()

    # ------------------------------------------------------------------ decode

    def decode(self, chunks: list[Any], host_decode: Any) -> list[Any]:
        """Decode device chunks, batched. Each result is a CuPy array or the exception that
        chunk raised; ``host_decode(numpy_bytes)`` decodes any nvCOMP cannot take."""
        cupy = self.cupy
        with cupy.cuda.Device(self.device_id), self.stream:
            sources = [self.aligned(c) for c in chunks]
            info = self.frames(sources, [s.size for s in sources])
            out: list[Any] = [None] * len(sources)
            on_gpu = [i for i, (status, size, _) in enumerate(info) if status == 0 and size > 0]
            if on_gpu:
                arrays, batch = self.empty_batch([int(info[i, 1]) for i in on_gpu])
                for i, array in zip(on_gpu, arrays, strict=True):
                    out[i] = array
                try:
                    result = self.codec.decode(self.batch([sources[i] for i in on_gpu]),
                                               out=batch)
                    decoded_sizes = list(result.buffer_sizes)
                except Exception:  # noqa: BLE001 - the host decodes them, or says what is wrong
                    decoded_sizes = [-1] * len(on_gpu)
                for i, decoded in zip(on_gpu, decoded_sizes, strict=True):
                    if decoded != out[i].size:
                        out[i] = None  # the host decodes it, or reports why it cannot
                checked = [i for i in on_gpu if out[i] is not None and info[i, 2] >= 0]
                if checked:
                    ok = cupy.zeros(len(checked), dtype=np.int32)
                    _launch(self.xxh64, len(checked), _pointers(cupy, [out[i] for i in checked]),
                            _sizes(cupy, [out[i].size for i in checked]),
                            _pointers(cupy, [sources[i] for i in checked],
                                      [int(info[i, 2]) for i in checked]),
                            _pointers(cupy, [sources[i] for i in checked]), np.int32(0), ok)
                    for i, good in zip(checked, ok.get(), strict=True):
                        if not good:
                            out[i] = ChecksumError(
                                f"zstd chunk of {sources[i].size} bytes decoded on the GPU to "
                                f"{out[i].size} bytes that do not match its content checksum")
            for i in range(len(sources)):
                if out[i] is None:
                    out[i] = _on_host(host_decode, sources[i])
            self.stream.synchronize()
        return out

    # ------------------------------------------------------------------ encode

    def encode(self, chunks: list[Any], checksum: bool, host_encode: Any) -> list[Any]:
        """Encode device chunks, batched, each into one zstd frame (results as in
        :meth:`decode`); ``host_encode`` takes empty chunks, and any nvCOMP fails on."""
        cupy = self.cupy
        tail = 4 if checksum else 0
        with cupy.cuda.Device(self.device_id), self.stream:
            sources = [self.aligned(c) for c in chunks]
            out: list[Any] = [None] * len(sources)
            on_gpu = [i for i in range(len(sources)) if sources[i].size]
            if on_gpu:
                try:
                    result = self.codec.encode(self.batch([sources[i] for i in on_gpu]))
                    for j, (i, size) in enumerate(zip(on_gpu, result.buffer_sizes,
                                                      strict=True)):
                        frame = cupy.empty(size + tail, dtype=np.uint8)
                        frame[:size] = cupy.asarray(result[j])[:size]
                        out[i] = frame
                    self.stream.synchronize()  # before nvCOMP's buffers go
                    del result
                except Exception:  # noqa: BLE001 - the host encodes them instead
                    out = [None] * len(sources)
                    on_gpu = []
            if on_gpu:
                # The checksum is patched into nvCOMP's frames: check they are single frames
                # with the content size and no checksum yet, as the scan kernel reads them.
                info = self.frames([out[i] for i in on_gpu], [out[i].size - tail for i in on_gpu])
                for (status, size, checksum_at), i in zip(info, on_gpu, strict=True):
                    if status != 0 or size != sources[i].size or checksum_at >= 0:
                        out[i] = None
                patch = [i for i in on_gpu if out[i] is not None]
                if checksum and patch:
                    _launch(self.xxh64, len(patch), _pointers(cupy, [sources[i] for i in patch]),
                            _sizes(cupy, [sources[i].size for i in patch]),
                            _pointers(cupy, [out[i] for i in patch],
                                      [out[i].size - 4 for i in patch]),
                            _pointers(cupy, [out[i] for i in patch], [4] * len(patch)),
                            np.int32(1), cupy.zeros(1, dtype=np.int32))
            for i in range(len(sources)):
                if out[i] is None:
                    out[i] = _on_host(host_encode, sources[i])
            self.stream.synchronize()
        return out


def _on_host(code: Any, source: Any) -> Any:
    """Run a host codec function on a device chunk; the result goes back to the device."""
    import cupy

    try:
        result = code(cupy.asnumpy(source))
    except Exception as error:  # noqa: BLE001 - handed to the chunk's caller
        return error
    return cupy.asarray(np.frombuffer(result, dtype=np.uint8))


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    kind: str  # "decode" or "encode"
    arrays: list[Any]
    zstd: Any  # numcodecs' Zstd with the codec's level and checksum, for the host fallback
    future: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)

    @property
    def group(self) -> tuple[str, int, bool]:
        return (self.kind, self.zstd.level, bool(getattr(self.zstd, "checksum", False)))


class _DeviceWorker:
    """The one thread that codes zstd on one GPU.

    It owns nvCOMP's handles for its whole life (a daemon thread, so they are never torn
    down under a running interpreter), and it coalesces: whatever requests are waiting
    when it picks up work go to nvCOMP as one batch. zarr's pipeline hands a codec
    ``codec_pipeline.batch_size`` chunks at a time (1 by default) from up to
    ``async.concurrency`` tasks, so this is where their chunks meet.
    """

    _workers: ClassVar[dict[int, _DeviceWorker]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"arrayio-zstd-cuda{device_id}")
        self.thread.start()

    @classmethod
    def submit(cls, device_id: int, kind: str, arrays: list[Any], zstd: Any
               ) -> concurrent.futures.Future:
        """Queue chunks for the device's worker; the future gives one CuPy array each."""
        with cls._lock:
            worker = cls._workers.get(device_id)
            if worker is None:
                worker = cls._workers[device_id] = cls(device_id)
        job = _Job(kind, arrays, zstd)
        worker.jobs.put(job)
        return job.future

    def _serve(self) -> None:
        gpu: _Gpu | None = None
        while True:
            jobs = [self.jobs.get()]
            while True:
                try:
                    jobs.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                gpu = gpu or _Gpu(self.device_id)
            except Exception as error:  # noqa: BLE001 - every waiting caller gets it
                failure: Exception = error
                if isinstance(error, ImportError):
                    failure = FrameworkNotAvailableError(_INSTALL_HINT)
                    failure.__cause__ = error
                for job in jobs:
                    job.future.set_exception(failure)
                continue
            groups: dict[tuple[str, int, bool], list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.group, []).append(job)
            for (kind, _, checksum), group in groups.items():
                self._run(gpu, kind, checksum, group)

    @staticmethod
    def _run(gpu: _Gpu, kind: str, checksum: bool, jobs: list[_Job]) -> None:
        arrays = [array for job in jobs for array in job.arrays]
        zstd = jobs[0].zstd
        try:
            if kind == "decode":
                results = gpu.decode(arrays, lambda data: _decode_on_host(zstd, data))
            else:
                results = gpu.encode(arrays, checksum, lambda data: _encode_on_host(zstd, data))
        except BaseException as error:  # noqa: BLE001 - the callers get it, the worker lives
            for job in jobs:
                job.future.set_exception(error)
            return
        start = 0
        for job in jobs:
            mine = results[start:start + len(job.arrays)]
            start += len(job.arrays)
            failed = [r for r in mine if isinstance(r, BaseException)]
            if failed:
                job.future.set_exception(failed[0])
            else:
                job.future.set_result(mine)


# A forked child has the workers' queues but not their threads: it starts its own.
os.register_at_fork(after_in_child=_DeviceWorker._workers.clear)


def _device_array(buffer: Buffer) -> Any | None:
    """The CuPy array behind a buffer in GPU memory, or None for a buffer in host memory."""
    array = buffer.as_array_like()
    if not hasattr(array, "__cuda_array_interface__"):
        return None
    try:
        import cupy
    except ImportError as error:
        raise FrameworkNotAvailableError(_INSTALL_HINT) from error
    return cupy.asarray(array)


def _to_buffer(prototype: BufferPrototype, array: Any) -> Buffer:
    """Wrap a CuPy result in the buffer class zarr asked for, copying only across devices."""
    from zarr.core.buffer import gpu

    if issubclass(prototype.buffer, gpu.Buffer):
        return prototype.buffer.from_array_like(array)
    return prototype.buffer.from_bytes(array.get())


def _encode_on_host(zstd: Any, data: np.ndarray) -> bytes:
    return zstd.encode(data)


# --------------------------------------------------------------------------- the codec


class ZstdCodec(_ZarrZstdCodec):
    """zarr's ``zstd`` codec, decoded and encoded on the GPU by nvCOMP for GPU buffers.

    Same configuration, same JSON and same frames as ``zarr.codecs.ZstdCodec``; chunks in
    host memory are coded by numcodecs exactly as there. Select it for every array zarr
    opens with ``zarr.config.set({"codecs.zstd": "arrayio.zarr.codecs.ZstdCodec"})``, or
    pass ``compressors=ZstdCodec(level=..., checksum=...)`` when creating an array.

    Parameters
    ----------
    level : int
        The zstd compression level for chunks encoded on the host (numcodecs); nvCOMP,
        which encodes GPU chunks, has no levels.
    checksum : bool
        Whether written frames carry zstd's content checksum. Frames that carry one are
        verified when decoded, on the host by libzstd and on the GPU by an XXH64 kernel.

    Raises
    ------
    arrayio.errors.FormatError
        When decoding a chunk that is not a well-formed zstd stream.
    arrayio.errors.ChecksumError
        When a frame's decoded content does not match its content checksum.
    arrayio.errors.FrameworkNotAvailableError
        When a chunk is in GPU memory but CuPy or nvCOMP is not installed.
    """

    # -------------------------------------------------------------- batches (the pipeline)

    async def decode(
        self, chunks_and_specs: Iterable[tuple[Buffer | None, ArraySpec]]
    ) -> Iterable[Buffer | None]:
        """Decode a batch: its GPU chunks in one nvCOMP call, its host chunks concurrently."""
        return await self._run_async("decode", list(chunks_and_specs), self._decode_host)

    async def encode(
        self, chunks_and_specs: Iterable[tuple[Buffer | None, ArraySpec]]
    ) -> Iterable[Buffer | None]:
        """Encode a batch: its GPU chunks in one nvCOMP call, its host chunks concurrently."""
        return await self._run_async("encode", list(chunks_and_specs), self._encode_host)

    async def _run_async(self, kind: str, items: list[tuple[Buffer | None, ArraySpec]],
                         on_host: Any) -> list[Buffer | None]:
        out, pending, host = self._start(kind, items)

        async def device_part(indices: list[int], future: concurrent.futures.Future) -> None:
            self._finish(items, out, indices, await asyncio.wrap_future(future))

        async def host_part(i: int) -> None:
            out[i] = await asyncio.to_thread(on_host, *items[i])

        await asyncio.gather(*(device_part(*p) for p in pending), concurrent_map(
            [(i,) for i in host], host_part, _zarr_config.get("async.concurrency")))
        return out

    def _run_sync(self, kind: str, items: list[tuple[Buffer | None, ArraySpec]],
                  on_host: Any) -> list[Buffer | None]:
        out, pending, host = self._start(kind, items)
        for i in host:
            out[i] = on_host(*items[i])
        for indices, future in pending:
            self._finish(items, out, indices, future.result())
        return out

    def _start(self, kind: str, items: list[tuple[Buffer | None, ArraySpec]]
               ) -> tuple[list[Buffer | None], list[tuple[list[int], Any]], list[int]]:
        """Send the GPU chunks to their devices' workers; return the results to fill, the
        pending (indices, future) per device, and the indices of the host chunks."""
        by_device: dict[int, list[tuple[int, Any]]] = {}
        host = []
        for i, (chunk, _) in enumerate(items):
            array = None if chunk is None else _device_array(chunk)
            if array is not None:
                by_device.setdefault(array.device.id, []).append((i, array))
            elif chunk is not None:
                host.append(i)
        pending = [([i for i, _ in members],
                    _DeviceWorker.submit(device_id, kind, [a for _, a in members],
                                         self._zstd_codec))
                   for device_id, members in by_device.items()]
        return [None] * len(items), pending, host

    @staticmethod
    def _finish(items: list[tuple[Buffer | None, ArraySpec]], out: list[Buffer | None],
                indices: list[int], arrays: list[Any]) -> None:
        for i, array in zip(indices, arrays, strict=True):
            out[i] = _to_buffer(items[i][1].prototype, array)

    # -------------------------------------------------------------- single chunks

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return (await self.decode([(chunk_bytes, chunk_spec)]))[0]  # type: ignore[index]

    async def _encode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        return (await self.encode([(chunk_bytes, chunk_spec)]))[0]  # type: ignore[index]

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        # zarr's synchronous (fused) pipeline calls this, per chunk, from its thread pool.
        return self._run_sync("decode", [(chunk_bytes, chunk_spec)], self._decode_host)[0]

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        return self._run_sync("encode", [(chunk_bytes, chunk_spec)], self._encode_host)[0]

    def _decode_host(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        decoded = _decode_on_host(self._zstd_codec, chunk_bytes.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(decoded)

    def _encode_host(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        encoded = _encode_on_host(self._zstd_codec, chunk_bytes.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(encoded)


register_codec("zstd", ZstdCodec)
