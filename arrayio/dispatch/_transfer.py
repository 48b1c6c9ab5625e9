"""The one place where arrayio moves bytes between a file and memory.

:func:`read_into` and :func:`write_from` take a file descriptor, a byte offset and a buffer
(a host ``uint8`` NumPy array, or device memory) and hand the transfer to the dispatcher,
which picks the transfer tool (and its parameters) it has learned to be fastest in that
context, or the one the caller forces with ``tool=`` or ``ARRAYIO_TOOL``. The CRC-32C of the
bytes is computed on the way while they are on the host anyway, or, for device buffers of a
few megabytes and more (and for tools that never stage through the host, like KvikIO), on
the GPU after the transfer (:mod:`arrayio.integrity._device_checksum`). A read into a torch
or CuPy device buffer first waits for the work queued on the caller's current stream
(:func:`~arrayio.arrays._buffers.wait_for_current_streams`): the tools fill it from streams
of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..arrays._buffers import wait_for_current_streams
from . import dispatcher

if TYPE_CHECKING:
    import numpy as np

    from ..arrays._buffers import DeviceBuffer

__all__ = [
    "read_files",
    "read_into",
    "read_many",
    "read_many_files",
    "read_queued",
    "write_from",
    "write_many",
]


def read_into(
    fd: int,
    file_offset: int,
    dest: np.ndarray | DeviceBuffer,
    *,
    path: str = "<file>",
    with_checksum: bool = False,
    tool: Any = None,
) -> int | None:
    """Fill ``dest`` from ``fd`` at ``file_offset``; return the bytes' CRC-32C if asked.

    Raises
    ------
    TruncatedFileError
        If the file ends before ``dest`` is full.
    """
    wait_for_current_streams([dest])
    return dispatcher.get().read(
        fd, dest, file_offset, path=path, with_checksum=with_checksum, tool=tool
    )


def read_queued(
    fd: int, file_offset: int, dest: np.ndarray | DeviceBuffer, *, path: str = "<file>"
) -> None:
    """Fill ``dest`` from ``fd`` at ``file_offset``, in one batch with the reads that other
    threads ask for meanwhile (:mod:`arrayio.dispatch.coalesce`): for a store that many
    threads ask for one value at a time.

    Raises
    ------
    TruncatedFileError
        If the file ends before ``dest`` is full.
    """
    from . import coalesce

    wait_for_current_streams([dest])  # in the asking thread: its streams, not the leader's
    coalesce.read(fd, file_offset, dest, path)


def read_files(
    requests: Sequence[tuple[int, int, Any]], *, paths: Sequence[str] | None = None
) -> None:
    """Fill each ``(fd, file_offset, buffer)`` from several files as one batch (see
    :meth:`Dispatcher.read_files <arrayio.dispatch.dispatcher.Dispatcher.read_files>`).

    Raises
    ------
    TruncatedFileError
        If a file ends before its buffer is full.
    """
    wait_for_current_streams([buffer for _, _, buffer in requests])
    dispatcher.get().read_files(requests, paths=paths)


def write_from(
    fd: int,
    file_offset: int,
    src: np.ndarray | DeviceBuffer,
    *,
    with_checksum: bool = False,
    tool: Any = None,
) -> int | None:
    """Write all of ``src`` to ``fd`` at ``file_offset``; return its CRC-32C if asked (None
    if a forced tool cannot compute it)."""
    return dispatcher.get().write(fd, src, file_offset, with_checksum=with_checksum, tool=tool)


def read_many(
    fd: int,
    requests: Sequence[tuple[int, Any]],
    *,
    path: str = "<file>",
    with_checksum: bool = False,
    tool: Any = None,
    done: Callable[[int], None] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> list[int | None]:
    """Fill each ``(file_offset, buffer)`` as one batch, every transfer in flight at once;
    return their CRC-32Cs if asked. ``done(i)`` is called as request ``i`` completes;
    ``meanwhile()`` runs while they move (see :meth:`Dispatcher.read_many
    <arrayio.dispatch.dispatcher.Dispatcher.read_many>`).

    Raises
    ------
    TruncatedFileError
        If the file ends before a buffer is full.
    """
    wait_for_current_streams([buffer for _, buffer in requests])
    return dispatcher.get().read_many(
        fd,
        requests,
        path=path,
        with_checksum=with_checksum,
        tool=tool,
        done=done,
        meanwhile=meanwhile,
    )


def read_many_files(
    requests: Sequence[tuple[int, int, Any]],
    *,
    paths: Sequence[str],
    with_checksum: bool = False,
    tool: Any = None,
    done: Callable[[int], None] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> list[int | None]:
    """Fill each ``(fd, file_offset, buffer)`` from several files as one batch; return their
    CRC-32Cs if asked (see :meth:`Dispatcher.read_many_files
    <arrayio.dispatch.dispatcher.Dispatcher.read_many_files>`).

    Raises
    ------
    TruncatedFileError
        If a file ends before its buffer is full.
    """
    wait_for_current_streams([buffer for _, _, buffer in requests])
    return dispatcher.get().read_many_files(
        requests,
        paths=paths,
        with_checksum=with_checksum,
        tool=tool,
        done=done,
        meanwhile=meanwhile,
    )


def write_many(
    fd: int,
    requests: Sequence[tuple[int, Any]],
    *,
    with_checksum: bool = False,
    tool: Any = None,
    done: Callable[[int], None] | None = None,
) -> list[int | None]:
    """Write each ``(file_offset, buffer)`` as one batch; return their CRC-32Cs if asked
    (None for a forced tool that cannot compute them)."""
    return dispatcher.get().write_many(
        fd, requests, with_checksum=with_checksum, tool=tool, done=done
    )
