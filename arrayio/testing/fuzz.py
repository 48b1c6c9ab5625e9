"""A mutation fuzzer over every format arrayio reads, with an oracle run in child processes.

Seeds are small files written by ``arrayio.save`` (containers and ``.npy``), by ``numpy.save``
and by the ``safetensors`` package. Each case mutates one seed (a bit flip, a byte
overwrite, a truncation, appended bytes, a new length prefix, or a structured edit of a
safetensors JSON header or a ``.npy`` header) and runs every way of reading it:
``arrayio.open`` (keys, arrays, metadata, structure), ``arrayio.load``, ``Reader.read`` of the
first row of each array of one dimension or more, ``arrayio.read_into`` and the CLI's
``info`` and ``verify``. The case's outcome is one of

``ok-identical``
    every reading gave what the pristine seed gives;
``ok-changed``
    a reading succeeded with another result, from a file that records no checksum of its
    header (``.npy``, foreign safetensors), or from an arrayio container whose header a
    structured edit rewrote without any arrayio metadata left: that is a valid foreign file,
    which no checksum kept inside the file can tell from a damaged one (a byte-level
    mutation never gets this allowance);
``clean-error``
    every difference was refused with an :class:`~arrayio.ArrayioError` (or
    ``FileNotFoundError``); a CLI command exited non-zero without a traceback;

or a failure:

``other-exception``
    any other exception escaped (its type and message are kept), or the CLI printed a
    traceback;
``silent-change``
    a container arrayio wrote read back differently without an error: keys, structure,
    constants, dtypes, shapes, checksums, metadata, or values bit for bit (for the first-row
    read, values only when the mutation left the data section alone, since partial reads are
    not checksummed);
``slow``
    a case's six readings took over :data:`SLOW_SECONDS` together (a case still running
    then is interrupted by ``SIGALRM``; one stuck where Python cannot interrupt it is killed
    by the parent after :data:`HANG_SECONDS` without progress);
``signal``
    the child process died by a signal (SIGBUS, SIGSEGV...);
``memory``
    a reading grew the child's peak resident memory by more than :data:`MEMORY_BASE` plus
    :data:`MEMORY_FACTOR` times the file's size (Linux's ``VmHWM``, reset before each
    reading through ``/proc/self/clear_refs``; elsewhere the growth of ``ru_maxrss``), or
    raised ``MemoryError`` under the child's address-space limit
    (:data:`ADDRESS_SPACE_LIMIT`). Resident memory, not ``tracemalloc``: tracing every
    allocation made the cases eight times slower.

Cases run in batches, one child process per batch (``python -m arrayio.testing.fuzz --child``),
several children at once. A child reports each case as it starts and ends, so when one dies
the parent knows the case: it runs that case again alone to attribute the death, then goes
on with the rest of the batch in a new child. Everything is determined by the campaign seed:
case ``S:N`` is the ``N``-th case of seed ``S`` and ``--replay S:N`` runs it again.

::

    python -m arrayio.testing.fuzz --cases 5000 --seed 0 [--seconds 600] [--json out.json]
    python -m arrayio.testing.fuzz --replay 0:1234 [--keep mutated.safetensors]
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import json
import os
import queue
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "ADDRESS_SPACE_LIMIT",
    "FAILURE_KINDS",
    "MEMORY_BASE",
    "MEMORY_FACTOR",
    "SLOW_SECONDS",
    "Campaign",
    "Case",
    "Seed",
    "main",
    "make_case",
    "read_seeds",
    "replay",
    "run_campaign",
    "write_seeds",
]

OK_KINDS = ("ok-identical", "ok-changed", "clean-error")
FAILURE_KINDS = ("other-exception", "silent-change", "slow", "signal", "memory")
SLOW_SECONDS = 5.0
# A reading may allocate this much plus MEMORY_FACTOR times the file (the result itself, a
# copy for finishing, the header's Python objects) before it counts as a memory failure.
MEMORY_BASE = 64 << 20
MEMORY_FACTOR = 64
# Children cannot map more than this: an allocation a hostile header asks for fails with
# MemoryError (counted as ``memory``) rather than swapping the machine.
ADDRESS_SPACE_LIMIT = 8 << 30
# The parent kills a child whose current case has run this long, and counts it ``slow``.
HANG_SECONDS = 30.0
# This process's limit for a case (a child's can be lowered, to test the runner itself).
_limits = {"slow": SLOW_SECONDS}

OPERATIONS = ("open", "load", "read-slice", "read_into", "cli-info", "cli-verify")
# Severity, worst first: a case's outcome is its worst operation's.
_SEVERITY = (
    "signal",
    "slow",
    "memory",
    "other-exception",
    "silent-change",
    "ok-changed",
    "clean-error",
    "ok-identical",
)


# --------------------------------------------------------------------------- seeds


@dataclasses.dataclass(frozen=True)
class Seed:
    """A pristine file the cases mutate.

    Attributes
    ----------
    name
        Its name (also its file's stem).
    format
        ``"arrayio"`` (a container arrayio wrote), ``"arrayio-npy"``, ``"numpy-npy"`` or
        ``"safetensors"`` (written by the safetensors package).
    suffix
        The file's extension, ``".safetensors"`` or ``".npy"``.
    """

    name: str
    format: str
    suffix: str

    @property
    def filename(self) -> str:
        return self.name + self.suffix

    @property
    def checksummed(self) -> bool:
        """Whether arrayio wrote it as a container: then no change may go unnoticed."""
        return self.format == "arrayio"

    @property
    def container(self) -> bool:
        return self.suffix == ".safetensors"


Pair = collections.namedtuple("Pair", ["first", "second"], module=__name__)

SEEDS = (
    Seed("tree", "arrayio", ".safetensors"),
    Seed("small", "arrayio", ".safetensors"),
    Seed("ml-dtypes", "arrayio", ".safetensors"),
    Seed("arrayio", "arrayio-npy", ".npy"),
    Seed("numpy", "numpy-npy", ".npy"),
    Seed("numpy-fortran", "numpy-npy", ".npy"),
    Seed("foreign", "safetensors", ".safetensors"),
)
# How often each format is fuzzed: arrayio's containers carry the guarantee.
_FORMAT_WEIGHTS = {"arrayio": 0.5, "arrayio-npy": 0.125, "numpy-npy": 0.125, "safetensors": 0.25}


def _ml_dtypes() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


def seed_object(name: str) -> Any:
    """What the seed ``name`` holds, built afresh (the same every time)."""
    rng = np.random.default_rng(7)
    if name == "tree":
        return {
            "params": {
                "w": rng.standard_normal((3, 4)).astype(np.float32),
                "b": np.arange(5, dtype=np.float16),
                "mask": np.array([True, False, True]),
                "q": np.arange(-4, 4, dtype=np.int8).reshape(2, 4),
            },
            "stats": [
                np.array([1.5, -0.0, np.inf, np.nan]),
                np.array(7, dtype=np.int64),
                np.empty((0, 3), np.float32),
            ],
            "z": (np.array([1 + 2j, -3.5 - 0.25j], np.complex128), Pair(2, "two")),
            "consts": {
                "int": 2**70,
                "neg": -3,
                "float": -0.0,
                "nan": float("nan"),
                "complex": 1.5 - 2j,
                "str": 'h\u00e9llo "q"',
                "true": True,
                "none": None,
            },
            "u": np.array([0, 255, 7], np.uint8),
        }
    if name == "small":
        return {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    if name == "ml-dtypes":
        ml = _ml_dtypes()
        assert ml is not None
        return {
            "bf": np.array([[1.0, -2.5], [0.125, 3.0]], ml.bfloat16),
            "f8": np.array([0.5, 1.0, -2.0], ml.float8_e4m3fn),
            "i32": np.arange(6, dtype=np.int32),
        }
    if name == "arrayio":
        return np.arange(20, dtype=np.float32).reshape(4, 5)
    if name == "numpy":
        return np.linspace(-1, 1, 6).reshape(3, 2)
    if name == "numpy-fortran":
        return np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4))
    if name == "foreign":
        return {
            "a": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b": np.array([1, -1, 2], np.int64),
            "c": np.array([True, False]),
        }
    raise KeyError(name)


SEED_METADATA = {"note": "seed", "n": 3, "nested": {"a": [1, 2.5, None]}}


def available_seeds() -> list[Seed]:
    """The seeds this installation can write (``ml-dtypes`` needs ml_dtypes; ``foreign``
    needs the safetensors package)."""
    import importlib.util

    seeds = []
    for seed in SEEDS:
        if seed.name == "ml-dtypes" and _ml_dtypes() is None:
            continue
        if seed.name == "foreign" and importlib.util.find_spec("safetensors") is None:
            continue
        seeds.append(seed)
    return seeds


def write_seeds(directory: str | os.PathLike[str]) -> list[Seed]:
    """Write every available seed into ``directory``.

    Returns
    -------
    list of Seed
        The seeds written (see :func:`available_seeds`).

    Raises
    ------
    AssertionError
        If a seed arrayio wrote does not load back exactly (the fuzzer would be comparing
        against a broken reference).
    """
    import arrayio

    directory = os.fspath(directory)
    seeds = available_seeds()
    for seed in seeds:
        path = os.path.join(directory, seed.filename)
        obj = seed_object(seed.name)
        if seed.format == "arrayio":
            arrayio.save(
                path, obj, metadata=SEED_METADATA if seed.name == "tree" else None, progress=False
            )
        elif seed.format == "arrayio-npy":
            arrayio.save(path, obj, progress=False)
        elif seed.format == "numpy-npy":
            np.save(path, obj)
        else:
            from safetensors.numpy import save_file

            save_file(obj, path, metadata={"origin": "safetensors"})
        if seed.format.startswith("arrayio"):
            got = _fingerprint(arrayio.load(path))
            want = _fingerprint(obj)
            if got != want:
                raise AssertionError(f"seed {seed.name} does not round-trip: {_diff(want, got)}")
    return seeds


def read_seeds(directory: str | os.PathLike[str]) -> tuple[list[Seed], dict[str, bytes]]:
    """Read back what :func:`write_seeds` wrote.

    Returns
    -------
    seeds, blobs
        The seeds found in ``directory``, and their bytes by seed name.
    """
    seeds = [
        seed for seed in available_seeds() if os.path.exists(os.path.join(directory, seed.filename))
    ]
    blobs = {}
    for seed in seeds:
        with open(os.path.join(directory, seed.filename), "rb") as file:
            blobs[seed.name] = file.read()
    return seeds, blobs


# --------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a seed's parts lie: length fields before ``header_start``, the header's text up
    to ``text_end``, its padding up to ``data_start``, then data."""

    kind: str  # "safetensors" or "npy"
    header_start: int
    text_end: int
    data_start: int
    size: int

    def region(self, offset: int) -> str:
        if offset < self.header_start:
            return "length prefix" if self.kind == "safetensors" else "magic/version/length"
        if offset < self.text_end:
            return "header"
        if offset < self.data_start:
            return "header padding"
        return "data"


def _layout(blob: bytes, suffix: str) -> _Layout:
    if suffix == ".npy":
        length_size = 2 if blob[6] == 1 else 4
        (header_len,) = struct.unpack("<H" if length_size == 2 else "<I", blob[8 : 8 + length_size])
        start = 8 + length_size
        text = blob[start : start + header_len]
        return _Layout(
            "npy", start, start + len(text.rstrip(b" \n")), start + header_len, len(blob)
        )
    (header_len,) = struct.unpack("<Q", blob[:8])
    text = blob[8 : 8 + header_len]
    return _Layout("safetensors", 8, 8 + len(text.rstrip(b" ")), 8 + header_len, len(blob))


# --------------------------------------------------------------------------- mutations


@dataclasses.dataclass(frozen=True)
class Case:
    """One mutated file: ``id`` is ``"SEED:N"`` (campaign seed, case number)."""

    id: str
    seed: Seed
    mutation: str
    data: bytes
    touches_data: bool  # whether bytes of the data section changed (partial reads may differ)
    # A structured edit left a valid header with no arrayio metadata: a foreign file.
    forged_foreign: bool = False


INTERESTING_BYTES = (0x00, 0xFF, ord('"'), ord("{"), ord("9"), ord("-"), ord(" "), 0x80)
HOSTILE_NUMBERS: tuple[Any, ...] = (
    2**63,
    2**64,
    2**64 + 1,
    10**30,
    -1,
    -(2**63),
    0,
    1.0,
    1.5,
    -0.0,
    1e308,
    float("inf"),
    float("nan"),
    True,
    False,
    None,
    "1",
    [1],
    {},
)
HOSTILE_VALUES: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    2**64,
    1.5,
    "",
    "x",
    "F32",
    "BOOL",
    "C64",
    [],
    {},
    [0, 4],
    {"leaf": "w"},
    {"dict": []},
    {"none": None},
)
DTYPE_CODES = (
    "F16",
    "F32",
    "F64",
    "BF16",
    "I8",
    "U8",
    "I16",
    "I32",
    "U32",
    "I64",
    "U64",
    "BOOL",
    "C64",
    "F8_E4M3",
    "F8_E5M2",
    "F4",
    "",
    "f32",
)
NPY_SHAPES: tuple[Any, ...] = (
    (2**62,),
    (2**63,),
    (2**64,),
    (10**30,),
    (10**6, 10**6),
    (-1,),
    (1.5,),
    ("a",),
    (True,),
    ((1,),),
    (1,) * 66,
    (1,) * 65,
    (1,) * 64,
    (0,) * 66,
    (),
    (0,),
    None,
    [1],
)
NPY_DESCRS: tuple[Any, ...] = (
    "<f2",
    "|b1",
    ">f8",
    "|O",
    "<U4",
    "|V4",
    "<c16",
    "<M8[s]",
    "<m8[s]",
    "<f4",
    "<i8",
    "bfloat16",
    "",
    5,
    None,
    [("a", "<f4")],
    "<f16",
    "|S4",
    "<g",
)
_DUP = "@@arrayio-fuzz-duplicate@@"
_BIG = "@@arrayio-fuzz-big@@"
_BLOB = "@@arrayio-fuzz-blob@@"


def _rng(campaign_seed: int, number: int) -> random.Random:
    return random.Random(f"arrayio-fuzz:{campaign_seed}:{number}")


def _context(blob: bytes, offset: int) -> str:
    return repr(blob[max(0, offset - 10) : offset + 10])


def _pick_offset(rng: random.Random, layout: _Layout) -> int:
    """An offset, weighted toward the header: 60% in the length fields and header text,
    15% in the header's padding, 25% anywhere."""
    r = rng.random()
    if r < 0.6 and layout.text_end > 0:
        return rng.randrange(layout.text_end)
    if r < 0.75 and layout.data_start > layout.text_end:
        return rng.randrange(layout.text_end, layout.data_start)
    return rng.randrange(layout.size)


def _bit_flip(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    offset, bit = _pick_offset(rng, layout), rng.randrange(8)
    out = bytearray(blob)
    out[offset] ^= 1 << bit
    return (
        bytes(out),
        f"flip bit {bit} of byte {offset} ({layout.region(offset)}: {_context(blob, offset)})",
        offset >= layout.data_start,
    )


def _overwrite(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    offset, value = _pick_offset(rng, layout), rng.choice(INTERESTING_BYTES)
    count = 1 if rng.random() < 0.8 else rng.randint(2, 8)
    count = min(count, layout.size - offset)
    out = bytearray(blob)
    out[offset : offset + count] = bytes([value]) * count
    return (
        bytes(out),
        f"overwrite {count} byte(s) at {offset} with {value:#04x} "
        f"({layout.region(offset)}: {_context(blob, offset)})",
        offset + count > layout.data_start,
    )


def _truncate(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    if rng.random() < 0.5:
        at = rng.randrange(layout.size)
    else:
        at = rng.randrange(min(layout.size, layout.data_start + 1))
    return blob[:at], f"truncate to {at} of {layout.size} bytes ({layout.region(at)})", False


def _append(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    kind = rng.randrange(3)
    if kind == 0:
        extra = rng.randbytes(rng.randint(1, 64))
    elif kind == 1:
        extra = b"\0" * 4096
    else:
        extra = blob[: rng.randint(1, 256)]
    return blob + extra, f"append {len(extra)} bytes ({extra[:12]!r}...)", False


def _length_field(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    if layout.kind == "safetensors":
        (old,) = struct.unpack("<Q", blob[:8])
        fmt, start, limit = "<Q", 0, 2**64
        specials = [
            0,
            1,
            2,
            old - 1,
            old + 1,
            old - 8,
            old + 8,
            old * 2,
            layout.size - 8,
            layout.size,
            2**32,
            2**63,
            2**64 - 1,
            100_000_000,
            100_000_001,
        ]
    else:
        fmt = "<H" if blob[6] == 1 else "<I"
        start, limit = 8, 2 ** (8 * struct.calcsize(fmt))
        (old,) = struct.unpack(fmt, blob[8 : 8 + struct.calcsize(fmt)])
        specials = [0, 1, old - 1, old + 1, old - 16, old + 16, 10_000, 10_001, limit - 1]
    choice = rng.random()
    if choice < 0.7:
        new = rng.choice(specials)
    elif choice < 0.85:
        new = old ^ (1 << rng.randrange(8 * struct.calcsize(fmt)))
    else:
        new = rng.randrange(limit)
    new %= limit
    out = bytearray(blob)
    out[start : start + struct.calcsize(fmt)] = struct.pack(fmt, new)
    return bytes(out), f"header length {old} -> {new}", False


# ----------------------------------------------------------------- structured JSON edits


def _walk(value: Any, path: tuple[Any, ...] = ()) -> Iterable[tuple[tuple[Any, ...], Any]]:
    yield path, value
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _walk(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _walk(child, (*path, index))


def _get(doc: Any, path: Sequence[Any]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _set(doc: Any, path: Sequence[Any], value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


def _replace_key(
    mapping: dict[str, Any], old: str, new: str, value: Any = None, *, keep: bool = False
) -> dict[str, Any]:
    """``mapping`` with ``old`` renamed ``new`` in place (order kept); with ``keep``, ``new``
    is inserted before ``old`` with ``value``."""
    out: dict[str, Any] = {}
    for key, child in mapping.items():
        if key == old:
            if keep:
                out[new] = value
                out[key] = child
            else:
                out[new] = child
        else:
            out[key] = child
    return out


def _path_text(path: Sequence[Any]) -> str:
    return "".join(f"[{part!r}]" for part in path) or "(root)"


class _Document:
    """A safetensors header as JSON, with arrayio's metadata blob decoded as part of it:
    ``root["header"]`` is the header, ``root["arrayio"]`` the blob (None if absent). In the
    header the blob is a marker string until :meth:`encode`, so that renaming, dropping or
    replacing ``__metadata__`` or its ``arrayio`` key takes the blob along."""

    def __init__(self, blob: bytes, layout: _Layout) -> None:
        header = json.loads(blob[8 : layout.data_start])
        metadata = header.get("__metadata__")
        text = metadata.get("arrayio") if isinstance(metadata, dict) else None
        inner = None
        if isinstance(text, str):
            inner = json.loads(text)
            metadata["arrayio"] = _BLOB
        self.root: dict[str, Any] = {"header": header, "arrayio": inner}
        self.replacements: dict[str, dict[str, str]] = {"header": {}, "arrayio": {}}
        self.data = blob[layout.data_start :]
        self.old_length = layout.data_start - 8

    @property
    def header(self) -> Any:
        return self.root["header"]

    def nodes(
        self, kind: type | tuple[type, ...] | None = None
    ) -> list[tuple[tuple[Any, ...], Any]]:
        found = []
        for part in ("header", "arrayio"):
            if self.root[part] is None:
                continue
            for path, value in _walk(self.root[part], (part,)):
                if kind is None or isinstance(value, kind):
                    found.append((path, value))
        return found

    def set(self, path: tuple[Any, ...], value: Any) -> None:
        if len(path) == 1:
            self.root[path[0]] = value
        else:
            _set(self.root, path, value)

    def splice(self, path: tuple[Any, ...], text: str) -> None:
        """Put the raw JSON ``text`` at ``path`` when encoding."""
        marker = f"{_BIG}{len(self.replacements[path[0]])}"
        self.replacements[path[0]][json.dumps(marker)] = text
        self.set(path, marker)

    def encode(self) -> bytes:
        text = json.dumps(self.root["header"], separators=(",", ":"), ensure_ascii=False)
        if self.root["arrayio"] is not None:
            inner = json.dumps(self.root["arrayio"], separators=(",", ":"), ensure_ascii=False)
            for marker, raw_text in self.replacements["arrayio"].items():
                inner = inner.replace(marker, raw_text)
            text = text.replace(json.dumps(_BLOB), json.dumps(inner, ensure_ascii=False))
        for marker, raw_text in self.replacements["header"].items():
            text = text.replace(marker, raw_text)
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw) <= self.old_length:
            raw = raw.ljust(self.old_length, b" ")
        return struct.pack("<Q", len(raw)) + raw + self.data


def _entry_keys(doc: _Document) -> list[str]:
    if not isinstance(doc.header, dict):
        return []
    return [
        key
        for key, value in doc.header.items()
        if key != "__metadata__" and isinstance(value, dict)
    ]


def _json_numbers(rng: random.Random, doc: _Document) -> str:
    keys = _entry_keys(doc)
    if not keys:
        return _json_replace(rng, doc)
    key = rng.choice(keys)
    field = rng.choice(["shape", "data_offsets"])
    current = doc.header[key].get(field)
    value = rng.choice(HOSTILE_NUMBERS)
    if isinstance(current, list) and current and rng.random() < 0.8:
        index = rng.randrange(len(current))
        current[index] = value
        return f"set {key!r}.{field}[{index}] = {value!r}"
    if isinstance(current, list) and rng.random() < 0.5:
        current.append(value)
        return f"append {value!r} to {key!r}.{field}"
    doc.header[key][field] = value
    return f"set {key!r}.{field} = {value!r}"


def _json_dtype(rng: random.Random, doc: _Document) -> str:
    keys = _entry_keys(doc)
    if not keys:
        return _json_replace(rng, doc)
    key, code = rng.choice(keys), rng.choice(DTYPE_CODES)
    old = doc.header[key].get("dtype")
    doc.header[key]["dtype"] = code
    return f"set {key!r}.dtype {old!r} -> {code!r}"


def _mutate_name(rng: random.Random, name: str) -> str:
    if not name:
        return "x"
    choice = rng.random()
    index = rng.randrange(len(name))
    if choice < 0.6:  # one letter changed, e.g. "tree" -> "tsee"
        letter = rng.choice("abcdefghijklmnopqrstuvwxyz_.0")
        new = name[:index] + letter + name[index + 1 :]
        return new if new != name else name + letter
    if choice < 0.8:
        return name[:index] + name[index + 1 :]  # one letter dropped
    return name.upper() if name != name.upper() else name + " "


def _json_rename(rng: random.Random, doc: _Document) -> str:
    objects = [(path, value) for path, value in doc.nodes(dict) if value]
    path, mapping = rng.choice(objects)
    old = rng.choice(list(mapping))
    new = _mutate_name(rng, old)
    if new in mapping:
        new = old + "~"
    doc.set(path, _replace_key(mapping, old, new))
    return f"rename key {old!r} -> {new!r} in {_path_text(path)}"


def _json_drop(rng: random.Random, doc: _Document) -> str:
    objects = [(path, value) for path, value in doc.nodes(dict) if value]
    path, mapping = rng.choice(objects)
    key = rng.choice(list(mapping))
    del mapping[key]
    return f"drop key {key!r} from {_path_text(path)}"


def _json_replace(rng: random.Random, doc: _Document) -> str:
    path, old = rng.choice([(p, v) for p, v in doc.nodes() if len(p) > 1])
    value = rng.choice(HOSTILE_VALUES)
    doc.set(path, value)
    return f"set {_path_text(path)} = {value!r} (was {json.dumps(old)[:40]})"


def _json_duplicate(rng: random.Random, doc: _Document) -> str:
    objects = [(path, value) for path, value in doc.nodes(dict) if value]
    path, mapping = rng.choice(objects)
    key = rng.choice(list(mapping))
    siblings = [v for k, v in mapping.items() if k != key]
    value = rng.choice(siblings) if siblings and rng.random() < 0.5 else rng.choice(HOSTILE_VALUES)
    after = rng.random() < 0.5
    if after:
        new = dict(mapping)
        new[_DUP] = value
    else:
        new = _replace_key(mapping, key, _DUP, value, keep=True)
    doc.set(path, new)
    doc.replacements[path[0]][json.dumps(_DUP)] = json.dumps(key, ensure_ascii=False)
    where = "after" if after else "before"
    return (
        f"duplicate key {key!r} in {_path_text(path)} ({where} it, value {json.dumps(value)[:40]})"
    )


def _json_deep(rng: random.Random, doc: _Document) -> str:
    depth = rng.choice([64, 500, 990, 5000, 100_000])
    tree = (
        doc.root["arrayio"] is not None
        and isinstance(doc.root["arrayio"], dict)
        and "tree" in doc.root["arrayio"]
        and rng.random() < 0.5
    )
    if tree:
        path: tuple[Any, ...] = ("arrayio", "tree")
        text = '{"list":[' * depth + '{"none":null}' + "]}" * depth
        what = "pytree of nested lists"
    else:
        path, _ = rng.choice([(p, v) for p, v in doc.nodes() if len(p) > 1])
        if rng.random() < 0.5:
            text, what = "[" * depth + "0" + "]" * depth, "nested lists"
        else:
            text, what = '{"a":' * depth + "0" + "}" * depth, "nested objects"
    doc.splice(path, text)
    return f"set {_path_text(path)} = {what} {depth} deep"


def _json_huge_list(rng: random.Random, doc: _Document) -> str:
    million = 1_000_000
    keys = _entry_keys(doc)
    choice = rng.random()
    if keys and choice < 0.4:
        key = rng.choice(keys)
        path: tuple[Any, ...] = ("header", key, "shape")
        text, what = "[" + ",".join(["1"] * million) + "]", "a million 1s"
    elif doc.root["arrayio"] is not None and isinstance(doc.root["arrayio"], dict) and choice < 0.7:
        path = ("arrayio", "tree")
        text, what = '{"list":[' + ",".join(["0"] * million) + "]}", "a list of a million 0s"
    else:
        path, _ = rng.choice([(p, v) for p, v in doc.nodes() if len(p) > 1])
        text, what = "[" + ",".join(["0"] * million) + "]", "a million 0s"
    doc.splice(path, text)
    return f"set {_path_text(path)} = {what}"


# (edit, weight): the deep and huge ones cost up to a second a case, so they are rarer.
_JSON_EDITS: tuple[tuple[Callable[[random.Random, _Document], str], float], ...] = (
    (_json_numbers, 0.20),
    (_json_dtype, 0.10),
    (_json_rename, 0.20),
    (_json_drop, 0.10),
    (_json_replace, 0.15),
    (_json_duplicate, 0.12),
    (_json_deep, 0.08),
    (_json_huge_list, 0.04),
)


def _json_edit(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    doc = _Document(blob, layout)
    edit = rng.choices([e for e, _ in _JSON_EDITS], weights=[w for _, w in _JSON_EDITS])[0]
    description = edit(rng, doc)
    return doc.encode(), f"JSON: {description}", False


def _forged_foreign(data: bytes) -> bool:
    """Whether ``data`` has a valid safetensors header with no arrayio metadata at all (no
    ``__metadata__`` key naming arrayio): what the safetensors package could have written."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
    except (struct.error, ValueError, RecursionError):
        return False
    if not isinstance(header, dict):
        return False
    metadata = header.get("__metadata__")
    return not (isinstance(metadata, dict) and any("arrayio" in str(k) for k in metadata))


# ------------------------------------------------------------------ .npy header edits


def _npy_parts(blob: bytes, layout: _Layout) -> tuple[dict[str, Any], str]:
    text = blob[layout.header_start : layout.data_start].decode("latin1")
    return ast.literal_eval(text.strip()), text


def _npy_encode(blob: bytes, layout: _Layout, text: str) -> bytes:
    raw = text.encode("latin1")
    length = layout.data_start - layout.header_start
    if len(raw) + 1 <= length:
        raw = raw.ljust(length - 1, b" ") + b"\n"
    else:
        raw += b"\n"
    fmt = "<H" if blob[6] == 1 else "<I"
    if fmt == "<H" and len(raw) >= 1 << 16:
        raw = raw[: (1 << 16) - 1]
    return blob[:8] + struct.pack(fmt, len(raw)) + raw + blob[layout.data_start :]


def _npy_text(fields: dict[str, Any]) -> str:
    return "{" + "".join(f"{key!r}: {value!r}, " for key, value in fields.items()) + "}"


def _npy_edit(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    fields, text = _npy_parts(blob, layout)
    kind = rng.randrange(8)
    if kind == 0:  # a stray byte inside the padding
        stripped = len(text.rstrip(" \n"))
        if stripped >= len(text) - 1:
            kind = 1
        else:
            at = rng.randrange(stripped, len(text) - 1)
            stray = rng.choice(["x", "\0", "#", "\xff", "'", "(", "}", "\n", "\t"])
            out = bytearray(blob)
            out[layout.header_start + at] = ord(stray)
            return bytes(out), f".npy: stray {stray!r} in the header padding at {at}", False
    if kind == 1:  # an unterminated quote, parenthesis or brace
        body = text.rstrip(" \n")
        spots = [i for i, c in enumerate(body) if c in "')},"]
        at = rng.choice(spots)
        new = body[:at] + body[at + 1 :]
        return (
            _npy_encode(blob, layout, new),
            f".npy: remove {body[at]!r} at {at} of the header",
            False,
        )
    if kind == 2:
        value = rng.choice(NPY_SHAPES)
        fields["shape"] = value
        what = (
            f"shape = {value!r}"
            if not isinstance(value, tuple) or len(value) < 8
            else f"shape = {len(value)} dimensions of {value[0]}"
        )
    elif kind == 3:
        value = rng.choice(NPY_DESCRS)
        fields["descr"] = value
        what = f"descr = {value!r}"
    elif kind == 4:
        value = rng.choice([True, False, 1, 0, "yes", None])
        fields["fortran_order"] = value
        what = f"fortran_order = {value!r}"
    elif kind == 5:
        key = rng.choice(list(fields))
        if rng.random() < 0.5:
            new_key = _mutate_name(rng, key)
            fields = _replace_key(fields, key, new_key)
            what = f"rename key {key!r} -> {new_key!r}"
        else:
            del fields[key]
            what = f"drop key {key!r}"
    elif kind == 6:
        key = rng.choice(list(fields))
        value = rng.choice([*NPY_SHAPES[:6], "<f8", True])
        new_text = _npy_text(fields)[:-1] + f"{key!r}: {value!r}, }}"
        return (
            _npy_encode(blob, layout, new_text),
            f".npy: duplicate key {key!r} = {value!r} at the end",
            False,
        )
    else:
        fields["extra"] = rng.choice([1, "x", None, (1, 2)])
        what = f"extra key 'extra' = {fields['extra']!r}"
    return _npy_encode(blob, layout, _npy_text(fields)), f".npy: {what}", False


def _npy_version(rng: random.Random, blob: bytes, layout: _Layout) -> tuple[bytes, str, bool]:
    version = rng.choice([0, 2, 3, 4, 255])
    return blob[:6] + bytes([version]) + blob[7:], f".npy: version byte 1 -> {version}", False


# (mutator, weight, applies to: "all", "safetensors" or "npy")
_MUTATORS: tuple[tuple[Callable[..., tuple[bytes, str, bool]], float, str], ...] = (
    (_bit_flip, 0.30, "all"),
    (_overwrite, 0.15, "all"),
    (_truncate, 0.08, "all"),
    (_append, 0.05, "all"),
    (_length_field, 0.07, "all"),
    (_json_edit, 0.35, "safetensors"),
    (_npy_edit, 0.30, "npy"),
    (_npy_version, 0.05, "npy"),
)


def _choose_seed(rng: random.Random, seeds: Sequence[Seed]) -> Seed:
    formats = sorted({seed.format for seed in seeds})
    fmt = rng.choices(formats, weights=[_FORMAT_WEIGHTS[f] for f in formats])[0]
    return rng.choice([seed for seed in seeds if seed.format == fmt])


def make_case(case_id: str, seeds: Sequence[Seed], blobs: dict[str, bytes]) -> Case:
    """Build a case: the same ``case_id`` always gives the same mutated file.

    Parameters
    ----------
    case_id
        ``"S:N"``: case ``N`` of campaign seed ``S``.
    seeds, blobs
        The seeds and their pristine bytes by name (see :func:`read_seeds`).

    Returns
    -------
    Case
    """
    campaign_seed, number = (int(part) for part in case_id.split(":"))
    rng = _rng(campaign_seed, number)
    seed = _choose_seed(rng, seeds)
    blob = blobs[seed.name]
    layout = _layout(blob, seed.suffix)
    mutators = [(m, w) for m, w, applies in _MUTATORS if applies in ("all", layout.kind)]
    while True:  # a mutation that changed nothing (a byte overwritten by itself) is redrawn
        mutate = rng.choices([m for m, _ in mutators], weights=[w for _, w in mutators])[0]
        data, description, touches = mutate(rng, blob, layout)
        if data != blob:
            forged = mutate is _json_edit and seed.checksummed and _forged_foreign(data)
            return Case(case_id, seed, description, data, touches, forged)


# --------------------------------------------------------------------------- the oracle


def _fingerprint(x: Any) -> Any:
    """A comparable, bit-exact description of a loaded value (types, order, bytes)."""
    from .. import ArrayInfo

    if isinstance(x, np.ndarray | np.generic):
        x = np.asarray(x)
        return ("array", str(x.dtype), x.dtype.str, x.shape, np.ascontiguousarray(x).tobytes())
    if isinstance(x, ArrayInfo):
        return ("info", x.key, x.dtype, tuple(x.shape), x.nbytes, x.crc32c)
    if isinstance(x, dict):
        return ("dict", [((type(k).__name__, k), _fingerprint(v)) for k, v in x.items()])
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return ("namedtuple", type(x).__name__, tuple(x._fields), [_fingerprint(v) for v in x])
    if isinstance(x, list | tuple):
        return (type(x).__name__, [_fingerprint(v) for v in x])
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return (type(x).__name__, x)
    if isinstance(x, int):
        return ("int", str(x))
    if isinstance(x, float):
        return ("float", struct.pack("<d", x))
    if isinstance(x, complex):
        return ("complex", struct.pack("<dd", x.real, x.imag))
    return ("other", type(x).__name__, repr(x))


_OPEN_FIELDS = ("format", "keys", "arrays", "metadata", "framework", "structure", "len", "nbytes")


def _describe(fp: Any) -> str:
    return _short(_describe_long(fp), 100)


def _describe_long(fp: Any) -> str:
    if isinstance(fp, tuple) and fp and fp[0] == "array":
        return f"{fp[1]}{list(fp[3])}"
    if isinstance(fp, tuple) and fp and fp[0] == "info":
        return f"ArrayInfo({fp[1]!r}, {fp[2]}{list(fp[3])}, crc32c={fp[5]})"
    if (
        isinstance(fp, tuple)
        and len(fp) == 2
        and isinstance(fp[0], str)
        and not isinstance(fp[1], list)
    ):
        value = fp[1]
        if fp[0] == "float":
            value = struct.unpack("<d", value)[0]
        elif fp[0] == "complex":
            value = complex(*struct.unpack("<dd", value))
        return f"{fp[0]} {value!r}"
    if isinstance(fp, tuple) and fp and fp[0] in ("dict", "list", "tuple", "namedtuple"):
        return f"a {fp[0]} of {len(fp[-1])}"
    return _short(fp)


def _diff(want: Any, got: Any, path: str = "") -> str:
    """Where two fingerprints (see :func:`_fingerprint`) first differ, in words."""
    here = path or "(the result)"
    same_kind = (
        isinstance(want, tuple) and isinstance(got, tuple) and want and got and want[0] == got[0]
    )
    if not same_kind:
        return f"{here}: {_describe(want)} became {_describe(got)}"
    kind = want[0]
    if kind == "dict":
        wkeys, gkeys = [k for k, _ in want[1]], [k for k, _ in got[1]]
        if wkeys != gkeys:
            return (
                f"{here}: keys {_short([k for _, k in wkeys])} became "
                f"{_short([k for _, k in gkeys])}"
            )
        for (key, a), (_, b) in zip(want[1], got[1], strict=True):
            if a != b:
                return _diff(a, b, f"{path}[{key[1]!r}]")
    elif kind in ("list", "tuple") and isinstance(want[1], list):
        if len(want[1]) != len(got[1]):
            return f"{here}: {len(want[1])} items became {len(got[1])}"
        for i, (a, b) in enumerate(zip(want[1], got[1], strict=True)):
            if a != b:
                return _diff(a, b, f"{path}[{i}]")
    elif kind == "namedtuple" and want[1:3] == got[1:3]:
        for field, a, b in zip(want[2], want[3], got[3], strict=True):
            if a != b:
                return _diff(a, b, f"{path}.{field}")
    elif kind == "array" and want[1:4] == got[1:4]:
        return f"{here}: {_describe(want)} values differ"
    elif kind == "open":
        for field, a, b in zip(_OPEN_FIELDS, want[1:], got[1:], strict=True):
            if a != b:
                return _diff(a, b, f"{path}.{field}")
    return f"{here}: {_describe(want)} became {_describe(got)}"


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass
class _OpResult:
    outcome: str  # "ok", "error", "exception", "memory"
    value: Any = None  # the fingerprint when ok
    detail: str = ""
    exception: str = ""
    seconds: float = 0.0
    peak: int = 0


def _numpy_dtype(name: str) -> Any:
    from ..arrays import _dtypes

    return _dtypes.numpy_dtype(_dtypes.by_name(name))


def _cli(argv: list[str]) -> Any:
    from .. import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    text = out.getvalue() + err.getvalue()
    if not isinstance(code, int) or isinstance(code, bool):
        raise _Traceback(f"returned {code!r} rather than an exit code")
    if "Traceback (most recent call last)" in text:
        raise _Traceback("printed a traceback: " + text[text.index("Traceback") :][-300:])
    if code != 0:
        last = text.strip().splitlines()[-1][:200] if text.strip() else ""
        raise _CleanExit(f"exit code {code}: {last}")
    return ("exit", 0)


class _Traceback(Exception):
    """The CLI printed a traceback or returned no exit code."""


class _CleanExit(Exception):
    """The CLI refused the file with a message and a non-zero exit code."""


def _operations(path: str, stall: float = 0.0, hog: int = 0) -> list[tuple[str, Callable[[], Any]]]:
    """The readings of ``path``, in order: each returns a fingerprint or raises. To test the
    runner, ``stall`` makes the first one sleep that long first, and ``hog`` makes it touch
    that many bytes of memory."""
    import arrayio

    state: dict[str, Any] = {}

    def do_open() -> Any:
        time.sleep(stall)
        if hog:
            np.ones(hog, np.uint8)
        with arrayio.open(path) as reader:
            arrays = reader.arrays
            state["arrays"] = arrays
            return (
                "open",
                reader.format,
                reader.keys(),
                _fingerprint(arrays),
                _fingerprint(reader.metadata),
                reader.framework,
                _fingerprint(reader.structure),
                len(reader),
                reader.nbytes,
            )

    def do_load() -> Any:
        return _fingerprint(arrayio.load(path))

    def do_read_slice() -> Any:
        arrays = state.get("arrays")
        if arrays is None:
            with arrayio.open(path) as reader:
                return _fingerprint(reader.read(None, index=slice(0, 1)))
        results = {}
        with arrayio.open(path) as reader:
            for key, info in arrays.items():
                if len(info.shape) >= 1:
                    results[key] = reader.read(key, index=slice(0, 1))
        return _fingerprint(results)

    def do_read_into() -> Any:
        arrays = state.get("arrays")
        if arrays is None:
            return _fingerprint(arrayio.read_into(path, np.empty(1, np.float32)))
        results = {}
        for key, info in arrays.items():
            out = np.empty(info.shape, _numpy_dtype(info.dtype))
            results[key] = arrayio.read_into(path, out, key=key)
        return _fingerprint(results)

    return [
        ("open", do_open),
        ("load", do_load),
        ("read-slice", do_read_slice),
        ("read_into", do_read_into),
        ("cli-info", lambda: _cli(["info", path])),
        ("cli-verify", lambda: _cli(["verify", path])),
    ]


class _Timeout(BaseException):
    """Raised by SIGALRM in a case that runs too long (a BaseException, so that the
    library's ``except Exception`` does not swallow it)."""


class _PeakMemory:
    """The growth of the process's peak resident memory over a reading."""

    def __init__(self) -> None:
        self._resettable = True
        self._base = 0

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"no {field} in /proc/self/status")

    def start(self) -> None:
        if self._resettable:
            try:
                with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                    clear.write("5")  # resets VmHWM to the current resident size
                self._base = self._status("VmRSS")
                return
            except OSError:
                self._resettable = False
        import resource

        self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def growth(self) -> int:
        if self._resettable:
            return max(0, self._status("VmHWM") - self._base)
        import resource

        return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._base)


_peak = _PeakMemory()


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def _run_operations(
    path: str, *, interruptible: bool = False, stall: float = 0.0, hog: int = 0
) -> dict[str, _OpResult]:
    """Run every reading of ``path``. With ``interruptible``, a case still running after
    :data:`SLOW_SECONDS` raises :class:`_Timeout` out of the reading it is in (the
    readings not run are missing from the result)."""
    import arrayio

    results: dict[str, _OpResult] = {}
    if interruptible:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, _limits["slow"])
    try:
        for name, operation in _operations(path, stall, hog):
            _peak.start()
            start = time.perf_counter()
            try:
                value = operation()
            except (arrayio.ArrayioError, FileNotFoundError, _CleanExit) as error:
                kind = "exit code" if isinstance(error, _CleanExit) else type(error).__name__
                result = _OpResult("error", exception=kind, detail=str(error)[:300])
            except MemoryError as error:
                result = _OpResult("memory", exception="MemoryError", detail=str(error)[:300])
            except SystemExit as error:  # a library that exits is a finding too
                result = _OpResult("exception", exception="SystemExit", detail=str(error))
            except _Timeout:
                results[name] = _OpResult(
                    "slow", seconds=time.perf_counter() - start, detail="interrupted"
                )
                break
            except Exception as error:  # noqa: BLE001 - every other exception is a finding
                kind = "traceback" if isinstance(error, _Traceback) else type(error).__name__
                where = traceback.extract_tb(error.__traceback__)[-1]
                result = _OpResult(
                    "exception",
                    exception=kind,
                    detail=(
                        f"{str(error)[:240]} (at {os.path.basename(where.filename)}:"
                        f"{where.lineno} in {where.name})"
                    ),
                )
            else:
                result = _OpResult("ok", value)
            result.seconds = time.perf_counter() - start
            result.peak = _peak.growth()
            results[name] = result
    finally:
        if interruptible:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return results


def _judge(
    case: Case, results: dict[str, _OpResult], reference: dict[str, _OpResult], size: int
) -> dict[str, Any]:
    """The case's record: its outcome, its failures by kind, each reading's outcome."""
    failures: dict[str, dict[str, str]] = {}
    kinds: dict[str, str] = {}
    bound = MEMORY_BASE + MEMORY_FACTOR * size

    def fail(kind: str, op: str, detail: str) -> None:
        failures.setdefault(kind, {"op": op, "detail": detail})

    for op, result in results.items():
        if result.outcome == "slow":
            kinds[op] = "slow"
        elif result.outcome == "memory" or result.peak > bound:
            fail(
                "memory",
                op,
                result.detail
                or f"peak resident memory grew by {result.peak} "
                f"bytes for a file of {size} (bound {bound})",
            )
            kinds[op] = "memory"
        elif result.outcome == "exception":
            fail("other-exception", op, f"{result.exception}: {result.detail}")
            kinds[op] = "other-exception"
        elif result.outcome == "error":
            kinds[op] = "clean-error"
        else:
            want = reference[op].value
            got = result.value
            if op == "read-slice" and case.touches_data:
                want, got = _without_bytes(want), _without_bytes(got)
            if got == want:
                kinds[op] = "ok-identical"
            elif case.seed.checksummed and not case.forged_foreign:
                fail("silent-change", op, _diff(want, got))
                kinds[op] = "silent-change"
            else:
                kinds[op] = "ok-changed"
    total = sum(r.seconds for r in results.values())
    if total > _limits["slow"] or len(results) < len(OPERATIONS):
        slowest = max(results, key=lambda op: results[op].seconds)
        interrupted = " (interrupted)" if len(results) < len(OPERATIONS) else ""
        fail(
            "slow",
            slowest,
            f"{total:.1f} s for the case{interrupted}, {slowest} {results[slowest].seconds:.1f} s",
        )
        kinds[slowest] = "slow"
    outcome = min(kinds.values(), key=_SEVERITY.index)
    return {
        "case": case.id,
        "seed": case.seed.name,
        "format": case.seed.format,
        "mutation": case.mutation,
        "outcome": outcome,
        "failures": failures,
        "ops": {
            op: (kinds[op] + (f" ({r.exception})" if r.exception else ""))
            for op, r in results.items()
        },
        "seconds": round(total, 4),
        "peak": max(r.peak for r in results.values()),
    }


def _without_bytes(value: Any) -> Any:
    if isinstance(value, tuple) and value and value[0] == "array":
        return value[:4]
    if isinstance(value, tuple | list):
        return type(value)(_without_bytes(v) for v in value)
    return value


# --------------------------------------------------------------------------- the child


def _limit_address_space() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = (
            ADDRESS_SPACE_LIMIT
            if hard == resource.RLIM_INFINITY
            else min(hard, ADDRESS_SPACE_LIMIT)
        )
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass


def _reference(seed: Seed, seeds_dir: str) -> dict[str, _OpResult]:
    """What every reading of the pristine ``seed`` gives: what the cases are compared with.

    Raises
    ------
    AssertionError
        If a reading fails other than by design (a Fortran-ordered ``.npy`` for
        ``read_into``): the fuzzer would compare against a broken reference.
    """
    results = _run_operations(os.path.join(seeds_dir, seed.filename))
    allowed = ("ok",) if seed.checksummed else ("ok", "error")
    if any(result.outcome not in allowed for result in results.values()):
        raise AssertionError(f"the pristine seed {seed.name} does not read: {results}")
    return results


def _sabotage(what: str | None, size: int) -> dict[str, Any]:
    """Misbehave as asked, to test the runner: die, hang, or return the arguments that
    make the readings slow or greedy."""
    if what == "signal":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif what == "hang":  # where SIGALRM cannot reach: only the parent ends it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    elif what == "slow":
        return {"stall": 3 * _limits["slow"]}
    elif what == "memory":
        return {"hog": 2 * (MEMORY_BASE + MEMORY_FACTOR * size)}
    return {}


def _child(args: argparse.Namespace) -> int:
    """Run the cases named on stdin (one number a line); report on the protocol descriptor:
    ``{"start": N}`` before a case, ``{"result": {...}}`` after it, ``{"error": ...}`` for
    a bug of the fuzzer itself."""
    import faulthandler

    from .. import cli

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing but the protocol on the parent's pipe
    os.close(devnull)
    faulthandler.enable()
    _limit_address_space()
    _limits["slow"] = args.slow_seconds
    sabotage = dict(item.split(":") for item in args.sabotage.split(",") if item)
    # The same parser for every command: building it is a third of a case's time.
    cli.build_parser = functools.cache(cli.build_parser)
    seeds, blobs = read_seeds(args.seeds_dir)
    work = tempfile.mkdtemp(prefix="case-", dir=args.work_dir)
    references: dict[str, dict[str, _OpResult]] = {}
    try:
        for line in filter(str.strip, sys.stdin):
            if args.deadline and time.time() > args.deadline:
                break
            protocol.write(json.dumps({"start": int(line)}) + "\n")
            try:
                case = make_case(f"{args.seed}:{int(line)}", seeds, blobs)
                if case.seed.name not in references:
                    references[case.seed.name] = _reference(case.seed, args.seeds_dir)
            except Exception:  # noqa: BLE001 - the fuzzer's own bug: the parent stops
                protocol.write(json.dumps({"error": traceback.format_exc()}) + "\n")
                return 3
            path = os.path.join(work, "case" + case.seed.suffix)
            with open(path, "wb") as file:
                file.write(case.data)
            tricks = _sabotage(sabotage.get(line.strip()), len(case.data))
            results = _run_operations(path, interruptible=True, **tricks)
            record = _judge(case, results, references[case.seed.name], len(case.data))
            protocol.write(json.dumps({"result": record}) + "\n")
            if len(results) < len(OPERATIONS):
                break  # interrupted anywhere: this process's state is not to be trusted
    finally:
        shutil.rmtree(work, ignore_errors=True)
        protocol.close()
    return 0


# --------------------------------------------------------------------------- the parent


def _child_environment(tool: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARRAYIO_")}
    env.update(ARRAYIO_CACHE_DIR="none", ARRAYIO_PROGRESS="0", PYTHONFAULTHANDLER="1")
    if tool:
        env["ARRAYIO_TOOL"] = tool
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


@dataclasses.dataclass
class _Runner:
    seed: int
    seeds_dir: str
    work_dir: str
    tool: str | None
    deadline: float | None
    hang_seconds: float = HANG_SECONDS
    slow_seconds: float = SLOW_SECONDS
    sabotage: dict[int, str] = dataclasses.field(default_factory=dict)

    def run(self, numbers: list[int]) -> list[dict[str, Any]]:
        """Run ``numbers`` in children: one for the batch, again after a death."""
        records: list[dict[str, Any]] = []
        pending = list(numbers)
        while pending and not (self.deadline and time.time() > self.deadline):
            done, current, death = self._child(pending)
            records.extend(done)
            finished = {int(r["case"].split(":")[1]) for r in done}
            pending = [n for n in pending if n not in finished]
            if current is None:
                if not done:
                    break  # past the deadline
                continue  # it stopped after an interrupted case: go on in a new child
            pending.remove(current)
            if death.startswith("hung"):
                records.append(self._failure(current, "slow", death))
                continue
            alone, _, death_alone = self._child([current])
            if alone:
                record = alone[0]
                record["failures"].setdefault(
                    "signal", {"op": "?", "detail": f"{death} in a batch, not when run alone"}
                )
                record["outcome"] = "signal"
                records.append(record)
            else:
                kind = "slow" if death_alone.startswith("hung") else "signal"
                records.append(self._failure(current, kind, death_alone or death))
        return records

    def _failure(self, number: int, kind: str, detail: str) -> dict[str, Any]:
        case = make_case(f"{self.seed}:{number}", *read_seeds(self.seeds_dir))
        return {
            "case": case.id,
            "seed": case.seed.name,
            "format": case.seed.format,
            "mutation": case.mutation,
            "outcome": kind,
            "failures": {kind: {"op": "?", "detail": detail}},
            "ops": {},
            "seconds": None,
            "peak": None,
        }

    def _child(self, numbers: list[int]) -> tuple[list[dict[str, Any]], int | None, str]:
        """Run ``numbers`` in one child; return the records, the case it was on when it
        died or hung (None if it ended normally), and how it died."""
        command = [
            sys.executable,
            "-W",
            "error",
            "-m",
            "arrayio.testing.fuzz",
            "--child",
            "--seed",
            str(self.seed),
            "--seeds-dir",
            self.seeds_dir,
            "--work-dir",
            self.work_dir,
            "--slow-seconds",
            repr(self.slow_seconds),
            "--sabotage",
            ",".join(f"{n}:{what}" for n, what in self.sabotage.items()),
        ]
        if self.deadline:
            command += ["--deadline", repr(self.deadline)]
        with (
            tempfile.TemporaryFile(dir=self.work_dir) as stderr,
            subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=_child_environment(self.tool),
                text=True,
            ) as process,
        ):
            lines: queue.Queue[str | None] = queue.Queue()

            def pump() -> None:
                assert process.stdout is not None
                for line in process.stdout:
                    lines.put(line)
                lines.put(None)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            assert process.stdin is not None
            try:
                process.stdin.write("".join(f"{n}\n" for n in numbers))
                process.stdin.close()
            except BrokenPipeError:
                pass
            records: list[dict[str, Any]] = []
            current: int | None = None
            hung = False
            while True:
                try:
                    line = lines.get(timeout=self.hang_seconds)
                except queue.Empty:
                    hung = True
                    process.kill()
                    break
                if line is None:
                    break
                message = json.loads(line)
                if "error" in message:
                    process.kill()
                    process.wait()
                    reader.join()
                    raise RuntimeError(
                        f"the fuzzer failed on case {self.seed}:{current}:\n{message['error']}"
                    )
                if "start" in message:
                    current = message["start"]
                else:
                    records.append(message["result"])
                    current = None
            process.wait()
            reader.join()
            if hung:
                return records, current, f"hung: no progress for {self.hang_seconds:.0f} s"
            if current is None and process.returncode == 0:
                return records, None, ""
            stderr.seek(0)
            text = stderr.read().decode("utf-8", "replace").strip()
        code = process.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if current is None:
            raise RuntimeError(f"a fuzz child failed outside any case ({how}): {text[-2000:]}")
        return records, current, f"{how} ({_crash_site(text)})"


def _crash_site(stderr: str) -> str:
    """faulthandler's report in brief: what happened, and where the crashing thread was."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = next((line for line in lines if line.startswith("Fatal Python error")), "")
    current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
    where = next((line for line in lines[current:] if line.startswith("File ")), "")
    return "; ".join(filter(None, [fatal, where])) or (lines[-1] if lines else "no stderr")


@dataclasses.dataclass
class Campaign:
    """What a campaign found: one record per case (see :func:`run_campaign`)."""

    seed: int
    records: list[dict[str, Any]]
    seconds: float
    workers: int

    def failures(self) -> dict[str, list[dict[str, Any]]]:
        """The records with a failure, by kind (a case may count under several)."""
        found: dict[str, list[dict[str, Any]]] = {kind: [] for kind in FAILURE_KINDS}
        for record in self.records:
            for kind in record["failures"]:
                found[kind].append(record)
        return found

    @property
    def failed(self) -> bool:
        return any(self.failures().values())

    def exception_types(self) -> dict[str, list[dict[str, Any]]]:
        """The other-exception records, by exception type, most frequent first."""
        found: dict[str, list[dict[str, Any]]] = {}
        for record in self.failures()["other-exception"]:
            kind = record["failures"]["other-exception"]["detail"].split(":", 1)[0]
            found.setdefault(kind, []).append(record)
        return dict(sorted(found.items(), key=lambda item: -len(item[1])))

    def summary(self) -> dict[str, Any]:
        """Counts by format and failure kind, with an example of each (JSON-able)."""
        by_format: dict[str, collections.Counter[str]] = {}
        for record in self.records:
            counts = by_format.setdefault(record["format"], collections.Counter())
            counts["cases"] += 1
            counts[record["outcome"]] += 1
            counts["failures"] += bool(record["failures"])
        failures = {
            kind: {"count": len(records), "example": _example(records[0], kind)}
            for kind, records in self.failures().items()
            if records
        }
        exceptions = {
            kind: {"count": len(records), "example": _example(records[0], "other-exception")}
            for kind, records in self.exception_types().items()
        }
        return {
            "seed": self.seed,
            "cases": len(self.records),
            "seconds": round(self.seconds, 1),
            "workers": self.workers,
            "by_format": {fmt: dict(counts) for fmt, counts in sorted(by_format.items())},
            "failures": failures,
            "other_exception_types": exceptions,
        }

    def table(self) -> str:
        """The summary as text."""
        summary = self.summary()
        lines = [
            f"arrayio fuzz: {summary['cases']} cases, seed {self.seed}, "
            f"{self.seconds:.1f} s, {self.workers} workers"
        ]
        columns = ("cases", *OK_KINDS, "failures")
        lines.append(f"{'format':<13}" + "".join(f"{c:>14}" for c in columns))
        for fmt, counts in summary["by_format"].items():
            lines.append(f"{fmt:<13}" + "".join(f"{counts.get(c, 0):>14}" for c in columns))
        if not summary["failures"]:
            lines.append("failures: none")
            return "\n".join(lines)
        lines.append("failures (replay one with: python -m arrayio.testing.fuzz --replay CASE)")
        for kind, info in summary["failures"].items():
            example = info["example"]
            lines.append(
                f"  {kind:<16} {info['count']:>6}  e.g. {example['case']} "
                f"[{example['seed']}] {example['mutation']}"
            )
            lines.append(f"  {'':<23}  -> {example['op']}: {example['detail'][:160]}")
        if summary["other_exception_types"]:
            lines.append("other exceptions by type:")
            for kind, info in summary["other_exception_types"].items():
                example = info["example"]
                lines.append(
                    f"  {kind:<24} {info['count']:>6}  e.g. {example['case']} "
                    f"[{example['seed']}] {example['mutation'][:90]}"
                )
                lines.append(f"  {'':<31}  -> {example['op']}: {example['detail'][:150]}")
        return "\n".join(lines)


def _example(record: dict[str, Any], kind: str) -> dict[str, Any]:
    failure = record["failures"][kind]
    return {
        "case": record["case"],
        "seed": record["seed"],
        "mutation": record["mutation"],
        "op": failure["op"],
        "detail": failure["detail"],
    }


def run_campaign(
    cases: int,
    seed: int = 0,
    *,
    seconds: float | None = None,
    workers: int | None = None,
    tool: str | None = None,
    batch: int | None = None,
    hang_seconds: float = HANG_SECONDS,
    slow_seconds: float = SLOW_SECONDS,
    sabotage: dict[int, str] | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> Campaign:
    """Run cases ``seed:0`` to ``seed:cases-1`` (fewer if ``seconds`` run out first).

    Parameters
    ----------
    cases
        How many cases at most.
    seed
        The campaign seed: the same seed gives the same cases.
    seconds
        Stop starting cases after this long.
    workers
        Child processes at once (default: the CPU count).
    tool
        Force a transfer tool in the children (``ARRAYIO_TOOL``); default: the dispatcher's
        choice, with an in-memory table.
    batch
        Cases per child process.
    hang_seconds, slow_seconds
        When a case counts as hung (the child is killed) and as slow (it is interrupted).
    sabotage
        For testing the runner: case number to ``"signal"`` (the child kills itself with
        SIGSEGV), ``"hang"`` (it sleeps where SIGALRM cannot reach), ``"slow"`` or
        ``"memory"`` (it touches twice the memory bound).
    directory
        Where the seeds and the cases' files go (in a temporary directory removed at the
        end); default: the system's temporary directory.

    Returns
    -------
    Campaign
    """
    workers = workers or os.cpu_count() or 1
    started = time.monotonic()
    deadline = time.time() + seconds if seconds else None
    with tempfile.TemporaryDirectory(prefix="arrayio-fuzz-", dir=directory) as work:
        seeds_dir = os.path.join(work, "seeds")
        os.mkdir(seeds_dir)
        write_seeds(seeds_dir)
        runner = _Runner(
            seed, seeds_dir, work, tool, deadline, hang_seconds, slow_seconds, sabotage or {}
        )
        size = batch or max(10, min(1000, -(-cases // (workers * 3))))
        batches = [list(range(i, min(i + size, cases))) for i in range(0, cases, size)]
        records: list[dict[str, Any]] = []
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for found in pool.map(runner.run, batches):
                records.extend(found)
    records.sort(key=lambda r: int(r["case"].split(":")[1]))
    return Campaign(seed, records, time.monotonic() - started, workers)


def replay(case_id: str, *, keep: str | None = None, tool: str | None = None) -> dict[str, Any]:
    """Run one case again in a child process, as a campaign would.

    Parameters
    ----------
    case_id
        ``"S:N"``, as the campaign's table names it.
    keep
        Also save the mutated file there, to look at it.
    tool
        Force a transfer tool in the child.

    Returns
    -------
    dict
        The case's record: its mutation, outcome, failures and each reading's outcome.
    """
    campaign_seed, number = (int(part) for part in case_id.split(":"))
    with tempfile.TemporaryDirectory(prefix="arrayio-fuzz-") as work:
        seeds_dir = os.path.join(work, "seeds")
        os.mkdir(seeds_dir)
        write_seeds(seeds_dir)
        if keep:
            with open(keep, "wb") as file:
                file.write(make_case(case_id, *read_seeds(seeds_dir)).data)
        runner = _Runner(campaign_seed, seeds_dir, work, tool, None)
        return runner.run([number])[0]


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m arrayio.testing.fuzz",
        description="Mutation fuzzing of arrayio's readers (see the module docstring).",
    )
    parser.add_argument("--cases", type=int, default=1000, help="cases to run (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    parser.add_argument("--seconds", type=float, help="stop starting cases after this long")
    parser.add_argument("--workers", type=int, help="child processes at once (default: CPUs)")
    parser.add_argument("--batch", type=int, help="cases per child process")
    parser.add_argument("--tool", help="force a transfer tool in the children")
    parser.add_argument("--json", metavar="FILE", help="write the summary and every failure")
    parser.add_argument("--replay", metavar="CASE", help="run one case (SEED:N) and show it")
    parser.add_argument("--keep", metavar="FILE", help="with --replay: save the mutated file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seeds-dir", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--slow-seconds", type=float, default=SLOW_SECONDS, help=argparse.SUPPRESS)
    parser.add_argument("--sabotage", default="", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a campaign (or ``--replay`` a case) and print its table.

    Returns
    -------
    int
        1 if a failure was found, else 0.
    """
    args = _parser().parse_args(argv)
    if args.child:
        return _child(args)
    if args.replay:
        record = replay(args.replay, keep=args.keep, tool=args.tool)
        print(json.dumps(record, indent=2))
        return 1 if record["failures"] else 0
    campaign = run_campaign(
        args.cases,
        args.seed,
        seconds=args.seconds,
        workers=args.workers,
        tool=args.tool,
        batch=args.batch,
    )
    print(campaign.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(
                {
                    **campaign.summary(),
                    "failed_cases": [r for r in campaign.records if r["failures"]],
                },
                file,
                indent=1,
            )
    return 1 if campaign.failed else 0


if __name__ == "__main__":
    # Run as the package's module, not as __main__, so that what the seeds record (the
    # named tuple's module) is the same in the parent, the children and a replay.
    from arrayio.testing import fuzz

    sys.exit(fuzz.main())
