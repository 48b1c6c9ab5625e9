"""The ``arrayio`` command: look into files, check them, convert them, and measure and tune
this machine's transfer tools.

::

    arrayio info FILE [--json]              keys, dtypes, shapes, sizes, metadata, checksums
    arrayio verify FILE [--strict]          check every array's CRC-32C
    arrayio clean [DIR...] [--dry-run]      remove temporaries that killed saves left
    arrayio convert SRC DST                 .npy/.npz/.safetensors/.pt/Zarr <-> arrayio
    arrayio bench [--sizes 1M,64M] [--png]  quick bandwidth sweep of every tool here
    arrayio tune [DIR] [--device cuda:0] [--like FILE] [--max-calls N]
                                            teach the dispatcher this machine ahead of time
    arrayio explain [FILE] [--json]         what the dispatcher learned (or would do)

Exit codes (also in ``arrayio --help``):

0
    success
1
    the data failed: a checksum mismatch, a damaged, truncated or unreadable file, data
    the target format cannot hold (``convert``)
2
    usage: bad arguments, a missing input, an output that exists (without ``--overwrite``),
    an unknown key, a setting that cannot be understood (``ARRAYIO_*``)
3
    an optional dependency is missing (torch, zarr, matplotlib, ml_dtypes, tqdm); the
    message says what to install
4
    the environment failed, not the data: permission denied, a read-only file system, a
    full disk or quota; the message names the path
130
    interrupted (Ctrl-C)

Errors are one line on stderr naming the file and the problem, never a traceback
(``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from .. import config, errors
from . import _bench, _clean, _convert, _explain, _failures, _info, _tune, _verify
from ._common import (
    EPILOG,
    EXIT_DATA,
    EXIT_DEPENDENCY,
    EXIT_ENVIRONMENT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Formatter,
    needs,
)

__all__ = [
    "EXIT_DATA",
    "EXIT_DEPENDENCY",
    "EXIT_ENVIRONMENT",
    "EXIT_OK",
    "EXIT_USAGE",
    "CommandError",
    "main",
]

# In the order ``arrayio --help`` lists them.
_COMMANDS = (_info, _verify, _clean, _convert, _bench, _tune, _explain)


def build_parser() -> argparse.ArgumentParser:
    """The ``arrayio`` argument parser (for documentation tools and tests)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="arrayio",
        description="Look into, check and convert array files; measure and "
        "tune this machine's transfer tools.",
        epilog=EPILOG,
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"arrayio {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``arrayio`` command; return its exit code (see the module docstring).

    Parameters
    ----------
    argv
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 success, 1 data problem, 2 usage error, 3 missing optional dependency, 4 the
        environment (permissions, a read-only or full file system), 130 interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version (0) or a usage error (2)
        return int(exit_.code or 0)
    name = f"arrayio {args.command}"
    try:
        if args.progress:
            needs("tqdm", "progress", "--progress")
        with (
            config.set(progress=args.progress)
            if args.progress is not None
            else contextlib.nullcontext()
        ):
            return args.run(args)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `arrayio info x | head`: the reader left; nothing to report
        # Python's own advice: point stdout at devnull so the flush at exit cannot fail.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (errors.ArrayioError, OSError, ImportError, CommandError) as error:
        # What users cause (and arrayio reports as such); anything else is a bug in arrayio,
        # and its traceback is what a bug report needs.
        if args.debug:
            raise
        subject = next(
            (
                getattr(args, attribute)
                for attribute in ("file", "src", "directory")
                if getattr(args, attribute, None) is not None
            ),
            None,
        )
        print(f"{name}: {_failures.message(error, subject)}", file=sys.stderr)
        return _failures.exit_code(error)
