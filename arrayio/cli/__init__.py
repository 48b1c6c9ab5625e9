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
import errno
import functools
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .. import config, errors
from ..arrays import _dtypes
from ..dispatch import _transfer
from ..integrity import _atomic
from ..runtime import _progress
from ..runtime._units import format_bytes, format_count, parse_size

__all__ = ["EXIT_DATA", "EXIT_DEPENDENCY", "EXIT_ENVIRONMENT", "EXIT_OK", "EXIT_USAGE",
           "CommandError", "main"]

EXIT_OK = 0
EXIT_DATA = 1
EXIT_USAGE = 2
EXIT_DEPENDENCY = 3
EXIT_ENVIRONMENT = 4
EXIT_INTERRUPTED = 130

# What the machine refuses, whatever the file holds: permissions, a read-only file system,
# no space (or quota) left.
_ENVIRONMENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC,
                                 errno.EDQUOT})

_EPILOG = """exit codes:
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

_VERIFY_CHUNK = 64 << 20  # verify reads in pieces of this size: memory stays bounded


class _Formatter(argparse.HelpFormatter):
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


# --------------------------------------------------------------------------- output


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


# --------------------------------------------------------------------------- info


def _readable(path: str, command: str) -> str:
    """``path``, or a usage error if it is a directory or its name says it is a format that
    arrayio does not open (it converts them)."""
    kind = _format_of(path, None)
    if os.path.isdir(path) and not _zarr_store_at(path):
        raise CommandError(f"{path}: is a directory")
    if kind not in ("arrayio", "npy"):
        what = {"npz": "an .npz file", "pt": "a .pt file", "zarr": "a Zarr store"}[kind]
        raise CommandError(
            f"{path} is {what}; arrayio {command} reads arrayio / safetensors containers and "
            f".npy files: convert it first (arrayio convert {path} "
            f"{os.path.splitext(path.rstrip('/'))[0]}.safetensors)")
    return path


def _describe(path: str) -> dict[str, Any]:
    import arrayio

    with arrayio.open(_readable(path, "info")) as reader:
        arrays = [{"key": info.key, "dtype": info.dtype, "shape": list(info.shape),
                   "nbytes": info.nbytes, "offset": info.file_offset, "crc32c": info.crc32c}
                  for info in reader.arrays.values()]
        return {"path": path, "format": reader.format, "framework": reader.framework,
                "file_bytes": os.path.getsize(path), "nbytes": reader.nbytes,
                "metadata": reader.metadata, "arrays": arrays,
                "checksums": {"present": sum(a["crc32c"] is not None for a in arrays),
                              "arrays": len(arrays)}}


def _cmd_info(args: argparse.Namespace) -> int:
    info = _describe(args.file)
    if args.json:
        _print_json(info)
        return EXIT_OK
    origin = f", saved from {info['framework']}" if info["framework"] else ""
    count = format_count(len(info["arrays"]), "array")
    print(f"{info['path']}: {info['format']}, {count}, "
          f"{format_bytes(info['nbytes'])} (file {format_bytes(info['file_bytes'])})"
          f"{origin}")
    sums = info["checksums"]
    print(f"checksums: CRC-32C on {sums['present']} of {format_count(sums['arrays'], 'array')}")
    if info["metadata"]:
        print("metadata:")
        for name, value in info["metadata"].items():
            print(f"  {name} = {value if isinstance(value, str) else json.dumps(value)}")
    if info["arrays"]:
        rows = [(a["key"], a["dtype"], _shape(a["shape"]), format_bytes(a["nbytes"]),
                 str(a["offset"]), a["crc32c"] or "-") for a in info["arrays"]]
        print(_columns(("key", "dtype", "shape", "size", "offset", "crc32c"), rows, {3, 4}))
    return EXIT_OK


# --------------------------------------------------------------------------- verify


def _crc_of(fd: int, path: str, start: int, nbytes: int, buffer: np.ndarray) -> int:
    from ..integrity._checksum import combine

    crc = 0
    for offset in range(0, nbytes, buffer.nbytes):
        piece = buffer[: min(buffer.nbytes, nbytes - offset)]
        part = _transfer.read_into(fd, start + offset, piece, path=path, with_checksum=True)
        crc = combine(crc, part or 0, piece.nbytes)
    return crc


def _cmd_verify(args: argparse.Namespace) -> int:
    import arrayio

    from ..arrays._buffers import aligned_empty

    failed: list[str] = []
    unchecked: list[str] = []
    with arrayio.open(_readable(args.file, "verify")) as reader:
        if reader.format == "npy":  # opening checked its header and size
            return _verify_npy(args)
        # arrayio records its metadata in every file it writes: its absence is a fact.
        why = ("no arrayio metadata: written by another safetensors writer"
               if reader.framework is None else "saved without checksums")
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
                    print(f"{args.file}: array {info.key!r}: CRC-32C {crc:08x}, the file "
                          f"recorded {info.crc32c}: the data is damaged", file=sys.stderr)
                    failed.append(info.key)
                elif args.verbose:
                    print(f"ok  {info.key}")
                advance(info.nbytes)
    if unchecked and checked:
        names = ", ".join(repr(k) for k in unchecked[:5]) + (", ..." if len(unchecked) > 5
                                                             else "")
        print(f"{args.file}: not verified, no checksum recorded ({why}): {names}",
              file=sys.stderr if args.strict else sys.stdout)
    if failed:
        raise CommandError(f"{args.file}: {len(failed)} of "
                           f"{format_count(len(checked), 'checksummed array')} failed "
                           f"verification: {', '.join(map(repr, failed))}", EXIT_DATA)
    if unchecked and args.strict:
        verb = "carries" if len(unchecked) == 1 else "carry"
        raise CommandError(f"{args.file}: --strict and {format_count(len(unchecked), 'array')} "
                           f"{verb} no checksum", EXIT_DATA)
    if not checked:
        print(f"{args.file}: header and sizes valid; no checksums to verify ({why})")
        return EXIT_OK
    print(f"{args.file}: OK, {len(checked)} of {format_count(len(arrays), 'array')} verified "
          f"({format_bytes(sum(info.nbytes for info in checked))}, CRC-32C)")
    return EXIT_OK


def _cmd_clean(args: argparse.Namespace) -> int:
    removed: list[str] = []
    for directory in args.directories:
        if not os.path.isdir(directory):
            raise CommandError(f"{directory}: no such directory")
        removed += _atomic.remove_stale_temporaries_below(directory, dry_run=args.dry_run)
    for path in removed:
        print(path)
    freed = format_count(len(removed), "temporary file")
    print(f"{'would remove' if args.dry_run else 'removed'} {freed} left by dead processes",
          file=sys.stderr)
    return EXIT_OK


def _verify_npy(args: argparse.Namespace) -> int:
    if args.strict:
        raise CommandError(f"{args.file}: --strict: .npy has no place for a checksum; header "
                           "and size valid, data not verified", EXIT_DATA)
    print(f"{args.file}: .npy header and size valid; no checksums to verify (.npy has no "
          "place for one)")
    return EXIT_OK


# --------------------------------------------------------------------------- convert

FORMATS = ("arrayio", "npy", "npz", "pt", "zarr")
_ALIASES = {"safetensors": "arrayio", "container": "arrayio", "torch": "pt"}


def _format_of(path: str, given: str | None) -> str:
    if given is not None:
        return _ALIASES.get(given, given)
    bare = path.rstrip("/")
    if os.path.isdir(bare) or bare.endswith(".zarr"):
        return "zarr"
    extension = os.path.splitext(bare)[1].lower()
    return {".npy": "npy", ".npz": "npz", ".pt": "pt", ".pth": "pt"}.get(extension, "arrayio")


def _needs(module: str, extra: str, what: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise CommandError(f"{what} needs {module}: pip install 'arrayio[{extra}]'",
                           EXIT_DEPENDENCY) from None


def _check_dtype(array: Any, where: str) -> None:
    """Refuse a dtype arrayio does not store, naming the file and key."""
    _dtypes.dtype_of(array.dtype, where=where)


def _detached(x: Any) -> Any:
    """A tensor from torch.load, detached from autograd (DLPack refuses ``requires_grad``)."""
    return x.detach() if type(x).__module__.startswith("torch") and hasattr(x, "detach") else x


def _nest(flat: dict[str, Any], separator: str) -> dict[str, Any]:
    """{"a/b": x} -> {"a": {"b": x}}."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, name = path.split(separator)
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return tree


class _Source:
    """What a source file holds: a pytree (or one array) and its metadata."""

    def __init__(self, tree: Any, metadata: dict[str, Any]) -> None:
        from ..arrays._frameworks import is_array
        from ..arrays._pytree import leaves_by_key

        self.tree = tree
        self.metadata = metadata
        leaves = leaves_by_key(tree)
        self.arrays = {key: x for key, x in leaves.items() if is_array(x)}
        self.constants = [key for key, x in leaves.items() if not is_array(x)]


def _read_source(path: str, kind: str, progress: bool | None, like: str | None) -> _Source:
    import arrayio

    if kind in ("arrayio", "npy"):
        with arrayio.open(path) as reader:
            return _Source(reader.load(like=like, progress=progress), dict(reader.metadata))
    if kind == "npz":
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (ValueError, OSError, zipfile.BadZipFile) as error:
            raise errors.FormatError(f"{path}: not a readable .npz file: {error}") from None
        for name, array in arrays.items():
            _check_dtype(array, f"{path}: array {name!r}: ")
        return _Source(arrays, {})
    if kind == "pt":
        torch = _needs("torch", "torch", "reading .pt files")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - torch raises many kinds (pickle, zip...)
            raise errors.FormatError(f"{path}: torch.load(weights_only=True) failed: "
                                     f"{str(error).splitlines()[0]}") from None
        return _Source(_map_arrays(obj, _detached), {})
    if kind == "zarr":
        zarr = _needs("zarr", "zarr", "reading Zarr")
        try:
            node = zarr.open(path, mode="r")
        except Exception as error:  # noqa: BLE001 - zarr's errors for a non-store vary
            raise errors.FormatError(f"{path}: not a Zarr array or group: {error}") from None
        if isinstance(node, zarr.Array):
            array = node[...]
            _check_dtype(array, f"{path}: ")
            return _Source(array, {})
        arrays = {}
        for name, member in node.members(max_depth=None):
            if isinstance(member, zarr.Array):
                arrays[name] = member[...]
                _check_dtype(arrays[name], f"{path}: array {name!r}: ")
        return _Source(_nest(arrays, "/"), dict(node.attrs))
    raise CommandError(f"unknown format {kind!r}; known: {', '.join(FORMATS)}")


def _arrays_only(source: _Source, kind: str) -> dict[str, Any]:
    """The source's arrays by key, with a note on stderr for what ``kind`` cannot hold."""
    if source.constants:
        names = ", ".join(source.constants[:5]) + (", ..." if len(source.constants) > 5 else "")
        print(f"arrayio convert: note: {kind} holds arrays only; not converted: {names}",
              file=sys.stderr)
    if kind in ("npz", "npy"):
        _note_metadata(source, kind)
    return source.arrays


def _note_metadata(source: _Source, kind: str) -> None:
    """A note on stderr naming the metadata that ``kind`` has no place for."""
    if source.metadata:
        print(f"arrayio convert: note: {kind} holds no metadata; not converted: "
              f"{', '.join(source.metadata)}", file=sys.stderr)


@contextlib.contextmanager
def _atomic_directory(path: str) -> Iterator[str]:
    """A temporary directory beside ``path``, moved over it on success: a failed conversion
    leaves no half-written output, and any previous one intact. (Files go through
    :func:`arrayio.integrity._atomic.atomic_write`.)"""
    parent = os.path.dirname(os.path.abspath(path))
    prefix = ".arrayio-convert-"
    temporary = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o777 & ~umask)  # as mkdir would make it (mkdtemp gives 0o700)
    try:
        yield temporary
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=prefix, suffix=".old", dir=parent)
            os.replace(path, os.path.join(old, "previous"))
            os.replace(temporary, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _host_numpy(array: Any) -> np.ndarray:
    """A NumPy view of a CPU array of any framework (torch's bfloat16 included)."""
    if isinstance(array, np.ndarray):
        return array
    from ..arrays._frameworks import export

    exported = export(array)
    return exported.data.view(_dtypes.numpy_dtype(exported.dtype)).reshape(exported.shape)


def _write_npz(flat: dict[str, Any], dst: str, progress: bool | None) -> None:
    from ..api import _save

    # Through save's own .npz writer, also for a destination named otherwise (--to npz).
    _save.write_prepared(_save.prepare_npz(dst, flat, None), progress=progress)


def _write_pt(source: _Source, dst: str) -> None:
    torch = _needs("torch", "torch", "writing .pt files")
    # A .pt file is one pickled object: keeping the metadata would mean a key of the user's
    # tree (or a wrapper around it) that torch.load's callers do not expect.
    _note_metadata(source, "pt")

    def to_torch(x: Any) -> Any:
        from ..arrays._frameworks import is_array

        if is_array(x) and not isinstance(x, torch.Tensor):
            return torch.from_numpy(_host_numpy(x).copy(order="C"))  # 0-d stays 0-d
        return x

    tree = _map_arrays(source.tree, to_torch)
    with _atomic.atomic_write(dst) as fd, os.fdopen(os.dup(fd), "wb") as file:
        try:
            torch.save(tree, file)
        except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, pickle errors...
            raise errors.UnsupportedObjectError(f"{dst}: torch.save failed: {error}") from None


def _map_arrays(tree: Any, function: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _map_arrays(v, function) for k, v in tree.items()}
    if isinstance(tree, list | tuple) and not hasattr(type(tree), "_fields"):
        items = [_map_arrays(v, function) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return function(tree)


def _zarr_store_at(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name))
               for name in ("zarr.json", ".zgroup", ".zarray"))


def _write_zarr(source: _Source, dst: str, progress: bool | None) -> None:
    zarr = _needs("zarr", "zarr", "writing Zarr")
    from ..arrays._frameworks import is_array

    arrays = {key: _host_numpy(a) for key, a in _arrays_only(source, "zarr").items()}
    total = sum(a.nbytes for a in arrays.values())
    with _atomic_directory(dst) as temporary, _progress.bar(
            total, desc=f"writing {dst}", progress=progress) as advance:
        if is_array(source.tree):  # one array: a Zarr array, not a group
            nodes = [("", next(iter(arrays.values())))]
            create = functools.partial(zarr.create_array, temporary)
        else:
            root = zarr.open_group(temporary, mode="w")
            if source.metadata:
                root.attrs.update(source.metadata)
            nodes = list(arrays.items())
            create = root.create_array
        for key, array in nodes:
            try:
                if key:
                    create(key.replace(".", "/"), data=array)
                else:
                    create(data=array)
            except Exception as error:  # noqa: BLE001 - zarr's errors: ValueError for a dtype,
                # ContainsArrayError for a key that is also a group...
                what = f"array {key!r} ({array.dtype})" if key else str(array.dtype)
                raise errors.UnsupportedDtypeError(
                    f"{dst}: Zarr cannot store {what}: {error}") from None
            advance(array.nbytes)


def _write_target(source: _Source, src: str, dst: str, kind: str, progress: bool | None
                  ) -> None:
    import arrayio

    if kind == "npy":
        if len(source.arrays) != 1:
            raise CommandError(
                f"{dst}: .npy holds one array and {src} has {len(source.arrays)}; pick one "
                f"with --key (arrays: {', '.join(list(source.arrays)[:8])})")
        arrayio.save(dst, next(iter(_arrays_only(source, "npy").values())), progress=progress)
    elif kind == "arrayio":
        arrayio.save(dst, source.tree, metadata=source.metadata or None, progress=progress)
    elif kind == "npz":
        _write_npz(_arrays_only(source, "npz"), dst, progress)
    elif kind == "pt":
        _write_pt(source, dst)
    elif kind == "zarr":
        _write_zarr(source, dst, progress)
    else:
        raise CommandError(f"unknown format {kind!r}; known: {', '.join(FORMATS)}")


def _cmd_convert(args: argparse.Namespace) -> int:

    src, dst = args.src, args.dst
    source_kind, target_kind = _format_of(src, args.source_format), _format_of(dst, args.to)
    if os.path.abspath(src.rstrip("/")) == os.path.abspath(dst.rstrip("/")):
        raise CommandError(f"{dst}: the destination is the source")
    if not os.path.exists(src):
        raise CommandError(f"{src}: no such file or directory")
    if os.path.exists(dst) and not args.overwrite:
        raise CommandError(f"{dst} exists: pass --overwrite to replace it")
    if target_kind == "zarr" and os.path.isdir(dst) and os.listdir(dst) and not _zarr_store_at(
            dst):
        raise CommandError(f"{dst} is a directory that is not a Zarr store: refusing to "
                           "replace it")
    if target_kind != "zarr" and os.path.isdir(dst):
        raise CommandError(f"{dst} is a directory")
    progress = args.progress
    if target_kind == "pt":
        _needs("torch", "torch", "writing .pt files")
    # Into .pt, arrayio loads torch tensors directly (bfloat16 and float8 included).
    source = _read_source(src, source_kind, progress, "torch" if target_kind == "pt" else None)
    if args.key is not None:
        if args.key not in source.arrays:
            raise errors.KeyNotFoundError(f"{src}: no array {args.key!r} (arrays: "
                                          f"{', '.join(list(source.arrays)[:8])})")
        source = _Source({args.key: source.arrays[args.key]}, source.metadata)

    try:
        _write_target(source, src, dst, target_kind, progress)
    except errors.ArrayioError as error:
        if dst in str(error):
            raise
        raise type(error)(f"{dst}: {error}") from None  # name the file at fault
    except OSError as error:  # on a temporary file beside DST, or inside it (Zarr): DST's
        if error.errno is None or error.strerror is None:
            raise
        raise OSError(error.errno, error.strerror, dst) from error
    print(f"{src} ({source_kind}) -> {dst} ({target_kind}): "
          f"{format_count(len(source.arrays), 'array')}")
    return EXIT_OK


# --------------------------------------------------------------------------- bench, tune


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _cmd_bench(args: argparse.Namespace) -> int:
    from .. import tools
    from . import _sweep as _bench

    if args.png is not None:
        _needs("matplotlib", "bench", "--png")
    if args.tools is not None:
        for name in args.tools:
            tools.tool_class(name)  # unknown names: UnknownToolError, a usage error
    if not os.path.isdir(args.dir):
        raise CommandError(f"{args.dir}: not a directory")
    memory = ["host", "cuda"] if args.gpu else ["host"]
    result = _bench.run(args.dir, sizes=args.sizes or _bench.DEFAULT_SIZES, memory=memory,
                        caches=["warm", "cold"] if args.cold else ["warm"],
                        tool_names=args.tools, dispatcher=not args.no_dispatcher,
                        checksum=args.checksum, repeats=args.repeats, device=args.device,
                        progress=args.progress)
    if args.json:
        _print_json(result.as_dict())
    else:
        print(result.table())
    if args.png is not None:
        result.plot().savefig(args.png, dpi=120)
        print(f"plot: {args.png}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK  # a tool refused here (O_DIRECT on tmpfs) is a finding, shown in the table


def _cmd_tune(args: argparse.Namespace) -> int:
    import arrayio

    if not os.path.isdir(args.directory):
        raise CommandError(f"{args.directory}: not a directory")
    kwargs: dict[str, Any] = {"device": args.device, "verify": args.checksum,
                              "caches": ["warm", "cold"] if args.cold else ["warm"]}
    if args.sizes is not None:
        kwargs["sizes"] = args.sizes
    if args.max_calls is not None:
        kwargs["max_calls"] = args.max_calls
    if args.like is not None:  # its arrays, as a program saves and loads them
        kwargs["arrays"] = arrayio.load(args.like, device=args.device)
        kwargs.setdefault("sizes", ())
    report = arrayio.tune(args.directory, **kwargs)
    if args.json:
        _print_json(report.as_dict())
    else:
        print(report)
    return EXIT_OK


def _cmd_explain(args: argparse.Namespace) -> int:
    import arrayio

    if args.file is None and (args.key is not None or args.device is not None):
        raise CommandError("--key and --device need a FILE")
    path = None if args.file is None else _readable(args.file, "explain")
    report = arrayio.explain(path, key=args.key, device=args.device)
    if args.json:
        _print_json(report.as_dict())
    else:
        print(report)
    return EXIT_OK


# --------------------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    """The ``arrayio`` argument parser (for documentation tools and tests)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="arrayio", description="Look into, check and convert array files; measure and "
        "tune this machine's transfer tools.", epilog=_EPILOG,
        formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"arrayio {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show progress bars (default: on a terminal, for long work; "
                        "also ARRAYIO_PROGRESS)")
    common.add_argument("--debug", action="store_true",
                        help="on error, show the traceback instead of one line")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=description,
                                  parents=[common], epilog=_EPILOG,
                                  formatter_class=_Formatter)
        return sub

    info = command("info", "what a file holds", "Keys, dtypes, shapes, sizes, offsets, "
                   "metadata and checksum status of an arrayio / safetensors container or "
                   ".npy file. Reads only the header.")
    info.add_argument("file", metavar="FILE")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(run=_cmd_info)

    verify = command("verify", "check every array's checksum",
                     "Read every array and check its CRC-32C against the one recorded when "
                     "the file was written. Exits 1 naming each damaged array. A .npy file "
                     "has no place for a checksum: its header and size are checked.")
    verify.add_argument("file", metavar="FILE")
    verify.add_argument("--strict", action="store_true",
                        help="also fail (exit 1) when arrays carry no checksum (.npy files, "
                        "safetensors files not written by arrayio)")
    verify.add_argument("-v", "--verbose", action="store_true", help="list every array")
    verify.set_defaults(run=_cmd_verify)

    clean = command("clean", "remove what saves killed midway left behind",
                    "Remove, under each DIR (recursively, not following links), the hidden "
                    "temporary files (.NAME.arrayio-tmp-PID-...) of saves and Zarr chunk "
                    "writes whose process died before finishing (SIGKILL, power loss). A "
                    "temporary a live process is still writing is never touched. The next "
                    "save into a directory does the same for that directory.")
    clean.add_argument("directories", metavar="DIR", nargs="*", default=["."],
                       help="where to look (default: the current directory)")
    clean.add_argument("-n", "--dry-run", action="store_true",
                       help="list what would be removed, remove nothing")
    clean.set_defaults(run=_cmd_clean)

    convert = command(
        "convert", "convert between .npy, .npz, .safetensors, .pt, Zarr and arrayio",
        "Convert SRC to DST, formats told by extension (.npy, .npz, .pt/.pth, a directory "
        "or .zarr for Zarr, anything else an arrayio container, which is a safetensors "
        "file) or by --from/--to. dtypes are kept (bfloat16 and float8 need ml_dtypes, "
        "and .npy, .npz and Zarr cannot hold them); the pytree structure and metadata are "
        "kept where the target can hold them. .pt files are read with "
        "torch.load(weights_only=True). Arrays are held in memory.")
    convert.add_argument("src", metavar="SRC")
    convert.add_argument("dst", metavar="DST")
    convert.add_argument("--from", dest="source_format", choices=[*FORMATS, *_ALIASES],
                         help="the source format (default: from SRC's name)")
    convert.add_argument("--to", choices=[*FORMATS, *_ALIASES],
                         help="the target format (default: from DST's name)")
    convert.add_argument("--key", help="convert only this array (e.g. into a .npy)")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.set_defaults(run=_cmd_convert)

    bench = command("bench", "quick bandwidth sweep of every transfer tool here",
                    "Measure every transfer tool that can run here (default parameters) and "
                    "the dispatcher, reading (warm) and writing a scratch file in --dir at "
                    "a few sizes; prints GB/s per tool and size, every write timed until its "
                    "bytes are on the device. The dispatcher learns from these transfers too.")
    bench.add_argument("--dir", default=".", help="where the scratch file goes (default: .)")
    bench.add_argument("--sizes", type=_sizes, default=None, metavar="LIST",
                       help="comma-separated sizes (default: 256K,4M,64M)")
    bench.add_argument("--repeats", type=int, default=3, help="samples per figure (median)")
    bench.add_argument("--tools", type=_names, default=None, metavar="LIST",
                       help="only these tools (default: every one available)")
    bench.add_argument("--cold", action="store_true", help="also cold reads (page cache "
                       "evicted before each)")
    bench.add_argument("--gpu", action="store_true", help="also GPU memory (needs CuPy)")
    bench.add_argument("--device", default="cuda:0", help="the GPU for --gpu")
    bench.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=True,
                       help="compute CRC-32C on the way, as loads and saves do (default: on)")
    bench.add_argument("--no-dispatcher", action="store_true", help="tools only")
    bench.add_argument("--png", metavar="FILE", help="also plot bandwidth against size")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.set_defaults(run=_cmd_bench)

    tune = command("tune", "teach the dispatcher this machine ahead of time",
                   "Run transfers of several sizes on a scratch file in DIRECTORY until the "
                   "dispatcher has learned the fastest tool for each; the table is saved "
                   "under ARRAYIO_CACHE_DIR for later processes.")
    tune.add_argument("directory", metavar="DIRECTORY", nargs="?", default=".",
                      help="on the storage to tune for (default: .)")
    tune.add_argument("--device", default=None, help="cpu (default) or a GPU (cuda:0)")
    tune.add_argument("--sizes", type=_sizes, default=None, metavar="LIST",
                      help="comma-separated sizes (default: 64K,1M,16M,256M)")
    tune.add_argument("--like", metavar="FILE", default=None,
                      help="tune saving and loading the arrays of FILE (a checkpoint), "
                           "instead of the sizes unless --sizes is given")
    tune.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                      help="also tune cold reads (default: on)")
    tune.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=True,
                      help="tune checksummed transfers, as loads verify (default: on)")
    tune.add_argument("--max-calls", type=_positive_int, default=None, metavar="N",
                      help="at most N calls per context (default: 400); each --like call "
                           "moves the whole file, and real use learns what is left")
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    tune.set_defaults(run=_cmd_tune)

    explain = command("explain", "what the dispatcher learned, or would do for a file",
                      "Without FILE: every learned context, its chosen tool and each tool's "
                      "measured bandwidth. With FILE: what loading it would use.")
    explain.add_argument("file", metavar="FILE", nargs="?")
    explain.add_argument("--key", help="with FILE: only this array")
    explain.add_argument("--device", help="with FILE: where the load would go (cpu, cuda:0)")
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(run=_cmd_explain)
    return parser


def _exit_code(error: BaseException) -> int:
    if isinstance(error, CommandError):
        return error.code
    if isinstance(error, errors.FrameworkNotAvailableError | ImportError):
        return EXIT_DEPENDENCY
    if isinstance(error, errors.DiskFullError) or (
            isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS):
        return EXIT_ENVIRONMENT
    if isinstance(error, errors.KeyNotFoundError | errors.UnknownToolError |
                  errors.DeviceError | errors.ConfigError | FileNotFoundError | IsADirectoryError |
                  NotADirectoryError | FileExistsError):
        return EXIT_USAGE
    return EXIT_DATA  # FormatError (checksum, truncation), UnsupportedDtypeError, OSError...


def _message(error: BaseException, subject: str | None) -> str:
    """One line, naming the file: ``subject`` (the command's file) if the error does not."""
    if isinstance(error, OSError) and error.strerror:
        filename = error.filename if error.filename is not None else subject
        if filename is not None and _is_scratch(os.fspath(filename)):
            filename = os.path.dirname(os.fspath(filename))  # where the user pointed us
        return f"{filename}: {error.strerror}" if filename else error.strerror
    text = str(error) or type(error).__name__
    if isinstance(error, ImportError):
        text = text.splitlines()[0]
    if subject and subject not in text and not isinstance(
            error, CommandError | ImportError | errors.ConfigError):  # not about the file
        text = f"{subject}: {text}"
    return text


def _is_scratch(path: str) -> bool:
    """Whether ``path`` names one of arrayio's hidden temporary files (``.arrayio-tune-*``,
    ``.ckpt.safetensors.arrayio-tmp-*``), which the user never named."""
    name = os.path.basename(path)
    return name.startswith(".") and "arrayio-" in name


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
            _needs("tqdm", "progress", "--progress")
        with config.set(progress=args.progress) if args.progress is not None else \
                contextlib.nullcontext():
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
        subject = next((getattr(args, attribute) for attribute in ("file", "src", "directory")
                        if getattr(args, attribute, None) is not None), None)
        print(f"{name}: {_message(error, subject)}", file=sys.stderr)
        return _exit_code(error)
