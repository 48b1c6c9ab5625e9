"""Checkpoints in several files, as Hugging Face writes them: ``model-00001-of-00004.safetensors``
and so on beside ``model.safetensors.index.json``, whose ``weight_map`` names the file of every
tensor.

:func:`find` tells such a checkpoint from a single file: a path to an index, or a directory
holding one index (or a single ``.safetensors`` file). The index is read within a bound and
checked before any shard is opened: every file it names must be a plain name in the index's
directory (never a path out of it), and exist.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

from ..errors import FormatError, KeyNotFoundError, UnsupportedFormatError
from ._names import Names

__all__ = ["INDEX_SUFFIX", "MAX_INDEX_BYTES", "ShardIndex", "find"]

INDEX_SUFFIX = ".safetensors.index.json"
# A checkpoint of a million tensors has an index of about a hundred MB; beyond this bound an
# index is refused before it is read.
MAX_INDEX_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """A checkpoint in several files: ``files[name]`` is the path of the shard holding
    tensor ``name``, in the index's order. ``files`` is not to change once the index is
    used: :meth:`select` keeps its names sorted."""

    path: str
    files: dict[str, str]
    metadata: dict[str, object]

    def select(self, keys: str | Sequence[str] | None) -> dict[str, list[str]]:
        """The tensors ``keys`` names (exact names, or subtrees: ``"model.layers.0"`` is
        every tensor below it), grouped by shard, in the index's order.

        Raises
        ------
        KeyNotFoundError
            For a key that names no tensor.
        """
        if keys is None:
            wanted = list(self.files)
        else:
            wanted = []
            for key in [keys] if isinstance(keys, str) else list(keys):
                below = self._names.below(key, (".", "/"))
                if not below:
                    raise KeyNotFoundError(f"{self.path}: no tensor {key!r} in the checkpoint")
                wanted += below
        by_file: dict[str, list[str]] = {}
        for name in dict.fromkeys(wanted):
            by_file.setdefault(self.files[name], []).append(name)
        return by_file

    @functools.cached_property
    def _names(self) -> Names:
        """The tensors' names in the index's order, for :meth:`select`."""
        return Names(self.files)


def find(path: str | os.PathLike[str]) -> ShardIndex | str | None:
    """What ``path`` names: a :class:`ShardIndex` for an index or a directory holding one,
    the path of the single ``.safetensors`` file of a directory holding just that, or None
    for anything else (a file, read as one).

    Raises
    ------
    UnsupportedFormatError
        For a directory holding several indexes, or several ``.safetensors`` files and no
        index.
    FormatError
        For an index that is too large, malformed, or names files it cannot.
    """
    path = os.fspath(path)
    if path.endswith(INDEX_SUFFIX) and os.path.isfile(path):
        return _read_index(path)
    if not os.path.isdir(path):
        return None
    names = sorted(os.listdir(path))
    indexes = [name for name in names if name.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        raise UnsupportedFormatError(
            f"{path}: holds several checkpoint indexes ({', '.join(indexes)}); load one of them"
        )
    if indexes:
        return _read_index(os.path.join(path, indexes[0]))
    tensors = [name for name in names if name.endswith(".safetensors")]
    if len(tensors) == 1:
        return os.path.join(path, tensors[0])
    if not tensors:
        return None  # the reader says what the directory is not
    raise UnsupportedFormatError(
        f"{path}: holds {len(tensors)} .safetensors files and no *{INDEX_SUFFIX} to say "
        "which tensor is where; load one file, or write an index"
    )


def _read_index(path: str) -> ShardIndex:
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > MAX_INDEX_BYTES:
            raise FormatError(
                f"{path}: a checkpoint index of {size} bytes, over the {MAX_INDEX_BYTES} "
                "arrayio reads"
            )
        text = file.read(MAX_INDEX_BYTES + 1)
    try:
        index = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise FormatError(f"{path}: not a checkpoint index (not JSON: {error})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{path}: a checkpoint index needs a non-empty 'weight_map'")
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise FormatError(f"{path}: the index's 'metadata' is not an object")
    directory = os.path.dirname(path)
    files: dict[str, str] = {}
    checked: dict[str, str] = {}
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not isinstance(name, str):
            raise FormatError(f"{path}: weight_map entries map names to file names")
        if file_name not in checked:
            if (
                not file_name
                or os.path.basename(file_name) != file_name
                or file_name in (".", "..")
                or "\x00" in file_name
            ):
                raise FormatError(
                    f"{path}: the index names {file_name!r}; shards must be plain file names "
                    "beside the index"
                )
            shard = os.path.join(directory, file_name)
            if not os.path.isfile(shard):
                raise FormatError(f"{path}: the index names {file_name!r}, which is not there")
            checked[file_name] = shard
        files[name] = checked[file_name]
    return ShardIndex(path, files, metadata)
