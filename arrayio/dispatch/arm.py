"""An arm: a transfer tool with its parameters, the thing the dispatcher learns about."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..tools import Tool

__all__ = ["Arm"]


@dataclasses.dataclass(frozen=True, slots=True)
class Arm:
    """A transfer tool with its parameters: what the policy learns about.

    ``params`` may be given as a mapping; it is stored as a tuple of (key, value) pairs
    sorted by key, so equal arms compare and hash equal. :attr:`label` is the format of
    :attr:`Tool.label <arrayio.tools.Tool.label>`: ``name(k1=v1,k2=v2)`` or ``name``.
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()
    label: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        items = self.params.items() if isinstance(self.params, Mapping) else self.params
        params = tuple(
            sorted(((str(key), value) for key, value in items), key=lambda item: item[0])
        )
        if len({key for key, _ in params}) != len(params):
            raise ValueError(f"repeated parameter in {params!r}")
        object.__setattr__(self, "params", params)
        inner = ",".join(f"{key}={value}" for key, value in params)
        object.__setattr__(self, "label", f"{self.name}({inner})" if inner else self.name)

    @classmethod
    def of(cls, name: str, /, **params: Any) -> Arm:
        """``Arm.of("posix", threads=16)``."""
        return cls(name, tuple(params.items()))

    @classmethod
    def from_tool(cls, tool: Tool) -> Arm:
        """The arm of an existing tool instance."""
        return cls(tool.name, tuple(tool.params.items()))

    def make(self) -> Tool:
        """A new instance of the tool: ``arrayio.tools.make(name, **params)``.

        Raises
        ------
        UnknownToolError
            If no tool is registered under :attr:`name`.
        """
        from .. import tools

        return tools.make(self.name, **dict(self.params))

    def __str__(self) -> str:
        return self.label
