"""CRC-32C pieces combined: the arithmetic the threaded tools and the GPU kernel rely on."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayio.integrity._checksum import ChecksumParts, _multiply, _x8n, checksum, combine


@given(st.binary(max_size=2000), st.binary(max_size=2000))
def test_combine_gives_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    crc_a, crc_b = checksum(np.frombuffer(a, np.uint8)), checksum(np.frombuffer(b, np.uint8))
    assert combine(crc_a, crc_b, len(b)) == checksum(np.frombuffer(a + b, np.uint8))


@given(st.integers(0, (1 << 62) - 1))
@settings(max_examples=200)
def test_powers_of_x_square_for_every_length(n: int) -> None:
    # x^(16n) == (x^(8n))^2 at every length, including from 512 MiB (2^32 bits) up, where
    # zlib's table index n & 31, which holds for its polynomial, breaks for CRC-32C.
    assert _x8n(2 * n) == _multiply(_x8n(n), _x8n(n))


def test_combine_across_512_mib() -> None:
    # The length at which the wrapping table went wrong, checked against a direct CRC.
    zeros = np.zeros(1 << 29, dtype=np.uint8)
    head = np.frombuffer(b"arrayio", np.uint8)
    whole = checksum(zeros, checksum(head))
    assert combine(checksum(head), checksum(zeros), zeros.nbytes) == whole


@given(st.binary(min_size=1, max_size=5000), st.data())
def test_parts_in_any_order_and_split_give_the_whole(data: bytes, draw: st.DataObject) -> None:
    array = np.frombuffer(data, np.uint8)
    cuts = (
        sorted(draw.draw(st.sets(st.integers(1, len(data) - 1), max_size=6)))
        if len(data) > 1
        else []
    )
    bounds = [0, *cuts, len(data)]
    parts = ChecksumParts(len(data))
    for start, stop in reversed(list(zip(bounds[:-1], bounds[1:], strict=True))):
        parts.add_data(start, array[start:stop])
    assert parts.value() == checksum(array)
