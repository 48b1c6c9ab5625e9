"""CUDA streams and events that keep the offloader's I/O off the caller's compute stream.

* torch and CuPy: :func:`record_ready` marks, on the current stream, when a put array is
  produced; the writer waits for that event on the host, in its own thread.
* Reads allocate their destination on a side stream of the offloader's
  (:class:`SideStreams`). torch: :func:`record_stream` then tells the caching allocator that
  the compute stream uses the tensor. CuPy, whose pool has no ``record_stream``: the reader
  waits for earlier work on the device before filling (:func:`wait_for_device`).
* JAX orders its own work: exporting through DLPack waits for the array, and reads go
  through the host and ``jax.device_put``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from ._entries import Entry

__all__ = ["SideStreams", "arrived", "record_ready", "record_stream", "wait_for_device"]


def record_ready(array: Any, framework: str | None, cuda: bool) -> Any:
    """An event on the current stream marking the array as produced (CUDA torch, CuPy);
    None for other arrays."""
    if not cuda:
        return None
    if framework == "torch":
        import torch

        with torch.cuda.device(array.device):
            return torch.cuda.current_stream().record_event()
    if framework == "cupy":
        import cupy

        with array.device:
            return cupy.cuda.get_current_stream().record()
    return None  # JAX: exporting through DLPack waits until the array is ready


class SideStreams:
    """The offloader's own stream per framework and device, created on first use."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # (reentrant: see HostTier's lock)
        self._streams: dict[tuple[str, int], Any] = {}

    def allocating(self, entry: Entry) -> Any:
        """A context in which the destination of the entry's read is allocated: on a side
        stream, so that the caching allocator never hands it a block the compute stream may
        still use."""
        placement = entry.request.placement
        if not placement.is_cuda or entry.framework == "jax":
            return contextlib.nullcontext()
        if entry.framework == "torch":
            import torch

            return torch.cuda.stream(self.torch_stream(placement.index))
        import cupy

        key = ("cupy", placement.index)
        with self._lock:
            if key not in self._streams:
                with cupy.cuda.Device(placement.index):
                    self._streams[key] = cupy.cuda.Stream(non_blocking=True)
            stream = self._streams[key]
        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(placement.index))
        stack.enter_context(stream)
        return stack

    def synchronize(self) -> None:
        """Wait for the work queued on every torch side stream made so far."""
        with self._lock:
            streams = [s for (kind, _), s in self._streams.items() if kind.startswith("torch")]
        for stream in streams:
            stream.synchronize()

    def torch_stream(self, index: int, kind: str = "torch") -> Any:
        """A torch side stream of GPU ``index``: ``"torch"``, on which reads from files
        allocate their destination and the host tier queues its copies out; ``"torch back"``,
        on which the host tier's copies back allocate theirs and run (a block of one stream's
        pool is never handed to the other's users while a copy into it is queued)."""
        import torch

        key = (kind, index)
        with self._lock:
            if key not in self._streams:
                self._streams[key] = torch.cuda.Stream(device=index)
            return self._streams[key]


def arrived(array: Any, event: Any) -> None:
    """Make the current stream wait (on the GPU) for ``event``: the copy that filled
    ``array`` (a torch tensor read back by a copy queued on a side stream)."""
    import torch

    torch.cuda.current_stream(array.device).wait_event(event)


def wait_for_device(entry: Entry) -> None:
    """Before a read fills a fresh CuPy-pool block: wait for earlier work on the device."""
    placement = entry.request.placement
    if placement.is_cuda and entry.framework == "cupy":
        import cupy

        with cupy.cuda.Device(placement.index):
            cupy.cuda.runtime.deviceSynchronize()


def record_stream(array: Any, framework: str) -> None:
    """Tell torch's caching allocator that the compute stream uses a tensor allocated on a
    side stream, so that its block is not reused before the compute stream is done."""
    if framework == "torch" and array.device.type == "cuda":
        import torch

        array.record_stream(torch.cuda.current_stream(array.device))
