"""Counts for people: ``format_bytes(3 << 20) == "3.0 MiB"``, ``parse_size("64M")``,
``format_count(1, "array") == "1 array"``."""

from __future__ import annotations

__all__ = ["format_bytes", "format_count", "parse_size"]

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at least 1 (``"24.4 MiB"``)."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def format_count(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1: ``"1 array"``,
    ``"3 arrays"``; ``plural`` where adding an "s" is wrong (``"entries"``)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"64K"``, ``"1M"``, ``"1.5GiB"`` (binary units).

    Raises
    ------
    ValueError
        For anything else, or a size that is not positive.
    """
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if cleaned and cleaned[-1] in _UNITS:
            value = int(float(cleaned[:-1]) * _UNITS[cleaned[-1]])
        else:
            value = int(cleaned)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 4096, 64K, 16M, 1G)") from None
    if value <= 0:
        raise ValueError(f"sizes must be positive, got {text!r}")
    return value
