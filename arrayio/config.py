"""Settings in one place: defaults, ``ARRAYIO_*`` environment variables, and ``set()``.

``config.set(verify_checksums=False)`` changes a setting for the whole process (worker threads
included, as ``kvikio.defaults.set`` does); used as a ``with`` block it restores the previous
settings on exit.

Environment variables, read once at import:

``ARRAYIO_VERIFY_CHECKSUMS``  ``0`` to skip checksum verification on load (default ``1``).
``ARRAYIO_ALIGNMENT``         byte alignment of tensor data in written files (default 4096).
``ARRAYIO_STAGING_BYTES``     size of each pinned host staging buffer for GPU I/O (default 64 MiB).
``ARRAYIO_TOOL``              force one transfer tool for every transfer (``posix``, or with
                              parameters ``posix(threads=4)``); unset: the dispatcher chooses.
``ARRAYIO_CACHE_DIR``         where the dispatcher keeps what it learned (default
                              ``$XDG_CACHE_HOME/arrayio`` or ``~/.cache/arrayio``); ``none``
                              keeps it in memory only.
``ARRAYIO_PROGRESS``          progress bars (tqdm) for saves, loads, conversions and benchmarks
                              of 256 MiB or more or lasting over 2 seconds: unset (or ``auto``)
                              shows them on a terminal or in Jupyter only, ``1`` also where
                              output is not interactive (logs, CI), ``0`` never.
``ARRAYIO_ASYNC_WORKERS``     how many :func:`arrayio.save_async` / :func:`arrayio.load_async`
                              operations run at once (default 4; more wait in a queue).
``ARRAYIO_GC_PAUSE``          ``0`` to leave Python's cyclic garbage collector running during
                              saves and loads (default ``1``: paused over a synchronous call,
                              and over an asynchronous one's object-creating steps only; see
                              ``arrayio._gcpause``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["Settings", "get", "set"]


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """arrayio's settings; see the module docstring for their environment variables."""

    verify_checksums: bool = True
    alignment: int = 4096
    staging_bytes: int = 64 << 20
    tool: str | None = None
    cache_dir: str | None = dataclasses.field(default_factory=lambda: _default_cache_dir())
    progress: bool | None = None  # None: automatic (see ARRAYIO_PROGRESS)
    async_workers: int = 4
    gc_pause: bool = True

    def __post_init__(self) -> None:
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")
        if self.staging_bytes < 4096:
            raise ValueError(f"staging_bytes must be at least 4096, got {self.staging_bytes}")
        if self.async_workers < 1:
            raise ValueError(f"async_workers must be at least 1, got {self.async_workers}")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "arrayio")


def _from_environment() -> Settings:
    def flag(name: str, default: bool) -> bool:
        value = os.environ.get(name)
        if value is None:
            return default
        return value.strip().lower() not in ("0", "false", "no", "off", "")

    def integer(name: str, default: int) -> int:
        value = os.environ.get(name)
        return default if value is None else int(value)

    return Settings(
        verify_checksums=flag("ARRAYIO_VERIFY_CHECKSUMS", True),
        alignment=integer("ARRAYIO_ALIGNMENT", 4096),
        staging_bytes=integer("ARRAYIO_STAGING_BYTES", 64 << 20),
        tool=os.environ.get("ARRAYIO_TOOL") or None,
        cache_dir=_cache_dir_from(os.environ.get("ARRAYIO_CACHE_DIR")),
        progress=_progress_from(os.environ.get("ARRAYIO_PROGRESS")),
        async_workers=integer("ARRAYIO_ASYNC_WORKERS", 4),
        gc_pause=flag("ARRAYIO_GC_PAUSE", True),
    )


def _progress_from(value: str | None) -> bool | None:
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    return value.strip().lower() not in ("0", "false", "no", "off")


def _cache_dir_from(value: str | None) -> str | None:
    if value is None or value == "":
        return _default_cache_dir()
    return None if value.strip().lower() == "none" else value


_current: Settings = _from_environment()


def get() -> Settings:
    """Return the settings in force."""
    return _current


class _Restore:
    def __init__(self, previous: Settings) -> None:
        self._previous = previous

    def __enter__(self) -> Settings:
        return _current

    def __exit__(self, *exc: Any) -> None:
        global _current
        _current = self._previous


def set(**changes: Any) -> _Restore:
    """Change settings; usable as a ``with`` block that restores them on exit.

    Parameters
    ----------
    **changes
        Field names of :class:`Settings` and their new values.

    Raises
    ------
    TypeError
        For a name that is not a setting.
    """
    global _current
    known = [f.name for f in dataclasses.fields(Settings)]
    unknown = sorted(name for name in changes if name not in known)
    if unknown:
        raise TypeError(f"unknown arrayio setting(s) {unknown}; known: {known}")
    previous = _current
    _current = dataclasses.replace(previous, **changes)
    return _Restore(previous)
