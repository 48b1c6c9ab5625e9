"""The host tier: device arrays spilled to pinned host memory before the disk.

Pinned copies run at tens of GB/s each way, beside compute; a disk takes a GB/s or two.
ZeRO-Infinity and JAX's host offload use this tier first, and so does the offloader: an
array it spills goes to host memory while the tier's budget has room, and to its file
after that (:mod:`arrayio.offload._spills` decides). Its buffers come from the process's
pinned pool (:mod:`arrayio.tools._pinned`): a copy given back when its array is freed
serves the next spill, so no array pins memory of its own.

The copies go through the CUDA driver on a stream of the I/O thread's own, after the
producer's event: no framework's stream waits for them. Host arrays (NumPy, JAX or torch
on the CPU) skip the tier: their "device" is the host already.
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
    """An array's bytes in a pinned buffer lent by the pool, until :meth:`release`."""

    __slots__ = ("_loan", "_tier", "buffer", "nbytes")

    def __init__(self, tier: HostTier, loan: contextlib.ExitStack, buffer: np.ndarray) -> None:
        self._tier, self.buffer = tier, buffer
        self._loan: contextlib.ExitStack | None = loan
        self.nbytes = buffer.nbytes

    def release(self) -> None:
        """Give the buffer back (once; later calls do nothing)."""
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
        self._lock = threading.Lock()
        self.used_bytes = 0
        if lend is None and self.budget_bytes:
            # The pool keeps the tier's buffers between the steps that reuse them.
            from ..tools._pinned import pool

            weakref.finalize(self, pool.keep_more(self.budget_bytes))

    def store(self, data: Any) -> HostCopy | None:
        """A host copy of ``data`` (a device buffer whose producer is done), or None where
        the tier has no room or ``data`` is host memory."""
        if isinstance(data, np.ndarray) or data.nbytes == 0:
            return None
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

    def store_jax(self, array: Any, host_sharding: Any) -> JaxHostCopy | None:
        """``array`` (a JAX array) moved to pinned host memory by JAX (``host_sharding``, from
        :func:`jax_host_offload`), or None where the tier has no room."""
        import jax

        nbytes = int(array.nbytes)
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
