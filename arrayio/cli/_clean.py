"""``arrayio clean [DIR...]``: remove the temporaries that saves killed midway left behind."""

from __future__ import annotations

import argparse
import os
import sys

from ..integrity import _atomic
from ..runtime._units import format_count
from ._common import EXIT_OK, CommandError, add_command


def register(commands: argparse._SubParsersAction) -> None:
    clean = add_command(
        commands,
        "clean",
        "remove what saves killed midway left behind",
        "Remove, under each DIR (recursively, not following links), the hidden "
        "temporary files (.NAME.arrayio-tmp-PID-...) of saves and Zarr chunk "
        "writes whose process died before finishing (SIGKILL, power loss). A "
        "temporary a live process is still writing is never touched. The next "
        "save into a directory does the same for that directory.",
    )
    clean.add_argument(
        "directories",
        metavar="DIR",
        nargs="*",
        default=["."],
        help="where to look (default: the current directory)",
    )
    clean.add_argument(
        "-n", "--dry-run", action="store_true", help="list what would be removed, remove nothing"
    )
    clean.set_defaults(run=_cmd_clean)


def _cmd_clean(args: argparse.Namespace) -> int:
    removed: list[str] = []
    for directory in args.directories:
        if not os.path.isdir(directory):
            raise CommandError(f"{directory}: no such directory")
        removed += _atomic.remove_stale_temporaries_below(directory, dry_run=args.dry_run)
    for path in removed:
        print(path)
    freed = format_count(len(removed), "temporary file")
    print(
        f"{'would remove' if args.dry_run else 'removed'} {freed} left by dead processes",
        file=sys.stderr,
    )
    return EXIT_OK
