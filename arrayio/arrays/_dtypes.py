"""The dtypes arrayio stores, and their names in the file format and in each framework.

One row per dtype. The canonical name is NumPy's (``np.dtype(...).name``, which ml_dtypes
extends with ``bfloat16`` and the float8 types); torch's names are the same after ``torch.``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..errors import FrameworkNotAvailableError, UnsupportedDtypeError

__all__ = ["DType", "DTYPES", "by_code", "by_name", "dtype_of", "lookup_code", "numpy_dtype"]


@dataclasses.dataclass(frozen=True, slots=True)
class DType:
    """A dtype as arrayio stores it.

    ``code`` is the safetensors dtype string. ``complex128`` has none: it is stored as ``F64``
    with a trailing axis of 2 (``storage_code``/``storage_lanes``), readable by any safetensors
    tool, and arrayio's metadata records the real dtype.
    """

    name: str
    code: str | None
    itemsize: int
    storage_code: str
    storage_lanes: int = 1

    @property
    def numpy_native(self) -> bool:
        """Whether plain NumPy has this dtype (bfloat16 and float8 need ml_dtypes)."""
        return self.name not in _ML_DTYPES


_ML_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})

DTYPES: tuple[DType, ...] = (
    DType("bool", "BOOL", 1, "BOOL"),
    DType("int8", "I8", 1, "I8"),
    DType("int16", "I16", 2, "I16"),
    DType("int32", "I32", 4, "I32"),
    DType("int64", "I64", 8, "I64"),
    DType("uint8", "U8", 1, "U8"),
    DType("uint16", "U16", 2, "U16"),
    DType("uint32", "U32", 4, "U32"),
    DType("uint64", "U64", 8, "U64"),
    DType("float16", "F16", 2, "F16"),
    DType("bfloat16", "BF16", 2, "BF16"),
    DType("float32", "F32", 4, "F32"),
    DType("float64", "F64", 8, "F64"),
    DType("float8_e4m3fn", "F8_E4M3", 1, "F8_E4M3"),
    DType("float8_e5m2", "F8_E5M2", 1, "F8_E5M2"),
    DType("complex64", "C64", 8, "C64"),
    DType("complex128", None, 16, "F64", 2),
)

_BY_NAME = {d.name: d for d in DTYPES}
_BY_CODE = {d.code: d for d in DTYPES if d.code is not None}

# safetensors codes that exist but that arrayio does not (yet) handle: reported as unsupported
# rather than as a malformed file.
_KNOWN_UNSUPPORTED_CODES = frozenset(
    {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
)


def by_name(name: str, *, where: str = "") -> DType:
    """Return the dtype called ``name`` (NumPy naming), or raise UnsupportedDtypeError.

    ``where`` prefixes the error message (a file and key).
    """
    if isinstance(name, str) and name in _BY_NAME:
        return _BY_NAME[name]
    raise UnsupportedDtypeError(
        f"{where}dtype {name!r} is not supported by arrayio; supported: {sorted(_BY_NAME)}"
    )


def lookup_code(code: object) -> DType | None:
    """The dtype whose safetensors code is ``code``, or None."""
    return _BY_CODE.get(code) if type(code) is str else None


def by_code(code: object, *, where: str = "") -> DType:
    """Return the dtype whose safetensors code is ``code``, or raise UnsupportedDtypeError."""
    if isinstance(code, str) and code in _BY_CODE:
        return _BY_CODE[code]
    known = isinstance(code, str) and code in _KNOWN_UNSUPPORTED_CODES
    what = "a safetensors dtype arrayio does not handle" if known else "an unknown dtype"
    raise UnsupportedDtypeError(f"{where}{code!r} is {what}; supported: {sorted(_BY_CODE)}")


def dtype_of(dtype: Any, *, where: str = "") -> DType:
    """Map a framework dtype (NumPy, ml_dtypes, JAX, CuPy, torch) to arrayio's dtype."""
    module = type(dtype).__module__
    if module.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise UnsupportedDtypeError(f"{where}cannot interpret {dtype!r} as a dtype") from None
        if np_dtype.byteorder == ">":
            raise UnsupportedDtypeError(
                f"{where}big-endian dtype {np_dtype.str!r} is not supported: convert with "
                f".astype({np_dtype.name!r}) first"
            )
        name = np_dtype.name
    return by_name(name, where=where)


def numpy_dtype(dtype: DType) -> np.dtype:
    """Return the NumPy dtype for ``dtype``, importing ml_dtypes for bfloat16 and float8."""
    if dtype.numpy_native:
        return np.dtype(dtype.name)
    try:
        import ml_dtypes
    except ImportError:
        raise FrameworkNotAvailableError(
            f"{dtype.name} in NumPy needs ml_dtypes: pip install 'arrayio[dtypes]' "
            "(or load with like='jax' or like='torch')"
        ) from None
    return np.dtype(getattr(ml_dtypes, dtype.name))
