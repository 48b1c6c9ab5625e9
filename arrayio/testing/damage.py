"""Files damaged on purpose, to check that arrayio notices: one byte's bits flipped in place,
and headers edited on purpose that still carry a valid CRC (what a hostile writer can make)."""

from __future__ import annotations

import os
import struct

__all__ = ["damage_array", "flip_byte", "seal_header"]


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0xFF) -> bytes:
    """XOR the byte at ``offset`` of ``path`` with ``mask``; return what it held (write it
    back to mend the file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
    return byte


def damage_array(
    path: str | os.PathLike[str], key: str, at: int = 10, mask: int = 0xFF
) -> tuple[int, bytes]:
    """Flip the bits ``mask`` of the byte ``at`` bytes into array ``key`` of an arrayio or
    safetensors file; return that byte's offset in the file and what it held."""
    from .. import open as open_file

    with open_file(path) as reader:
        offset = reader[key].file_offset + at
    return offset, flip_byte(path, offset, mask)


def seal_header(blob: bytes) -> bytes:
    """Give ``blob``, a container whose header was encoded as arrayio encodes headers (compact
    JSON, the header's CRC entry first in ``__metadata__``) and then edited, the header CRC
    that matches its new content, so that a test reaches the checks behind that CRC."""
    from ..formats.safetensors import seal

    (length,) = struct.unpack("<Q", blob[:8])
    return seal(blob[: 8 + length]) + blob[8 + length :]
