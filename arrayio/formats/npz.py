"""NumPy's ``.npz``: a zip archive of ``.npy`` files, one per named array.

arrayio writes the members stored (uncompressed), as ``numpy.savez`` does, so that each
array's bytes lie in the file as they are: a reader finds them from the zip's directory and
reads them through the dispatcher, a slice of rows as much as a whole array. Compressed
members (``numpy.savez_compressed``) are inflated as they are read. An ``.npz`` holds a flat
mapping of names to arrays: no structure, constants, metadata or checksums beyond the
archive's own CRC-32 of each member (checked for compressed members, which are read whole).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import IO

import numpy as np

from ..errors import ArrayioError, FormatError, TruncatedFileError
from . import npy

__all__ = ["MAGIC", "Member", "read_members", "read_compressed", "write"]

MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... name length, extra length
# What zipfile and zlib raise for a damaged or hostile archive.
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    EOFError,
    OSError,
    ValueError,
    struct.error,
    OverflowError,
    NotImplementedError,
    RuntimeError,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """One array of an archive: its ``.npy`` header, and the zip entry for one compressed."""

    key: str
    header: npy.NpyHeader  # data_start is in the archive for a stored member
    compressed: zipfile.ZipInfo | None


def write(
    file: IO[bytes], arrays: Mapping[str, np.ndarray], advance: Callable[[int], None] | None = None
) -> None:
    """Write ``arrays`` (host arrays of dtypes ``.npy`` records) as an ``.npz`` to ``file``."""
    with zipfile.ZipFile(file, "w") as archive:
        for key, array in arrays.items():
            # As numpy.savez, without its keyword arguments (a key named "file" is fine here).
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
            if advance is not None:
                advance(array.nbytes)


@contextlib.contextmanager
def _archive(fd: int, path: str) -> Iterator[zipfile.ZipFile]:
    """The archive open as ``fd``, through a descriptor of its own (zipfile seeks)."""
    with os.fdopen(os.dup(fd), "rb") as file:
        try:
            archive = zipfile.ZipFile(file)
        except _ZIP_ERRORS as error:
            raise FormatError(f"{path}: not a readable .npz archive ({error})") from None
        with archive:
            yield archive


def read_members(fd: int, path: str) -> list[Member]:
    """Every array of the archive open as ``fd``, checked before anything is allocated.

    Raises
    ------
    FormatError
        (and subclasses, as for ``.npy``) for a damaged archive, a member that is not an
        ``.npy`` file, or a damaged member header.
    """
    with _archive(fd, path) as archive:
        members = []
        for info in archive.infolist():
            if not info.filename.endswith(".npy") or info.is_dir():
                raise FormatError(
                    f"{path}: member {info.filename!r} is not an array "
                    "(.npz members are .npy files)"
                )
            key = info.filename.removesuffix(".npy")
            where = f"{path}[{key}]"
            try:
                if info.compress_type == zipfile.ZIP_STORED:
                    header = npy.read_header(
                        fd, where, offset=_data_offset(fd, info, path), size=info.file_size
                    )
                    members.append(Member(key, header, None))
                else:
                    members.append(Member(key, _compressed_header(archive, info, where), info))
            except _ZIP_ERRORS as error:
                if isinstance(error, ArrayioError):
                    raise
                raise FormatError(f"{where}: damaged .npz member ({error})") from None
        if len({member.key for member in members}) != len(members):
            raise FormatError(f"{path}: the archive holds an array name twice")
        return members


def _data_offset(fd: int, info: zipfile.ZipInfo, path: str) -> int:
    """Where a stored member's bytes begin: after its local header, whose name and extra
    field may differ in length from the central directory's."""
    local = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
    if len(local) < _LOCAL_HEADER.size:
        raise TruncatedFileError(f"{path}: the archive ends inside member {info.filename!r}")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(local)
    if signature != MAGIC:
        raise FormatError(f"{path}: member {info.filename!r} has no local header")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _compressed_header(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str
) -> npy.NpyHeader:
    with archive.open(info) as member:
        head = member.read(12)
        if not head.startswith(npy.MAGIC) or len(head) < 10:
            raise FormatError(f"{where}: not a .npy member")
        length_format = "<H" if head[6] == 1 else "<I"
        prefix = len(npy.MAGIC) + 2 + struct.calcsize(length_format)
        (header_len,) = struct.unpack(length_format, head[8:prefix])
        if header_len > npy.MAX_HEADER_BYTES:
            raise FormatError(f"{where}: .npy header of {header_len} bytes is too long")
        raw = head[prefix:] + member.read(header_len - (len(head) - prefix))
        dtype, shape, fortran = npy.parse_header_text(raw, head[6], where)
    header = npy.NpyHeader(dtype, shape, fortran, prefix + header_len)
    if header.data_start + header.nbytes != info.file_size:
        raise FormatError(
            f"{where}: {header.nbytes} bytes of data expected, the member holds "
            f"{info.file_size - header.data_start}"
        )
    return header


def read_compressed(fd: int, path: str, member: Member, out: np.ndarray) -> None:
    """Inflate a compressed member's data into ``out`` (a host ``uint8`` array of its size);
    the archive's CRC-32 of the member is checked at its end.

    Raises
    ------
    FormatError
        For a damaged member (its CRC-32, its deflate stream, its length).
    """
    assert member.compressed is not None
    try:
        with _archive(fd, path) as archive, archive.open(member.compressed) as stream:
            _skip(stream, member.header.data_start)
            view = memoryview(out)
            done = 0
            while done < out.nbytes:
                got = stream.readinto(view[done:])
                if not got:
                    raise TruncatedFileError(f"{path}[{member.key}]: the member ends early")
                done += got
            if stream.read(1):
                raise FormatError(f"{path}[{member.key}]: the member holds more than its array")
    except _ZIP_ERRORS as error:
        if isinstance(error, ArrayioError):
            raise
        raise FormatError(f"{path}[{member.key}]: damaged .npz member ({error})") from None


def _skip(stream: IO[bytes], nbytes: int) -> None:
    while nbytes:
        got = len(stream.read(min(nbytes, 1 << 16)))
        if not got:
            raise EOFError("member ends inside its header")
        nbytes -= got
