"""What the ``arrayio`` subcommands share: exit codes, the error they report, the options and
help layout of every subcommand, JSON output, optional dependencies, and how a file's name
tells its format."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..runtime._units import parse_size

EXIT_OK = 0
EXIT_DATA = 1
EXIT_USAGE = 2
EXIT_DEPENDENCY = 3
EXIT_ENVIRONMENT = 4
EXIT_INTERRUPTED = 130

EPILOG = """exit codes:
  0    success
  1    the data failed: checksum mismatch, damaged or truncated file, data the target
       format cannot hold
  2    usage: bad arguments, missing input, existing output (see --overwrite), unknown key,
       a setting that cannot be understood (ARRAYIO_*)
  3    an optional dependency is missing (the message says what to install)
  4    the environment failed: permission denied, a read-only file system, a full disk
       or quota (the message names the path)
  130  interrupted
"""


class Formatter(argparse.HelpFormatter):
    """Wraps descriptions as usual, keeps the exit-code table as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit codes:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class CommandError(Exception):
    """An error the command reports as one line on stderr, exiting with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- the parser


def _shared_options() -> argparse.ArgumentParser:
    """The options every subcommand takes; :func:`arrayio.cli.main` acts on them."""
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show progress bars (default: on a terminal, for long work; also ARRAYIO_PROGRESS)",
    )
    shared.add_argument(
        "--debug", action="store_true", help="on error, show the traceback instead of one line"
    )
    return shared


def add_command(
    commands: argparse._SubParsersAction, name: str, help_text: str, description: str
) -> argparse.ArgumentParser:
    """Add the subcommand ``name`` to ``commands``, with the shared options and epilog.

    Parameters
    ----------
    commands
        The subparsers of the ``arrayio`` parser.
    name, help_text, description
        The subcommand's name, its line in ``arrayio --help`` and its own description.

    Returns
    -------
    argparse.ArgumentParser
        The subcommand's parser, for its own arguments.
    """
    return commands.add_parser(
        name,
        help=help_text,
        description=description,
        parents=[_shared_options()],
        epilog=EPILOG,
        formatter_class=Formatter,
    )


def size_list(text: str) -> list[int]:
    """``--sizes 256K,4M``: a list of byte counts, or an argparse error naming the bad one."""
    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# --------------------------------------------------------------------------- output


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def needs(module: str, extra: str, what: str) -> Any:
    """``module`` imported, or an exit-3 error saying which extra installs it for ``what``."""
    try:
        return __import__(module)
    except ImportError:
        raise CommandError(
            f"{what} needs {module}: pip install 'arrayio[{extra}]'", EXIT_DEPENDENCY
        ) from None


# --------------------------------------------------------------------------- formats

FORMATS = ("arrayio", "npy", "npz", "pt", "zarr")
ALIASES = {"safetensors": "arrayio", "container": "arrayio", "torch": "pt"}


def format_of(path: str, given: str | None) -> str:
    """The format ``given`` (aliases resolved), or the one ``path``'s name says."""
    if given is not None:
        return ALIASES.get(given, given)
    bare = path.rstrip("/")
    if os.path.isdir(bare) or bare.endswith(".zarr"):
        return "zarr"
    extension = os.path.splitext(bare)[1].lower()
    return {".npy": "npy", ".npz": "npz", ".pt": "pt", ".pth": "pt"}.get(extension, "arrayio")


def zarr_store_at(path: str) -> bool:
    return any(
        os.path.exists(os.path.join(path, name)) for name in ("zarr.json", ".zgroup", ".zarray")
    )


def readable(path: str, command: str) -> str:
    """``path``, or a usage error if it is a directory or its name says it is a format that
    arrayio does not open (it converts them)."""
    kind = format_of(path, None)
    if os.path.isdir(path) and not zarr_store_at(path):
        raise CommandError(f"{path}: is a directory")
    if kind not in ("arrayio", "npy", "npz"):
        what = {"pt": "a .pt file", "zarr": "a Zarr store"}[kind]
        raise CommandError(
            f"{path} is {what}; arrayio {command} reads arrayio / safetensors containers, "
            f".npy and .npz files: convert it first (arrayio convert {path} "
            f"{os.path.splitext(path.rstrip('/'))[0]}.safetensors)"
        )
    return path
