"""``arrayio bench``: a quick bandwidth sweep of every transfer tool here (the sweep itself is
:mod:`arrayio.cli._sweep`)."""

from __future__ import annotations

import argparse
import os
import sys

from ._common import EXIT_OK, CommandError, add_command, needs, print_json, size_list


def register(commands: argparse._SubParsersAction) -> None:
    bench = add_command(
        commands,
        "bench",
        "quick bandwidth sweep of every transfer tool here",
        "Measure every transfer tool that can run here (default parameters) "
        "and the dispatcher, reading (warm) and writing a scratch file in "
        "--dir at a few sizes; prints GB/s per tool and size, every write "
        "timed until its bytes are on the device. The dispatcher learns from "
        "these transfers too.",
    )
    bench.add_argument("--dir", default=".", help="where the scratch file goes (default: .)")
    bench.add_argument(
        "--sizes",
        type=size_list,
        default=None,
        metavar="LIST",
        help="comma-separated sizes (default: 256K,4M,64M)",
    )
    bench.add_argument("--repeats", type=int, default=3, help="samples per figure (median)")
    bench.add_argument(
        "--tools",
        type=_names,
        default=None,
        metavar="LIST",
        help="only these tools (default: every one available)",
    )
    bench.add_argument(
        "--cold", action="store_true", help="also cold reads (page cache evicted before each)"
    )
    bench.add_argument("--gpu", action="store_true", help="also GPU memory (needs CuPy)")
    bench.add_argument("--device", default="cuda:0", help="the GPU for --gpu")
    bench.add_argument(
        "--checksum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute CRC-32C on the way, as loads and saves do (default: on)",
    )
    bench.add_argument("--no-dispatcher", action="store_true", help="tools only")
    bench.add_argument("--png", metavar="FILE", help="also plot bandwidth against size")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.set_defaults(run=_cmd_bench)


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _cmd_bench(args: argparse.Namespace) -> int:
    from .. import tools
    from . import _sweep

    if args.png is not None:
        needs("matplotlib", "bench", "--png")
    if args.tools is not None:
        for name in args.tools:
            tools.tool_class(name)  # unknown names: UnknownToolError, a usage error
    if not os.path.isdir(args.dir):
        raise CommandError(f"{args.dir}: not a directory")
    memory = ["host", "cuda"] if args.gpu else ["host"]
    result = _sweep.run(
        args.dir,
        sizes=args.sizes or _sweep.DEFAULT_SIZES,
        memory=memory,
        caches=["warm", "cold"] if args.cold else ["warm"],
        tool_names=args.tools,
        dispatcher=not args.no_dispatcher,
        checksum=args.checksum,
        repeats=args.repeats,
        device=args.device,
        progress=args.progress,
    )
    if args.json:
        print_json(result.as_dict())
    else:
        print(result.table())
    if args.png is not None:
        result.plot().savefig(args.png, dpi=120)
        print(f"plot: {args.png}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK  # a tool refused here (O_DIRECT on tmpfs) is a finding, shown in the table
