"""``arrayio.open`` of a checkpoint in several files: one reader over its shards, each opened
when one of its arrays is first described or read, so that a tensor-parallel rank reads only
its rows of each tensor (``reader.read(key, index=slice(...))``) from the shards it needs."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import KeyNotFoundError
from ..formats import shards
from ._reader import ArrayInfo, Reader

__all__ = ["ShardedReader"]


class ShardedReader:
    """A checkpoint in several safetensors files, read as one; see :func:`arrayio.open`.

    Its keys are the index's tensor names, in the index's order. Use it as a context
    manager: it closes the shards it opened.
    """

    def __init__(
        self, index: shards.ShardIndex, *, verify: bool | None = None, tool: Any = None
    ) -> None:
        self.index = index
        self.path = index.path
        self._verify, self._tool = verify, tool
        self._open: dict[str, Reader] = {}

    def _shard(self, key: str) -> Reader:
        try:
            file = self.index.files[key]
        except KeyError:
            raise KeyNotFoundError(f"{self.path}: no tensor {key!r} in the checkpoint") from None
        reader = self._open.get(file)
        if reader is None:
            reader = self._open[file] = Reader(file, verify=self._verify, tool=self._tool)
        return reader

    def keys(self) -> list[str]:
        """The tensors' names, in the index's order."""
        return list(self.index.files)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.index.files)

    def __contains__(self, key: object) -> bool:
        return key in self.index.files

    def __getitem__(self, key: str) -> ArrayInfo:
        """The tensor's dtype, shape and size (opening its shard)."""
        return self._shard(key)[key]

    @property
    def metadata(self) -> dict[str, object]:
        """The index's ``metadata`` (``total_size``...)."""
        return dict(self.index.metadata)

    def read(self, key: str, index: Any = None, *, like: Any = None, device: Any = None) -> Any:
        """One tensor, or only the part ``index`` selects (rows, and a range of one later
        axis), from its shard alone; see :meth:`Reader.read <arrayio.Reader.read>`."""
        return self._shard(key).read(key, index, like=like, device=device)

    def load(
        self,
        *,
        keys: str | Sequence[str] | None = None,
        like: Any = None,
        device: Any = None,
        progress: bool | None = None,
        sharding: Any = None,
    ) -> Any:
        """What :func:`arrayio.load` gives for the checkpoint."""
        from ._load import _load_shards

        return _load_shards(
            self.index, keys, like, device, self._verify, self._tool, progress, sharding
        )

    def close(self) -> None:
        """Close the shards opened so far."""
        readers, self._open = list(self._open.values()), {}
        for reader in readers:
            reader.close()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        files = len(set(self.index.files.values()))
        where = os.fspath(self.path)
        return f"<arrayio.ShardedReader {where!r} ({len(self)} tensors in {files} files)>"
