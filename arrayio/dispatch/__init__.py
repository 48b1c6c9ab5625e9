"""Adaptive dispatch: learn on real work which transfer tool, with which parameters, is fastest.

:class:`Policy` explores the candidate arms of each context, exploits the fastest, re-explores
when its bandwidth drifts and falls back when a tool fails; :class:`Table` holds what it
learned and persists it as JSON. Importing this package imports no tool and no framework.
"""

from __future__ import annotations

from .arm import Arm
from .explain import ArmReport, Explanation
from .failures import is_tool_failure
from .policy import Policy, Split
from .table import ArmStats, ContextEntry, Table

__all__ = [
    "Arm",
    "ArmReport",
    "ArmStats",
    "ContextEntry",
    "Explanation",
    "Policy",
    "Split",
    "Table",
    "is_tool_failure",
]
