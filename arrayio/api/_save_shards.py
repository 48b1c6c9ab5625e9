"""``save(..., max_shard_size=...)``: a checkpoint in several safetensors files and their index,
as Hugging Face writes them, readable by ``transformers`` and ``safetensors`` as they are.

The index is the commit point. Every shard is written atomically under a name the current
index does not use (the standard ``model-00001-of-00004.safetensors`` where it is free, the
same with a token before ``.safetensors`` where a shard of that name belongs to the checkpoint
being replaced), then the index replaces the old one atomically, then the shards only the old
index named are removed. A reader, or a crash, meets the old checkpoint whole or the new one
whole, never a mix.

In a multi-process JAX program (``jax.distributed``), every process calls ``save`` with the
same tree: each shard is written as a one-file distributed save (each process its own pieces,
process 0 the header and the commit, :mod:`arrayio.api._save_distributed`), process 0 chooses
the names and writes the index once every shard is committed, and every process returns once
the index is in place (or raises with every other, the previous checkpoint intact).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

from ..arrays import _pytree
from ..arrays._frameworks import export
from ..errors import UnsupportedFormatError, UnsupportedObjectError
from ..formats import shards
from ..integrity import _atomic
from ..runtime._units import parse_size

__all__ = ["save_shards", "shard_groups"]


def shard_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of ``sizes`` in order, cut into groups of at most ``limit`` bytes, as
    ``transformers`` cuts them: a new shard starts when the next tensor would overflow the
    current one (a tensor larger than ``limit`` has a shard of its own)."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if groups and total + size <= limit:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            total = size
    return groups


def _target(path: str) -> tuple[str, str]:
    """The directory and the file stem (``model``) of a checkpoint saved at ``path``: a
    ``.safetensors`` name, or a directory (its files named ``model...``)."""
    if path.endswith(".safetensors"):
        return os.path.dirname(path) or ".", os.path.basename(path)[: -len(".safetensors")]
    return path, "model"


def save_shards(
    path: str | os.PathLike[str],
    obj: Any,
    max_shard_size: int | str,
    *,
    metadata: Mapping[str, Any] | None,
    tool: Any,
    progress: bool | None,
    distributed: bool = False,
) -> None:
    """Write ``obj``'s arrays as shards of at most ``max_shard_size`` bytes and their index;
    see the module docstring. ``distributed``: ``obj`` holds arrays spread over the
    processes of a multi-process JAX program, every one of which calls this."""
    from ._save import save  # the one-file save, for each shard
    from ._save_distributed import save_distributed

    def write(file: str, part: dict[str, Any]) -> None:
        if distributed:
            save_distributed(file, part, metadata, tool)
        else:
            save(file, part, metadata=metadata, tool=tool, progress=progress)

    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ValueError(f"max_shard_size must be a positive size, got {max_shard_size!r}")
    path = os.fspath(path)
    if path.endswith((".npy", ".npz")):
        raise UnsupportedFormatError(
            f"{path}: a checkpoint in shards is safetensors files; give a directory or a "
            ".safetensors name"
        )
    directory, stem = _target(path)
    leaves, _ = _pytree.flatten(obj)
    if not leaves:
        raise UnsupportedObjectError("a checkpoint in shards needs at least one array")
    sizes = [_nbytes(key, leaf) for key, leaf in leaves]
    groups = shard_groups(sizes, limit)
    # transformers refuses a safetensors file whose metadata does not name its format.
    metadata = {"format": "pt", **(metadata or {})}
    index_path = os.path.join(directory, f"{stem}{shards.INDEX_SUFFIX}")
    old = _referenced(index_path)  # before process 0 can have replaced it
    _by_process_zero(
        distributed, lambda: os.makedirs(directory, exist_ok=True), f"{directory}: not created"
    )
    if len(groups) == 1:
        single = os.path.join(directory, f"{stem}.safetensors")
        write(single, dict(leaves))
        _by_process_zero(
            distributed,
            lambda: _retire(index_path, old, keep={single}),
            f"{path}: saved as {single}, but the replaced checkpoint's index or shards remain",
        )
        return
    names = [f"{stem}-{i + 1:05d}-of-{len(groups):05d}" for i in range(len(groups))]
    if any(os.path.join(directory, f"{name}.safetensors") in old for name in names):
        # In a multi-process save only process 0's names reach the disk (it creates and
        # commits each shard, and writes the index), so no process waits for its token.
        token = secrets.token_hex(4)
        names = [f"{name}.{token}" for name in names]
    weight_map: dict[str, str] = {}
    written: set[str] = set()
    for name, group in zip(names, groups, strict=True):
        file_name = f"{name}.safetensors"
        part = {leaves[i][0]: leaves[i][1] for i in group}
        write(os.path.join(directory, file_name), part)
        written.add(os.path.join(directory, file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}

    def commit() -> None:
        with _atomic.atomic_write(index_path) as fd:
            os.write(fd, json.dumps(index, indent=2).encode() + b"\n")
        _remove(old - written)
        _remove(_orphans(directory, stem) - written)

    _by_process_zero(
        distributed,
        commit,
        f"{path}: the index, or the removal of the replaced checkpoint's shards, failed",
    )


def _by_process_zero(distributed: bool, step: Any, failed: str) -> None:
    """Run ``step``, in process 0 alone when ``distributed``: every process returns once it
    is done, or raises if it failed (process 0 its error, the others ``failed``). Every
    process reaches the one collective, whatever happened."""
    if not distributed:
        step()
        return
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    failure: Exception | None = None
    if jax.process_index() == 0:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - the others must hear of it first
            failure = error
    done = multihost_utils.broadcast_one_to_all(np.array([failure is None], dtype=np.int32))
    if failure is not None:
        raise failure
    if not int(np.asarray(done)[0]):
        raise RuntimeError(f"process 0 says: {failed}")


def _orphans(directory: str, stem: str) -> set[str]:
    """Shards of this checkpoint's naming that no index names any more: those of a save
    interrupted before its index was written."""
    pattern = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}(\.[0-9a-f]{{8}})?\.safetensors")
    return {
        os.path.join(directory, name) for name in os.listdir(directory) if pattern.fullmatch(name)
    }


def _nbytes(key: str, leaf: Any) -> int:
    """The array's size in bytes, without exporting it (each shard's save exports its own
    arrays; exporting a sharded ``jax.Array`` gathers it)."""
    nbytes = getattr(leaf, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    exported = export(leaf)
    if exported is None:
        raise UnsupportedObjectError(f"{key!r}: shards hold arrays, got {type(leaf).__name__}")
    return int(exported.data.nbytes)


def _referenced(index_path: str) -> set[str]:
    """The shard paths the index at ``index_path`` names now (none if there is none, or it
    cannot be read: then nothing is removed)."""
    try:
        return set(shards.find(index_path).files.values())  # type: ignore[union-attr]
    except (OSError, ValueError, AttributeError):
        return set()


def _retire(index_path: str, old: set[str], keep: set[str]) -> None:
    """Remove the index of a checkpoint replaced by a single file, then its shards."""
    try:
        os.unlink(index_path)
    except FileNotFoundError:
        pass
    _remove(old - keep)
    _remove(
        _orphans(
            os.path.dirname(index_path), os.path.basename(index_path)[: -len(shards.INDEX_SUFFIX)]
        )
    )


def _remove(paths: set[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
