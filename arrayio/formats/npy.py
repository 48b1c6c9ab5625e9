"""The ``.npy`` format for a single array: a header written so that data starts on the
alignment (NumPy reads any header length), and a reader that validates before allocating.

The header is parsed as NumPy parses it (``ast.literal_eval``, never ``eval``, with a bounded
size), without NumPy's slow fallback for Python 2 era headers. ``.npy`` has no way to record
bfloat16 or float8 (NumPy writes them as opaque ``|V2``/``|V1``), so arrayio refuses to write
them there.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
import struct

import numpy as np

from ..arrays import _dtypes
from ..arrays._dtypes import DType
from ..errors import FormatError, HeaderTooLargeError, TruncatedFileError, UnsupportedDtypeError
from ._shapes import shape_problem

__all__ = ["MAGIC", "NpyHeader", "encode_header", "parse_header_text", "read_header"]

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
    descr = (
        np.dtype(dtype.name).newbyteorder("<").str
        if dtype.itemsize > 1
        else np.dtype(dtype.name).str
    )
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    for version, length_format in (((1, 0), "<H"), ((2, 0), "<I")):
        prefix = len(MAGIC) + 2 + struct.calcsize(length_format)
        total = -(-(prefix + len(text) + 1) // alignment) * alignment
        header_len = total - prefix
        if header_len < 1 << (8 * struct.calcsize(length_format)):
            body = text.encode("latin1").ljust(header_len - 1, b" ") + b"\n"
            return MAGIC + bytes(version) + struct.pack(length_format, header_len) + body
    raise AssertionError("unreachable: a version 2.0 header holds 4 GiB")


def read_header(fd: int, path: str, *, offset: int = 0, size: int | None = None) -> NpyHeader:
    """Parse and validate a ``.npy`` header: of the file, or of the ``.npy`` file that fills
    the ``size`` bytes at ``offset`` (an ``.npz`` archive's member).

    The header is a Python dict literal padded with spaces; it is read as NumPy reads it
    (``ast.literal_eval``, never ``eval``), with the same checks, but without NumPy's
    fallback parser for Python 2 era headers, which takes seconds on a header with one
    stray byte: anything but whitespace after the dict is refused at once.

    Raises
    ------
    TruncatedFileError, HeaderTooLargeError, FormatError, UnsupportedDtypeError
        For a short file, an oversized header, a malformed header, or an unsupported dtype
        (object arrays, structured dtypes, big-endian data).
    """
    file_size = os.fstat(fd).st_size - offset if size is None else size
    head = os.pread(fd, min(12, max(file_size, 0)), offset)
    if not head.startswith(MAGIC):
        if head and MAGIC.startswith(head):
            raise TruncatedFileError(f"{path}: the file ends inside the .npy magic")
        raise FormatError(f"{path}: not a .npy file")
    if len(head) < len(MAGIC) + 2:
        raise TruncatedFileError(f"{path}: the file ends before the .npy version")
    major, minor = head[6], head[7]
    if major not in (1, 2, 3):
        raise FormatError(f"{path}: unsupported .npy version {major}.{minor}")
    length_format = "<H" if major == 1 else "<I"
    prefix = len(MAGIC) + 2 + struct.calcsize(length_format)
    if len(head) < prefix:
        raise TruncatedFileError(f"{path}: the file ends inside the .npy header length")
    (header_len,) = struct.unpack(length_format, head[len(MAGIC) + 2 : prefix])
    data_start = prefix + header_len
    if header_len > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(
            f"{path}: .npy header claims {header_len} bytes, more than the "
            f"{MAX_HEADER_BYTES} arrayio (and NumPy) accept"
        )
    if data_start > file_size:
        raise TruncatedFileError(
            f"{path}: the .npy header claims {header_len} bytes but the file ends after "
            f"{file_size - prefix}"
        )
    raw = os.pread(fd, header_len, offset + prefix)
    dtype, shape, fortran = parse_header_text(raw, major, path)
    header = NpyHeader(dtype, shape, fortran, offset + data_start)
    if data_start + header.nbytes > file_size:
        raise TruncatedFileError(
            f"{path}: {header.nbytes} bytes of data expected after the header, file holds "
            f"{file_size - data_start}"
        )
    return header


# What NumPy writes for the dtypes arrayio reads: byte order, kind, size ("<f4", "|b1").
_SIMPLE_DESCR = re.compile(r"([<>|=])([biufc])([0-9]{1,2})")


def _descr_dtype(descr: object, path: str) -> DType:
    """The dtype of a ``.npy`` descr, read without NumPy's parser: it evaluates comma strings
    with ``ast`` and warns about deprecated aliases, and everything beyond plain numbers and
    booleans (objects, records, strings, dates) is refused anyway."""
    match = _SIMPLE_DESCR.fullmatch(descr) if isinstance(descr, str) else None
    if match is None:
        raise UnsupportedDtypeError(
            f"{path}: .npy descr {descr!r} is not a dtype arrayio "
            "reads (object, structured, string and date dtypes are not)"
        )
    order, kind, size = match.groups()
    if order == ">" and size != "1":
        raise UnsupportedDtypeError(
            f"{path}: big-endian .npy data ({descr!r}) is not "
            "supported: convert it with numpy first"
        )
    try:
        np_dtype = np.dtype(kind + size)
    except TypeError:  # a size the kind does not have ("f3")
        raise UnsupportedDtypeError(f"{path}: .npy descr {descr!r} is not a dtype") from None
    return _dtypes.dtype_of(np_dtype, where=f"{path}: ")


def parse_header_text(raw: bytes, major: int, path: str) -> tuple[DType, tuple[int, ...], bool]:
    """The dtype, shape and Fortran order that the text of a ``.npy`` header of version
    ``major`` describes, checked as :func:`read_header` says."""
    try:
        text = raw.decode("utf-8" if major >= 3 else "latin1")
    except UnicodeDecodeError:
        raise FormatError(f"{path}: .npy header is not valid UTF-8") from None
    body = text.rstrip(" \t\r\n")
    if not (body.startswith("{") and body.endswith("}")):
        raise FormatError(
            f"{path}: malformed .npy header: a dict literal followed by padding was expected"
        )
    try:
        fields = ast.literal_eval(body)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as error:
        raise FormatError(f"{path}: malformed .npy header ({type(error).__name__})") from None
    if not isinstance(fields, dict) or fields.keys() != {"descr", "fortran_order", "shape"}:
        raise FormatError(
            f"{path}: .npy header must hold exactly 'descr', 'fortran_order' and 'shape'"
        )
    shape, fortran = fields["shape"], fields["fortran_order"]
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise FormatError(f"{path}: .npy shape {shape!r} is not a tuple of non-negative integers")
    if not isinstance(fortran, bool):
        raise FormatError(f"{path}: .npy fortran_order {fortran!r} is not a bool")
    dtype = _descr_dtype(fields["descr"], path)
    problem = shape_problem(shape, dtype.itemsize)
    if problem is not None:
        raise FormatError(f"{path}: .npy {problem}")
    return dtype, shape, fortran
