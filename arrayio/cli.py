"""The ``arrayio`` command (work in progress)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the ``arrayio`` command."""
    return 0
