"""The links' rates a spill plan is made from, measured where the spills will go.

:func:`measure_rates` times what the offloader itself does with a spilled tensor:

- **disk**: a sample written to a file in the offloader's directory and read back through
  the dispatcher, with the offloader's checksum and tool settings, as its spills are (from
  the device, on the GPU). The read follows the write, as a spill's read-back follows its
  write, so the page cache helps it as much as it helps the spills.
- **host tier**: the sample copied into a pinned buffer of the process's pool and back,
  through the tier's own copies (:meth:`HostTier.copy_seconds
  <arrayio.offload._host.HostTier.copy_seconds>`); for JAX, whose arrays the tier hands to
  JAX's own pinned host memory, moved there by ``jax.device_put`` and back, as the tier
  moves them. Only where the step runs CUDA and the
  offloader has a host tier (``host_budget_bytes``): host arrays skip the tier, so a step
  on the host plans the device and the disk only, and :func:`why_no_host_tier` says so.

Each rate is the median of a few timed transfers after an untimed one (the dispatcher's
first calls set up its tools). The links are measured alone, not beside compute.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..arrays._frameworks import export
from ..arrays._shards import Pieces
from ..dispatch import _transfer
from ._clock import cuda_in_use
from ._host import jax_host_offload
from ._plan import Rates

if TYPE_CHECKING:
    from ._offloader import Offloader

__all__ = ["JAX_SAMPLE_BYTES", "SAMPLE_BYTES", "measure_rates", "why_no_host_tier"]

SAMPLE_BYTES = 64 << 20
# A JAX move to or from pinned host memory is a call with a cost of its own (dispatch, a
# sharding's layout) that a 64 MiB sample weighs heavily: plans for JAX sample up to this.
JAX_SAMPLE_BYTES = 256 << 20
_FILE = "rates.bin"  # spill files are named by number: no clash


def measure_rates(
    offloader: Offloader,
    *,
    cuda: bool | None = None,
    sample_bytes: int = SAMPLE_BYTES,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    framework: str = "torch",
) -> Rates:
    """The rates of ``offloader``'s links, for :func:`~arrayio.offload.plan_step`.

    Parameters
    ----------
    offloader
        Whose directory, settings and host tier are measured.
    cuda
        Whether the tensors to spill are on the GPU (default: whether torch runs CUDA); a
        CUDA sample is a torch tensor on the current device, or a JAX array on JAX's first
        device with ``framework="jax"``.
    sample_bytes
        The bytes of each timed transfer: about the size of the tensors to spill.
    repeats
        Timed transfers per direction; the median counts.
    framework
        ``"torch"`` or ``"jax"``: whose arrays the plan spills (the sample's kind, and for
        JAX its host tier's own moves).

    Returns
    -------
    Rates
        ``to_host`` and ``from_host`` are ``math.inf`` and ``host_bytes`` 0 where the host
        tier is not used (see :func:`why_no_host_tier`).
    """
    if cuda is None:
        cuda = cuda_in_use()
    if framework not in ("torch", "jax"):
        raise ValueError(f"framework must be 'torch' or 'jax', got {framework!r}")
    jax_device = framework == "jax" and cuda
    source = _jax_sample(cuda, sample_bytes) if framework == "jax" else _sample(cuda, sample_bytes)
    # A spilled JAX array on a GPU is read back into host memory, then put on its device
    # by JAX (which owns the device's memory): its read is timed so.
    target = _sample(False, sample_bytes) if jax_device else _sample(cuda, sample_bytes)
    disk_write, disk_read = _disk_rates(
        offloader, source, target, repeats, clock, _jax_put_on(source) if jax_device else None
    )
    if why_no_host_tier(offloader, cuda=cuda) is not None:
        return Rates(math.inf, math.inf, disk_write, disk_read, 0)
    host_sharding = jax_host_offload(source) if jax_device else None
    if host_sharding is not None:
        to_host, from_host = _jax_host_rates(source, host_sharding, repeats, clock)
    else:  # (a JAX without pinned host memory: the tier copies its arrays as others')
        to_host, from_host = host_rates(offloader.host_tier, export(source).data, repeats, clock)
    return Rates(to_host, from_host, disk_write, disk_read, offloader.host_tier.budget_bytes)


def why_no_host_tier(offloader: Offloader, *, cuda: bool) -> str | None:
    """Why a plan for ``offloader`` cannot use the host tier, or None where it can."""
    if not offloader.host_tier.budget_bytes:
        return "the offloader has no host tier (host_budget_bytes=0)"
    if not cuda:
        return "the step runs on the host, whose arrays skip the host tier"
    return None


def host_rates(
    tier: Any, data: Any, repeats: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """Bytes per second into the host tier and back, for the device buffer ``data``."""
    tier.copy_seconds(data, clock)  # untimed: the pool pins its buffer here
    times = [tier.copy_seconds(data, clock) for _ in range(max(1, repeats))]
    return (
        _rate(data.nbytes, [out for out, _ in times]),
        _rate(data.nbytes, [back for _, back in times]),
    )


def _disk_rates(
    offloader: Offloader,
    source: Any,
    target: Any,
    repeats: int,
    clock: Callable[[], float],
    after_read: Callable[[Any], None] | None = None,
) -> tuple[float, float]:
    """Bytes per second of ``source`` written to a file and read back into ``target``, then
    ``after_read(target)`` (inside the read's time)."""
    spills = offloader._spills
    path = os.path.join(offloader.directory, _FILE)
    data, into = export(source).data, export(target).data
    assert not isinstance(data, Pieces) and not isinstance(into, Pieces)  # export_for_save's
    writes, reads = [], []
    try:
        for _ in range(1 + max(1, repeats)):
            start = clock()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _transfer.write_from(fd, 0, data, with_checksum=spills.verify, tool=spills.tool)
            finally:
                os.close(fd)
            written = clock()
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _transfer.read_into(
                    fd, 0, into, path=path, with_checksum=spills.verify, tool=spills.tool
                )
            finally:
                os.close(fd)
            if after_read is not None:
                after_read(target)
            writes.append(written - start)
            reads.append(clock() - written)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return _rate(data.nbytes, writes[1:]), _rate(data.nbytes, reads[1:])


def _rate(nbytes: int, seconds: list[float]) -> float:
    median = statistics.median(seconds)
    return nbytes / median if median > 0 else math.inf


def _sample(cuda: bool, nbytes: int) -> Any:
    """Random bytes (a file system that compresses must not shrink them): a torch tensor on
    the current CUDA device, or a NumPy array."""
    if cuda:
        import torch

        tensor = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()  # the writes read it from the I/O path, off the stream
        return tensor
    array = np.empty(nbytes, np.uint8)
    array[:] = np.frombuffer(np.random.default_rng().bytes(nbytes), np.uint8)
    return array


def _jax_sample(cuda: bool, nbytes: int) -> Any:
    """Random bytes as a JAX array on JAX's first device (``cuda``), or as a NumPy array
    (a host array's spill moves the same bytes from host memory)."""
    host = _sample(False, nbytes)
    if not cuda:
        return host
    import jax

    return jax.device_put(host, jax.devices()[0]).block_until_ready()


def _jax_put_on(array: Any) -> Callable[[Any], None]:
    """Put a host array on ``array``'s device with JAX, and wait for it."""
    import jax

    device = next(iter(array.devices()))
    return lambda host: jax.device_put(host, device).block_until_ready()


def _jax_host_rates(
    array: Any, host_sharding: Any, repeats: int, clock: Callable[[], float]
) -> tuple[float, float]:
    """Bytes per second of ``array`` (a JAX array on a GPU) moved to JAX's pinned host memory
    (``host_sharding``, from :func:`~arrayio.offload._host.jax_host_offload`) and back, as
    the host tier moves JAX arrays."""
    import jax

    device_sharding = array.sharding
    outs, backs = [], []
    for i in range(1 + max(1, repeats)):  # the first untimed: JAX compiles the moves
        start = clock()
        moved = jax.device_put(array, host_sharding).block_until_ready()
        copied = clock()
        jax.device_put(moved, device_sharding).block_until_ready()
        if i:
            outs.append(copied - start)
            backs.append(clock() - copied)
        del moved
    return _rate(int(array.nbytes), outs), _rate(int(array.nbytes), backs)
