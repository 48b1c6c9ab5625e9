"""Spills: an entry's array copied to pinned host memory while the host tier has room
(:mod:`arrayio.offload._host`), else written to its file and read back, through the
dispatcher.

Each file holds one array's raw bytes, checksummed (CRC-32C) unless ``verify=False``. These
calls run in the offloader's I/O threads and change none of its state: the offloader
updates its books, under its lock, once they return.
"""

from __future__ import annotations

import os
from typing import Any

from ..arrays._frameworks import CPU, Request, allocate, export, jax_uncommitted, torch_dtype
from ..arrays._shards import Pieces
from ..dispatch import _transfer
from ..errors import ChecksumError
from ._entries import Entry
from ._host import HostCopy, HostTier, JaxHostCopy, jax_host_offload
from ._streams import SideStreams, wait_for_device

__all__ = ["SpillFiles"]


class SpillFiles:
    """Writes and reads of spill files, with the offloader's checksum and tool settings.

    Parameters
    ----------
    verify
        Checksum written bytes, and check them when read back.
    tool
        A transfer tool to force, or None for the dispatcher's choice.
    """

    def __init__(self, *, verify: bool, tool: Any, host: HostTier | None = None) -> None:
        self.verify = verify
        self.tool = tool
        self.host = host
        self._streams = SideStreams()

    def write(
        self, entry: Entry, array: Any, ready: Any
    ) -> tuple[int | None, HostCopy | JaxHostCopy | None]:
        """Spill ``array`` once ``ready`` (a CUDA event, or None) has happened: to the host
        tier where it has room (unless the entry's tier is ``"disk"``), else to the entry's
        file.

        Returns
        -------
        tuple
            The file's CRC-32C (None without ``verify``, or for a host copy), and the host
            copy (None for a file).
        """
        if ready is not None:
            ready.synchronize()  # the producer's kernels are done (host wait, our thread)
        if self.host is not None and entry.tier != "disk":
            # A JAX array goes to pinned host memory through JAX itself where it can (its
            # memory kinds, as JAX's own host offload): JAX owns the device memory.
            host_sharding = jax_host_offload(array)
            if host_sharding is not None:
                jax_copy = self.host.store_jax(array, host_sharding)
                if jax_copy is not None:
                    return None, jax_copy
        data = export(array).data
        assert not isinstance(data, Pieces)  # only export_for_save leaves shards in place
        del array
        if self.host is not None and entry.tier != "disk":
            copy = self.host.store(data)
            if copy is not None:
                return None, copy
        fd = os.open(entry.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            crc = _transfer.write_from(fd, 0, data, with_checksum=self.verify, tool=self.tool)
        finally:
            os.close(fd)
        return crc, None

    def queue_to_host(self, entry: Entry) -> HostCopy | None:
        """The entry's array copied to the host tier by a copy queued on the GPU (see
        :meth:`HostTier.queue_out`), for a contiguous torch CUDA tensor where the tier has
        room and the entry may use it; else None, and the array goes the way of
        :meth:`write`."""
        array = entry.array
        if self.host is None or entry.tier == "disk" or not entry.request.placement.is_cuda:
            return None
        # JAX arrays go the writer's way, their moves waited for: queued and not waited for,
        # the arrays they left stayed allocated past the device budget while the host ran
        # ahead. record_stream keeps a block of torch's own allocator from reuse: memory
        # torch did not allocate (imported through DLPack, its storage not resizable) is not
        # protected by it, and goes the writer's way, held until its copy is done. (A
        # pluggable allocator without record_stream is not told apart: not supported here.)
        if (
            entry.framework != "torch"
            or not array.is_contiguous()
            or not array.untyped_storage().resizable()
        ):
            return None
        stream = self._streams.torch_stream(entry.request.placement.index)
        return self.host.queue_out(array, stream, entry.ready)

    def queues_back(self, entry: Entry) -> bool:
        """Whether the entry comes back from its host copy by a copy queued on the GPU: a
        torch CUDA tensor (any host copy of one, so that no reader thread fills a block of
        the side stream while a queued copy back into it is pending)."""
        return (
            isinstance(entry.host, HostCopy)
            and entry.framework == "torch"
            and entry.request.placement.is_cuda
        )

    def synchronize(self) -> None:
        """Wait for every copy queued on the GPU, and give back the host buffers released
        meanwhile."""
        self._streams.synchronize()
        if self.host is not None:
            self.host.reap()

    def settle(self) -> None:
        """At close: wait for every copy queued on the GPU and give back every buffer
        released while its copies ran."""
        self._streams.synchronize()
        if self.host is not None:
            self.host.settle()

    def queue_from_host(self, entry: Entry) -> tuple[Any, Any]:
        """The entry's array back from its host copy (:meth:`queues_back`) by a copy queued
        on the side stream of copies back (after the copy out's event), and the event its
        user's stream waits for."""
        assert self.host is not None and isinstance(entry.host, HostCopy)
        placement = entry.request.placement
        like = (torch_dtype(entry.dtype), entry.shape, f"cuda:{placement.index}")
        stream = self._streams.torch_stream(placement.index, "torch back")
        return self.host.queue_back(entry.host, like, stream)

    def read(self, entry: Entry) -> Any:
        """The entry's array, read back from its file into new memory of its framework on
        its device.

        Raises
        ------
        ChecksumError
            If the bytes read do not match those written.
        OSError
            If the file cannot be read.
        """
        array = self._read(entry)
        return jax_uncommitted(array) if entry.uncommitted else array

    def _read(self, entry: Entry) -> Any:
        if isinstance(entry.host, JaxHostCopy):
            return entry.host.back()
        request = entry.request
        to_jax_device = request.framework == "jax" and request.placement.is_cuda
        if to_jax_device:  # through the host, then device_put: JAX owns the memory
            request = Request("numpy", CPU)
        with self._streams.allocating(entry):
            target = allocate(request, entry.dtype, entry.shape)
        wait_for_device(entry)
        if entry.host is not None:
            assert self.host is not None
            self.host.load(entry.host, target.data)
            return self._finish(entry, target)
        fd = os.open(entry.file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            check = self.verify and entry.crc is not None
            # On the side stream the block was allocated on: the read waits for that
            # stream's work, not the compute stream's (see wait_for_current_streams).
            with self._streams.allocating(entry):
                crc = _transfer.read_into(
                    fd, 0, target.data, path=entry.file, with_checksum=check, tool=self.tool
                )
        finally:
            os.close(fd)
        if check and crc != entry.crc:
            raise ChecksumError(
                f"{entry.file}: spilled array #{entry.id} has CRC-32C "
                f"{crc:08x}, {entry.crc:08x} was written: the disk damaged it"
            )
        return self._finish(entry, target)

    @staticmethod
    def _finish(entry: Entry, target: Any) -> Any:
        """The array read into ``target``, on the entry's device."""
        if entry.request.framework == "jax" and entry.request.placement.is_cuda:
            import jax  # read through the host: JAX owns its device memory

            return jax.device_put(target.finish(), entry.request.jax_device).block_until_ready()
        return target.finish()
