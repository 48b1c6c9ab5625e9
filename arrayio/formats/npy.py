"""The ``.npy`` format for a single array: a header written so that data starts on the
alignment (NumPy reads any header length), and a reader that validates before allocating.

Parsing uses NumPy's own ``numpy.lib.format`` readers, which bound the header size and parse
it with ``ast.literal_eval`` (never ``eval``). ``.npy`` has no way to record bfloat16 or
float8 (NumPy writes them as opaque ``|V2``/``|V1``), so arrayio refuses to write them there.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import struct

import numpy as np

from .. import _dtypes
from .._dtypes import DType
from ..errors import FormatError, HeaderTooLargeError, TruncatedFileError, UnsupportedDtypeError

__all__ = ["MAGIC", "NpyHeader", "encode_header", "read_header"]

MAGIC = b"\x93NUMPY"
# NumPy's own default limit (numpy.lib.format._MAX_HEADER_SIZE): a hostile header length is
# refused before its text is read.
MAX_HEADER_BYTES = 10_000


@dataclasses.dataclass(frozen=True, slots=True)
class NpyHeader:
    """A validated ``.npy`` header: data starts at ``data_start``, stored shape and order."""

    dtype: DType
    shape: tuple[int, ...]
    fortran_order: bool
    data_start: int

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def encode_header(dtype: DType, shape: tuple[int, ...], alignment: int) -> bytes:
    """Return a version 1.0 (or 2.0, for huge headers) header whose length is a multiple of
    ``alignment``.

    Raises
    ------
    UnsupportedDtypeError
        For dtypes ``.npy`` cannot describe (bfloat16, float8).
    """
    if not dtype.numpy_native:
        raise UnsupportedDtypeError(
            f".npy cannot record {dtype.name} (NumPy would read opaque bytes); save it to a "
            ".safetensors container instead"
        )
    descr = np.dtype(dtype.name).newbyteorder("<").str if dtype.itemsize > 1 else np.dtype(
        dtype.name).str
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    for version, length_format in (((1, 0), "<H"), ((2, 0), "<I")):
        prefix = len(MAGIC) + 2 + struct.calcsize(length_format)
        total = -(-(prefix + len(text) + 1) // alignment) * alignment
        header_len = total - prefix
        if header_len < 1 << (8 * struct.calcsize(length_format)):
            body = text.encode("latin1").ljust(header_len - 1, b" ") + b"\n"
            return MAGIC + bytes(version) + struct.pack(length_format, header_len) + body
    raise AssertionError("unreachable: a version 2.0 header holds 4 GiB")


def read_header(fd: int, path: str) -> NpyHeader:
    """Parse and validate a ``.npy`` header.

    Raises
    ------
    TruncatedFileError, HeaderTooLargeError, FormatError, UnsupportedDtypeError
        For a short file, an oversized header, a malformed header, or an unsupported dtype
        (object arrays, structured dtypes, big-endian data).
    """
    file_size = os.fstat(fd).st_size
    head = os.pread(fd, 12, 0)
    if len(head) < 10 or not head.startswith(MAGIC):
        raise TruncatedFileError(f"{path}: too short for a .npy header") if head.startswith(
            MAGIC[: len(head)]) else FormatError(f"{path}: not a .npy file")
    major = head[6]
    length_size = 2 if major == 1 else 4
    if major not in (1, 2, 3) or len(head) < 8 + length_size:
        raise FormatError(f"{path}: unsupported .npy version {major}.{head[7]}")
    (header_len,) = struct.unpack("<H" if length_size == 2 else "<I", head[8 : 8 + length_size])
    data_start = 8 + length_size + header_len
    if header_len > MAX_HEADER_BYTES or data_start > file_size:
        raise HeaderTooLargeError(
            f"{path}: .npy header claims {header_len} bytes (file: {file_size} bytes, "
            f"limit {MAX_HEADER_BYTES})"
        )
    text = os.pread(fd, data_start, 0)
    stream = io.BytesIO(text)
    np.lib.format.read_magic(stream)
    try:
        if major == 1:
            shape, fortran, np_dtype = np.lib.format.read_array_header_1_0(
                stream, max_header_size=MAX_HEADER_BYTES)
        else:
            # 3.0 differs from 2.0 only in allowing UTF-8 field names, which arrayio refuses.
            shape, fortran, np_dtype = np.lib.format.read_array_header_2_0(
                stream, max_header_size=MAX_HEADER_BYTES)
    except Exception as error:  # noqa: BLE001 - NumPy's parser raises several kinds
        raise FormatError(f"{path}: malformed .npy header ({error!r})") from None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise FormatError(f"{path}: .npy shape {shape!r} is not a tuple of non-negative integers")
    if np_dtype.hasobject or np_dtype.fields is not None:
        raise UnsupportedDtypeError(f"{path}: .npy of dtype {np_dtype} (object or structured) "
                                    "cannot be loaded by arrayio")
    dtype = _dtypes.dtype_of(np_dtype, where=f"{path}: ")
    header = NpyHeader(dtype, tuple(shape), bool(fortran), data_start)
    if data_start + header.nbytes > file_size:
        raise TruncatedFileError(
            f"{path}: {header.nbytes} bytes of data expected after the header, file holds "
            f"{file_size - data_start}"
        )
    return header
