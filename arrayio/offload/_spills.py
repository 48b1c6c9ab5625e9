"""Spill files: an entry's array written to its file and read back, through the dispatcher.

Each array is one file of raw bytes, checksummed (CRC-32C) unless ``verify=False``. These
calls run in the offloader's I/O threads and change none of its state: the offloader
updates its books, under its lock, once they return.
"""

from __future__ import annotations

import os
from typing import Any

from ..arrays._frameworks import CPU, Request, allocate, export
from ..arrays._shards import Pieces
from ..dispatch import _transfer
from ..errors import ChecksumError
from ._entries import Entry
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

    def __init__(self, *, verify: bool, tool: Any) -> None:
        self.verify = verify
        self.tool = tool
        self._streams = SideStreams()

    def write(self, entry: Entry, array: Any, ready: Any) -> int | None:
        """Write ``array`` to the entry's file once ``ready`` (a CUDA event, or None) has
        happened.

        Returns
        -------
        int or None
            The bytes' CRC-32C, or None without ``verify``.
        """
        if ready is not None:
            ready.synchronize()  # the producer's kernels are done (host wait, our thread)
        data = export(array).data
        assert not isinstance(data, Pieces)  # only export_for_save leaves shards in place
        del array
        fd = os.open(entry.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            return _transfer.write_from(fd, 0, data, with_checksum=self.verify, tool=self.tool)
        finally:
            os.close(fd)

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
        request = entry.request
        to_jax_device = request.framework == "jax" and request.placement.is_cuda
        if to_jax_device:  # through the host, then device_put: JAX owns the memory
            request = Request("numpy", CPU)
        with self._streams.allocating(entry):
            target = allocate(request, entry.dtype, entry.shape)
        wait_for_device(entry)
        fd = os.open(entry.file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            check = self.verify and entry.crc is not None
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
        if to_jax_device:
            import jax

            return jax.device_put(target.finish(), entry.request.jax_device).block_until_ready()
        return target.finish()
