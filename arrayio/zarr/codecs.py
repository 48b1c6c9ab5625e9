"""A zstd codec for zarr-python 3 that decodes and encodes chunks on the GPU with nvCOMP.

:class:`ZstdCodec` has the same name and JSON configuration as zarr's built-in ``zstd`` codec
(``{"name": "zstd", "configuration": {"level": 0, "checksum": false}}``), so arrays written
with it are plain Zarr, and zarr can be told to use it for every ``zstd`` chunk it reads::

    import arrayio.zarr.codecs  # registers the codec with zarr
    zarr.config.set({"codecs.zstd": "arrayio.zarr.codecs.ZstdCodec"})
    zarr.config.enable_gpu()    # chunks in GPU memory: decoded there by nvCOMP

Where a chunk lives decides where it is coded: in GPU memory, by nvCOMP on the device's
worker thread (:mod:`arrayio.zarr._gpu_worker`); in host memory, by numcodecs' ``Zstd``
exactly as zarr's own codec does, so the codec works, and gives the same bytes, on a machine
without a GPU. CuPy and nvCOMP are imported only on the GPU path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from zarr.codecs.zstd import ZstdCodec as _ZarrZstdCodec
from zarr.core.common import concurrent_map
from zarr.core.config import config as _zarr_config
from zarr.registry import register_codec

from ..errors import FrameworkNotAvailableError
from ._frames import decode_on_host, encode_on_host
from ._gpu_worker import INSTALL_HINT, DeviceWorker

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, BufferPrototype

__all__ = ["ZstdCodec"]


def _device_array(buffer: Buffer) -> Any | None:
    """The CuPy array behind a buffer in GPU memory, or None for a buffer in host memory."""
    array = buffer.as_array_like()
    if not hasattr(array, "__cuda_array_interface__"):
        return None
    try:
        import cupy
    except ImportError as error:
        raise FrameworkNotAvailableError(INSTALL_HINT) from error
    return cupy.asarray(array)


def _to_buffer(prototype: BufferPrototype, array: Any) -> Buffer:
    """Wrap a CuPy result in the buffer class zarr asked for, copying only across devices."""
    from zarr.core.buffer import gpu

    if issubclass(prototype.buffer, gpu.Buffer):
        return prototype.buffer.from_array_like(array)
    return prototype.buffer.from_bytes(array.get())


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

    Notes
    -----
    On the GPU, every frame's header and block headers are checked by a kernel before
    anything is allocated for it; a chunk that fails is decoded on the host, which raises
    ``FormatError`` with the reason. Anything nvCOMP does not take (several frames in one
    chunk, skippable frames, no declared content size, a dictionary, an nvCOMP failure) is
    coded on the host too, with the same result. Past those checks nvCOMP trusts its input:
    a payload altered without breaking its structure is caught only by a content checksum.

    nvCOMP decodes each frame with one thread block, so the GPU is fast only with many
    chunks at once. One worker thread per GPU merges the chunks of concurrent calls into one
    batch; raising zarr's ``codec_pipeline.batch_size`` (e.g. to 512) hands it whole reads.
    ``docs/design/zarr.md`` has the details.
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

    async def _run_async(
        self, kind: str, items: list[tuple[Buffer | None, ArraySpec]], on_host: Any
    ) -> list[Buffer | None]:
        out, pending, host = self._start(kind, items)

        async def device_part(indices: list[int], future: concurrent.futures.Future) -> None:
            self._finish(items, out, indices, await asyncio.wrap_future(future))

        async def host_part(i: int) -> None:
            out[i] = await asyncio.to_thread(on_host, *items[i])

        await asyncio.gather(
            *(device_part(*p) for p in pending),
            concurrent_map([(i,) for i in host], host_part, _zarr_config.get("async.concurrency")),
        )
        return out

    def _run_sync(
        self, kind: str, items: list[tuple[Buffer | None, ArraySpec]], on_host: Any
    ) -> list[Buffer | None]:
        out, pending, host = self._start(kind, items)
        for i in host:
            out[i] = on_host(*items[i])
        for indices, future in pending:
            self._finish(items, out, indices, future.result())
        return out

    def _start(
        self, kind: str, items: list[tuple[Buffer | None, ArraySpec]]
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
        pending = [
            (
                [i for i, _ in members],
                DeviceWorker.submit(device_id, kind, [a for _, a in members], self._zstd_codec),
            )
            for device_id, members in by_device.items()
        ]
        return [None] * len(items), pending, host

    @staticmethod
    def _finish(
        items: list[tuple[Buffer | None, ArraySpec]],
        out: list[Buffer | None],
        indices: list[int],
        arrays: list[Any],
    ) -> None:
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
        decoded = decode_on_host(self._zstd_codec, chunk_bytes.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(decoded)

    def _encode_host(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        encoded = encode_on_host(self._zstd_codec, chunk_bytes.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(encoded)


register_codec("zstd", ZstdCodec)
