"""``arrayio tune [DIR]``: teach the dispatcher this machine ahead of time
(:func:`arrayio.tune`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._common import EXIT_OK, CommandError, add_command, print_json, size_list


def register(commands: argparse._SubParsersAction) -> None:
    tune = add_command(
        commands,
        "tune",
        "teach the dispatcher this machine ahead of time",
        "Run transfers of several sizes on a scratch file in DIRECTORY until "
        "the dispatcher has learned the fastest tool for each; the table is "
        "saved under ARRAYIO_CACHE_DIR for later processes.",
    )
    tune.add_argument(
        "directory",
        metavar="DIRECTORY",
        nargs="?",
        default=".",
        help="on the storage to tune for (default: .)",
    )
    tune.add_argument("--device", default=None, help="cpu (default) or a GPU (cuda:0)")
    tune.add_argument(
        "--sizes",
        type=size_list,
        default=None,
        metavar="LIST",
        help="comma-separated sizes (default: 64K,1M,16M,256M)",
    )
    tune.add_argument(
        "--like",
        metavar="FILE",
        default=None,
        help="tune saving and loading the arrays of FILE (a checkpoint), "
        "instead of the sizes unless --sizes is given",
    )
    tune.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also tune cold reads (default: on)",
    )
    tune.add_argument(
        "--checksum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tune checksummed transfers, as loads verify (default: on)",
    )
    tune.add_argument(
        "--max-calls",
        type=_positive_int,
        default=None,
        metavar="N",
        help="at most N calls per context (default: 400); each --like call "
        "moves the whole file, and real use learns what is left",
    )
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    tune.set_defaults(run=_cmd_tune)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _cmd_tune(args: argparse.Namespace) -> int:
    import arrayio

    if not os.path.isdir(args.directory):
        raise CommandError(f"{args.directory}: not a directory")
    kwargs: dict[str, Any] = {
        "device": args.device,
        "verify": args.checksum,
        "caches": ["warm", "cold"] if args.cold else ["warm"],
    }
    if args.sizes is not None:
        kwargs["sizes"] = args.sizes
    if args.max_calls is not None:
        kwargs["max_calls"] = args.max_calls
    if args.like is not None:  # its arrays, as a program saves and loads them
        kwargs["arrays"] = arrayio.load(args.like, device=args.device)
        kwargs.setdefault("sizes", ())
    report = arrayio.tune(args.directory, **kwargs)
    if args.json:
        print_json(report.as_dict())
    else:
        print(report)
    return EXIT_OK
