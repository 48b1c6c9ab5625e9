"""Settings in one place: defaults, ``ARRAYIO_*`` environment variables, and ``set()``.

``config.set(verify_checksums=False)`` changes a setting for the whole process (worker threads
included, as ``kvikio.defaults.set`` does); used as a ``with`` block it restores the previous
settings on exit.

Environment variables, read once at import. Booleans accept ``1``, ``true``, ``yes``, ``on``
and ``0``, ``false``, ``no``, ``off`` (any case); numbers are whole numbers; unset or empty
means the default. A value that cannot be understood raises :class:`~arrayio.ConfigError`
(naming the variable and what it accepts) from every :func:`get` until it is fixed or
replaced with :func:`set`: from the first save or load, never from ``import arrayio``.

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
                              ``arrayio.runtime._gcpause``).
``ARRAYIO_SECOND_PASS``       ``0`` to leave a cold load's pages as the kernel left them (default
                              ``1``: read once more from the page cache in the background, so
                              that the next load does not pay their move to the kernel's
                              active list; see ``arrayio.dispatch.second_pass``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from .errors import ConfigError

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
    second_pass: bool = True

    def __post_init__(self) -> None:
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {self.alignment}")
        if self.staging_bytes < 4096:
            raise ConfigError(f"staging_bytes must be at least 4096, got {self.staging_bytes}")
        if self.async_workers < 1:
            raise ConfigError(f"async_workers must be at least 1, got {self.async_workers}")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "arrayio")


_FLAGS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}
_FLAG_SPELLINGS = "1, true, yes, on, 0, false, no or off"
_UNSET = object()


def _flag_from(value: str | None) -> Any:
    if value is None or not value.strip():
        return _UNSET
    try:
        return _FLAGS[value.strip().lower()]
    except KeyError:
        raise ConfigError(f"expected {_FLAG_SPELLINGS} (or unset for the default)") from None


def _integer_from(value: str | None) -> Any:
    if value is None or not value.strip():
        return _UNSET
    try:
        return int(value)
    except ValueError:
        raise ConfigError("expected a whole number (or unset for the default)") from None


def _progress_from(value: str | None) -> bool | None:
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    try:
        return _FLAGS[value.strip().lower()]
    except KeyError:
        raise ConfigError(f"expected auto, {_FLAG_SPELLINGS} (or unset: auto)") from None


def _read_environment() -> tuple[Settings, dict[str, str]]:
    """The settings the environment gives, with the default where a variable cannot be
    understood, and for each such setting the message naming its variable."""
    values: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for field, (variable, read) in _VARIABLES.items():
        text = os.environ.get(variable)
        try:
            value = read(text)
            if value is not _UNSET:
                Settings(**{field: value})  # the setting's own checks, one at a time
                values[field] = value
        except ConfigError as error:
            problems[field] = f"{variable}={text!r}: {error}"
    return Settings(**values), problems


def _from_environment() -> Settings:
    """The settings the environment gives.

    Raises
    ------
    ConfigError
        If a variable cannot be understood.
    """
    settings, problems = _read_environment()
    if problems:
        raise ConfigError("; ".join(problems.values()))
    return settings


def _cache_dir_from(value: str | None) -> str | None:
    if value is None or value == "":
        return _default_cache_dir()
    return None if value.strip().lower() == "none" else value


_VARIABLES: dict[str, tuple[str, Callable[[str | None], Any]]] = {
    "verify_checksums": ("ARRAYIO_VERIFY_CHECKSUMS", _flag_from),
    "alignment": ("ARRAYIO_ALIGNMENT", _integer_from),
    "staging_bytes": ("ARRAYIO_STAGING_BYTES", _integer_from),
    "tool": ("ARRAYIO_TOOL", lambda value: value or None),  # parsed where used (parse_arm)
    "cache_dir": ("ARRAYIO_CACHE_DIR", _cache_dir_from),
    "progress": ("ARRAYIO_PROGRESS", _progress_from),
    "async_workers": ("ARRAYIO_ASYNC_WORKERS", _integer_from),
    "gc_pause": ("ARRAYIO_GC_PAUSE", _flag_from),
    "second_pass": ("ARRAYIO_SECOND_PASS", _flag_from),
}


# A variable that cannot be understood is kept here, and raised by get(), rather than raised
# now: an import that raises breaks programs that never save or load (and `arrayio --help`),
# and warning and using the default instead would let `ARRAYIO_VERIFY_CHECKSUMS=flase` skip
# (or keep) checksums against the user's intent with a message easily lost in a log.
_current, _invalid = _read_environment()


def get() -> Settings:
    """Return the settings in force.

    Raises
    ------
    ConfigError
        While an ``ARRAYIO_*`` variable cannot be understood (and :func:`set` has not
        replaced its setting); the message names the variable and what it accepts.
    """
    if _invalid:
        raise ConfigError("; ".join(_invalid.values()))
    return _current


class _Restore:
    def __init__(self, previous: tuple[Settings, dict[str, str]]) -> None:
        self._previous = previous

    def __enter__(self) -> Settings:
        return _current

    def __exit__(self, *exc: Any) -> None:
        global _current, _invalid
        _current, _invalid = self._previous


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
    ConfigError
        For a value the setting refuses (an alignment that is not a power of two...).
    """
    global _current, _invalid
    known = [f.name for f in dataclasses.fields(Settings)]
    unknown = sorted(name for name in changes if name not in known)
    if unknown:
        raise TypeError(f"unknown arrayio setting(s) {unknown}; known: {known}")
    previous = (_current, _invalid)
    _current = dataclasses.replace(_current, **changes)
    _invalid = {name: message for name, message in _invalid.items() if name not in changes}
    return _Restore(previous)
