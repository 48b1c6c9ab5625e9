"""The host tier: device arrays spilled to pinned host memory before the disk.

Pinned copies run at tens of GB/s each way, beside compute; a disk takes a GB/s or two.
ZeRO-Infinity and JAX's host offload use this tier first, and so does the offloader: an
array it spills goes to host memory while the tier's budget has room, and to its file
after that (:mod:`arrayio.offload._spills` decides). Its buffers come from the process's
pinned pool (:mod:`arrayio.tools._pinned`): a copy given back when its array is freed
serves the next spill, so no array pins memory of its own.

torch tensors move by copies queued on the GPU, on the caller's thread, with no host wait
(:meth:`HostTier.queue_out`): the host runs ahead of the GPU, and a copy made on an I/O
thread after waiting for the producer lands after the step has asked for the array back, so
the step holds it and saves nothing. JAX arrays move by JAX's own ``device_put``, waited for
on an I/O thread (queued and not waited for, the arrays they left stayed allocated past the
device budget while the host ran ahead). Other arrays (CuPy) go through the CUDA driver on a
stream of an I/O thread's own, after the producer's event. Host arrays (NumPy, JAX or torch on
the CPU) skip the tier: their "device" is the host already.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["HostCopy", "HostTier", "JaxHostCopy", "jax_host_offload"]

# Moves ``nbytes`` from a device buffer into a host array, and back; both return once done.
ToHost = Callable[[Any, np.ndarray], None]
ToDevice = Callable[[np.ndarray, Any], None]


class HostCopy:
    """An array's bytes in a pinned buffer lent by the pool, until :meth:`release`.

    ``busy``: for a copy queued on a GPU stream (:meth:`HostTier.queue_out`), the event of
    the last copy queued into or out of the buffer; the buffer goes back to the pool only
    once it has happened (other tools fill the pool's buffers from their own threads)."""

    __slots__ = ("_loan", "_tier", "buffer", "busy", "nbytes")

    def __init__(
        self, tier: HostTier, loan: contextlib.ExitStack, buffer: np.ndarray, busy: Any = None
    ) -> None:
        self._tier, self.buffer, self.busy = tier, buffer, busy
        self._loan: contextlib.ExitStack | None = loan
        self.nbytes = buffer.nbytes

    @property
    def queued(self) -> bool:
        """Whether the bytes move by copies queued on a GPU stream (see the class)."""
        return self.busy is not None

    def release(self) -> None:
        """Give the buffer back (once; later calls do nothing): now, or once the last copy
        queued on it has happened."""
        if self._loan is None:
            return
        if self.busy is not None and not self.busy.query():
            self._tier._defer(self)
            return
        loan, self._loan = self._loan, None
        if loan is not None:
            loan.close()
            self._tier._returned(self.nbytes)


class JaxHostCopy:
    """A JAX array moved to its device's pinned host memory by JAX itself (memory kind
    ``pinned_host``, as JAX's own host offload does), until :meth:`release`."""

    __slots__ = ("_tier", "array", "device_sharding", "nbytes")

    def __init__(self, tier: HostTier, array: Any, device_sharding: Any, nbytes: int) -> None:
        self._tier: HostTier | None = tier
        self.array, self.device_sharding, self.nbytes = array, device_sharding, nbytes

    def back(self) -> Any:
        """The array in its device's memory again (a new JAX array)."""
        import jax

        return jax.device_put(self.array, self.device_sharding).block_until_ready()

    def release(self) -> None:
        """Drop the host copy (once; later calls do nothing)."""
        tier, self._tier = self._tier, None
        if tier is not None:
            self.array = None
            tier._returned(self.nbytes)


def jax_host_offload(array: Any) -> Any:
    """The sharding that puts ``array`` (a JAX array on a GPU) in pinned host memory through
    JAX's memory kinds, or None where JAX offers none (another framework, the CPU, a jaxlib
    without ``pinned_host``)."""
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(array, jax.Array):
        return None
    try:
        devices = array.sharding.device_set
        if any(device.platform == "cpu" for device in devices):
            return None  # host memory already
        kinds = {memory.kind for device in devices for memory in device.addressable_memories()}
        if "pinned_host" not in kinds or array.sharding.memory_kind == "pinned_host":
            return None
        return array.sharding.with_memory_kind("pinned_host")
    except (AttributeError, NotImplementedError, ValueError):  # a jaxlib without memory kinds
        return None


class HostTier:
    """Pinned host memory for spilled device arrays, at most ``budget_bytes`` of it.

    Parameters
    ----------
    budget_bytes
        The most bytes of arrays the tier holds.
    lend
        Lends a buffer of at least ``n`` bytes as a context manager (default: the pinned
        pool's); ``to_host`` and ``to_device`` copy between a device buffer and a host
        array (default: the CUDA driver, on the thread's stream). Tests pass host fakes.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        lend: Callable[[int], Any] | None = None,
        to_host: ToHost | None = None,
        to_device: ToDevice | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._lend = lend
        self._to_host = to_host or _driver_to_host
        self._to_device = to_device or _driver_to_device
        # Reentrant: a garbage collection on a thread that holds it may free a handle, whose
        # copy then gives its buffer back (or defers it) through this same lock.
        self._lock = threading.RLock()
        self.used_bytes = 0
        self._deferred: list[HostCopy] = []  # released while their copies were queued
        if lend is None and self.budget_bytes:
            # The pool keeps the tier's buffers between the steps that reuse them.
            from ..tools._pinned import pool

            weakref.finalize(self, pool.keep_more(self.budget_bytes))

    def store(self, data: Any) -> HostCopy | None:
        """A host copy of ``data`` (a device buffer whose producer is done), or None where
        the tier has no room or ``data`` is host memory."""
        if isinstance(data, np.ndarray) or data.nbytes == 0:
            return None
        self.reap()
        with self._lock:
            if self.used_bytes + data.nbytes > self.budget_bytes:
                return None
            self.used_bytes += data.nbytes
        loan = contextlib.ExitStack()
        try:
            lend = self._lend if self._lend is not None else _pool_lend
            buffer = loan.enter_context(lend(data.nbytes))[: data.nbytes]
            self._to_host(data, buffer)
        except BaseException:
            loan.close()
            self._returned(data.nbytes)
            raise
        return HostCopy(self, loan, buffer)

    def queue_out(self, tensor: Any, stream: Any, ready: Any) -> HostCopy | None:
        """A host copy of ``tensor`` (a contiguous torch CUDA tensor) queued on ``stream``
        after ``ready`` (the producer's event; None: the current stream's work so far), or
        None where the tier has no room. Nothing waits on the host: the tensor can be
        dropped at once, since ``record_stream`` keeps its block from reuse until the copy
        has run (as ``torch.autograd.graph.save_on_cpu`` relies on). A copy made on an I/O
        thread after a host wait lands later than the host, which runs ahead of the GPU,
        asks for the tensor back: the step then holds it, and nothing is saved."""
        import torch

        nbytes = tensor.numel() * tensor.element_size()
        self.reap()
        with self._lock:
            if nbytes == 0 or self.used_bytes + nbytes > self.budget_bytes:
                return None
            self.used_bytes += nbytes
        loan = contextlib.ExitStack()
        queued = False
        try:
            lend = self._lend if self._lend is not None else _pool_lend
            buffer = loan.enter_context(lend(nbytes))[:nbytes]
            source = tensor.reshape(-1).view(torch.uint8)
            producer = torch.cuda.current_stream(tensor.device)  # (before the side one is)
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                else:
                    stream.wait_stream(producer)
                queued = True
                torch.from_numpy(buffer).copy_(source, non_blocking=True)
                busy = stream.record_event()
            tensor.record_stream(stream)
        except BaseException:
            if queued:  # the copy may be on its way into the buffer: not back to the pool yet
                stream.synchronize()
            loan.close()
            self._returned(nbytes)
            raise
        return HostCopy(self, loan, buffer, busy)

    def queue_back(self, copy: HostCopy, like: Any, stream: Any) -> tuple[Any, Any]:
        """A new tensor shaped as ``like`` (dtype, shape, device), allocated on ``stream``
        and filled from ``copy`` by a copy queued there after the copy out's event (the
        copies out run on a stream of their own, so that copies each way overlap), and the
        event the stream that uses it must wait for."""
        import torch

        dtype, shape, device = like
        with torch.cuda.stream(stream):
            if copy.busy is not None:  # the copy out (or an earlier copy back) first
                stream.wait_event(copy.busy)
            out = torch.empty(copy.nbytes, dtype=torch.uint8, device=device)
            out.copy_(torch.from_numpy(copy.buffer), non_blocking=True)
            copy.busy = arrived = stream.record_event()
        return out.view(dtype).reshape(shape), arrived

    def _defer(self, copy: HostCopy) -> None:
        with self._lock:
            self._deferred.append(copy)

    def reap(self) -> None:
        """Give back the deferred buffers whose copies have happened."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        waiting = []
        for copy in deferred:
            if copy.busy.query():
                copy.release()
            else:
                waiting.append(copy)
        with self._lock:
            self._deferred.extend(waiting)

    def settle(self) -> None:
        """Wait for every deferred buffer's copies and give the buffers back (at close)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for copy in deferred:
            copy.busy.synchronize()
            copy.release()

    def store_jax(self, array: Any, host_sharding: Any) -> JaxHostCopy | None:
        """``array`` (a JAX array) moved to pinned host memory by JAX (``host_sharding``, from
        :func:`jax_host_offload`), or None where the tier has no room."""
        import jax

        nbytes = int(array.nbytes)
        self.reap()
        with self._lock:
            if self.used_bytes + nbytes > self.budget_bytes:
                return None
            self.used_bytes += nbytes
        try:
            device_sharding = array.sharding
            moved = jax.device_put(array, host_sharding).block_until_ready()
        except BaseException:
            self._returned(nbytes)
            raise
        return JaxHostCopy(self, moved, device_sharding, nbytes)

    def load(self, copy: HostCopy, data: Any) -> None:
        """Copy ``copy``'s bytes into ``data`` (device memory, or a host array)."""
        if isinstance(data, np.ndarray):
            np.copyto(data.reshape(-1).view(np.uint8), copy.buffer)
        else:
            self._to_device(copy.buffer, data)

    def copy_seconds(self, data: Any, clock: Callable[[], float]) -> tuple[float, float]:
        """Seconds to copy ``data`` (a device buffer) into a pinned buffer of the pool and
        back, through the tier's own copies: how its rates are measured
        (:mod:`arrayio.offload._rates`). Takes none of the budget."""
        lend = self._lend if self._lend is not None else _pool_lend
        with lend(data.nbytes) as lent:
            buffer = lent[: data.nbytes]
            start = clock()
            self._to_host(data, buffer)
            copied = clock()
            self._to_device(buffer, data)
            return copied - start, clock() - copied

    def _returned(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


def _pool_lend(nbytes: int) -> Any:
    from ..tools._pinned import pool

    return pool.lend(nbytes)


def _driver_to_host(data: Any, buffer: np.ndarray) -> None:
    from ..arrays import _cuda

    stream = _cuda.thread_stream(data.device_index)
    _cuda.copy_to_host(buffer, data.data_ptr, stream)
    stream.synchronize()


def _driver_to_device(buffer: np.ndarray, data: Any) -> None:
    from ..arrays import _cuda

    stream = _cuda.thread_stream(data.device_index)
    _cuda.copy_to_device(data.data_ptr, buffer, stream)
    stream.synchronize()
