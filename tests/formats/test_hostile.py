"""Hostile and damaged files: every one must be refused with a precise arrayio error.

Each case checks, for ``arrayio.open``, ``arrayio.load`` and ``arrayio.read_into``:

* the specific error class (``HeaderTooLargeError``, ``TruncatedFileError``, ``FormatError``,
  ``UnsupportedDtypeError``, ``ChecksumError``), which is an ``ArrayioError`` and also the
  builtin a caller would catch without knowing arrayio (``ValueError``, ``EOFError``,
  ``TypeError``);
* that the message names the file;
* for files that claim huge sizes, that the refusal comes before any large allocation
  (measured with ``tracemalloc``).

Hostile containers are built by hand: an 8-byte little-endian header length, a JSON header,
then data. Damaged files start as real ``arrayio.save`` output and are then cut or corrupted.
"""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arrayio
from arrayio.formats.safetensors import HEADER_CRC_KEY
from arrayio.testing import flip_byte, seal_header

# The builtins each error class must also be, as errors.py documents them. Written out here
# (not derived from the classes) so that a change to the hierarchy fails a test.
BUILTINS: dict[type[arrayio.ArrayioError], tuple[type[Exception], ...]] = {
    arrayio.FormatError: (ValueError,),
    arrayio.HeaderTooLargeError: (ValueError,),
    arrayio.TruncatedFileError: (ValueError, EOFError),
    arrayio.ChecksumError: (ValueError,),
    arrayio.UnsupportedDtypeError: (TypeError,),
    arrayio.OutOfMemoryError: (MemoryError,),
}

NPY_MAGIC = b"\x93NUMPY"

# A hostile file may not make arrayio allocate more than this while refusing it.
ALLOCATION_LIMIT = 1 << 20


# --------------------------------------------------------------------------- file builders


def container(header: Any, data: bytes = b"", *, header_length: int | None = None) -> bytes:
    """A safetensors container: length prefix, header (JSON-encoded unless bytes), data.

    ``header_length`` overrides the length written in the prefix. A header that arrayio
    wrote (its CRC entry first) gets the CRC of its edited content: these cases test what
    lies behind that check, as a hostile writer able to compute a CRC would.
    """
    raw = (
        header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    )
    length = len(raw) if header_length is None else header_length
    blob = struct.pack("<Q", length) + raw + data
    sealed = isinstance(header, dict) and HEADER_CRC_KEY in header.get("__metadata__", {})
    return seal_header(blob) if sealed and header_length is None else blob


def tensor(dtype: Any = "F32", shape: Any = (1,), offsets: Any = (0, 4)) -> dict[str, Any]:
    """One header entry; tuples become JSON lists, anything else is written as given."""

    def as_json(v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    return {"dtype": dtype, "shape": as_json(shape), "data_offsets": as_json(offsets)}


def npy(
    header: str | bytes, data: bytes = b"", *, version: int = 1, header_length: int | None = None
) -> bytes:
    """A ``.npy`` file: magic, version, header length, header text padded to 64 bytes, data.

    ``header_length`` overrides the length written after the version.
    """
    text = header.encode("latin1") if isinstance(header, str) else header
    length_format = "<H" if version == 1 else "<I"
    prefix = len(NPY_MAGIC) + 2 + struct.calcsize(length_format)
    total = -(-(prefix + len(text) + 1) // 64) * 64
    body = text.ljust(total - prefix - 1, b" ") + b"\n"
    length = len(body) if header_length is None else header_length
    return NPY_MAGIC + bytes([version, 0]) + struct.pack(length_format, length) + body + data


def npy_dict(descr: str = "<f4", shape: tuple[int, ...] = (1,)) -> str:
    """The dict literal of a ``.npy`` header."""
    return f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"


def write(tmp_path: Path, blob: bytes, name: str = "hostile.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def read_container(path: Path) -> tuple[dict[str, Any], bytes]:
    """Split a container into its parsed header and its data section."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def save_sample(tmp_path: Path, name: str = "sample.safetensors") -> Path:
    """A real container written by arrayio: ``w`` (4096 bytes, first) and ``b`` (80 bytes)."""
    path = tmp_path / name
    arrayio.save(path, {"w": np.arange(1024, dtype=np.float32), "b": np.arange(10)})
    return path


# --------------------------------------------------------------------------- entry points


def _open(path: Path) -> None:
    with arrayio.open(path):
        pass


def _load(path: Path) -> None:
    arrayio.load(path)


def _read_into(path: Path) -> None:
    # open fails before the output's shape is compared, so any output will do.
    arrayio.read_into(path, np.empty(1, np.float32))


ENTRY_POINTS: dict[str, Callable[[Path], None]] = {
    "open": _open,
    "load": _load,
    "read_into": _read_into,
}


def check_error(
    error: BaseException, expected: type[arrayio.ArrayioError], path: Path, *, exact: bool = True
) -> None:
    """``error`` is ``expected`` (exactly, unless ``exact=False``), an ArrayioError, the
    builtins its class promises, and its message names ``path``."""
    if exact:
        assert type(error) is expected, f"expected {expected.__name__}, got {error!r}"
    assert isinstance(error, expected)
    assert isinstance(error, arrayio.ArrayioError)
    for builtin in BUILTINS[expected]:
        assert isinstance(error, builtin), f"{type(error).__name__} is not a {builtin.__name__}"
    assert str(path) in str(error), f"message does not name the file: {error}"


def expect(
    call: Callable[[Path], None],
    path: Path,
    expected: type[arrayio.ArrayioError],
    *,
    exact: bool = True,
) -> BaseException:
    # Catch everything so that a raw builtin (TypeError, RecursionError...) fails with a clear
    # message rather than as an error of the test itself.
    try:
        call(path)
    except Exception as error:  # noqa: BLE001 - any class is checked below
        check_error(error, expected, path, exact=exact)
        return error
    pytest.fail(f"no error for {path.name}; expected {expected.__name__}")


# --------------------------------------------------------------------------- sanity of the builders


def test_builders_make_valid_files(tmp_path: Path) -> None:
    """The hand-built files below differ from these valid ones only in the defect tested."""
    data = np.array([1.5, -2.0], np.float32).tobytes() + np.array([7], np.int64).tobytes()
    header = {"a": tensor("F32", (2,), (0, 8)), "b": tensor("I64", (), (8, 16))}
    path = write(tmp_path, container(header, data))
    loaded = arrayio.load(path)
    np.testing.assert_array_equal(loaded["a"], np.array([1.5, -2.0], np.float32))
    assert loaded["b"] == 7 and loaded["b"].dtype == np.int64

    path = write(tmp_path, npy(npy_dict("<f4", (2,)), data[:8]), "valid.npy")
    np.testing.assert_array_equal(arrayio.load(path), np.array([1.5, -2.0], np.float32))


# --------------------------------------------------------------------------- hand-built containers

ONE_F32 = {"a": tensor()}
FOUR_BYTES = b"\0" * 4
# A header that would be valid, with its encoded size, to claim lengths relative to it.
_VALID = json.dumps(ONE_F32).encode()

CONTAINER_CASES = [
    # --- too short to hold a length prefix
    pytest.param(b"", arrayio.TruncatedFileError, id="empty-file"),
    pytest.param(b"\x05\x00\x00", arrayio.TruncatedFileError, id="3-bytes"),
    pytest.param(b"\x02\x00\x00\x00\x00\x00\x00", arrayio.TruncatedFileError, id="7-bytes"),
    # --- header length beyond the file or beyond any sane header
    pytest.param(
        container(b"{}", header_length=2**63), arrayio.HeaderTooLargeError, id="header-length-2**63"
    ),
    pytest.param(
        container(b"{}", header_length=2**64 - 1),
        arrayio.HeaderTooLargeError,
        id="header-length-2**64-1",
    ),
    pytest.param(
        container(b"{}", header_length=4 << 30),
        arrayio.HeaderTooLargeError,
        id="header-length-4GiB",
    ),
    # Under the cap but beyond the end of the file: a file cut short.
    pytest.param(
        container(b"{}", header_length=99_999_999),
        arrayio.TruncatedFileError,
        id="header-length-under-cap-beyond-file",
    ),
    pytest.param(
        container(_VALID, FOUR_BYTES, header_length=len(_VALID) + 4 + 1),
        arrayio.TruncatedFileError,
        id="header-length-1-past-end",
    ),
    # --- header is not a JSON object
    pytest.param(container(b"{not json"), arrayio.FormatError, id="not-json"),
    pytest.param(container(b'{"a": "\xff\xfe"}'), arrayio.FormatError, id="not-utf8"),
    pytest.param(container(b"[]"), arrayio.FormatError, id="json-list"),
    pytest.param(container(b'"a string"'), arrayio.FormatError, id="json-string"),
    pytest.param(container(b"null"), arrayio.FormatError, id="json-null"),
    pytest.param(container(b""), arrayio.FormatError, id="zero-length-header"),
    # Python's json refuses integers over 4300 digits with a plain ValueError.
    pytest.param(
        container(
            b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
            FOUR_BYTES,
        ),
        arrayio.FormatError,
        id="integer-of-5000-digits",
    ),
    # Deep nesting makes json.loads raise RecursionError.
    pytest.param(
        container(b"[" * 100_000 + b"]" * 100_000), arrayio.FormatError, id="deeply-nested-json"
    ),
    # --- __metadata__ must map strings to strings
    pytest.param(
        container({"__metadata__": {"k": 1}, **ONE_F32}, FOUR_BYTES),
        arrayio.FormatError,
        id="metadata-value-not-string",
    ),
    pytest.param(
        container({"__metadata__": "text", **ONE_F32}, FOUR_BYTES),
        arrayio.FormatError,
        id="metadata-not-object",
    ),
    # --- malformed entries
    pytest.param(container({"a": 5}, FOUR_BYTES), arrayio.FormatError, id="entry-not-object"),
    *(
        pytest.param(
            container({"a": {k: v for k, v in tensor().items() if k != field}}, FOUR_BYTES),
            arrayio.FormatError,
            id=f"entry-missing-{field}",
        )
        for field in ("dtype", "shape", "data_offsets")
    ),
    pytest.param(
        container({"a": tensor(shape=[-1], offsets=(0, 4))}, FOUR_BYTES),
        arrayio.FormatError,
        id="shape-negative",
    ),
    # Two negative axes multiply to a positive size that matches the offsets.
    pytest.param(
        container({"a": tensor(shape=[-1, -1], offsets=(0, 4))}, FOUR_BYTES),
        arrayio.FormatError,
        id="shape-two-negatives",
    ),
    pytest.param(
        container({"a": tensor(shape=[1.0])}, FOUR_BYTES), arrayio.FormatError, id="shape-float"
    ),
    pytest.param(
        container({"a": tensor(shape=["1"])}, FOUR_BYTES),
        arrayio.FormatError,
        id="shape-string-entry",
    ),
    pytest.param(
        container({"a": tensor(shape=[True])}, FOUR_BYTES), arrayio.FormatError, id="shape-boolean"
    ),
    pytest.param(
        container({"a": tensor(shape=[[1]])}, FOUR_BYTES),
        arrayio.FormatError,
        id="shape-nested-list",
    ),
    pytest.param(
        container({"a": tensor(shape=1)}, FOUR_BYTES), arrayio.FormatError, id="shape-not-list"
    ),
    pytest.param(
        container({"a": tensor(shape=None)}, FOUR_BYTES), arrayio.FormatError, id="shape-null"
    ),
    pytest.param(
        container({"a": tensor(offsets=[0])}, FOUR_BYTES), arrayio.FormatError, id="offsets-single"
    ),
    pytest.param(
        container({"a": tensor(offsets=[0, 4, 8])}, FOUR_BYTES),
        arrayio.FormatError,
        id="offsets-triple",
    ),
    pytest.param(
        container({"a": tensor(offsets="0,4")}, FOUR_BYTES),
        arrayio.FormatError,
        id="offsets-string",
    ),
    pytest.param(
        container({"a": tensor(offsets={"begin": 0, "end": 4})}, FOUR_BYTES),
        arrayio.FormatError,
        id="offsets-object",
    ),
    pytest.param(
        container({"a": tensor(offsets=[0, 4.0])}, FOUR_BYTES),
        arrayio.FormatError,
        id="offsets-float",
    ),
    pytest.param(
        container({"a": tensor(shape=[], offsets=[False, 4])}, FOUR_BYTES),
        arrayio.FormatError,
        id="offsets-boolean",
    ),
    pytest.param(
        container({"a": tensor(offsets=[-4, 0])}, FOUR_BYTES),
        arrayio.FormatError,
        id="offsets-negative",
    ),
    pytest.param(
        container({"a": tensor(offsets=[4, 0])}, FOUR_BYTES),
        arrayio.FormatError,
        id="offsets-begin-after-end",
    ),
    # --- shape and byte range disagree
    pytest.param(
        container({"a": tensor(shape=[2, 2], offsets=[0, 12])}, b"\0" * 12),
        arrayio.FormatError,
        id="shape-2x2-f32-in-12-bytes",
    ),
    pytest.param(
        container({"a": tensor(shape=[0], offsets=[0, 4])}, FOUR_BYTES),
        arrayio.FormatError,
        id="empty-shape-with-bytes",
    ),
    # --- byte ranges outside the data section
    pytest.param(
        container({"a": tensor(shape=[2], offsets=[0, 8])}, FOUR_BYTES),
        arrayio.TruncatedFileError,
        id="offsets-past-end",
    ),
    pytest.param(
        container({"a": tensor(), "b": tensor(offsets=[4, 8])}, b"\0" * 6),
        arrayio.TruncatedFileError,
        id="second-tensor-past-end",
    ),
    pytest.param(
        container(
            {"a": tensor(shape=[100_000, 100_000], offsets=[0, 100_000 * 100_000 * 4])}, FOUR_BYTES
        ),
        arrayio.TruncatedFileError,
        id="40GB-tensor-in-4-bytes",
    ),
    # --- overlapping tensors
    pytest.param(
        container(
            {"a": tensor(shape=[2], offsets=[0, 8]), "b": tensor(shape=[2], offsets=[4, 12])},
            b"\0" * 12,
        ),
        arrayio.FormatError,
        id="overlap-partial",
    ),
    pytest.param(
        container(
            {"a": tensor(shape=[2], offsets=[0, 8]), "b": tensor(shape=[2], offsets=[0, 8])},
            b"\0" * 8,
        ),
        arrayio.FormatError,
        id="overlap-same-range",
    ),
    pytest.param(
        container(
            {"a": tensor(shape=[4], offsets=[0, 16]), "b": tensor(shape=[1], offsets=[4, 8])},
            b"\0" * 16,
        ),
        arrayio.FormatError,
        id="overlap-nested",
    ),
    # --- dtypes
    *(
        pytest.param(
            container({"a": tensor(dtype=code)}, FOUR_BYTES),
            arrayio.UnsupportedDtypeError,
            id=f"dtype-{code or 'empty'}",
        )
        for code in ("F7", "C128", "f32", "float32", "")
    ),
    # Real safetensors codes that arrayio does not handle.
    *(
        pytest.param(
            container({"a": tensor(dtype=code, offsets=(0, 1))}, b"\0"),
            arrayio.UnsupportedDtypeError,
            id=f"dtype-known-unsupported-{code}",
        )
        for code in ("F8_E8M0", "F8_E4M3FNUZ")
    ),
    # A dtype that is not a string at all is still an unknown dtype, whatever its JSON type.
    *(
        pytest.param(
            container({"a": tensor(dtype=code)}, FOUR_BYTES),
            arrayio.UnsupportedDtypeError,
            id=f"dtype-json-{kind}",
        )
        for kind, code in (
            ("number", 32),
            ("null", None),
            ("list", ["F32"]),
            ("object", {"F32": 1}),
        )
    ),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("blob", "expected"), CONTAINER_CASES)
def test_hostile_container(tmp_path: Path, blob: bytes, expected: type, entry: str) -> None:
    path = write(tmp_path, blob)
    expect(ENTRY_POINTS[entry], path, expected)


# ------------------------------------------------------------- corrupted arrayio metadata

# Each mutation edits the ``__metadata__["arrayio"]`` blob of a real saved file: given the
# blob's text, it returns the new text.


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        blob = json.loads(text)
        change(blob)
        return json.dumps(blob)

    return mutate


def _set(field: str, value: Any) -> Callable[[str], str]:
    return _edit(lambda blob: blob.__setitem__(field, value))


METADATA_CASES = [
    pytest.param(lambda text: text[:-3], arrayio.FormatError, id="blob-cut-short"),
    pytest.param(lambda text: "not json", arrayio.FormatError, id="blob-not-json"),
    pytest.param(lambda text: "[1, 2]", arrayio.FormatError, id="blob-json-list"),
    pytest.param(
        _edit(lambda blob: blob.pop("version")), arrayio.FormatError, id="version-missing"
    ),
    pytest.param(_set("version", "1"), arrayio.FormatError, id="version-string"),
    pytest.param(_set("version", 999), arrayio.FormatError, id="version-999"),
    pytest.param(_set("crc32c", {"w": "xyz"}), arrayio.FormatError, id="crc-not-hex"),
    pytest.param(_set("crc32c", {"w": "1234567"}), arrayio.FormatError, id="crc-7-digits"),
    pytest.param(_set("crc32c", {"w": "123456789"}), arrayio.FormatError, id="crc-9-digits"),
    pytest.param(_set("crc32c", {"w": "ABCDEF01"}), arrayio.FormatError, id="crc-uppercase"),
    pytest.param(_set("crc32c", {"w": 12345678}), arrayio.FormatError, id="crc-number"),
    pytest.param(_set("crc32c", ["00000000"]), arrayio.FormatError, id="crc-not-object"),
    pytest.param(
        _edit(lambda blob: blob["crc32c"].__setitem__("ghost", "00000000")),
        arrayio.FormatError,
        id="crc-of-unknown-tensor",
    ),
    pytest.param(
        _set("tree", {"dict": [["w", {"leaf": "ghost"}]]}),
        arrayio.FormatError,
        id="tree-names-missing-tensor",
    ),
    pytest.param(_set("tree", 5), arrayio.FormatError, id="tree-number"),
    pytest.param(_set("tree", {"dict": 5}), arrayio.FormatError, id="tree-dict-of-number"),
    pytest.param(_set("tree", {"leaf": ["w"]}), arrayio.FormatError, id="tree-leaf-list"),
    pytest.param(_set("json_metadata", 5), arrayio.FormatError, id="json-metadata-number"),
    pytest.param(
        _set("dtypes", {"w": "complex128"}), arrayio.UnsupportedDtypeError, id="real-dtype-mismatch"
    ),
    pytest.param(
        _set("dtypes", {"w": "no-such-dtype"}),
        arrayio.UnsupportedDtypeError,
        id="real-dtype-unknown",
    ),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("mutate", "expected"), METADATA_CASES)
def test_corrupt_arrayio_metadata(
    tmp_path: Path, mutate: Callable[[str], str], expected: type, entry: str
) -> None:
    header, data = read_container(save_sample(tmp_path))
    header["__metadata__"]["arrayio"] = mutate(header["__metadata__"]["arrayio"])
    path = write(tmp_path, container(header, data))
    expect(ENTRY_POINTS[entry], path, expected)


def test_undamaged_sample_round_trips(tmp_path: Path) -> None:
    """Re-encoding an unmodified header gives a valid file: the cases above test only their
    one change."""
    header, data = read_container(save_sample(tmp_path))
    path = write(tmp_path, container(header, data))
    loaded = arrayio.load(path)
    np.testing.assert_array_equal(loaded["w"], np.arange(1024, dtype=np.float32))
    np.testing.assert_array_equal(loaded["b"], np.arange(10))


# --------------------------------------------------------------------------- truncated real files


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("cut", [1, 3, 80, 81, 4000])
def test_truncated_container(tmp_path: Path, cut: int, entry: str) -> None:
    # The sample's data is 4096 bytes of "w" then 80 of "b": the cuts end inside "b", exactly
    # at its start, and inside "w".
    path = save_sample(tmp_path)
    os.truncate(path, path.stat().st_size - cut)
    expect(ENTRY_POINTS[entry], path, arrayio.TruncatedFileError)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_container_cut_to_its_header(tmp_path: Path, entry: str) -> None:
    path = save_sample(tmp_path)
    with arrayio.open(path) as reader:
        data_start = min(info.file_offset for info in reader.arrays.values())
    os.truncate(path, data_start)
    expect(ENTRY_POINTS[entry], path, arrayio.TruncatedFileError)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_container_cut_inside_its_header(tmp_path: Path, entry: str) -> None:
    path = save_sample(tmp_path)
    os.truncate(path, 100)
    expect(ENTRY_POINTS[entry], path, arrayio.TruncatedFileError)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_truncated_npy(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "x.npy"
    arrayio.save(path, np.arange(100, dtype=np.float32))
    os.truncate(path, path.stat().st_size - 3)
    expect(ENTRY_POINTS[entry], path, arrayio.TruncatedFileError)


# --------------------------------------------------------------------------- checksums


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, int]:
    """A saved sample with one byte of ``w`` flipped; returns the path and the byte's index
    within ``w``."""
    path = save_sample(tmp_path)
    with arrayio.open(path) as reader:
        offset = reader["w"].file_offset
    flip_byte(path, offset + 101)
    return path, 101


CHECKSUM_READS: dict[str, Callable[[Path], Any]] = {
    "load": lambda path: arrayio.load(path),
    "load-keys-str": lambda path: arrayio.load(path, keys="w"),
    "load-keys-list": lambda path: arrayio.load(path, keys=["w", "b"]),
    "reader-read": lambda path: arrayio.open(path).read("w"),
    "read_into": lambda path: arrayio.read_into(path, np.empty(1024, np.float32), key="w"),
}


@pytest.mark.parametrize("read", CHECKSUM_READS)
def test_flipped_byte_fails_checksum(damaged: tuple[Path, int], read: str) -> None:
    path, _ = damaged
    error = expect(CHECKSUM_READS[read], path, arrayio.ChecksumError)
    assert "'w'" in str(error), f"message does not name the damaged array: {error}"


def test_checksums_are_per_array(damaged: tuple[Path, int]) -> None:
    path, _ = damaged
    np.testing.assert_array_equal(arrayio.load(path, keys="b"), np.arange(10))


def _assert_shows_flipped_byte(w: np.ndarray, index: int) -> None:
    expected = np.arange(1024, dtype=np.float32).view(np.uint8).copy()
    expected[index] ^= 0xFF
    np.testing.assert_array_equal(np.asarray(w).view(np.uint8), expected)


def test_verify_false_loads_damaged_data(damaged: tuple[Path, int]) -> None:
    path, index = damaged
    _assert_shows_flipped_byte(arrayio.load(path, verify=False)["w"], index)
    with arrayio.open(path, verify=False) as reader:
        _assert_shows_flipped_byte(reader.read("w"), index)
    out = np.empty(1024, np.float32)
    _assert_shows_flipped_byte(arrayio.read_into(path, out, key="w", verify=False), index)


def test_config_turns_verification_off_within_block(damaged: tuple[Path, int]) -> None:
    path, index = damaged
    with arrayio.config.set(verify_checksums=False):
        _assert_shows_flipped_byte(arrayio.load(path)["w"], index)
        # An explicit verify=True still wins over the setting.
        with pytest.raises(arrayio.ChecksumError):
            arrayio.load(path, keys="w", verify=True)
    assert arrayio.config.get().verify_checksums is True
    with pytest.raises(arrayio.ChecksumError):
        arrayio.load(path, keys="w")


# --------------------------------------------------------------------------- hostile .npy

NPY_CASES = [
    pytest.param(b"\x93NUMPX\x01\x00" + b"\0" * 120, arrayio.FormatError, id="bad-magic"),
    pytest.param(b"\x93NUMP", arrayio.TruncatedFileError, id="cut-inside-magic"),
    pytest.param(NPY_MAGIC + b"\x01", arrayio.TruncatedFileError, id="cut-inside-version"),
    pytest.param(NPY_MAGIC + b"\x01\x00\x76", arrayio.TruncatedFileError, id="cut-inside-length"),
    pytest.param(npy(npy_dict())[:50], arrayio.TruncatedFileError, id="cut-inside-header"),
    pytest.param(
        npy(npy_dict(), b"\0" * 4, header_length=0xFFFF),
        arrayio.HeaderTooLargeError,
        id="v1-header-length-65535",
    ),
    pytest.param(
        npy(npy_dict(), b"\0" * 4, version=2, header_length=0xFFFF_FFFF),
        arrayio.HeaderTooLargeError,
        id="v2-header-length-4GiB",
    ),
    pytest.param(npy(npy_dict(), b"\0" * 4, version=9), arrayio.FormatError, id="unknown-version"),
    pytest.param(npy("[1, 2]"), arrayio.FormatError, id="header-list-literal"),
    pytest.param(npy("{'descr': '<f4'"), arrayio.FormatError, id="header-unclosed-dict"),
    pytest.param(npy("{'descr': '<f4'}"), arrayio.FormatError, id="header-missing-keys"),
    # Not a literal: must be refused by the parser, never evaluated.
    pytest.param(npy("__import__('os').getcwd()"), arrayio.FormatError, id="header-code"),
    pytest.param(npy(b"\xff" * 20), arrayio.FormatError, id="header-binary"),
    pytest.param(npy(npy_dict("<f4", (-1,))), arrayio.FormatError, id="shape-negative"),
    pytest.param(
        npy(npy_dict("<f4", (-1, -1)), b"\0" * 4), arrayio.FormatError, id="shape-two-negatives"
    ),
    pytest.param(npy(npy_dict("|O"), b"\0" * 8), arrayio.UnsupportedDtypeError, id="object-dtype"),
    pytest.param(
        npy("{'descr': [('x', '<f4')], 'fortran_order': False, 'shape': (1,), }", b"\0" * 4),
        arrayio.UnsupportedDtypeError,
        id="structured-dtype",
    ),
    pytest.param(
        npy(npy_dict(">f4"), b"\0" * 4), arrayio.UnsupportedDtypeError, id="big-endian-dtype"
    ),
    # NumPy reads a comma string as a structured dtype, through ast.literal_eval.
    pytest.param(
        npy(npy_dict(",i2"), b"\0" * 4), arrayio.UnsupportedDtypeError, id="comma-string-dtype"
    ),
    # A deprecated alias: NumPy warns (an error under -W error) before it answers.
    pytest.param(
        npy(npy_dict("|a4"), b"\0" * 4), arrayio.UnsupportedDtypeError, id="deprecated-alias-dtype"
    ),
    pytest.param(
        npy(npy_dict("<U1"), b"\0" * 4), arrayio.UnsupportedDtypeError, id="unicode-dtype"
    ),
    pytest.param(
        npy(npy_dict("<f4", (2,)), b"\0" * 4),
        arrayio.TruncatedFileError,
        id="shape-one-element-too-many",
    ),
    pytest.param(
        npy(npy_dict("<f4", (100_000, 100_000)), b"\0" * 4),
        arrayio.TruncatedFileError,
        id="40GB-shape-in-4-bytes",
    ),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("blob", "expected"), NPY_CASES)
def test_hostile_npy(tmp_path: Path, blob: bytes, expected: type, entry: str) -> None:
    path = write(tmp_path, blob, "hostile.npy")
    # A file with a wrong magic is not recognised as .npy at all (it is read as a container
    # with a garbage header length): any FormatError will do.
    bad_magic = not NPY_MAGIC.startswith(blob[:6])
    expect(ENTRY_POINTS[entry], path, expected, exact=not bad_magic)


# --------------------------------------------------------------------------- no large allocation

MEMORY_CASES = [
    pytest.param(
        container(b"{}", header_length=2**63),
        "x.safetensors",
        arrayio.HeaderTooLargeError,
        id="header-length-2**63",
    ),
    pytest.param(
        container(b"{}", header_length=8 << 30),
        "x.safetensors",
        arrayio.HeaderTooLargeError,
        id="header-length-8GiB",
    ),
    # Under the header size cap, so only the file size stops it being read.
    pytest.param(
        container(b"{}", header_length=99_999_999),
        "x.safetensors",
        arrayio.TruncatedFileError,
        id="header-length-under-cap",
    ),
    pytest.param(
        container(
            {"a": tensor(shape=[100_000, 100_000], offsets=[0, 100_000 * 100_000 * 4])}, FOUR_BYTES
        ),
        "x.safetensors",
        arrayio.TruncatedFileError,
        id="40GB-tensor",
    ),
    pytest.param(
        npy(npy_dict("<f4", (100_000, 100_000)), FOUR_BYTES),
        "x.npy",
        arrayio.TruncatedFileError,
        id="npy-40GB-shape",
    ),
    pytest.param(
        npy(npy_dict(), FOUR_BYTES, version=2, header_length=0xFFFF_FFFF),
        "x.npy",
        arrayio.HeaderTooLargeError,
        id="npy-header-length-4GiB",
    ),
    # Shapes no framework can allocate even empty: too many dimensions, strides past 64 bits.
    pytest.param(
        container({"a": tensor(shape=[1] * 66, offsets=[0, 4])}, FOUR_BYTES),
        "x.safetensors",
        arrayio.FormatError,
        id="66-dimensions",
    ),
    pytest.param(
        container({"a": tensor(shape=[0, 2**40, 2**40], offsets=[0, 0])}),
        "x.safetensors",
        arrayio.FormatError,
        id="empty-shape-beyond-64-bits",
    ),
    pytest.param(
        container({"a": tensor(shape=[0, 2**63], offsets=[0, 0])}),
        "x.safetensors",
        arrayio.FormatError,
        id="dimension-beyond-64-bits",
    ),
    pytest.param(
        npy(npy_dict("<f4", (0,) * 66)), "x.npy", arrayio.FormatError, id="npy-66-dimensions"
    ),
    pytest.param(
        npy(npy_dict("<f4", (0, 2**62, 2**62))),
        "x.npy",
        arrayio.FormatError,
        id="npy-empty-shape-beyond-64-bits",
    ),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("blob", "name", "expected"), MEMORY_CASES)
def test_refused_before_large_allocation(
    tmp_path: Path, blob: bytes, name: str, expected: type, entry: str
) -> None:
    path = write(tmp_path, blob, name)
    call = ENTRY_POINTS[entry]

    def attempt() -> Exception | None:
        try:
            call(path)
        except Exception as error:  # noqa: BLE001 - the caller checks the class
            return error
        return None

    attempt()  # once untraced, so that imports and caches are warm
    tracemalloc.start()
    try:
        error = attempt()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_LIMIT, f"peak traced memory {peak} bytes while refusing {name}"
    assert error is not None, f"no error for {name}; expected {expected.__name__}"
    check_error(error, expected, path)


# --------------------------------------------------------------------------- the header's CRC

# A pytree whose header holds every kind of fact a flip could change: keys, nesting, constants,
# dtypes, shapes, user metadata and the tensors' own checksums.
DESCRIBED = {
    "params": {
        "w": np.arange(24, dtype=np.float32).reshape(4, 6),
        "b": np.arange(3, dtype=np.int16),
    },
    "opt": [np.ones(2, np.complex128), None, 7, "adam"],
    "step": 1200,
}


def _same_load(loaded: Any, expected: Any) -> bool:
    if isinstance(expected, dict):
        return (
            isinstance(loaded, dict)
            and loaded.keys() == expected.keys()
            and all(_same_load(loaded[k], v) for k, v in expected.items())
        )
    if isinstance(expected, list | tuple):
        return (
            type(loaded) is type(expected)
            and len(loaded) == len(expected)
            and all(_same_load(a, b) for a, b in zip(loaded, expected, strict=True))
        )
    if isinstance(expected, np.ndarray):
        return (
            isinstance(loaded, np.ndarray)
            and loaded.dtype == expected.dtype
            and loaded.shape == expected.shape
            and loaded.tobytes() == expected.tobytes()
        )
    return type(loaded) is type(expected) and loaded == expected


@pytest.mark.slow
def test_no_single_bit_flip_in_a_header_loads_silently(tmp_path: Path) -> None:
    """Every bit of the length prefix and of the header's JSON (the padding after it is
    covered too, and is checked by the fuzz suite): a flip either raises an ArrayioError or
    leaves what loads exactly as saved."""
    path = tmp_path / "described.safetensors"
    arrayio.save(path, DESCRIBED, metadata={"run": "baseline", "lr": 0.1})
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    used = 8 + len(blob[8 : 8 + length].rstrip(b" "))
    silent = []
    for offset in range(used):
        for bit in range(8):
            damaged = bytearray(blob)
            damaged[offset] ^= 1 << bit
            path.write_bytes(damaged)
            try:
                with arrayio.open(path) as reader:
                    loaded, metadata = reader.load(), reader.metadata
            except arrayio.ArrayioError:
                continue
            if not (_same_load(loaded, DESCRIBED) and metadata == {"run": "baseline", "lr": 0.1}):
                silent.append((offset, bit, blob[offset : offset + 1]))
    assert silent == [], f"{len(silent)} flips changed what loads without an error: {silent[:5]}"


def _rename_key(blob: bytes, old: bytes, new: bytes) -> bytes:
    assert blob.count(old) == 1
    return blob.replace(old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'\\"tree\\"', b'\\"tsee\\"'),  # the structure: load() would return {}
        (b'\\"crc32c\\"', b'\\"crc32b\\"'),  # every tensor's checksum
        (b'"arrayio":', b'"arrayjo":'),  # arrayio's facts: a plain safetensors file
        (b'"arrayio_header_crc32c"', b'"arrayio_header_crc32b"'),  # the header's own CRC
    ],
    ids=["tree", "tensor-crcs", "arrayio-key", "header-crc-key"],
)
def test_a_renamed_key_in_the_header_is_caught(tmp_path: Path, old: bytes, new: bytes) -> None:
    path = save_sample(tmp_path)
    path.write_bytes(_rename_key(path.read_bytes(), old, new))
    expect(lambda p: arrayio.load(p), path, arrayio.ChecksumError)
    loaded = arrayio.load(path, verify=False)  # what the damage would have given
    assert isinstance(loaded, dict)


def test_a_header_arrayio_wrote_before_it_had_a_crc_still_loads(tmp_path: Path) -> None:
    """Format 1 files (no header CRC) load as before."""
    header, data = read_container(save_sample(tmp_path))
    del header["__metadata__"][HEADER_CRC_KEY]
    facts = json.loads(header["__metadata__"]["arrayio"])
    header["__metadata__"]["arrayio"] = json.dumps({**facts, "version": 1})
    path = write(tmp_path, container(header, data), "format1.safetensors")
    loaded = arrayio.load(path)
    np.testing.assert_array_equal(loaded["w"], np.arange(1024, dtype=np.float32))
    with arrayio.open(path) as reader:
        assert reader.metadata == {}


@pytest.mark.parametrize("bad", ["0123abc", "0123abcde", "0123ABCD", "0123abcg", ""])
def test_a_malformed_tensor_checksum_is_named(tmp_path: Path, bad: str) -> None:
    """Each tensor's CRC in arrayio's facts is 8 lowercase hex digits; the first that is not
    is named, among many that are."""
    source = tmp_path / "many.safetensors"
    arrayio.save(source, {f"a{i}": np.full(4, i, np.float32) for i in range(50)})
    header, data = read_container(source)
    del header["__metadata__"][HEADER_CRC_KEY]
    facts = json.loads(header["__metadata__"]["arrayio"])
    facts["crc32c"]["a37"] = bad
    header["__metadata__"]["arrayio"] = json.dumps({**facts, "version": 1})
    path = write(tmp_path, container(header, data), "badcrc.safetensors")
    with pytest.raises(arrayio.FormatError, match=r"checksum of 'a37' is .*8 hex digits"):
        arrayio.open(path)


def test_the_header_crc_is_not_user_metadata(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    arrayio.save(path, {"w": np.ones(2)}, metadata={"run": "a"})
    with arrayio.open(path) as reader:
        assert reader.metadata == {"run": "a"}
    with pytest.raises(arrayio.UnsupportedObjectError, match="reserved"):
        arrayio.save(path, {"w": np.ones(2)}, metadata={HEADER_CRC_KEY: "0"})


# --------------------------------------------------------------------------- memory


def _available() -> int:
    from arrayio.runtime import _memory

    available = _memory.available_host_bytes()
    if available is None:
        pytest.skip("this platform does not say how much memory is available")
    return available


def test_a_sparse_file_larger_than_memory_is_refused_before_allocating(tmp_path: Path) -> None:
    """A valid header over a sparse file (4 KiB on disk) whose tensor is larger than the
    memory available: an OutOfMemoryError that says so, before anything large is allocated;
    a few rows of it still read."""
    nbytes = _available() * 4 // 4096 * 4096
    header = {"big": tensor("U8", (nbytes // 4096, 4096), (0, nbytes))}
    path = write(tmp_path, container(header))
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size + nbytes)
    tracemalloc.start()
    try:
        error = expect(lambda p: arrayio.load(p), path, arrayio.OutOfMemoryError)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_LIMIT and isinstance(error, MemoryError)
    assert "sparse" in str(error)
    with arrayio.open(path) as reader:
        assert not reader.read("big", index=slice(0, 3)).any()


def test_a_frameworks_memory_error_becomes_an_arrayio_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_sample(tmp_path)

    def no_memory(*args: Any) -> Any:
        raise MemoryError("Unable to allocate")

    monkeypatch.setattr("arrayio.api._reader.allocate", no_memory)
    error = expect(lambda p: arrayio.load(p), path, arrayio.OutOfMemoryError)
    assert "'w'" in str(error) or "'b'" in str(error)


@pytest.mark.slow
def test_many_empty_tensors_take_memory_in_proportion_to_the_header(tmp_path: Path) -> None:
    """A valid file of 30,000 empty tensors: a load's peak memory stays within a small
    multiple of the header's size (each result used to take 4 KiB of alignment padding)."""
    count = 30_000
    header = {f"t{i}": tensor("F32", (0,), (0, 0)) for i in range(count)}
    blob = container(header)
    path = write(tmp_path, blob, "empty.safetensors")
    tracemalloc.start()
    try:
        loaded = arrayio.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(loaded) == count
    assert peak < 40 * len(blob), f"{peak / len(blob):.0f}x the file's size"
    print(f"peak {peak / len(blob):.1f}x the file's size")


# --------------------------------------------------------------------------- not our files


def test_a_text_file_is_not_a_safetensors_file(tmp_path: Path) -> None:
    path = write(tmp_path, b"hello world, this is a text file\n" * 10, "notes.safetensors")
    error = expect(ENTRY_POINTS["load"], path, arrayio.FormatError)
    assert "not a safetensors or .npy file" in str(error)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_directory_is_refused_with_its_path(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "ckpt.safetensors"
    path.mkdir()
    error = expect(ENTRY_POINTS[entry], path, arrayio.FormatError)
    assert "directory" in str(error)


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    path = tmp_path / "pipe.safetensors"
    os.mkfifo(path)
    expect(ENTRY_POINTS["load"], path, arrayio.FormatError)


def test_a_tensor_named_twice_is_refused(tmp_path: Path) -> None:
    raw = b'{"a":' + json.dumps(tensor()).encode() + b',"a":' + json.dumps(tensor()).encode() + b"}"
    path = write(tmp_path, container(raw, FOUR_BYTES))
    error = expect(ENTRY_POINTS["load"], path, arrayio.FormatError)
    assert "'a' twice" in str(error)


def test_json_metadata_naming_a_key_twice_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    arrayio.save(path, {"w": np.ones(2)}, metadata={"cfg": {"lr": 0.1}})
    header, data = read_container(path)
    facts = json.loads(header["__metadata__"]["arrayio"])
    facts["json_metadata"] = ["cfg", "cfg"]
    header["__metadata__"]["arrayio"] = json.dumps(facts, separators=(",", ":"))
    path = write(tmp_path, container(header, data))
    expect(ENTRY_POINTS["open"], path, arrayio.FormatError)


@pytest.mark.parametrize("stray", [b"'", b'"', b"\\", b"(", b"x"])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.99])
def test_a_stray_byte_in_npy_padding_is_refused_at_once(
    tmp_path: Path, stray: bytes, where: float
) -> None:
    """NumPy's fallback parser for Python 2 era headers takes seconds on such a header."""
    path = tmp_path / "x.npy"
    arrayio.save(path, np.arange(10.0))  # its header is padded to 4 KiB
    blob = bytearray(path.read_bytes())
    end = blob.index(b"}") + 1
    padding_end = blob.index(b"\n", end)
    blob[end + int((padding_end - end) * where)] = stray[0]
    path.write_bytes(blob)
    started = time.perf_counter()
    expect(ENTRY_POINTS["load"], path, arrayio.FormatError)
    assert time.perf_counter() - started < 0.5
