"""The conformance suite every transfer tool passes, reusable by plug-in authors (in the
spirit of zarr-python's ``StoreTests``).

Subclass :class:`ToolConformance` in a test module and override its ``tool`` fixture::

    import pytest
    from arrayio.testing.tool_suite import ToolConformance

    class TestMyTool(ToolConformance):
        @pytest.fixture
        def tool(self):
            tool = MyTool(threads=2)
            yield tool
            tool.close()

Override ``directory`` as well when the tool needs files on a particular file system (the
default is pytest's ``tmp_path``; :func:`o_direct_refusal` tells whether one takes
``O_DIRECT``). Tests of a direction or memory kind that the tool's capabilities leave out
are skipped, so a read-only tool is never asked to write. Tests of device memory carry the
``gpu`` marker (register it under ``--strict-markers``) and skip themselves when no CUDA GPU
or no CuPy is usable.

Importing this module needs pytest; it imports no GPU library.
"""

from __future__ import annotations

import concurrent.futures
import functools
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest

from ..arrays._buffers import CupyDeviceBuffer, aligned_empty, wait_for_current_streams
from ..integrity._checksum import ChecksumParts
from ..tools.base import Availability, Tool
from .frameworks import gpu_available

__all__ = [
    "ScratchFiles",
    "ToolConformance",
    "host_buffer",
    "o_direct_refusal",
    "random_bytes",
]

OFFSETS = [0, 1, 511, 4095, 4096, 4097, 12345]
SIZES = [0, 1, 7, 4095, 4096, 4097, 1 << 20, (1 << 20) + 3]
# Not a multiple of 4096, so that the file's last block is partial.
FILE_SIZE = max(OFFSETS) + max(SIZES) + 5000
# Several tasks for any task size a tool would choose by default.
LARGE_SIZE = (20 << 20) + 3
# (file size, offset, bytes asked for): reads that meet the end of the file.
EOF_CASES = [
    (10_000, 0, 16_384),
    (10_000, 4096, 8192),
    (10_000, 9000, 3 * 4096 + 1),
    (10_000, 9999, 2),
    (10_000, 10_000, 1),
    (10_000, 20_000, 4096),
    (8192, 4096, 8192),
    (8192, 8192, 4096),
    (0, 0, 1),
    (0, 0, 4096),
    ((1 << 20) + 5, 1, 2 << 20),
]
DEVICE_CASES = [(0, 0), (1, 7), (4095, 4097), (12345, (1 << 20) + 3)]


@functools.cache
def _noise(seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed).integers(0, 256, LARGE_SIZE + 8192, dtype=np.uint8)
    noise.flags.writeable = False
    return noise


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    """A read-only ``uint8`` array of ``nbytes`` random bytes, the same for the same seed.

    Raises
    ------
    ValueError
        If ``nbytes`` is more than the suite's largest range needs.
    """
    noise = _noise(seed)
    if nbytes > noise.nbytes:
        raise ValueError(f"random_bytes gives at most {noise.nbytes} bytes, not {nbytes}")
    return noise[:nbytes]


def host_buffer(nbytes: int, shift: int = 0) -> np.ndarray:
    """An uninitialised host buffer whose address lies ``shift`` bytes past a 4096 boundary."""
    return aligned_empty(nbytes + shift)[shift:]


class ScratchFiles:
    """Writes new files into ``directory`` and opens them read-write, until :meth:`close`.

    Calling it with the content (bytes or a ``uint8`` array) returns the descriptor;
    ``paths`` maps each descriptor to its file.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.paths: dict[int, Path] = {}

    def __call__(self, content: bytes | np.ndarray) -> int:
        path = self.directory / f"data-{len(self.paths)}.bin"
        path.write_bytes(
            content if isinstance(content, bytes) else memoryview(np.ascontiguousarray(content))
        )
        fd = os.open(path, os.O_RDWR)
        self.paths[fd] = path
        return fd

    def close(self) -> None:
        for fd in self.paths:
            os.close(fd)
        self.paths.clear()


def o_direct_refusal(directory: Path) -> str | None:
    """Why files in ``directory`` cannot be read with ``O_DIRECT``, or None if they can."""
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform"
    probe = directory / ".o_direct_probe"
    probe.write_bytes(bytes(4096))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return f"{directory} refuses O_DIRECT: {exc}"
    finally:
        probe.unlink()
    try:
        # Opening can succeed where reads then fail; an anonymous map is page-aligned.
        with mmap.mmap(-1, 4096) as aligned:
            os.preadv(fd, [aligned], 0)
    except OSError as exc:
        return f"{directory} opens files with O_DIRECT but refuses an aligned read: {exc}"
    finally:
        os.close(fd)
    return None


def _contents(fd: int) -> np.ndarray:
    """Everything the file behind ``fd`` holds, read with plain ``pread``."""
    size = os.fstat(fd).st_size
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, size - done, done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return np.frombuffer(b"".join(chunks), np.uint8)


def _device_buffer(array: Any) -> CupyDeviceBuffer:
    """``array``'s memory as arrayio's reads and writes hand it to a tool: with nothing
    queued on it. The tools copy on streams of their own, not ordered after the caller's;
    the callers wait for their current streams first (``wait_for_current_streams``). Without
    this wait, ``cupy.zeros``' fill could land after the file's bytes whenever the GPU is
    busy with another process's kernels."""
    buffer = CupyDeviceBuffer(array)
    wait_for_current_streams([buffer])
    return buffer


def _assert_same_bytes(actual: np.ndarray, expected: np.ndarray) -> None:
    """Compare byte arrays, naming the first difference rather than printing megabytes."""
    assert actual.nbytes == expected.nbytes, f"{actual.nbytes} bytes, expected {expected.nbytes}"
    differ = np.flatnonzero(actual != expected)
    assert differ.size == 0, (
        f"{differ.size} bytes differ, the first at byte {differ[0]}: "
        f"{actual[differ[0]]} instead of {expected[differ[0]]}"
    )


class ToolConformance:
    """Tests that any :class:`~arrayio.tools.Tool` must pass; see the module docstring."""

    @pytest.fixture
    def tool(self) -> Tool:
        """The tool under test: override in each subclass (yield it, then close it)."""
        raise NotImplementedError("subclasses of ToolConformance override the tool fixture")

    @pytest.fixture
    def directory(self, tmp_path: Path) -> Path:
        """Where the test files live; override for a tool that needs some file system."""
        return tmp_path

    @pytest.fixture
    def open_file(self, directory: Path) -> Iterator[ScratchFiles]:
        """Makes new files holding given bytes, open read-write (see :class:`ScratchFiles`)."""
        files = ScratchFiles(directory)
        yield files
        files.close()

    # ---- helpers -------------------------------------------------------------------------

    @staticmethod
    def require(tool: Tool, direction: str, memory: str = "host") -> None:
        """Skip unless the tool's capabilities include ``direction`` on ``memory``."""
        if not tool.capabilities.serves(direction, memory):
            pytest.skip(f"{tool.label} does not {direction} {memory} memory")

    @classmethod
    def require_gpu(cls, tool: Tool, direction: str) -> Any:
        """Skip unless the tool serves CUDA memory and a GPU and CuPy are usable; CuPy."""
        cls.require(tool, direction, "cuda")
        if not gpu_available():
            pytest.skip("no CUDA GPU")
        return pytest.importorskip("cupy")

    @staticmethod
    def checksum_parts(tool: Tool, nbytes: int) -> ChecksumParts | None:
        """A fresh :class:`ChecksumParts` when the tool can report checksums, else None."""
        return ChecksumParts(nbytes) if tool.capabilities.checksums else None

    @staticmethod
    def check_checksum(parts: ChecksumParts | None, expected: np.ndarray) -> None:
        if parts is not None:
            assert parts.value() == crc32c.crc32c(expected), "wrong CRC-32C recorded"

    # ---- the contract --------------------------------------------------------------------

    def test_describes_itself(self, tool: Tool) -> None:
        caps = tool.capabilities
        assert tool.name and tool.label.startswith(tool.name)
        assert caps.memory and caps.memory <= {"host", "cuda"}
        assert caps.directions and caps.directions <= {"read", "write"}
        assert caps.alignment >= 1 and caps.alignment & (caps.alignment - 1) == 0
        availability = type(tool).availability()
        assert isinstance(availability, Availability)
        assert availability or availability.reason, "an unavailable tool must say why"

    @pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "unaligned"])
    @pytest.mark.parametrize("size", SIZES)
    @pytest.mark.parametrize("offset", OFFSETS)
    def test_read(self, tool: Tool, open_file, offset: int, size: int, shift: int) -> None:
        self.require(tool, "read")
        data = random_bytes(FILE_SIZE)
        fd = open_file(data)
        buffer = host_buffer(size, shift)
        parts = self.checksum_parts(tool, size)
        assert tool.read(fd, buffer, offset, checksum=parts) == size
        _assert_same_bytes(buffer, data[offset : offset + size])
        self.check_checksum(parts, data[offset : offset + size])

    @pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "unaligned"])
    @pytest.mark.parametrize("size", SIZES)
    @pytest.mark.parametrize("offset", OFFSETS)
    def test_write(self, tool: Tool, open_file, offset: int, size: int, shift: int) -> None:
        self.require(tool, "write")
        before = random_bytes(FILE_SIZE, seed=1)
        fd = open_file(before)
        buffer = host_buffer(size, shift)
        buffer[...] = random_bytes(size, seed=2)
        parts = self.checksum_parts(tool, size)
        assert tool.write(fd, buffer, offset, checksum=parts) == size
        expected = before.copy()
        expected[offset : offset + size] = buffer
        _assert_same_bytes(_contents(fd), expected)  # the range, and its neighbours untouched
        self.check_checksum(parts, buffer)
        if tool.capabilities.serves("read", "host"):
            back = host_buffer(size)
            assert tool.read(fd, back, offset) == size
            _assert_same_bytes(back, buffer)

    @pytest.mark.parametrize(
        ("offset", "shift"), [(0, 0), (4097, 0), (4097, 1)], ids=["aligned", "offset", "congruent"]
    )
    def test_read_large(self, tool: Tool, open_file, offset: int, shift: int) -> None:
        self.require(tool, "read")
        data = random_bytes(offset + LARGE_SIZE + 100)
        fd = open_file(data)
        buffer = host_buffer(LARGE_SIZE, shift)
        parts = self.checksum_parts(tool, LARGE_SIZE)
        assert tool.pread(fd, buffer, offset, checksum=parts).get() == LARGE_SIZE
        _assert_same_bytes(buffer, data[offset : offset + LARGE_SIZE])
        self.check_checksum(parts, buffer)

    @pytest.mark.parametrize(
        ("offset", "shift"), [(0, 0), (4097, 0), (4097, 1)], ids=["aligned", "offset", "congruent"]
    )
    def test_write_large(self, tool: Tool, open_file, offset: int, shift: int) -> None:
        self.require(tool, "write")
        fd = open_file(random_bytes(100, seed=1))
        buffer = host_buffer(LARGE_SIZE, shift)
        buffer[...] = random_bytes(LARGE_SIZE, seed=2)
        parts = self.checksum_parts(tool, LARGE_SIZE)
        assert tool.pwrite(fd, buffer, offset, checksum=parts).get() == LARGE_SIZE
        expected = np.zeros(offset + LARGE_SIZE, np.uint8)
        expected[:100] = random_bytes(100, seed=1)
        expected[offset:] = buffer
        _assert_same_bytes(_contents(fd), expected)
        self.check_checksum(parts, buffer)

    @pytest.mark.parametrize(("file_size", "offset", "size"), EOF_CASES)
    def test_read_past_end(
        self, tool: Tool, open_file, file_size: int, offset: int, size: int
    ) -> None:
        self.require(tool, "read")
        data = random_bytes(file_size)
        fd = open_file(data)
        expected = data[offset : offset + size]  # short, or empty from the end on
        buffer = host_buffer(size)
        parts = self.checksum_parts(tool, expected.nbytes)
        assert tool.read(fd, buffer, offset, checksum=parts) == expected.nbytes
        _assert_same_bytes(buffer[: expected.nbytes], expected)
        self.check_checksum(parts, expected)

    @pytest.mark.parametrize("offset", [0, 5, 4096, 50_000])
    def test_zero_bytes(self, tool: Tool, open_file, offset: int) -> None:
        before = random_bytes(10_000)
        fd = open_file(before)
        for direction, call in (("read", tool.read), ("write", tool.write)):
            if tool.capabilities.serves(direction, "host"):
                parts = self.checksum_parts(tool, 0)
                assert call(fd, host_buffer(0), offset, checksum=parts) == 0
                self.check_checksum(parts, host_buffer(0))
        _assert_same_bytes(_contents(fd), before)  # not even extended

    @pytest.mark.parametrize(("offset", "size"), [(12345, 5000), (0, 3 * 4096 + 5), (8192, 8192)])
    def test_write_extends_file(self, tool: Tool, open_file, offset: int, size: int) -> None:
        self.require(tool, "write")
        fd = open_file(b"")
        buffer = host_buffer(size, 1)
        buffer[...] = random_bytes(size, seed=2)
        assert tool.write(fd, buffer, offset) == size
        expected = np.zeros(offset + size, np.uint8)
        expected[offset:] = buffer
        _assert_same_bytes(_contents(fd), expected)

    def test_write_from_read_only_buffer(self, tool: Tool, open_file) -> None:
        self.require(tool, "write")
        fd = open_file(random_bytes(FILE_SIZE, seed=1))
        data = random_bytes(3 * 4096, seed=2)  # read-only, as np.frombuffer(bytes) gives
        assert not data.flags.writeable
        assert tool.write(fd, data, 4096) == data.nbytes
        _assert_same_bytes(_contents(fd)[4096 : 4096 + data.nbytes], data)

    def test_reads_in_flight(self, tool: Tool, open_file) -> None:
        self.require(tool, "read")
        data = random_bytes(4 << 20)
        fd = open_file(data)
        ranges = [(i * (512 << 10) + i, (256 << 10) + 7 * i) for i in range(8)]  # disjoint
        buffers = [host_buffer(size, i % 2) for i, (_, size) in enumerate(ranges)]
        futures = [
            tool.pread(fd, buffer, offset)
            for buffer, (offset, _) in zip(buffers, ranges, strict=True)
        ]
        assert [future.get() for future in futures] == [size for _, size in ranges]
        for buffer, (offset, size) in zip(buffers, ranges, strict=True):
            _assert_same_bytes(buffer, data[offset : offset + size])

    def test_writes_in_flight(self, tool: Tool, open_file) -> None:
        self.require(tool, "write")
        expected = random_bytes(4 << 20, seed=1).copy()
        fd = open_file(expected)
        ranges = [(i * (512 << 10) + i, (256 << 10) + 7 * i) for i in range(8)]
        buffers = []
        for i, (offset, size) in enumerate(ranges):
            buffers.append(host_buffer(size, i % 2))
            buffers[-1][...] = random_bytes(offset + size, seed=2)[offset:]
            expected[offset : offset + size] = buffers[-1]
        futures = [
            tool.pwrite(fd, buffer, offset)
            for buffer, (offset, _) in zip(buffers, ranges, strict=True)
        ]
        assert [future.get() for future in futures] == [size for _, size in ranges]
        _assert_same_bytes(_contents(fd), expected)

    @pytest.mark.parametrize("memory", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
    def test_calls_from_many_threads_do_not_mix(self, tool: Tool, open_file, memory: str) -> None:
        """One tool is shared by every thread: concurrent calls (each on a disjoint range, into
        its own buffer) must never share a staging buffer."""
        cupy = self.require_gpu(tool, "read") if memory == "cuda" else None
        self.require(tool, "read", memory)
        threads, rounds, size = 8, 3, (1 << 20) + 4099
        data = random_bytes(threads * (size + 4096))
        fd = open_file(data)
        barrier = threading.Barrier(threads)

        def reader(k: int) -> list[np.ndarray]:
            offset, got = k * (size + 4096) + k, []
            for _ in range(rounds):
                if cupy is None:
                    buffer: Any = host_buffer(size, k % 2)
                else:
                    buffer = _device_buffer(cupy.zeros(size, dtype=cupy.uint8))
                barrier.wait()
                assert tool.read(fd, buffer, offset) == size
                got.append(buffer if cupy is None else cupy.asnumpy(buffer.array))
            return got

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(reader, range(threads)))
        for k, got in enumerate(results):
            offset = k * (size + 4096) + k
            for buffer in got:
                _assert_same_bytes(buffer, data[offset : offset + size])

    @pytest.mark.parametrize("direction", ["read", "write"])
    def test_done_becomes_true(self, tool: Tool, open_file, direction: str) -> None:
        self.require(tool, direction)
        fd = open_file(random_bytes(FILE_SIZE))
        buffer = host_buffer(FILE_SIZE - 1)
        start = tool.pread if direction == "read" else tool.pwrite
        future = start(fd, buffer, 1)
        deadline = time.monotonic() + 30
        while not future.done():  # without get(): completion must not wait for the caller
            assert time.monotonic() < deadline, "done() still False after 30 s"
            time.sleep(0.001)
        assert future.get() == buffer.nbytes
        assert future.done()

    def test_blocking_twins(self, tool: Tool, open_file) -> None:
        data = random_bytes(FILE_SIZE)
        fd = open_file(data)
        if tool.capabilities.serves("read", "host"):
            one, two = host_buffer(100_000), host_buffer(100_000)
            assert tool.read(fd, one, 4097) == tool.pread(fd, two, 4097).get() == 100_000
            _assert_same_bytes(one, two)
        if tool.capabilities.serves("write", "host"):
            source = random_bytes(100_000, seed=2)
            assert tool.write(fd, source, 1) == tool.pwrite(fd, source, 200_001).get()
            written = _contents(fd)
            _assert_same_bytes(written[1:100_001], written[200_001:300_001])

    # ---- device memory -------------------------------------------------------------------

    @pytest.mark.gpu
    @pytest.mark.parametrize(("offset", "size"), DEVICE_CASES)
    def test_device_read(self, tool: Tool, open_file, offset: int, size: int) -> None:
        cupy = self.require_gpu(tool, "read")
        data = random_bytes(FILE_SIZE)
        fd = open_file(data)
        device = _device_buffer(cupy.zeros(size, dtype=cupy.uint8))
        parts = self.checksum_parts(tool, size)
        assert tool.pread(fd, device, offset, checksum=parts).get() == size
        _assert_same_bytes(cupy.asnumpy(device.array), data[offset : offset + size])
        self.check_checksum(parts, data[offset : offset + size])

    @pytest.mark.gpu
    def test_device_read_past_end(self, tool: Tool, open_file) -> None:
        cupy = self.require_gpu(tool, "read")
        data = random_bytes(FILE_SIZE)
        fd = open_file(data)
        device = _device_buffer(cupy.zeros(8192, dtype=cupy.uint8))
        assert tool.read(fd, device, FILE_SIZE - 100) == 100
        _assert_same_bytes(cupy.asnumpy(device.array[:100]), data[-100:])
        assert tool.read(fd, device, FILE_SIZE + 1) == 0

    @pytest.mark.gpu
    @pytest.mark.parametrize(("offset", "size"), DEVICE_CASES)
    def test_device_write(self, tool: Tool, open_file, offset: int, size: int) -> None:
        cupy = self.require_gpu(tool, "write")
        before = random_bytes(FILE_SIZE, seed=1)
        fd = open_file(before)
        source = random_bytes(size, seed=2)
        device = _device_buffer(cupy.asarray(source))
        parts = self.checksum_parts(tool, size)
        assert tool.pwrite(fd, device, offset, checksum=parts).get() == size
        expected = before.copy()
        expected[offset : offset + size] = source
        _assert_same_bytes(_contents(fd), expected)
        self.check_checksum(parts, source)

    # Piece sizes for tools that write several device buffers as one range (``pwritev``):
    # empty pieces, pieces within one block, across blocks and across the tool's chunks.
    GATHERED_CASES = [
        (0, [7, 0, 4096, 1]),
        (4095, [(1 << 20) + 3, 5, 70_000]),
        (12345, [3, (3 << 20) + 1, 4097, 1 << 20]),
    ]

    # Requests for tools that read several device buffers as one range (``preadv``):
    # (file offset, size) in file order, with gaps between them, empty ones, pieces within
    # one block and across the tool's chunks, and the last one past the end of the file.
    SCATTERED_CASES = [
        [(0, 7), (7, 0), (100, 4096), (4196, 1)],
        [(4095, 600_003), (604_100, 5), (700_000, 70_000)],
        [(12345, 3), (20000, 500_001), (530_000, 4097), (FILE_SIZE - 10, 50)],
    ]

    @pytest.mark.gpu
    @pytest.mark.parametrize("requests", SCATTERED_CASES)
    def test_device_scattered_read(
        self, tool: Tool, open_file, requests: list[tuple[int, int]]
    ) -> None:
        if not callable(getattr(tool, "preadv", None)):
            pytest.skip(f"{tool.label} has no preadv")
        cupy = self.require_gpu(tool, "read")
        data = random_bytes(FILE_SIZE)
        fd = open_file(data)
        devices = [_device_buffer(cupy.zeros(size, dtype=cupy.uint8)) for _, size in requests]
        parts = [self.checksum_parts(tool, size) for _, size in requests]
        pairs = [(offset, device) for (offset, _), device in zip(requests, devices, strict=True)]
        got = tool.preadv(fd, pairs, checksums=parts).get()
        nonempty = [(offset, size) for offset, size in requests if size]
        first, (last, last_size) = nonempty[0][0], nonempty[-1]
        assert got == min(last + last_size, FILE_SIZE) - first
        for (offset, size), device, part in zip(requests, devices, parts, strict=True):
            expected = data[offset : offset + size]
            _assert_same_bytes(cupy.asnumpy(device.array[: expected.nbytes]), expected)
            if expected.nbytes == size:
                self.check_checksum(part, expected)

    @pytest.mark.gpu
    @pytest.mark.parametrize(("offset", "sizes"), GATHERED_CASES)
    def test_device_gathered_write(
        self, tool: Tool, open_file, offset: int, sizes: list[int]
    ) -> None:
        if not callable(getattr(tool, "pwritev", None)):
            pytest.skip(f"{tool.label} has no pwritev")
        cupy = self.require_gpu(tool, "write")
        before = random_bytes(FILE_SIZE, seed=1)
        fd = open_file(before)
        sources = [random_bytes(size, seed=3 + i) for i, size in enumerate(sizes)]
        devices = [_device_buffer(cupy.asarray(source)) for source in sources]
        parts = [self.checksum_parts(tool, size) for size in sizes]
        assert tool.pwritev(fd, devices, offset, checksums=parts).get() == sum(sizes)
        joined = np.concatenate(sources)
        expected = np.zeros(max(before.nbytes, offset + joined.nbytes), dtype=np.uint8)
        expected[: before.nbytes] = before
        expected[offset : offset + joined.nbytes] = joined
        _assert_same_bytes(_contents(fd), expected)
        for part, source in zip(parts, sources, strict=True):
            self.check_checksum(part, source)
