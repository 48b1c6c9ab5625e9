"""One safetensors file written by every process of a multi-process JAX program at once.

A ``jax.Array`` that no one process can address whole (``jax.distributed``: each process
holds the shards of its own devices) cannot be gathered to write it. Each process writes
its own unique shards instead (``replica_id == 0``: a replica is written by one owner) to
their ranges of one file, which is committed once every process has finished, with the
guarantees of an ordinary save:

1. every process plans the same layout from the global shapes and dtypes;
2. process 0 creates the temporary beside the target (:func:`create_temporary`, holding its
   lock), reserves its blocks, and tells the others its name;
3. each process writes its pieces as one dispatcher batch (process 0 also the arrays that
   are not sharded across processes), fsyncs, and reports each piece's CRC-32C;
4. process 0 combines the CRCs of each tensor's pieces in order, writes the header, fsyncs
   and renames the temporary over the target; then every process returns.

A process that fails to write says so at the next step, where every process meets, and the
save raises in all of them with nothing committed (the previous file intact, the temporary
removed); a process that dies leaves the others waiting there, as any collective does.
Shards split along a later axis than the first go in runs, one per index of the axes
before it (:func:`~arrayio.arrays._shards.local_pieces`), as no process can gather them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import config
from ..arrays import _dtypes, _pytree
from ..arrays._frameworks import _export_jax, export_for_save, framework_of
from ..arrays._shards import local_pieces
from ..dispatch import _transfer
from ..formats import safetensors
from ..integrity._atomic import (
    _fsync_directory,
    create_temporary,
    describe_write_error,
    resolve_target,
)
from ..integrity._checksum import combine
from ..tools._io import preallocate

__all__ = ["needs_distributed_save", "save_distributed"]

_NAME_BYTES = 4096
_PADDING, _FAILED = -2, -3  # rows of the gathered table that are no piece


def _across_processes(x: Any) -> bool:
    return framework_of(x) == "jax" and not getattr(x, "is_fully_addressable", True)


def needs_distributed_save(obj: Any) -> bool:
    """Whether ``obj`` holds a ``jax.Array`` no one process addresses whole."""
    if "jax" not in sys.modules:  # no jax.Array then: spare every save the walk
        return False
    leaves, _ = _pytree.flatten(obj)
    return any(_across_processes(x) for _, x in leaves)


def save_distributed(
    path: str, obj: Any, metadata: Mapping[str, Any] | None, tool: Any = None
) -> None:
    """Write ``obj`` to ``path`` from every process; see the module docstring. Every process
    of the program must call it with the same tree."""
    import jax
    from jax.experimental import multihost_utils

    from ._save import _encode_metadata

    rank = jax.process_index()
    leaves, tree = _pytree.flatten(obj)
    stored_metadata, json_keys = _encode_metadata(metadata)
    shapes = {key: (_dtypes.dtype_of(x.dtype), tuple(np.shape(x))) for key, x in leaves}
    arrayio: dict[str, Any] = {"tree": tree, "framework": "jax"}
    if json_keys:
        arrayio["json_metadata"] = json_keys
    layout = safetensors.plan(
        [(key, dtype, shape) for key, (dtype, shape) in shapes.items()],
        metadata=stored_metadata,
        arrayio=arrayio,
        alignment=config.get().alignment,
        checksums=True,
    )
    entries = {entry.key: (index, entry) for index, entry in enumerate(layout.entries)}

    # This process's pieces: (entry index, offset in the file, data).
    requests: list[tuple[int, int, Any]] = []
    for key, x in leaves:
        index, entry = entries[key]
        if _across_processes(x):
            # Every layout has its runs (no bound on their number: nothing can gather it);
            # the commit checks that the processes' runs tile each tensor once.
            pieces = local_pieces(x, _export_jax) or []
            requests += [(index, entry.start + offset, data) for offset, data in pieces]
        elif rank == 0:
            exported = export_for_save(x)
            parts = getattr(exported.data, "pieces", ((0, exported.data),))
            requests += [(index, entry.start + offset, data) for offset, data in parts]

    target = resolve_target(path)
    fd, name = -1, ""
    failure: BaseException | None = None
    if rank == 0:
        try:
            name, fd = create_temporary(target)
            # Every block reserved before any process writes: the processes' writes are then
            # overwrites, which ext4 runs side by side under the file's shared lock, where
            # writes into a sparse file's holes take turns under its exclusive lock (see
            # preallocate). A disk without room for the file says so here, before anyone
            # writes. Where the file system cannot reserve, the file is only sized.
            if not preallocate(fd, 0, layout.file_size):
                os.ftruncate(fd, layout.file_size)
        except OSError as error:  # the others hear of it as an empty name
            failure = describe_write_error(error, target, name or None)
            if fd >= 0:
                os.close(fd)
                os.unlink(name)
            name = ""
    encoded = np.zeros(_NAME_BYTES, dtype=np.uint8)
    encoded[: len(os.fsencode(name))] = np.frombuffer(os.fsencode(name), dtype=np.uint8)
    name = os.fsdecode(
        bytes(np.asarray(multihost_utils.broadcast_one_to_all(encoded))).rstrip(b"\0")
    )
    if failure is not None:
        raise failure
    if not name:
        raise RuntimeError(
            f"{path}: process 0 could not create or reserve the file; nothing was written"
        )
    try:
        own = fd if rank == 0 else os.open(name, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            crcs = _transfer.write_many(
                own, [(offset, data) for _, offset, data in requests], with_checksum=True, tool=tool
            )
            os.fsync(own)
        finally:
            if own != fd:
                os.close(own)
        table = np.array(
            [
                (index, offset, data.nbytes, -1 if crc is None else crc)
                for (index, offset, data), crc in zip(requests, crcs, strict=True)
            ],
            dtype=np.int64,
        ).reshape(-1, 4)
    except Exception as error:  # noqa: BLE001 - every process must hear of it, then it is raised
        if isinstance(error, OSError):
            error = describe_write_error(error, target, name)
        failure, table = error, np.array([[_FAILED, 0, 0, 0]], dtype=np.int64)
    # Every process reaches every collective below, whatever failed, so that none waits
    # forever for one that gave up.
    every = _allgather_rows(multihost_utils, table)
    failed = bool((every[:, 0] == _FAILED).any())
    if rank == 0:
        try:
            if failure is None and not failed:
                _commit(fd, name, target, layout, every)
        except Exception as error:  # noqa: BLE001 - as above
            failure = error
        finally:
            os.close(fd)
            if os.path.exists(name):
                os.unlink(name)  # not committed
    committed = multihost_utils.broadcast_one_to_all(
        np.array([0 if failed or failure is not None else 1], dtype=np.int32)
    )
    if failure is not None:
        raise failure
    if not int(np.asarray(committed)[0]):
        raise RuntimeError(
            f"{path}: another process could not write its shards; nothing was committed "
            "(the previous file is intact)"
        )


def _allgather_rows(multihost_utils: Any, table: np.ndarray) -> np.ndarray:
    """Every process's rows of ``table`` (int64), stacked (processes hold different counts).
    They travel as bytes: JAX without 64-bit mode narrows int64 to int32."""
    counts = np.asarray(multihost_utils.process_allgather(np.array([len(table)], np.int32)))
    most = int(counts.max())
    padded = np.full((most, 4), _PADDING, dtype=np.int64)
    padded[: len(table)] = table
    raw = np.asarray(multihost_utils.process_allgather(padded.view(np.uint8)))
    gathered = np.ascontiguousarray(raw, dtype=np.uint8).view(np.int64).reshape(-1, 4)
    return gathered[gathered[:, 0] != _PADDING]


def _commit(fd: int, name: str, target: str, layout: Any, rows: np.ndarray) -> None:
    """Process 0: each tensor's CRC from its pieces in order, the header, fsync, rename."""
    checksums: dict[str, int] = {}
    for index, entry in enumerate(layout.entries):
        pieces = sorted(
            (int(offset), int(length), int(crc)) for i, offset, length, crc in rows if i == index
        )
        at, crc = entry.start, None
        for offset, length, piece_crc in pieces:
            if offset != at or piece_crc < 0:
                raise RuntimeError(
                    f"{entry.key!r}: the processes' pieces do not cover it once "
                    f"(a piece at byte {offset}, expected {at})"
                )
            crc = piece_crc if crc is None else combine(crc, piece_crc, length)
            at += length
        if at != entry.start + entry.nbytes:
            raise RuntimeError(f"{entry.key!r}: the processes' pieces do not cover it")
        checksums[entry.key] = 0 if crc is None else crc
    header = layout.header(checksums)
    view = memoryview(header)
    offset = 0
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    os.fsync(fd)
    os.replace(name, target)
    _fsync_directory(os.path.dirname(target) or ".")
