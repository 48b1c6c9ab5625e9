"""zstd framing read on the host (RFC 8878), and the host coders that check it first.

Only the framing is read (frame headers, block headers, the content checksum), never the
entropy-coded payload: enough to refuse a damaged chunk with a reason before anything is
allocated for it, and to find what nvCOMP cannot decode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..errors import ChecksumError, FormatError

__all__ = ["Frame", "decode_on_host", "encode_on_host", "scan_frames"]

_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = 0x184D2A50  # 0x184D2A50 to 0x184D2A5F
_BLOCK_MAX = 128 << 10  # Block_Maximum_Size is at most 128 KiB whatever the window
_DICT_ID_BYTES = (0, 1, 2, 4)
_EMPTY_CHECKSUM = (0xEF46DB3751D8E999 & 0xFFFFFFFF).to_bytes(4, "little")  # XXH64(b"")


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One zstd frame of a chunk: where it is, and what its header declares."""

    start: int
    end: int  # just past the frame, content checksum included
    content_size: int | None  # Frame_Content_Size; None when the header leaves it out
    checksum: bool  # whether a content checksum ends the frame
    dictionary_id: int


def scan_frames(data: bytes | bytearray | memoryview | np.ndarray) -> list[Frame]:
    """Walk the frames of a zstd stream without decoding them; skippable frames are dropped.

    Raises
    ------
    FormatError
        The bytes are not a well-formed zstd stream: no frame at all, a bad magic number, a
        reserved bit or block type, a block larger than zstd allows, a frame cut short, or a
        declared content size its blocks cannot produce.
    """
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data).cast("B")
    size = len(view)
    if size == 0:
        raise FormatError("zstd chunk is empty: expected at least one frame, found 0 bytes")

    def need(at: int, count: int, what: str) -> None:
        if at + count > size:
            raise FormatError(
                f"zstd chunk of {size} bytes is cut short: its {what} at byte "
                f"{at} needs {count} bytes"
            )

    def read(at: int, count: int, what: str) -> int:
        need(at, count, what)
        return int.from_bytes(view[at : at + count], "little")

    frames: list[Frame] = []
    pos = 0
    while pos < size:
        magic = read(pos, 4, "magic number")
        if magic & 0xFFFFFFF0 == _SKIPPABLE_MAGIC:
            length = read(pos + 4, 4, "skippable frame header")
            need(pos + 8, length, "skippable frame")
            pos += 8 + length
            continue
        if magic != _MAGIC:
            raise FormatError(
                f"not a zstd frame at byte {pos} of a {size}-byte chunk: magic number "
                f"0x{magic:08X}, expected 0x{_MAGIC:08X}"
            )
        descriptor = read(pos + 4, 1, "frame header")
        if descriptor & 0x08:
            raise FormatError(f"zstd frame at byte {pos} sets the reserved header bit")
        fcs_flag, single_segment = descriptor >> 6, (descriptor >> 5) & 1
        dict_bytes = _DICT_ID_BYTES[descriptor & 0x03]
        fcs_bytes = (1 if single_segment else 0) if fcs_flag == 0 else 1 << fcs_flag
        cursor = pos + 5 + (0 if single_segment else 1)  # past the window descriptor
        dictionary_id = read(cursor, dict_bytes, "frame header")
        cursor += dict_bytes
        content_size = read(cursor, fcs_bytes, "frame header") if fcs_bytes else None
        if fcs_bytes == 2:
            content_size += 256  # type: ignore[operator]
        cursor += fcs_bytes
        least = most = 0  # how many bytes the blocks can decode to
        last = 0
        while not last:
            block = read(cursor, 3, "block header")
            last, kind, block_size = block & 1, (block >> 1) & 3, block >> 3
            if kind == 3:
                raise FormatError(f"zstd block at byte {cursor} has the reserved block type")
            if block_size > _BLOCK_MAX:
                raise FormatError(
                    f"zstd block at byte {cursor} declares {block_size} bytes; "
                    f"zstd blocks hold at most {_BLOCK_MAX}"
                )
            stored = 1 if kind == 1 else block_size  # an RLE block stores one byte
            need(cursor + 3, stored, "block")
            cursor += 3 + stored
            least += 0 if kind == 2 else block_size
            most += _BLOCK_MAX if kind == 2 else block_size
        checksum = bool(descriptor & 0x04)
        if checksum:
            need(cursor, 4, "content checksum")
            cursor += 4
        if content_size is not None and not least <= content_size <= most:
            raise FormatError(
                f"zstd frame at byte {pos} declares {content_size} content bytes, but its "
                f"blocks hold between {least} and {most}"
            )
        frames.append(Frame(pos, cursor, content_size, checksum, dictionary_id))
        pos = cursor
    return frames


def decode_on_host(
    zstd: Any, data: np.ndarray, out: np.ndarray | None = None
) -> bytes | np.ndarray:
    """Decode a zstd stream held in host memory with numcodecs, after checking its frames.

    With ``out`` (writable host bytes) and a stream of one frame that declares exactly
    ``out.nbytes`` of content, the content is decoded into ``out``, which is returned: no
    allocation, no copy after. Otherwise a new buffer is returned."""
    frames = scan_frames(data)
    for frame in frames:
        if frame.dictionary_id:
            raise FormatError(
                f"zstd frame at byte {frame.start} needs dictionary {frame.dictionary_id}; "
                "zarr's zstd codec has no dictionaries"
            )
    if all(frame.content_size == 0 for frame in frames):
        # Empty content (or skippable frames only), which libzstd's one-shot decoder, hence
        # numcodecs, refuses although it writes such frames itself.
        for frame in frames:
            stored = bytes(data[frame.end - 4 : frame.end])
            if frame.checksum and stored != _EMPTY_CHECKSUM:
                raise ChecksumError(
                    f"empty zstd frame at byte {frame.start} has content "
                    f"checksum {stored.hex()}, expected {_EMPTY_CHECKSUM.hex()}"
                )
        return b""
    fits = out is not None and len(frames) == 1 and frames[0].content_size == out.nbytes
    try:
        if fits:
            zstd.decode(data, out=out)
            return out  # type: ignore[return-value]
        return zstd.decode(data)
    except RuntimeError as error:  # numcodecs reports every libzstd failure as RuntimeError
        kind = ChecksumError if "checksum" in str(error).lower() else FormatError
        raise kind(f"zstd chunk of {data.nbytes} bytes could not be decoded: {error}") from error


def encode_on_host(zstd: Any, data: np.ndarray) -> bytes:
    """Encode host bytes with numcodecs (``zstd``: its ``Zstd`` with the codec's settings)."""
    return zstd.encode(data)
