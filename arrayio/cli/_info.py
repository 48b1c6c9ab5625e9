"""``arrayio info FILE``: what a file holds, read from its header alone."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from ..runtime._units import format_bytes, format_count
from ._common import EXIT_OK, add_command, print_json, readable


def register(commands: argparse._SubParsersAction) -> None:
    info = add_command(
        commands,
        "info",
        "what a file holds",
        "Keys, dtypes, shapes, sizes, "
        "offsets, metadata and checksum status of an arrayio / safetensors "
        "container or .npy file. Reads only the header.",
    )
    info.add_argument("file", metavar="FILE")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(run=_cmd_info)


def _cmd_info(args: argparse.Namespace) -> int:
    info = _describe(args.file)
    if args.json:
        print_json(info)
        return EXIT_OK
    origin = f", saved from {info['framework']}" if info["framework"] else ""
    count = format_count(len(info["arrays"]), "array")
    print(
        f"{info['path']}: {info['format']}, {count}, "
        f"{format_bytes(info['nbytes'])} (file {format_bytes(info['file_bytes'])})"
        f"{origin}"
    )
    sums = info["checksums"]
    header = "the header and " if sums["header"] else ""
    print(
        f"checksums: CRC-32C on {header}{sums['present']} of "
        f"{format_count(sums['arrays'], 'array')}"
    )
    if info["metadata"]:
        print("metadata:")
        for name, value in info["metadata"].items():
            print(f"  {name} = {value if isinstance(value, str) else json.dumps(value)}")
    if info["arrays"]:
        rows = [
            (
                a["key"],
                a["dtype"],
                _shape(a["shape"]),
                format_bytes(a["nbytes"]),
                str(a["offset"]),
                a["crc32c"] or "-",
            )
            for a in info["arrays"]
        ]
        print(_columns(("key", "dtype", "shape", "size", "offset", "crc32c"), rows, {3, 4}))
    return EXIT_OK


def _describe(path: str) -> dict[str, Any]:
    import arrayio

    with arrayio.open(readable(path, "info")) as reader:
        arrays = [
            {
                "key": info.key,
                "dtype": info.dtype,
                "shape": list(info.shape),
                "nbytes": info.nbytes,
                "offset": info.file_offset,
                "crc32c": info.crc32c,
            }
            for info in reader.arrays.values()
        ]
        return {
            "path": path,
            "format": reader.format,
            "framework": reader.framework,
            "file_bytes": os.path.getsize(path),
            "nbytes": reader.nbytes,
            "metadata": reader.metadata,
            "arrays": arrays,
            "checksums": {
                "present": sum(a["crc32c"] is not None for a in arrays),
                "arrays": len(arrays),
                "header": reader.header_checked,
            },
        }


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])
