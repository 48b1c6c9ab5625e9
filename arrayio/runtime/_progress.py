"""Progress bars (tqdm) for long saves, loads, conversions and benchmarks.

One hook, :func:`bar`: a context manager that yields ``advance(n)``, to be called as work
is done (bytes, or benchmark cases). Whether a bar appears is decided once, when the
operation starts (:func:`delay_for`):

* ``progress=False`` (or ``ARRAYIO_PROGRESS=0``): never.
* ``progress=None`` (the default, ``ARRAYIO_PROGRESS`` unset or ``auto``): only where someone
  watches, a terminal (stderr is a TTY) or a Jupyter kernel.
* ``progress=True`` (or ``ARRAYIO_PROGRESS=1``): also in logs and CI.

and then only for long operations: a bar appears at once for 256 MiB or more, otherwise only
once the operation has lasted 2 seconds (tqdm's ``delay``), so quick ones print nothing.

tqdm is optional (``pip install 'arrayio[progress]'``). Without it, automatic bars are
silently skipped; a bar asked for with ``progress=True`` raises
:class:`~arrayio.errors.FrameworkNotAvailableError`, and one asked for through the
``ARRAYIO_PROGRESS=1`` setting warns once (a setting should not break every save).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .. import config
from ..errors import FrameworkNotAvailableError

__all__ = ["INSTANT_BYTES", "SLOW_SECONDS", "bar", "delay_for", "interactive"]

INSTANT_BYTES = 256 << 20  # byte operations this large show a bar from the start
SLOW_SECONDS = 2.0  # smaller ones (and counts of cases) only once they last this long

_INSTALL_HINT = "progress bars need tqdm: pip install 'arrayio[progress]' (or tqdm)"
_warned_missing = False


def _noop(n: int) -> None:
    pass


def in_jupyter() -> bool:
    """Whether this process is a Jupyter kernel (an IPython kernel, not a terminal IPython)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # noqa: BLE001 - an IPython too old or broken: not Jupyter
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def interactive() -> bool:
    """Whether someone is likely watching: stderr is a terminal, or this is a Jupyter kernel."""
    stream = sys.stderr
    try:
        tty = stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        tty = False
    return tty or in_jupyter()


def delay_for(total: int, *, unit: str = "B", progress: bool | None = None) -> float | None:
    """Seconds after which a bar for this operation should appear, or None for no bar.

    Parameters
    ----------
    total
        The operation's size in ``unit``.
    unit
        ``"B"`` (bytes: large operations show at once) or a count (``"case"``...: only the
        time threshold applies).
    progress
        ``True``, ``False`` or ``None`` (automatic); ``None`` defers to the ``progress``
        setting (``ARRAYIO_PROGRESS``).

    Returns
    -------
    float or None
        ``0.0`` to show at once, :data:`SLOW_SECONDS` to show only if it lasts that long.
    """
    if progress is None:
        progress = config.get().progress
    if progress is False or total <= 0:
        return None
    if progress is None and not interactive():
        return None
    return 0.0 if unit == "B" and total >= INSTANT_BYTES else SLOW_SECONDS


def _tqdm_class(asked: bool, from_setting: bool) -> Any:
    """tqdm's notebook bar in Jupyter when ipywidgets is there, its text bar otherwise."""
    global _warned_missing
    try:
        from tqdm import std
    except ImportError:
        if asked and not from_setting:
            raise FrameworkNotAvailableError(_INSTALL_HINT) from None
        if asked and not _warned_missing:
            _warned_missing = True
            warnings.warn(
                f"ARRAYIO_PROGRESS is on but {_INSTALL_HINT}", RuntimeWarning, stacklevel=4
            )
        return None
    if in_jupyter():
        # What tqdm.auto does, without its warning when ipywidgets is missing: text bars
        # render in Jupyter too.
        try:
            import ipywidgets  # noqa: F401
            from tqdm import notebook
        except ImportError:
            return std.tqdm
        return notebook.tqdm
    return std.tqdm


@contextlib.contextmanager
def bar(
    total: int, *, desc: str, unit: str = "B", progress: bool | None = None
) -> Iterator[Callable[[int], None]]:
    """A progress bar for an operation of ``total`` units; yields ``advance(n)``.

    Parameters
    ----------
    total
        Bytes (``unit="B"``) or a count of steps.
    desc
        What is being done, e.g. ``"saving ckpt.safetensors"``.
    unit
        ``"B"`` for bytes (shown scaled, KiB/MiB...), else the name of one step.
    progress
        ``True``/``False`` to show or hide it; ``None`` follows the setting (see the module
        docstring).

    Yields
    ------
    Callable[[int], None]
        Call with the units done since the last call; a no-op when no bar is shown.

    Raises
    ------
    FrameworkNotAvailableError
        If ``progress=True`` was passed and tqdm is not installed.
    """
    delay = delay_for(total, unit=unit, progress=progress)
    if delay is None:
        yield _noop
        return
    tqdm = _tqdm_class(
        True if progress else config.get().progress is True, from_setting=progress is None
    )
    if tqdm is None:
        yield _noop
        return
    scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    # A finished bar stays in a notebook's output; on a terminal it makes room again.
    with tqdm(
        total=total,
        desc=desc,
        unit=unit,
        delay=delay,
        leave=in_jupyter(),
        file=sys.stderr,
        dynamic_ncols=True,
        **scaled,
    ) as progress_bar:
        yield progress_bar.update
