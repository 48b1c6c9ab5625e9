"""nvCOMP's zstd codec on one GPU, batched, with the frame scan and checksum kernels.

A chunk nvCOMP cannot take (a frame it does not handle, a failed decode, an empty chunk to
encode) is coded on the host instead, per chunk; the result is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ChecksumError
from . import _nvcomp_batched
from ._kernels import (
    DeviceSpan,
    addresses,
    as_array,
    kernels,
    launch,
    pointer_array,
    size_array,
)

__all__ = ["NvcompZstd"]


class NvcompZstd:
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
            self.codec = nvcomp.Codec(
                algorithm="Zstd",
                bitstream_kind=nvcomp.BitstreamKind.RAW,
                device_id=device_id,
                cuda_stream=self.stream.ptr,
            )
            self.scan, self.xxh64 = kernels()
        self.alignment = max(
            8,
            int(self.codec.get_required_decompression_alignment()),
            int(self.codec.get_required_compression_alignment()),
        )
        lib = _nvcomp_batched.library()
        # nvCOMP's C function, where its library loads: no array object per chunk.
        self.batched = _nvcomp_batched.BatchedZstd(lib, cupy) if lib is not None else None

    def aligned(self, array: Any) -> Any:
        """``array`` (a CuPy array or a :class:`~arrayio.zarr._kernels.DeviceSpan`) as
        contiguous bytes at an address nvCOMP and the kernels accept."""
        if type(array) is DeviceSpan:
            return array if array.ptr % self.alignment == 0 else array.array().copy()
        if not (array.ndim == 1 and array.dtype == np.uint8 and array.strides == (1,)):
            array = self.cupy.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if array.data.ptr % self.alignment:
            array = array.copy()  # fresh CuPy allocations are 256-byte aligned
        return array

    def _fill(self, places: list[Any], sizes: list[int]) -> list[Any]:
        """``places`` with each None replaced by a new array of its size (one allocation)."""
        missing = [k for k, place in enumerate(places) if place is None]
        if missing:
            made = self._carve([sizes[k] for k in missing])
            for k, array in zip(missing, made, strict=True):
                places[k] = array
        return places

    def _carve(self, sizes: Sequence[int]) -> list[Any]:
        """One allocation carved into arrays of ``sizes`` bytes, each 256-byte aligned."""
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum((np.asarray(sizes, dtype=np.int64) + 255) // 256 * 256, out=offsets[1:])
        whole = self.cupy.empty(int(offsets[-1]), dtype=np.uint8)
        return [
            whole[start : start + size]
            for start, size in zip(offsets.tolist(), sizes, strict=False)
        ]

    def _decode_batch(self, sources: list[Any], places: list[Any], sizes: list[int]) -> list[int]:
        """Decode ``sources`` into ``places`` (of ``sizes`` bytes) in one batch: each chunk's
        decoded size, or -1 where it failed (the host then decodes it, or says what is
        wrong). nvCOMP's C function where its library loaded, else its Python codec."""
        if self.batched is not None:
            try:
                return self.batched.decompress(
                    addresses(sources),
                    [s.size for s in sources],
                    addresses(places),
                    sizes,
                    self.stream,
                ).tolist()
            except Exception:  # noqa: BLE001 - refused, or no memory for it: the Python codec's turn
                pass
        try:
            result = self.codec.decode(self.batch(sources), out=self.batch(places))
            # Wait here, where CuPy lets go of the interpreter's lock while it waits, rather
            # than in nvCOMP's reading of the sizes: threads decoding on the host meanwhile
            # need the lock between their chunks.
            self.stream.synchronize()
            return list(result.buffer_sizes)
        except Exception:  # noqa: BLE001 - the host decodes them, or says what is wrong
            return [-1] * len(sources)

    def _destination(self, place: Any, size: int) -> Any:
        """``place`` where a chunk of ``size`` decoded bytes can be decoded into it, else
        None."""
        if type(place) is DeviceSpan:
            fits = place.nbytes == size and place.device_id == self.device_id
            return place if fits and place.ptr % self.alignment == 0 else None
        if (
            place is None
            or place.size != size
            or place.ndim != 1
            or place.dtype != np.uint8
            or place.data.ptr % self.alignment
            or place.device.id != self.device_id
        ):
            return None
        return place

    def batch(self, arrays: Sequence[Any]) -> Any:
        return self.nvcomp.as_arrays([as_array(a) for a in arrays], cuda_stream=self.stream.ptr)

    def frames(self, arrays: Sequence[Any], sizes: Sequence[int]) -> np.ndarray:
        """Run the frame scan: per array, (0 if nvCOMP can decode it, content size, checksum
        offset or -1)."""
        cupy = self.cupy
        info = cupy.empty((len(arrays), 3), dtype=np.int64)
        launch(self.scan, len(arrays), pointer_array(cupy, arrays), size_array(cupy, sizes), info)
        return info.get()

    # ------------------------------------------------------------------ decode

    def decode(
        self, chunks: list[Any], host_decode: Any, destinations: list[Any] | None = None
    ) -> list[Any]:
        """Decode device chunks (CuPy arrays or spans,
        :class:`~arrayio.zarr._kernels.DeviceSpan`), batched. Each result is a CuPy
        array or the exception that chunk raised; ``host_decode(numpy_bytes)`` decodes any
        nvCOMP cannot take. A chunk with a destination (flat device bytes of its decoded
        size, aligned for nvCOMP: an array or a span) is decoded there, and its result is
        the destination."""
        cupy = self.cupy
        with cupy.cuda.Device(self.device_id), self.stream:
            sources = [self.aligned(c) for c in chunks]
            info = self.frames(sources, [s.size for s in sources])
            out: list[Any] = [None] * len(sources)
            on_gpu = [i for i, (status, size, _) in enumerate(info) if status == 0 and size > 0]
            if on_gpu:
                sizes = [int(info[i, 1]) for i in on_gpu]
                places = [
                    self._destination(destinations[i] if destinations else None, size)
                    for i, size in zip(on_gpu, sizes, strict=True)
                ]
                for i, place in zip(on_gpu, self._fill(places, sizes), strict=True):
                    out[i] = place
                decoded_sizes = self._decode_batch([sources[i] for i in on_gpu], places, sizes)
                for i, decoded in zip(on_gpu, decoded_sizes, strict=True):
                    if decoded != out[i].size:
                        out[i] = None  # the host decodes it, or reports why it cannot
                checked = [i for i in on_gpu if out[i] is not None and info[i, 2] >= 0]
                if checked:
                    ok = cupy.zeros(len(checked), dtype=np.int32)
                    launch(
                        self.xxh64,
                        len(checked),
                        pointer_array(cupy, [out[i] for i in checked]),
                        size_array(cupy, [out[i].size for i in checked]),
                        pointer_array(
                            cupy, [sources[i] for i in checked], [int(info[i, 2]) for i in checked]
                        ),
                        pointer_array(cupy, [sources[i] for i in checked]),
                        np.int32(0),
                        ok,
                    )
                    for i, good in zip(checked, ok.get(), strict=True):
                        if not good:
                            out[i] = ChecksumError(
                                f"zstd chunk of {sources[i].size} bytes decoded on the GPU to "
                                f"{out[i].size} bytes that do not match its content checksum"
                            )
            for i in range(len(sources)):
                if out[i] is None:
                    out[i] = _on_host(host_decode, as_array(sources[i]))
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
                    for j, (i, size) in enumerate(zip(on_gpu, result.buffer_sizes, strict=True)):
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
                    launch(
                        self.xxh64,
                        len(patch),
                        pointer_array(cupy, [sources[i] for i in patch]),
                        size_array(cupy, [sources[i].size for i in patch]),
                        pointer_array(
                            cupy, [out[i] for i in patch], [out[i].size - 4 for i in patch]
                        ),
                        pointer_array(cupy, [out[i] for i in patch], [4] * len(patch)),
                        np.int32(1),
                        cupy.zeros(1, dtype=np.int32),
                    )
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
