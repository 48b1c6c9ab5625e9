"""zstd chunks read into pinned host memory, decoded into a GPU's memory by nvCOMP and by
the host's cores at once, as :mod:`~arrayio.zarr._decode_placement` shares them out."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy as np

from ..dispatch.candidates import usable_cores
from ..tools._pinned import pool as pinned_pool
from . import _decode_placement
from ._frames import decode_on_host
from ._io_pool import executor
from ._kernels import DeviceSpan, address

__all__ = ["decode_for_gpu", "to_device"]


def decode_for_gpu(
    zstd: Any,
    slab: np.ndarray,
    encoded: list[np.ndarray | None],
    decoded_sizes: list[int],
    target: Any,
    destinations: list[Any] | None = None,
) -> list[Any]:
    """Each chunk (a view of the pinned ``slab``, or None: missing) decoded onto
    ``target``'s GPU: its destination (flat device bytes of its decoded size, a CuPy array or
    a :class:`~arrayio.zarr._kernels.DeviceSpan`) where it has one, else a new CuPy array.
    ``decoded_sizes`` are the chunks' decoded bytes as the array's spec gives them. The
    chunks are shared between nvCOMP and the host's cores; a chunk that cannot be decoded
    raises its error."""
    indices = [i for i, data in enumerate(encoded) if data is not None]
    out: list[Any] = [None] * len(encoded)
    if not indices:
        return out
    device_id = target.device.id
    typical = int(np.median([decoded_sizes[i] for i in indices]))
    chosen = _decode_placement.placement(device_id, typical, len(indices))
    # The host takes chunks from the end, nvCOMP from the start: with chunks in file order,
    # each side's destinations stay together.
    on_host = indices[len(indices) - chosen.host_chunks :] if chosen.host_chunks else []
    on_gpu = indices[: len(indices) - chosen.host_chunks]
    gpu_done: list[float] = []
    if on_host:
        # Work the caller queued on its stream (a fill of the output) lands before the host
        # side's copies, which run on streams that do not wait for it.
        import cupy

        with cupy.cuda.Device(device_id):
            cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    gpu_future = _submit_gpu(zstd, slab, encoded, on_gpu, target, destinations, gpu_done)
    host_seconds = None
    if on_host:
        _decode_on_host(zstd, encoded, decoded_sizes, on_host, device_id, destinations, out)
        host_seconds = time.perf_counter() - start
    if gpu_future is not None:
        results = gpu_future.result()
        for i, result in zip(on_gpu, results, strict=True):
            out[i] = result
    if len(indices) > 1:

        def rate(side: list[int], seconds: float | None) -> float | None:
            if not side or not seconds or seconds <= 0:
                return None
            return sum(decoded_sizes[i] for i in side) / seconds

        gpu_seconds = gpu_done[0] - start if gpu_done else None
        _decode_placement.record(
            chosen,
            rate(on_gpu, gpu_seconds),
            rate(on_host, host_seconds),
            rate(indices, time.perf_counter() - start),
        )
    for i in indices:
        if isinstance(out[i], Exception):
            raise out[i]
    return out


def _submit_gpu(
    zstd: Any,
    slab: np.ndarray,
    encoded: list[np.ndarray | None],
    chosen: list[int],
    target: Any,
    destinations: list[Any] | None,
    done: list[float],
) -> concurrent.futures.Future | None:
    """The ``chosen`` chunks copied to the GPU and queued for its nvCOMP worker; ``done``
    gets the moment they are decoded."""
    if not chosen:
        return None
    from ._gpu_worker import DeviceWorker

    base = slab.__array_interface__["data"][0]
    parts = [encoded[i] for i in chosen]
    first = min(part.__array_interface__["data"][0] for part in parts)  # type: ignore[union-attr]
    last = max(
        part.__array_interface__["data"][0] + part.nbytes  # type: ignore[union-attr]
        for part in parts
    )
    # One copy of the span of the slab that holds the chosen chunks (they are read into it
    # in order, so the span is theirs and little else).
    arrays = _spans_on_device(slab[first - base : last - base], parts, target)
    places = [destinations[i] for i in chosen] if destinations is not None else None
    future = DeviceWorker.submit(target.device.id, "decode", arrays, zstd, places)
    future.add_done_callback(lambda _: done.append(time.perf_counter()))
    return future


def _decode_on_host(
    zstd: Any,
    encoded: list[np.ndarray | None],
    decoded_sizes: list[int],
    chosen: list[int],
    device_id: int,
    destinations: list[Any] | None,
    out: list[Any],
) -> None:
    """Decode the ``chosen`` chunks on the host's cores, each into a pinned buffer of its
    thread's, then copy it to its destination on the GPU (or to a new array there); each
    result, or the error a chunk raised, goes into ``out``."""
    import cupy

    threads = max(1, min(len(chosen), usable_cores()))
    largest = max(decoded_sizes[i] for i in chosen)
    shares = [chosen[k::threads] for k in range(threads)]
    with pinned_pool.lend(threads * largest) as pinned:

        def run(thread: int) -> None:
            buffer = pinned[thread * largest : (thread + 1) * largest]
            with cupy.cuda.Device(device_id):
                # A stream of its own that does not wait for nvCOMP's (blocking) stream, as
                # the legacy default stream would: the two sides run at once.
                stream = cupy.cuda.Stream(non_blocking=True)
                for i in shares[thread]:
                    try:
                        out[i] = _one_on_host(
                            zstd, encoded[i], decoded_sizes[i], buffer, destinations, i, stream
                        )
                    except Exception as error:  # noqa: BLE001 - raised by the caller, in order
                        out[i] = error

        list(executor().map(run, range(threads)))


def _one_on_host(
    zstd: Any,
    data: Any,
    size: int,
    buffer: np.ndarray,
    destinations: list[Any] | None,
    index: int,
    stream: Any,
) -> Any:
    """One chunk decoded into ``buffer`` (pinned) and copied to the GPU: its destination
    where it has one of the decoded size, else a new CuPy array."""
    import cupy

    decoded = decode_on_host(zstd, data, buffer[:size])
    host = decoded if isinstance(decoded, np.ndarray) else np.frombuffer(decoded, dtype=np.uint8)
    place = destinations[index] if destinations is not None else None
    if place is None or place.nbytes != host.nbytes:
        place = cupy.empty(host.nbytes, dtype=np.uint8)
    if host.nbytes:
        cupy.cuda.runtime.memcpyAsync(
            address(place), host.__array_interface__["data"][0], host.nbytes, 1, stream.ptr
        )
        stream.synchronize()  # the bytes are on the GPU: the buffer is free again
    return place


def _spans_on_device(
    slab: np.ndarray, encoded: list[np.ndarray | None], target: Any
) -> list[DeviceSpan | None]:
    """The chunks (views of ``slab``) on ``target``'s GPU, with one copy of ``slab``, as
    spans (:class:`~arrayio.zarr._kernels.DeviceSpan`) of that copy: what nvCOMP's batch
    needs, where a CuPy view of each chunk costs microseconds to make."""
    device, offsets = _copied(slab, encoded, target)
    base, device_id = device.data.ptr, target.device.id
    return [
        None if data is None else DeviceSpan(device, base + offset, data.nbytes, device_id)
        for data, offset in zip(encoded, offsets, strict=True)
    ]


def to_device(slab: np.ndarray, encoded: list[np.ndarray | None], target: Any) -> list[Any]:
    """The chunks (views of ``slab``) on ``target``'s GPU, with one copy of ``slab``."""
    device, offsets = _copied(slab, encoded, target)
    return [
        None if data is None else device[offset : offset + data.nbytes]
        for data, offset in zip(encoded, offsets, strict=True)
    ]


def _copied(
    slab: np.ndarray, encoded: list[np.ndarray | None], target: Any
) -> tuple[Any, list[int]]:
    """``slab`` copied to ``target``'s GPU, and where each chunk (a view of it) starts."""
    import cupy

    with cupy.cuda.Device(target.device.id):
        device = cupy.asarray(slab)
    start = slab.__array_interface__["data"][0]
    offsets = [
        data.__array_interface__["data"][0] - start if data is not None and data.nbytes else 0
        for data in encoded
    ]
    return device, offsets
