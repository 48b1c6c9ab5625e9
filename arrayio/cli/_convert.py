"""``arrayio convert SRC DST``: between .npy, .npz, .safetensors, .pt, Zarr and arrayio; the
checks on SRC and DST before anything is read (``_convert_formats`` reads and writes)."""

from __future__ import annotations

import argparse
import os

from .. import errors
from ..runtime._units import format_count
from ._common import (
    ALIASES,
    EXIT_OK,
    FORMATS,
    CommandError,
    add_command,
    format_of,
    needs,
    zarr_store_at,
)
from ._convert_formats import Source, read_source, write_target


def register(commands: argparse._SubParsersAction) -> None:
    convert = add_command(
        commands,
        "convert",
        "convert between .npy, .npz, .safetensors, .pt, Zarr and arrayio",
        "Convert SRC to DST, formats told by extension (.npy, .npz, .pt/.pth, a directory "
        "or .zarr for Zarr, anything else an arrayio container, which is a safetensors "
        "file) or by --from/--to. dtypes are kept (bfloat16 and float8 need ml_dtypes, "
        "and .npy, .npz and Zarr cannot hold them); the pytree structure and metadata are "
        "kept where the target can hold them. .pt files are read with "
        "torch.load(weights_only=True). Arrays are held in memory.",
    )
    convert.add_argument("src", metavar="SRC")
    convert.add_argument("dst", metavar="DST")
    convert.add_argument(
        "--from",
        dest="source_format",
        choices=[*FORMATS, *ALIASES],
        help="the source format (default: from SRC's name)",
    )
    convert.add_argument(
        "--to", choices=[*FORMATS, *ALIASES], help="the target format (default: from DST's name)"
    )
    convert.add_argument("--key", help="convert only this array (e.g. into a .npy)")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.set_defaults(run=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    src, dst = args.src, args.dst
    source_kind, target_kind = format_of(src, args.source_format), format_of(dst, args.to)
    _check_paths(src, dst, target_kind, args.overwrite)
    progress = args.progress
    if target_kind == "pt":
        needs("torch", "torch", "writing .pt files")
    # Into .pt, arrayio loads torch tensors directly (bfloat16 and float8 included).
    source = read_source(src, source_kind, progress, "torch" if target_kind == "pt" else None)
    if args.key is not None:
        if args.key not in source.arrays:
            raise errors.KeyNotFoundError(
                f"{src}: no array {args.key!r} (arrays: {', '.join(list(source.arrays)[:8])})"
            )
        source = Source({args.key: source.arrays[args.key]}, source.metadata)

    try:
        write_target(source, src, dst, target_kind, progress)
    except errors.ArrayioError as error:
        if dst in str(error):
            raise
        raise type(error)(f"{dst}: {error}") from None  # name the file at fault
    except OSError as error:  # on a temporary file beside DST, or inside it (Zarr): DST's
        if error.errno is None or error.strerror is None:
            raise
        raise OSError(error.errno, error.strerror, dst) from error
    print(
        f"{src} ({source_kind}) -> {dst} ({target_kind}): "
        f"{format_count(len(source.arrays), 'array')}"
    )
    return EXIT_OK


def _check_paths(src: str, dst: str, target_kind: str, overwrite: bool) -> None:
    """A usage error for a source that is missing or is the destination, or a destination
    that exists (without ``--overwrite``) or is a directory the target cannot replace."""
    if os.path.abspath(src.rstrip("/")) == os.path.abspath(dst.rstrip("/")):
        raise CommandError(f"{dst}: the destination is the source")
    if not os.path.exists(src):
        raise CommandError(f"{src}: no such file or directory")
    if os.path.exists(dst) and not overwrite:
        raise CommandError(f"{dst} exists: pass --overwrite to replace it")
    if target_kind == "zarr" and os.path.isdir(dst) and os.listdir(dst) and not zarr_store_at(dst):
        raise CommandError(f"{dst} is a directory that is not a Zarr store: refusing to replace it")
    if target_kind != "zarr" and os.path.isdir(dst):
        raise CommandError(f"{dst} is a directory")
