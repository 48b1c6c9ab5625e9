"""``arrayio explain [FILE]``: what the dispatcher learned, or would do for a file
(:func:`arrayio.explain`)."""

from __future__ import annotations

import argparse

from ._common import EXIT_OK, CommandError, add_command, print_json, readable


def register(commands: argparse._SubParsersAction) -> None:
    explain = add_command(
        commands,
        "explain",
        "what the dispatcher learned, or would do for a file",
        "Without FILE: every learned context, its chosen tool and each "
        "tool's measured bandwidth. With FILE: what loading it would use.",
    )
    explain.add_argument("file", metavar="FILE", nargs="?")
    explain.add_argument("--key", help="with FILE: only this array")
    explain.add_argument("--device", help="with FILE: where the load would go (cpu, cuda:0)")
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(run=_cmd_explain)


def _cmd_explain(args: argparse.Namespace) -> int:
    import arrayio

    if args.file is None and (args.key is not None or args.device is not None):
        raise CommandError("--key and --device need a FILE")
    path = None if args.file is None else readable(args.file, "explain")
    report = arrayio.explain(path, key=args.key, device=args.device)
    if args.json:
        print_json(report.as_dict())
    else:
        print(report)
    return EXIT_OK
