"""The safetensors-compatible container: layout, header encoding, the header's own CRC-32C,
and a header parser that distrusts its input.

A plain safetensors file (8-byte length, JSON header, data), laid out for direct I/O where
the format allows; arrayio's facts live in ``__metadata__["arrayio"]`` and the header's
CRC-32C in the first entry of ``__metadata__``. ``docs/file-format.md`` describes it all.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import crc32c

from ..arrays import _dtypes
from ..arrays._dtypes import DType
from ..errors import (
    ChecksumError,
    FormatError,
    HeaderTooLargeError,
    TruncatedFileError,
    UnsupportedDtypeError,
)
from ._shapes import shape_problem

__all__ = [
    "ARRAYIO_KEY",
    "HEADER_CRC_KEY",
    "MAX_HEADER_BYTES",
    "Entry",
    "Header",
    "Layout",
    "plan",
    "read_header",
]

ARRAYIO_KEY = "arrayio"
HEADER_CRC_KEY = "arrayio_header_crc32c"
RESERVED_METADATA_KEYS = frozenset({ARRAYIO_KEY, HEADER_CRC_KEY})
FORMAT_VERSION = 2  # 2: the header carries its own CRC-32C
_FIRST_CHECKED_VERSION = 2
# As the safetensors package: a header larger than this is refused before it is read.
MAX_HEADER_BYTES = 100_000_000
_PREFIX = struct.Struct("<Q")
# How every header arrayio writes begins; the header's CRC (8 hex digits) follows at once.
_HEADER_CRC_LEAD = ('{"__metadata__":{"' + HEADER_CRC_KEY + '":"').encode()
_HEADER_CRC_AT = _PREFIX.size + len(_HEADER_CRC_LEAD)  # in the file
_UNSEALED = b"00000000"
_LOWER_HEX = frozenset(string.digits + "abcdef")


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a container: its dtype, shape and absolute byte range in the file."""

    key: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    stop: int
    crc32c: int | None = None

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    """A parsed, validated container header."""

    entries: dict[str, Entry]
    metadata: dict[str, Any]
    arrayio: dict[str, Any] | None
    data_start: int
    header_checked: bool = False  # its own CRC-32C was found and matched


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Where each tensor of a file-to-be goes, and how to encode its header."""

    entries: list[Entry]
    data_start: int
    file_size: int
    _header: dict[str, Any]
    _arrayio: dict[str, Any]
    _header_bytes: int

    def header(self, checksums: Mapping[str, int] | None) -> bytes:
        """Encode the header (with the checksums now known), padded to its planned size."""
        encoded = _encode(self._header, self._arrayio, checksums)
        if len(encoded) > self._header_bytes:
            raise AssertionError("header grew after planning")
        return seal(_PREFIX.pack(self._header_bytes) + encoded.ljust(self._header_bytes, b" "))


def seal(head: bytes) -> bytes:
    """Write the CRC-32C of ``head`` (length prefix and header, as arrayio encodes them) into
    its place in ``head``."""
    unsealed = head[:_HEADER_CRC_AT] + _UNSEALED + head[_HEADER_CRC_AT + len(_UNSEALED) :]
    return (
        unsealed[:_HEADER_CRC_AT]
        + f"{crc32c.crc32c(unsealed):08x}".encode()
        + unsealed[_HEADER_CRC_AT + len(_UNSEALED) :]
    )


def _header_crc(prefix: bytes, raw: bytes) -> tuple[int, int] | None:
    """The (recorded, computed) CRC-32C of a header that begins as arrayio's do, else None."""
    if not raw.startswith(_HEADER_CRC_LEAD):
        return None
    at = len(_HEADER_CRC_LEAD)
    digits = raw[at : at + len(_UNSEALED)]
    try:
        recorded = int(digits.decode("ascii"), 16) if len(digits) == len(_UNSEALED) else -1
    except ValueError:
        recorded = -1  # not hex: damaged, and then no CRC matches it
    unsealed = prefix + raw[:at] + _UNSEALED + raw[at + len(_UNSEALED) :]
    return recorded, crc32c.crc32c(unsealed)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _encode(
    header: dict[str, Any], arrayio: dict[str, Any], checksums: Mapping[str, int] | None
) -> bytes:
    if checksums is not None:
        # Fixed width: a placeholder of 0 encodes to as many bytes as the real checksum, and
        # a tensor without one (written by a tool that cannot checksum) only shortens it.
        arrayio = {**arrayio, "crc32c": {key: f"{crc:08x}" for key, crc in checksums.items()}}
    # The header's CRC first, where readers look for it (see the module docstring).
    metadata = {
        HEADER_CRC_KEY: _UNSEALED.decode(),
        **header["__metadata__"],
        ARRAYIO_KEY: _dumps(arrayio),
    }
    return _dumps({**header, "__metadata__": metadata}).encode()  # still the first entry


def plan(
    tensors: Sequence[tuple[str, DType, tuple[int, ...]]],
    *,
    metadata: Mapping[str, str],
    arrayio: Mapping[str, Any],
    alignment: int,
    checksums: bool,
) -> Layout:
    """Place ``tensors`` (key, dtype, shape) in a new file and size its header.

    The header's size is fixed here, with placeholder checksums of the final width, so the
    data can be written first and the header, with the real checksums, last.
    """
    order = sorted(
        range(len(tensors)),
        key=lambda i: (_nbytes(tensors[i]) % alignment != 0, -_nbytes(tensors[i]), i),
    )
    offset = 0
    offsets: dict[int, tuple[int, int]] = {}
    for i in order:
        offsets[i] = (offset, offset + _nbytes(tensors[i]))
        offset += _nbytes(tensors[i])
    data_bytes = offset

    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    real_dtypes = {}
    for i in order:
        key, dtype, shape = tensors[i]
        stored_shape = list(shape) + ([dtype.storage_lanes] if dtype.storage_lanes > 1 else [])
        header[key] = {
            "dtype": dtype.storage_code,
            "shape": stored_shape,
            "data_offsets": list(offsets[i]),
        }
        if dtype.code is None:
            real_dtypes[key] = dtype.name
    full_arrayio = {"version": FORMAT_VERSION, **arrayio}
    if real_dtypes:
        full_arrayio["dtypes"] = real_dtypes
    placeholder = {key: 0 for key, _, _ in tensors} if checksums else None

    unpadded = len(_encode(header, full_arrayio, placeholder))
    data_start = _round_up(_PREFIX.size + unpadded, alignment)
    header_bytes = data_start - _PREFIX.size
    entries = [
        Entry(
            tensors[i][0],
            tensors[i][1],
            tensors[i][2],
            data_start + offsets[i][0],
            data_start + offsets[i][1],
        )
        for i in order
    ]
    return Layout(entries, data_start, data_start + data_bytes, header, full_arrayio, header_bytes)


def _nbytes(tensor: tuple[str, DType, tuple[int, ...]]) -> int:
    return tensor[1].itemsize * math.prod(tensor[2])


def _round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


# --------------------------------------------------------------------------- reading


def read_header(fd: int, path: str, *, verify: bool = True) -> Header:
    """Read and validate a container header; nothing larger than the file is allocated.

    With ``verify`` (the default), the header's own CRC-32C is checked first where arrayio
    wrote one (see the module docstring).

    Raises
    ------
    ChecksumError
        If the header does not match its recorded CRC-32C, or lacks the CRC that its format
        requires: the description of the arrays is damaged.
    TruncatedFileError
        If the file is shorter than its header or data claim.
    HeaderTooLargeError
        If the header length is beyond the file or beyond :data:`MAX_HEADER_BYTES`.
    FormatError
        For invalid JSON, missing fields, bad shapes, or offsets out of range or overlapping.
    UnsupportedDtypeError
        For a dtype code arrayio does not know.
    """
    file_size = os.fstat(fd).st_size
    head = os.pread(fd, _PREFIX.size + 1, 0)
    if len(head) > _PREFIX.size and head[_PREFIX.size :] not in b"{ \t\r\n":
        raise FormatError(
            f"{path}: not a safetensors or .npy file (a safetensors header is "
            f"a JSON object; this file begins {head[:16]!r})"
        )
    if file_size < _PREFIX.size:
        raise TruncatedFileError(f"{path}: {file_size} bytes is too short for a safetensors file")
    (header_bytes,) = _PREFIX.unpack(head[: _PREFIX.size])
    if header_bytes > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(
            f"{path}: header claims {header_bytes} bytes, more than the {MAX_HEADER_BYTES} "
            "arrayio accepts"
        )
    if header_bytes > file_size - _PREFIX.size:
        raise TruncatedFileError(
            f"{path}: header claims {header_bytes} bytes but the file ends "
            f"{file_size - _PREFIX.size} bytes after the length prefix: it is cut short"
        )
    raw = os.pread(fd, header_bytes, _PREFIX.size)
    if len(raw) != header_bytes:
        raise TruncatedFileError(f"{path}: header cut short while reading")
    sealed = _header_crc(_PREFIX.pack(header_bytes), raw) if verify else None
    if sealed is not None and sealed[0] != sealed[1]:
        raise ChecksumError(
            f"{path}: the header has CRC-32C {sealed[1]:08x}, the file recorded "
            f"{max(sealed[0], 0):08x}: the description of the arrays is damaged "
            "(verify=False skips this check)"
        )
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as duplicate:
        raise FormatError(
            f"{path}: the header names {duplicate.args[0]!r} twice (the "
            "safetensors format forbids it; which one is meant is unknown)"
        ) from None
    except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, huge ints, deep nesting
        raise FormatError(f"{path}: header is not valid UTF-8 JSON ({error})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is a JSON {type(header).__name__}, expected an object")

    data_start = _PREFIX.size + header_bytes
    data_bytes = file_size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    arrayio = _parse_arrayio(metadata.get(ARRAYIO_KEY), path)
    if (
        verify
        and sealed is None
        and arrayio is not None
        and arrayio["version"] >= _FIRST_CHECKED_VERSION
    ):
        raise ChecksumError(
            f"{path}: the header lacks the CRC-32C that arrayio format "
            f"{arrayio['version']} records: it is damaged (verify=False skips "
            "this check)"
        )
    real_dtypes = arrayio.get("dtypes", {}) if arrayio else {}
    checksums = arrayio.get("crc32c", {}) if arrayio else {}

    entries: dict[str, Entry] = {}
    for key, info in header.items():
        entries[key] = _parse_entry(
            key, info, path, data_start, data_bytes, real_dtypes.get(key), checksums.get(key)
        )
    _check_overlaps(entries.values(), path)
    if arrayio is not None:
        _check_arrayio_keys(arrayio, entries, path)
    return Header(entries, metadata, arrayio, data_start, sealed is not None)


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (which ``json`` would let the
    last one win)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _parse_arrayio(text: str | None, path: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        arrayio = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as duplicate:
        raise FormatError(
            f"{path}: __metadata__[{ARRAYIO_KEY!r}] names {duplicate.args[0]!r} twice"
        ) from None
    except (ValueError, RecursionError) as error:
        raise FormatError(f"{path}: __metadata__[{ARRAYIO_KEY!r}] is not JSON ({error})") from None
    version = arrayio.get("version") if isinstance(arrayio, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{path}: __metadata__[{ARRAYIO_KEY!r}] lacks a format version")
    if arrayio["version"] > FORMAT_VERSION:
        raise FormatError(
            f"{path}: written by a newer arrayio (format {arrayio['version']}, this one reads "
            f"up to {FORMAT_VERSION}); upgrade arrayio"
        )
    for field in ("dtypes", "crc32c"):
        value = arrayio.get(field, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise FormatError(f"{path}: arrayio metadata field {field!r} must map keys to strings")
    crcs = arrayio.get("crc32c", {})
    # All at once (a checkpoint has thousands): each key's own check only to name a bad one.
    if set(map(len, crcs.values())) - {8} or not set("".join(crcs.values())) <= _LOWER_HEX:
        for key, crc in crcs.items():
            if len(crc) != 8 or not set(crc) <= _LOWER_HEX:
                raise FormatError(f"{path}: checksum of {key!r} is {crc!r}, expected 8 hex digits")
    return arrayio


def _parse_entry(
    key: str,
    info: Any,
    path: str,
    data_start: int,
    data_bytes: int,
    real_dtype: str | None,
    crc: str | None,
) -> Entry:
    # Called once per tensor (a million in a hostile file): the checks are plain comparisons,
    # and the message's prefix is made only for an error.
    if type(info) is not dict:
        raise FormatError(f"{_where(path, key)}entry must be an object")
    try:
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except KeyError:
        missing = {"dtype", "shape", "data_offsets"} - info.keys()
        raise FormatError(f"{_where(path, key)}missing {sorted(missing)}") from None
    stored = _dtypes.lookup_code(code)
    if stored is None:
        stored = _dtypes.by_code(code, where=f"{_where(path, key)}dtype ")  # raises
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise FormatError(
            f"{_where(path, key)}shape {shape!r} is not a list of non-negative integers"
        )
    if not (
        type(offsets) is list
        and len(offsets) == 2
        and type(offsets[0]) is int
        and type(offsets[1]) is int
    ):
        raise FormatError(f"{_where(path, key)}data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise FormatError(f"{_where(path, key)}data_offsets {offsets!r} out of order or negative")
    problem = shape_problem(shape, stored.itemsize)
    if problem is not None:
        raise FormatError(f"{_where(path, key)}{problem}")
    expected = stored.itemsize * math.prod(shape)
    if end - begin != expected:
        raise FormatError(
            f"{_where(path, key)}shape {shape} of {stored.name} needs {expected} bytes but "
            f"data_offsets {offsets} span {end - begin}"
        )
    if end > data_bytes:
        raise TruncatedFileError(
            f"{_where(path, key)}data_offsets {offsets} reach past the end of the data "
            f"({data_bytes} bytes)"
        )
    dtype, dims = (
        (stored, tuple(shape))
        if real_dtype is None
        else _real_dtype(stored, tuple(shape), real_dtype, _where(path, key))
    )
    return Entry(
        key,
        dtype,
        dims,
        data_start + begin,
        data_start + end,
        int(crc, 16) if crc is not None else None,
    )


def _where(path: str, key: str) -> str:
    return f"{path}: tensor {key!r}: "


def _real_dtype(
    stored: DType, shape: tuple[int, ...], real: str | None, where: str
) -> tuple[DType, tuple[int, ...]]:
    if real is None:
        return stored, shape
    dtype = _dtypes.by_name(real, where=where)
    if dtype.storage_code != stored.code or dtype.storage_lanes == 1:
        raise UnsupportedDtypeError(f"{where}cannot be {real} when stored as {stored.code}")
    if not shape or shape[-1] != dtype.storage_lanes:
        raise FormatError(
            f"{where}{real} stored as {stored.code} needs a last axis of "
            f"{dtype.storage_lanes}, shape is {list(shape)}"
        )
    return dtype, shape[:-1]


def _check_overlaps(entries: Any, path: str) -> None:
    previous: Entry | None = None
    for entry in sorted((e for e in entries if e.nbytes), key=lambda e: e.start):
        if previous is not None and entry.start < previous.stop:
            raise FormatError(
                f"{path}: tensors {previous.key!r} and {entry.key!r} overlap in the file"
            )
        previous = entry


def _check_arrayio_keys(arrayio: dict[str, Any], entries: dict[str, Entry], path: str) -> None:
    for field in ("dtypes", "crc32c"):
        unknown = set(arrayio.get(field, {})) - entries.keys()
        if unknown:
            raise FormatError(
                f"{path}: arrayio metadata {field!r} names unknown tensors {sorted(unknown)[:5]}"
            )
