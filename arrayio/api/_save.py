"""Saving: :func:`save`, and the two phases it is made of (:func:`prepare_save` checks and
exports, :func:`write_prepared` writes atomically), which :func:`arrayio.save_async` runs in
two threads."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .. import config
from ..arrays import _dtypes, _pytree
from ..arrays._frameworks import Exported, export, export_for_save, is_array
from ..arrays._shards import Pieces
from ..dispatch import _transfer
from ..errors import UnsupportedDtypeError, UnsupportedFormatError, UnsupportedObjectError
from ..formats import npy, npz, safetensors
from ..integrity._atomic import atomic_write
from ..integrity._checksum import combine
from ..runtime import _gcpause, _progress

__all__ = ["PreparedSave", "prepare_npz", "prepare_save", "save", "write_prepared"]

PathLike = str | os.PathLike[str]


def save(
    path: PathLike,
    obj: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    tool: Any = None,
    progress: bool | None = None,
    max_shard_size: int | str | None = None,
) -> None:
    """Save an array, or a pytree of arrays, atomically.

    Parameters
    ----------
    path
        Destination. A name ending in ``.npy`` writes one array as NumPy's ``.npy``, one
        ending in ``.npz`` a flat ``dict`` of arrays as NumPy's ``.npz``; the extension of
        another format (``.pt``, ``.h5``, ``.pkl``...) is refused, and any other name writes
        a safetensors-compatible container. A symbolic link is written through, and a file
        replaced keeps its permissions.
    obj
        An array of any DLPack framework (NumPy, JAX, CuPy, torch...) on the CPU or a GPU, or a
        pytree of them: nested ``dict``, ``list``, ``tuple``, named tuples, ``None``, Python
        scalars, and any registered JAX pytree node when JAX is imported.
    metadata
        String keys and JSON-able values, stored in the safetensors ``__metadata__`` (strings
        as they are, other values as JSON) and returned by :attr:`Reader.metadata`.
    tool
        Force a transfer tool (``"posix"``, ``"direct(threads=4)"``...) instead of letting
        the dispatcher choose; also ``ARRAYIO_TOOL``.
    progress
        Show a progress bar (tqdm): ``None`` (default) for long saves where someone watches
        (a terminal or Jupyter), ``True`` also in logs, ``False`` never; also
        ``ARRAYIO_PROGRESS``.
    max_shard_size
        Write a Hugging Face checkpoint in several files instead: shards of at most this
        many bytes (an ``int``, or ``"5GiB"``, ``"500M"``: binary units) named
        ``model-00001-of-0000N.safetensors`` beside ``model.safetensors.index.json``, in the
        directory ``path`` (or beside ``path``, named after it, for a ``.safetensors``
        name). The arrays' names are flat (``"model.layers.0.weight"``); ``transformers``
        and ``safetensors`` read the files as they are, and :func:`load` reads them back.
        The index is written last, atomically: an interrupted save leaves the previous
        checkpoint whole. In a multi-process JAX program each shard is written by every
        process at once, each its own pieces, and process 0 writes the index.

    Raises
    ------
    UnsupportedObjectError
        For leaves that are not arrays or constants, colliding keys, or metadata ``.npy``
        cannot hold.
    UnsupportedDtypeError
        For dtypes arrayio does not store (or ``.npy`` cannot describe).
    UnsupportedFormatError
        For the extension of a format arrayio does not write.
    DiskFullError
        When the disk fills up; the previous file is intact.

    Notes
    -----
    The file is written under a temporary name in the same directory, fsynced, and renamed
    over ``path``: an interrupted save leaves any previous file intact. Each array's CRC-32C is
    recorded and checked on load.

    A ``jax.Array`` sharded over several devices by whole rows is written shard by shard,
    each unique shard from its own device, without gathering it. In a multi-process JAX
    program (``jax.distributed``), every process calls ``save`` with the same tree, writes
    its own shards into the one file, and the file is committed once all have finished.
    """
    from ._save_distributed import needs_distributed_save, save_distributed

    if needs_distributed_save(obj):  # jax.Arrays spread over several processes
        target = os.fspath(path)
        if target.endswith((".npy", ".npz")):
            raise UnsupportedObjectError(
                "arrays spread over several processes are saved to safetensors files, "
                "not .npy or .npz"
            )
        if max_shard_size is not None:
            from ._save_shards import save_shards

            save_shards(
                path,
                obj,
                max_shard_size,
                metadata=metadata,
                tool=tool,
                progress=progress,
                distributed=True,
            )
            return
        _refuse_foreign_extension(target)
        save_distributed(target, obj, metadata, tool)
        return
    if max_shard_size is not None:
        from ._save_shards import save_shards

        save_shards(path, obj, max_shard_size, metadata=metadata, tool=tool, progress=progress)
        return
    write_prepared(prepare_save(path, obj, metadata), tool=tool, progress=progress)


@dataclasses.dataclass
class PreparedSave:
    """A save whose arguments are checked and whose arrays are exported: only I/O is left.

    :func:`arrayio.save_async` prepares in the caller's thread (the blocking phase, where it
    also snapshots mutable arrays) and writes in the background.
    """

    path: str
    arrays: dict[str, Exported]
    layout: safetensors.Layout | None  # None for .npy and .npz
    npy_header: bytes | None = None  # for .npy


@_gcpause.paused()  # objects for every array and header entry (see arrayio.runtime._gcpause)
def prepare_save(path: PathLike, obj: Any, metadata: Mapping[str, Any] | None) -> PreparedSave:
    """Check and export what :func:`save` would write, without any I/O."""
    path = os.fspath(path)
    _refuse_foreign_extension(path)
    if path.endswith(".npz"):
        return prepare_npz(path, obj, metadata)
    if path.endswith(".npy"):
        if not is_array(obj):
            raise UnsupportedObjectError(
                f".npy holds one array, got {type(obj).__name__}; save pytrees to a container "
                "(any other extension, e.g. .safetensors)"
            )
        if metadata:
            raise UnsupportedObjectError(".npy cannot hold metadata; use a .safetensors container")
        exported = export(obj)
        header = npy.encode_header(exported.dtype, exported.shape, config.get().alignment)
        return PreparedSave(path, {_pytree.SINGLE_ARRAY_KEY: exported}, None, header)
    leaves, tree = _pytree.flatten(obj)
    arrays = {key: export_for_save(x) for key, x in leaves}
    stored_metadata, json_keys = _encode_metadata(metadata)
    frameworks = sorted({e.framework for e in arrays.values()})
    arrayio: dict[str, Any] = {"tree": tree, "framework": ",".join(frameworks) or None}
    if json_keys:
        arrayio["json_metadata"] = json_keys
    layout = safetensors.plan(
        [(key, e.dtype, e.shape) for key, e in arrays.items()],
        metadata=stored_metadata,
        arrayio=arrayio,
        alignment=config.get().alignment,
        checksums=True,
    )
    return PreparedSave(path, arrays, layout)


# Extensions of formats arrayio does not write, and what their users would load them with:
# a safetensors container under such a name would only make that loader fail.
_FOREIGN_EXTENSIONS = {
    ".pt": "torch.load",
    ".pth": "torch.load",
    ".bin": "torch.load",
    ".ckpt": "torch.load",
    ".pkl": "pickle",
    ".pickle": "pickle",
    ".joblib": "joblib",
    ".h5": "h5py",
    ".hdf5": "h5py",
    ".nc": "netCDF",
    ".mat": "scipy.io.loadmat",
    ".msgpack": "flax.serialization",
    ".gguf": "gguf",
    ".onnx": "onnx",
    ".zarr": "zarr",
    ".zip": "zipfile",
    ".tar": "tarfile",
    ".json": "json",
}


def _refuse_foreign_extension(path: str) -> None:
    extension = os.path.splitext(path)[1].lower()
    reader = _FOREIGN_EXTENSIONS.get(extension)
    if reader is None:
        return
    stem = os.path.splitext(os.path.basename(path))[0]
    hint = (
        "; for Zarr use arrayio.zarr.NVMeStore"
        if extension == ".zarr"
        else f"; convert a saved file with: arrayio convert {stem}.safetensors "
        f"{os.path.basename(path)}"
        if extension in (".pt", ".pth")
        else ""
    )
    raise UnsupportedFormatError(
        f"{path}: arrayio does not write the {extension} format, which {reader} would expect "
        f"to read; save to {stem}.safetensors (or .npy, .npz){hint}"
    )


def prepare_npz(path: str, obj: Any, metadata: Mapping[str, Any] | None) -> PreparedSave:
    """Check and export an ``.npz`` save: a flat mapping of names to arrays ``.npy`` holds."""
    if metadata:
        raise UnsupportedObjectError(".npz cannot hold metadata; use a .safetensors container")
    if not isinstance(obj, Mapping) or not all(
        isinstance(key, str) and is_array(value) for key, value in obj.items()
    ):
        raise UnsupportedObjectError(
            f"{path}: .npz holds a flat dict of names to arrays, as numpy.savez takes; save "
            "other structures (nesting, constants, None) to a .safetensors container"
        )
    arrays = {key: export(value) for key, value in obj.items()}
    for key, exported in arrays.items():
        if not exported.dtype.numpy_native:
            raise UnsupportedDtypeError(
                f"{path}: .npz cannot record {exported.dtype.name} (array {key!r}; NumPy would "
                "read opaque bytes); save it to a .safetensors container instead"
            )
    return PreparedSave(path, arrays, None)


def write_prepared(
    prepared: PreparedSave,
    *,
    tool: Any = None,
    checkpoint: Callable[[bool], None] | None = None,
    progress: bool | None = None,
) -> None:
    """Write a :class:`PreparedSave` atomically.

    ``checkpoint(False)`` is called before the first array and as each array but the last is
    written, and ``checkpoint(True)`` just before the file replaces ``path``; an exception
    it raises abandons the save (once the writes under way are done), leaving any previous
    file intact (how a running :func:`arrayio.save_async` is cancelled).
    """
    total = sum(exported.data.nbytes for exported in prepared.arrays.values())
    with (
        _gcpause.paused(across_transfers=True),
        atomic_write(prepared.path) as fd,
        _progress.bar(total, desc=f"saving {prepared.path}", progress=progress) as advance,
    ):
        if prepared.npy_header is None and prepared.layout is None:  # .npz
            if checkpoint is not None:
                checkpoint(False)
            with os.fdopen(os.dup(fd), "wb") as file:
                npz.write(file, {key: _on_host(e) for key, e in prepared.arrays.items()}, advance)
        elif prepared.layout is None:  # .npy: one array after its header
            exported = next(iter(prepared.arrays.values()))
            if checkpoint is not None:
                checkpoint(False)
            _transfer.write_from(fd, len(prepared.npy_header), exported.data, tool=tool)
            _write_all(fd, prepared.npy_header, 0)
            advance(exported.data.nbytes)
        else:
            layout = prepared.layout
            entries = layout.entries

            # A request per array, or per unique shard of a sharded one (each written from
            # its device to its range of the tensor); owners[i] is request i's entry.
            requests, owners = [], []
            for index, entry in enumerate(entries):
                data = prepared.arrays[entry.key].data
                parts = data.pieces if isinstance(data, Pieces) else ((0, data),)
                for offset, part in parts:
                    requests.append((entry.start + offset, part))
                    owners.append(index)

            def done(i: int) -> None:
                advance(requests[i][1].nbytes)
                if checkpoint is not None and i + 1 < len(requests):
                    checkpoint(False)

            if checkpoint is not None and entries:
                checkpoint(False)
            # One batch: every array's write in flight at once (see Dispatcher.write_many).
            crcs = _transfer.write_many(fd, requests, with_checksum=True, tool=tool, done=done)
            checksums = _entry_checksums(entries, requests, owners, crcs)
            _write_all(fd, layout.header(checksums), 0)
            if os.fstat(fd).st_size < layout.file_size:  # only an empty last tensor does this
                os.ftruncate(fd, layout.file_size)
        if checkpoint is not None:
            checkpoint(True)


def _entry_checksums(
    entries: Any, requests: list[tuple[int, Any]], owners: list[int], crcs: list[int | None]
) -> dict[str, int]:
    """Each entry's CRC-32C, its pieces' combined in order; none for an entry a forced tool
    could not checksum."""
    combined: dict[int, int | None] = {}
    for (_, part), owner, crc in zip(requests, owners, crcs, strict=True):
        if owner not in combined:
            combined[owner] = crc
        else:
            previous = combined[owner]
            combined[owner] = (
                None if previous is None or crc is None else combine(previous, crc, part.nbytes)
            )
    return {entries[i].key: crc for i, crc in combined.items() if crc is not None}


def _on_host(exported: Exported) -> np.ndarray:
    """The array's values in host memory, as NumPy sees them."""
    data = exported.data
    if not isinstance(data, np.ndarray):  # device memory: one copy to the host
        host = np.empty(data.nbytes, np.uint8)
        data.copy_to_host(0, host)
        data = host
    return data.view(_dtypes.numpy_dtype(exported.dtype)).reshape(exported.shape)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _encode_metadata(metadata: Mapping[str, Any] | None) -> tuple[dict[str, str], list[str]]:
    if metadata is None:
        return {}, []
    if not isinstance(metadata, Mapping):
        raise UnsupportedObjectError(f"metadata must be a mapping, got {type(metadata).__name__}")
    stored: dict[str, str] = {}
    json_keys: list[str] = []
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise UnsupportedObjectError(f"metadata keys must be strings, got {key!r}")
        if key in safetensors.RESERVED_METADATA_KEYS:
            raise UnsupportedObjectError(f"metadata key {key!r} is reserved for arrayio")
        if isinstance(value, str):
            stored[key] = value
            continue
        try:
            stored[key] = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise UnsupportedObjectError(f"metadata {key!r} is not JSON-able: {error}") from None
        json_keys.append(key)
    return stored, json_keys
