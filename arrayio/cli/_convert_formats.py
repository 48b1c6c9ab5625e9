"""How ``arrayio convert`` reads each format it converts from (:func:`read_source`) and writes
each one it converts to (:func:`write_target`)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import errors
from ..arrays import _dtypes
from ..integrity import _atomic
from ..runtime import _progress
from ._common import FORMATS, CommandError, needs


class Source:
    """What a source file holds: a pytree (or one array) and its metadata."""

    def __init__(self, tree: Any, metadata: dict[str, Any]) -> None:
        from ..arrays._frameworks import is_array
        from ..arrays._pytree import leaves_by_key

        self.tree = tree
        self.metadata = metadata
        leaves = leaves_by_key(tree)
        self.arrays = {key: x for key, x in leaves.items() if is_array(x)}
        self.constants = [key for key, x in leaves.items() if not is_array(x)]


# --------------------------------------------------------------------------- reading


def read_source(path: str, kind: str, progress: bool | None, like: str | None) -> Source:
    """What ``path``, a file (or Zarr store) of format ``kind``, holds, in host memory;
    arrayio's own formats load as arrays of ``like`` (``None``: NumPy)."""
    import arrayio

    if kind in ("arrayio", "npy"):
        with arrayio.open(path) as reader:
            return Source(reader.load(like=like, progress=progress), dict(reader.metadata))
    if kind == "npz":
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (ValueError, OSError, zipfile.BadZipFile) as error:
            raise errors.FormatError(f"{path}: not a readable .npz file: {error}") from None
        for name, array in arrays.items():
            _check_dtype(array, f"{path}: array {name!r}: ")
        return Source(arrays, {})
    if kind == "pt":
        torch = needs("torch", "torch", "reading .pt files")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - torch raises many kinds (pickle, zip...)
            raise errors.FormatError(
                f"{path}: torch.load(weights_only=True) failed: {str(error).splitlines()[0]}"
            ) from None
        return Source(_map_arrays(obj, _detached), {})
    if kind == "zarr":
        zarr = needs("zarr", "zarr", "reading Zarr")
        try:
            node = zarr.open(path, mode="r")
        except Exception as error:  # noqa: BLE001 - zarr's errors for a non-store vary
            raise errors.FormatError(f"{path}: not a Zarr array or group: {error}") from None
        if isinstance(node, zarr.Array):
            array = node[...]
            _check_dtype(array, f"{path}: ")
            return Source(array, {})
        arrays = {}
        for name, member in node.members(max_depth=None):
            if isinstance(member, zarr.Array):
                arrays[name] = member[...]
                _check_dtype(arrays[name], f"{path}: array {name!r}: ")
        return Source(_nest(arrays, "/"), dict(node.attrs))
    raise CommandError(f"unknown format {kind!r}; known: {', '.join(FORMATS)}")


def _check_dtype(array: Any, where: str) -> None:
    """Refuse a dtype arrayio does not store, naming the file and key."""
    _dtypes.dtype_of(array.dtype, where=where)


def _detached(x: Any) -> Any:
    """A tensor from torch.load, detached from autograd (DLPack refuses ``requires_grad``)."""
    return x.detach() if type(x).__module__.startswith("torch") and hasattr(x, "detach") else x


def _nest(flat: dict[str, Any], separator: str) -> dict[str, Any]:
    """{"a/b": x} -> {"a": {"b": x}}."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, name = path.split(separator)
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return tree


def _map_arrays(tree: Any, function: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _map_arrays(v, function) for k, v in tree.items()}
    if isinstance(tree, list | tuple) and not hasattr(type(tree), "_fields"):
        items = [_map_arrays(v, function) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return function(tree)


# --------------------------------------------------------------------------- writing


def write_target(source: Source, src: str, dst: str, kind: str, progress: bool | None) -> None:
    """Write ``source`` (read from ``src``, named in messages) to ``dst`` in format ``kind``,
    atomically: a failure leaves no half-written output."""
    import arrayio

    if kind == "npy":
        if len(source.arrays) != 1:
            raise CommandError(
                f"{dst}: .npy holds one array and {src} has {len(source.arrays)}; pick one "
                f"with --key (arrays: {', '.join(list(source.arrays)[:8])})"
            )
        arrayio.save(dst, next(iter(_arrays_only(source, "npy").values())), progress=progress)
    elif kind == "arrayio":
        arrayio.save(dst, source.tree, metadata=source.metadata or None, progress=progress)
    elif kind == "npz":
        _write_npz(_arrays_only(source, "npz"), dst, progress)
    elif kind == "pt":
        _write_pt(source, dst)
    elif kind == "zarr":
        _write_zarr(source, dst, progress)
    else:
        raise CommandError(f"unknown format {kind!r}; known: {', '.join(FORMATS)}")


def _arrays_only(source: Source, kind: str) -> dict[str, Any]:
    """The source's arrays by key, with a note on stderr for what ``kind`` cannot hold."""
    if source.constants:
        names = ", ".join(source.constants[:5]) + (", ..." if len(source.constants) > 5 else "")
        print(
            f"arrayio convert: note: {kind} holds arrays only; not converted: {names}",
            file=sys.stderr,
        )
    if kind in ("npz", "npy"):
        _note_metadata(source, kind)
    return source.arrays


def _note_metadata(source: Source, kind: str) -> None:
    """A note on stderr naming the metadata that ``kind`` has no place for."""
    if source.metadata:
        print(
            f"arrayio convert: note: {kind} holds no metadata; not converted: "
            f"{', '.join(source.metadata)}",
            file=sys.stderr,
        )


def _host_numpy(array: Any) -> np.ndarray:
    """A NumPy view of a CPU array of any framework (torch's bfloat16 included)."""
    if isinstance(array, np.ndarray):
        return array
    from ..arrays._frameworks import export

    exported = export(array)
    return exported.data.view(_dtypes.numpy_dtype(exported.dtype)).reshape(exported.shape)


def _write_npz(flat: dict[str, Any], dst: str, progress: bool | None) -> None:
    from ..api import _save

    # Through save's own .npz writer, also for a destination named otherwise (--to npz).
    _save.write_prepared(_save.prepare_npz(dst, flat, None), progress=progress)


def _write_pt(source: Source, dst: str) -> None:
    torch = needs("torch", "torch", "writing .pt files")
    # A .pt file is one pickled object: keeping the metadata would mean a key of the user's
    # tree (or a wrapper around it) that torch.load's callers do not expect.
    _note_metadata(source, "pt")

    def to_torch(x: Any) -> Any:
        from ..arrays._frameworks import is_array

        if is_array(x) and not isinstance(x, torch.Tensor):
            return torch.from_numpy(_host_numpy(x).copy(order="C"))  # 0-d stays 0-d
        return x

    tree = _map_arrays(source.tree, to_torch)
    with _atomic.atomic_write(dst) as fd, os.fdopen(os.dup(fd), "wb") as file:
        try:
            torch.save(tree, file)
        except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, pickle errors...
            raise errors.UnsupportedObjectError(f"{dst}: torch.save failed: {error}") from None


def _write_zarr(source: Source, dst: str, progress: bool | None) -> None:
    zarr = needs("zarr", "zarr", "writing Zarr")
    from ..arrays._frameworks import is_array

    arrays = {key: _host_numpy(a) for key, a in _arrays_only(source, "zarr").items()}
    total = sum(a.nbytes for a in arrays.values())
    with (
        _atomic_directory(dst) as temporary,
        _progress.bar(total, desc=f"writing {dst}", progress=progress) as advance,
    ):
        if is_array(source.tree):  # one array: a Zarr array, not a group
            nodes = [("", next(iter(arrays.values())))]
            create = functools.partial(zarr.create_array, temporary)
        else:
            root = zarr.open_group(temporary, mode="w")
            if source.metadata:
                root.attrs.update(source.metadata)
            nodes = list(arrays.items())
            create = root.create_array
        for key, array in nodes:
            try:
                if key:
                    create(key.replace(".", "/"), data=array)
                else:
                    create(data=array)
            except Exception as error:  # noqa: BLE001 - zarr's errors: ValueError for a dtype,
                # ContainsArrayError for a key that is also a group...
                what = f"array {key!r} ({array.dtype})" if key else str(array.dtype)
                raise errors.UnsupportedDtypeError(
                    f"{dst}: Zarr cannot store {what}: {error}"
                ) from None
            advance(array.nbytes)


@contextlib.contextmanager
def _atomic_directory(path: str) -> Iterator[str]:
    """A temporary directory beside ``path``, moved over it on success: a failed conversion
    leaves no half-written output, and any previous one intact. (Files go through
    :func:`arrayio.integrity._atomic.atomic_write`.)"""
    parent = os.path.dirname(os.path.abspath(path))
    prefix = ".arrayio-convert-"
    temporary = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o777 & ~umask)  # as mkdir would make it (mkdtemp gives 0o700)
    try:
        yield temporary
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=prefix, suffix=".old", dir=parent)
            os.replace(path, os.path.join(old, "previous"))
            os.replace(temporary, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
