"""Transfer tools: one module per way of moving bytes, behind one :class:`Tool` interface.

The registry maps a name to a class, given as the class or as a ``"module:Class"`` string
imported on first use (fsspec's way), so that registering a GPU tool costs nothing until it
is used. Third parties add tools with :func:`register`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import UnknownToolError
from .base import Availability, Buffer, Capabilities, IOFuture, Tool, buffer_kind

__all__ = [
    "Availability",
    "Buffer",
    "Capabilities",
    "IOFuture",
    "Tool",
    "buffer_kind",
    "make",
    "names",
    "register",
    "tool_class",
]

_REGISTRY: dict[str, type[Tool] | str] = {
    "naive": "arrayio.tools.naive:NaiveTool",
    "posix": "arrayio.tools.posix:PosixTool",
    "direct": "arrayio.tools.direct:DirectTool",
    "mmap": "arrayio.tools.mmap:MmapTool",
    "kvikio": "arrayio.tools.kvikio:KvikioTool",
    "staged": "arrayio.tools.staged:StagedTool",
    "pagecache": "arrayio.tools.pagecache:PagecacheTool",
}


def register(name: str, tool: type[Tool] | str, *, clobber: bool = False) -> None:
    """Register a tool class (or ``"module:Class"``) under ``name``.

    Raises
    ------
    ValueError
        If ``name`` is taken and ``clobber`` is false.
    """
    if name in _REGISTRY and not clobber:
        raise ValueError(f"a transfer tool named {name!r} is already registered")
    _REGISTRY[name] = tool


def names() -> list[str]:
    """The registered tool names."""
    return list(_REGISTRY)


def tool_class(name: str) -> type[Tool]:
    """The class registered as ``name``, imported if given as a string.

    Raises
    ------
    UnknownToolError
        For a name nobody registered (the message lists the known ones).
    """
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise UnknownToolError(
            f"no transfer tool named {name!r}; known: {sorted(_REGISTRY)}"
        ) from None
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = getattr(importlib.import_module(module), attribute)
        _REGISTRY[name] = entry
    return entry


def make(name: str, **params: Any) -> Tool:
    """An instance of the tool ``name`` with ``params``."""
    return tool_class(name)(**params)
