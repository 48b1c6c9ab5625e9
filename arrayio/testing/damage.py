"""Files damaged on purpose, to check that arrayio notices: one byte's bits flipped in place."""

from __future__ import annotations

import os

__all__ = ["damage_array", "flip_byte"]


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0xFF) -> bytes:
    """XOR the byte at ``offset`` of ``path`` with ``mask``; return what it held (write it
    back to mend the file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
    return byte


def damage_array(path: str | os.PathLike[str], key: str, at: int = 10,
                 mask: int = 0xFF) -> tuple[int, bytes]:
    """Flip the bits ``mask`` of the byte ``at`` bytes into array ``key`` of an arrayio or
    safetensors file; return that byte's offset in the file and what it held."""
    from .. import open as open_file

    with open_file(path) as reader:
        offset = reader[key].file_offset + at
    return offset, flip_byte(path, offset, mask)
