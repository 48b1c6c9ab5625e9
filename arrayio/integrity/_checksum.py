"""CRC-32C (Castagnoli) of byte ranges, computed in pieces and combined.

Transfer tools move a range in tasks on several threads; each task checksums its own bytes
while they are in cache (``crc32c`` releases the GIL), and :class:`ChecksumParts` combines
the pieces into the CRC of the whole range with zlib's ``crc32_combine`` method, here for
the Castagnoli polynomial.
"""

from __future__ import annotations

import functools
import threading

import crc32c as _crc32c
import numpy as np

__all__ = ["ChecksumParts", "checksum", "combine"]

_POLY = 0x82F63B78  # CRC-32C, reflected


def checksum(data: np.ndarray, value: int = 0) -> int:
    """Extend the CRC-32C ``value`` with the bytes of ``data`` (a host ``uint8`` array)."""
    return _crc32c.crc32c(data, value) if data.nbytes else value


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial, both reflected (zlib's multmodp)."""
    m = 1 << 31
    product = 0
    while True:
        if a & m:
            product ^= b
            if a & (m - 1) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers(count: int) -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(count - 1):
        table.append(_multiply(table[-1], table[-1]))
    return table


# x^(2^n) modulo the polynomial, for every bit of an 8 * 64-bit length. zlib indexes its
# table with n & 31, which holds for its own polynomial; for CRC-32C, x^(2^32) is not x,
# and wrapping would break every length from 512 MiB up.
_X2N = _powers(67)


# Remembered: the lengths combined repeat (a load's arrays of one shape, a tool's tasks), and
# each costs up to 64 multiplications in Python, which finishing hundreds of GPU checksums
# would otherwise pay at the end of every load.
@functools.lru_cache(maxsize=4096)
def _x8n(n: int) -> int:
    """x^(8n) modulo the polynomial, for 0 <= n < 2^64."""
    power, k = 1 << 31, 3
    while n:
        if n & 1:
            power = _multiply(_X2N[k], power)
        n >>= 1
        k += 1
    return power


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32C of A followed by B, from the CRC of each and the length of B."""
    return _multiply(_x8n(length_b), crc_a) ^ crc_b if length_b else crc_a


class ChecksumParts:
    """Collects CRC-32Cs of pieces of one range, from any thread, and combines them.

    ``add(offset, length, crc)`` records the CRC of ``length`` bytes starting ``offset``
    bytes into the range; :meth:`value` checks that the pieces tile the range exactly.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._parts: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def add(self, offset: int, length: int, crc: int) -> None:
        with self._lock:
            self._parts.append((offset, length, crc))

    def add_data(self, offset: int, data: np.ndarray) -> None:
        """Checksum ``data`` (the bytes at ``offset`` in the range) and record it."""
        self.add(offset, data.nbytes, checksum(data))

    def value(self) -> int:
        """The CRC-32C of the whole range.

        Raises
        ------
        AssertionError
            If the recorded pieces leave a gap or overlap: a tool bug, never a data error.
        """
        crc, position = 0, 0
        for offset, length, part in sorted(self._parts):
            if length == 0:
                continue
            if offset != position:
                raise AssertionError(f"checksum pieces do not tile the range at byte {position}")
            # The CRC of nothing is 0, and combining onto 0 is the identity: skip the arithmetic
            # for the first piece (for a one-piece range, all of it).
            crc = combine(crc, part, length) if position else part
            position += length
        if position != self.nbytes:
            raise AssertionError(f"checksum pieces cover {position} of {self.nbytes} bytes")
        return crc
