"""The one place where arrayio moves bytes between a file and memory.

:func:`read_into` and :func:`write_from` take a file descriptor, a byte offset and a buffer
(a host ``uint8`` NumPy array, or device memory) and hand the transfer to the dispatcher,
which picks the transfer tool (and its parameters) it has learned to be fastest in that
context, or the one the caller forces with ``tool=`` or ``ARRAYIO_TOOL``. The CRC-32C of the
bytes is computed on the way while they are on the host anyway, or, for device buffers of a
few megabytes and more (and for tools that never stage through the host, like KvikIO), on
the GPU after the transfer (:mod:`arrayio._device_checksum`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .dispatch import dispatcher

if TYPE_CHECKING:
    import numpy as np

    from ._buffers import DeviceBuffer

__all__ = ["read_into", "write_from"]


def read_into(fd: int, file_offset: int, dest: np.ndarray | DeviceBuffer, *,
              path: str = "<file>", with_checksum: bool = False, tool: Any = None) -> int | None:
    """Fill ``dest`` from ``fd`` at ``file_offset``; return the bytes' CRC-32C if asked.

    Raises
    ------
    TruncatedFileError
        If the file ends before ``dest`` is full.
    """
    return dispatcher.get().read(fd, dest, file_offset, path=path,
                                 with_checksum=with_checksum, tool=tool)


def write_from(fd: int, file_offset: int, src: np.ndarray | DeviceBuffer, *,
               with_checksum: bool = False, tool: Any = None) -> int | None:
    """Write all of ``src`` to ``fd`` at ``file_offset``; return its CRC-32C if asked (None
    if a forced tool cannot compute it)."""
    return dispatcher.get().write(fd, src, file_offset, with_checksum=with_checksum, tool=tool)
