"""``arrayio verify FILE``: read every array and check the CRC-32C its file recorded."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import errors
from ..dispatch import _transfer
from ..runtime import _progress
from ..runtime._units import format_bytes, format_count
from ._common import EXIT_DATA, EXIT_OK, CommandError, add_command, readable

_VERIFY_CHUNK = 64 << 20  # verify reads in pieces of this size: memory stays bounded


def register(commands: argparse._SubParsersAction) -> None:
    verify = add_command(
        commands,
        "verify",
        "check every array's checksum",
        "Read every array and check its CRC-32C against the one recorded "
        "when the file was written. Exits 1 naming each damaged array. A "
        ".npy file has no place for a checksum: its header and size are "
        "checked.",
    )
    verify.add_argument("file", metavar="FILE")
    verify.add_argument(
        "--strict",
        action="store_true",
        help="also fail (exit 1) when arrays carry no checksum (.npy files, "
        "safetensors files not written by arrayio)",
    )
    verify.add_argument("-v", "--verbose", action="store_true", help="list every array")
    verify.set_defaults(run=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    import arrayio

    from ..arrays._buffers import aligned_empty

    failed: list[str] = []
    unchecked: list[str] = []
    with arrayio.open(readable(args.file, "verify")) as reader:
        if reader.format in ("npy", "npz"):  # opening checked the headers and sizes
            return _verify_numpy_file(args, reader.format)
        # arrayio records its metadata in every file it writes: its absence is a fact.
        why = (
            "no arrayio metadata: written by another safetensors writer"
            if reader.framework is None
            else "saved without checksums"
        )
        arrays = list(reader.arrays.values())
        checked = [info for info in arrays if info.crc32c is not None]
        unchecked = [info.key for info in arrays if info.crc32c is None]
        largest = max((info.nbytes for info in checked), default=0)
        buffer = aligned_empty(max(1, min(largest, _VERIFY_CHUNK)))
        total = sum(info.nbytes for info in checked)
        with _progress.bar(total, desc=f"verifying {args.file}") as advance:
            for info in checked:
                try:
                    crc = _crc_of(reader.fd, reader.path, info.file_offset, info.nbytes, buffer)
                except errors.TruncatedFileError as error:
                    print(f"{args.file}: array {info.key!r}: {error}", file=sys.stderr)
                    failed.append(info.key)
                    continue
                if f"{crc:08x}" != info.crc32c:
                    print(
                        f"{args.file}: array {info.key!r}: CRC-32C {crc:08x}, the file "
                        f"recorded {info.crc32c}: the data is damaged",
                        file=sys.stderr,
                    )
                    failed.append(info.key)
                elif args.verbose:
                    print(f"ok  {info.key}")
                advance(info.nbytes)
    if unchecked and checked:
        names = ", ".join(repr(k) for k in unchecked[:5]) + (", ..." if len(unchecked) > 5 else "")
        print(
            f"{args.file}: not verified, no checksum recorded ({why}): {names}",
            file=sys.stderr if args.strict else sys.stdout,
        )
    if failed:
        raise CommandError(
            f"{args.file}: {len(failed)} of "
            f"{format_count(len(checked), 'checksummed array')} failed "
            f"verification: {', '.join(map(repr, failed))}",
            EXIT_DATA,
        )
    if unchecked and args.strict:
        verb = "carries" if len(unchecked) == 1 else "carry"
        raise CommandError(
            f"{args.file}: --strict and {format_count(len(unchecked), 'array')} {verb} no checksum",
            EXIT_DATA,
        )
    if not checked:
        print(f"{args.file}: header and sizes valid; no checksums to verify ({why})")
        return EXIT_OK
    header = "the header and " if reader.header_checked else ""
    print(
        f"{args.file}: OK, {header}{len(checked)} of {format_count(len(arrays), 'array')} "
        f"verified ({format_bytes(sum(info.nbytes for info in checked))}, CRC-32C)"
    )
    return EXIT_OK


def _crc_of(fd: int, path: str, start: int, nbytes: int, buffer: np.ndarray) -> int:
    from ..integrity._checksum import combine

    crc = 0
    for offset in range(0, nbytes, buffer.nbytes):
        piece = buffer[: min(buffer.nbytes, nbytes - offset)]
        part = _transfer.read_into(fd, start + offset, piece, path=path, with_checksum=True)
        crc = combine(crc, part or 0, piece.nbytes)
    return crc


def _verify_numpy_file(args: argparse.Namespace, kind: str) -> int:
    """NumPy's formats have no place for arrayio's checksums: say what was checked."""
    what = "header and size" if kind == "npy" else "members' headers and sizes"
    if args.strict:
        raise CommandError(
            f"{args.file}: --strict: .{kind} has no place for a checksum; "
            f"{what} valid, data not verified",
            EXIT_DATA,
        )
    print(
        f"{args.file}: .{kind} {what} valid; no checksums to verify (.{kind} has no place for one)"
    )
    return EXIT_OK
