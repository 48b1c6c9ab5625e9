"""What is particular to each tool, beyond the conformance suite: the registry, labels and
parameters, and the inner workings that the suite cannot see (direct's fast path and
descriptors, mmap's mappings)."""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest

from arrayio import tools
from arrayio.errors import ToolUnavailableError, UnknownToolError
from arrayio.integrity._checksum import ChecksumParts
from arrayio.testing.tool_suite import ScratchFiles, host_buffer, o_direct_refusal, random_bytes
from arrayio.tools import _pinned
from arrayio.tools import direct as direct_module
from arrayio.tools import mmap as mmap_module
from arrayio.tools.direct import DirectTool
from arrayio.tools.mmap import MmapTool
from arrayio.tools.naive import NaiveTool
from arrayio.tools.posix import PosixTool


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[ScratchFiles]:
    files = ScratchFiles(tmp_path)
    yield files
    files.close()


@pytest.fixture
def direct_file(tmp_path: Path, data_file):
    reason = o_direct_refusal(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    return data_file


class _NotHost:
    """Stands for device memory: anything that is not a NumPy array."""

    nbytes = 16


# ---- the registry ----------------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test register tools without leaking them into other tests."""
    monkeypatch.setattr(tools, "_REGISTRY", dict(tools._REGISTRY))


def test_names_list_the_builtin_tools() -> None:
    assert {"naive", "posix", "direct", "mmap"} <= set(tools.names())


@pytest.mark.parametrize(
    ("name", "cls"),
    [("naive", NaiveTool), ("posix", PosixTool), ("direct", DirectTool), ("mmap", MmapTool)],
)
def test_make_builds_the_registered_class(name: str, cls: type) -> None:
    assert tools.tool_class(name) is cls
    tool = tools.make(name)
    assert type(tool) is cls and tool.name == name
    tool.close()


def test_unknown_tool(registry) -> None:
    with pytest.raises(UnknownToolError, match="'nope'.*known.*posix") as caught:
        tools.tool_class("nope")
    assert isinstance(caught.value, KeyError)
    assert str(caught.value).startswith("no transfer tool named 'nope'")
    with pytest.raises(KeyError):
        tools.make("nope")


def test_register_refuses_clashes_unless_clobber(registry) -> None:
    with pytest.raises(ValueError, match="'posix' is already registered"):
        tools.register("posix", NaiveTool)
    assert tools.tool_class("posix") is PosixTool
    tools.register("posix", NaiveTool, clobber=True)
    assert tools.tool_class("posix") is NaiveTool


def test_register_a_dotted_name_imported_on_first_use(registry) -> None:
    tools.register("mine", "arrayio.tools.posix:PosixTool")
    assert "mine" in tools.names()
    assert tools.tool_class("mine") is PosixTool


# ---- labels, parameters, capabilities --------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "label"),
    [
        ("naive", {}, "naive"),
        ("posix", {"threads": 2, "task_size": 1024}, "posix(task_size=1024,threads=2)"),
        ("direct", {}, f"direct(task_size={8 << 20},threads=8)"),
        ("direct", {"threads": 3, "task_size": 5000}, "direct(task_size=8192,threads=3)"),
        ("direct", {"task_size": 1}, "direct(task_size=4096,threads=8)"),
        ("mmap", {}, "mmap(threads=4)"),
        ("mmap", {"threads": 1}, "mmap(threads=1)"),
    ],
)
def test_label_and_params(name: str, params: dict, label: str) -> None:
    tool = tools.make(name, **params)
    assert tool.label == label
    assert repr(tool) == f"<arrayio tool {label}>"
    tool.params["threads"] = 99  # a copy: the tool is not changed through it
    assert "threads=99" not in tool.label


def test_direct_rounds_task_size_to_blocks() -> None:
    assert DirectTool(task_size=4096).task_size == 4096
    assert DirectTool(task_size=4097).task_size == 8192
    assert DirectTool(task_size=(8 << 20) - 1).params["task_size"] == 8 << 20


@pytest.mark.parametrize(
    ("cls", "params"),
    [
        (PosixTool, {"threads": 0}),
        (PosixTool, {"task_size": 0}),
        (DirectTool, {"threads": 0}),
        (DirectTool, {"task_size": 0}),
        (DirectTool, {"threads": -1}),
        (MmapTool, {"threads": 0}),
    ],
)
def test_parameters_are_validated(cls: type, params: dict) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        cls(**params)


def test_capabilities() -> None:
    assert DirectTool.capabilities.memory == {"host"}
    assert DirectTool.capabilities.alignment == 4096
    assert DirectTool.capabilities.checksums
    assert DirectTool.capabilities.directions == {"read", "write"}
    assert MmapTool.capabilities.memory == {"host"}
    assert MmapTool.capabilities.directions == {"read"}
    assert not MmapTool.capabilities.serves("write", "host")
    assert DirectTool.availability() and MmapTool.availability()


@pytest.mark.parametrize("cls", [PosixTool, DirectTool, MmapTool])
def test_host_only_tools_refuse_device_memory(cls: type, data_file) -> None:
    fd = data_file(random_bytes(100))
    with pytest.raises(TypeError, match="host memory only"):
        cls().pread(fd, _NotHost(), 0)
    if cls.capabilities.serves("write", "host"):
        with pytest.raises(TypeError, match="host memory only"):
            cls().pwrite(fd, _NotHost(), 0)


def test_mmap_refuses_writes(data_file) -> None:
    fd = data_file(random_bytes(100))
    with pytest.raises(ToolUnavailableError, match="mmap reads only"):
        MmapTool().pwrite(fd, host_buffer(10), 0)


# ---- direct ----------------------------------------------------------------------------


def _spy_transfers(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[int, int, int]]]:
    """Record (address, nbytes, file offset) of every direct and buffered transfer."""
    calls: dict[str, list[tuple[int, int, int]]] = {"read": [], "write": [], "buffered": []}

    def spy(kind, real):
        def recorded(*args):
            view, offset = args[-2], args[-1]
            calls[kind].append((view.__array_interface__["data"][0], view.nbytes, offset))
            return real(*args)

        return recorded

    monkeypatch.setattr(direct_module, "pread_direct", spy("read", direct_module.pread_direct))
    monkeypatch.setattr(direct_module, "pwrite_direct", spy("write", direct_module.pwrite_direct))
    monkeypatch.setattr(direct_module, "pwrite_full", spy("buffered", direct_module.pwrite_full))
    return calls


def _inside(buffer: np.ndarray, address: int, nbytes: int) -> bool:
    start = buffer.__array_interface__["data"][0]
    return start <= address and address + nbytes <= start + buffer.nbytes


@pytest.mark.parametrize("threads", [1, 4])
def test_direct_reads_congruent_ranges_into_the_callers_buffer(
    threads: int, direct_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(3 << 20)
    fd = direct_file(data)
    calls = _spy_transfers(monkeypatch)
    tool = DirectTool(threads=threads, task_size=256 << 10)
    # Address and offset both 1 past a block: only the first and last blocks bounce.
    buffer = host_buffer((2 << 20) + 10, shift=1)
    assert tool.read(fd, buffer, 4097) == buffer.nbytes
    np.testing.assert_array_equal(buffer, data[4097 : 4097 + buffer.nbytes])
    direct = [call for call in calls["read"] if _inside(buffer, call[0], call[1])]
    assert sum(nbytes for _, nbytes, _ in direct) == (2 << 20) - 4096
    assert len(calls["read"]) == len(direct) + 2
    tool.close()


def test_direct_bounces_ranges_that_are_not_congruent(
    direct_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(1 << 20)
    fd = direct_file(data)
    calls = _spy_transfers(monkeypatch)
    tool = DirectTool(threads=1, task_size=64 << 10)
    buffer = host_buffer(500_000)  # aligned address, unaligned offset
    assert tool.read(fd, buffer, 3) == 500_000
    np.testing.assert_array_equal(buffer, data[3:500_003])
    assert calls["read"] and not any(_inside(buffer, *call[:2]) for call in calls["read"])
    assert all(address % 4096 == 0 for address, _, _ in calls["read"])


def test_direct_writes_whole_blocks_directly_and_partial_ones_buffered(
    direct_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = direct_file(random_bytes(50_000, seed=1))
    calls = _spy_transfers(monkeypatch)
    tool = DirectTool(threads=1)
    buffer = host_buffer(3 * 4096, shift=1)
    buffer[...] = random_bytes(buffer.nbytes, seed=2)
    assert tool.write(fd, buffer, 1) == buffer.nbytes
    assert sorted((nbytes, offset) for _, nbytes, offset in calls["buffered"]) == [
        (1, 3 * 4096),
        (4095, 1),
    ]
    assert [(nbytes, offset) for _, nbytes, offset in calls["write"]] == [(2 * 4096, 4096)]
    assert _inside(buffer, *calls["write"][0][:2])  # congruent: no copy
    assert os.pread(fd, buffer.nbytes, 1) == buffer.tobytes()


def test_direct_reuses_bounce_buffers(direct_file, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = direct_file(random_bytes(1 << 20))
    made = []
    real = direct_module.aligned_empty

    def counted(*args):
        made.append(args)
        return real(*args)

    monkeypatch.setattr(direct_module, "aligned_empty", counted)
    tool = DirectTool(threads=2, task_size=64 << 10)
    for _ in range(3):
        assert tool.read(fd, host_buffer(300_000), 5) == 300_000
    assert 1 <= len(made) <= 3  # one per worker at most, then reused
    tool.close()


@pytest.mark.parametrize("direction", ["read", "write"])
def test_direct_opens_its_own_descriptor_without_truncating(
    direction: str, direct_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = direct_file(random_bytes(100_000))
    opened = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        opened.append((path, flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(direct_module.os, "open", spy)
    before = _open_fds()
    tool = DirectTool(threads=4, task_size=8192)
    call = tool.read if direction == "read" else tool.write
    assert call(fd, host_buffer(50_000), 1) == 50_000
    monkeypatch.undo()
    ((path, flags),) = opened
    assert path == f"/proc/self/fd/{fd}"
    assert flags & os.O_DIRECT and not flags & (os.O_TRUNC | os.O_CREAT | os.O_APPEND)
    assert flags & os.O_ACCMODE == (os.O_RDONLY if direction == "read" else os.O_WRONLY)
    assert _open_fds() == before
    assert os.fstat(fd).st_size == 100_000
    tool.close()


def test_direct_small_writes_need_no_direct_descriptor(
    direct_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = direct_file(random_bytes(100_000))
    monkeypatch.setattr(direct_module, "open_direct", None)  # calling it would fail
    # Within the first two blocks and covering neither whole: no block to write directly.
    assert DirectTool().write(fd, random_bytes(5000, seed=2), 1) == 5000
    assert os.pread(fd, 5000, 1) == random_bytes(5000, seed=2).tobytes()


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_refused_o_direct_names_the_file_and_its_file_system(
    code: int, data_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both errors say "this file system does not do O_DIRECT": the dispatcher falls back and
    # explain() shows the reason, for the direct and the staged tool alike.
    from arrayio.tools import _io

    fd = data_file(random_bytes(100_000))
    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(_io.os, "open", refusing)
    monkeypatch.setattr(_io.os, "O_DIRECT", getattr(os, "O_DIRECT", 0o40000), raising=False)
    with pytest.raises(
        ToolUnavailableError,
        match=r"O_DIRECT open refused for .+ on its \S+ "
        rf"file system \(\[Errno {code}\]",
    ):
        DirectTool().read(fd, host_buffer(50_000), 0)


@pytest.mark.parametrize("threads", [1, 4])
def test_direct_closes_its_descriptor_on_errors(threads: int, direct_file) -> None:
    fd = direct_file(random_bytes(1 << 20))
    before = _open_fds()
    tool = DirectTool(threads=threads, task_size=64 << 10)
    read_only = np.zeros(600_000, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((TypeError, ValueError)):
        tool.pread(fd, read_only, 1).get()
    with pytest.raises((TypeError, ValueError)):
        tool.pread(fd, read_only, 0).get()
    assert _open_fds() == before
    tool.close()


def test_direct_future_completes_after_its_descriptor_is_closed(direct_file) -> None:
    fd = direct_file(random_bytes(4 << 20))
    before = _open_fds()
    tool = DirectTool(threads=4, task_size=64 << 10)
    future = tool.pread(fd, host_buffer(4 << 20), 0)
    while not future.done():
        time.sleep(0.0005)
    assert _open_fds() == before  # closed before done() said so, without a get()
    assert future.get() == 4 << 20
    tool.close()


def test_direct_refused_by_the_file_system(direct_file, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = direct_file(random_bytes(100_000))
    real_open = os.open

    def refuse(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(direct_module.os, "open", refuse)
    with pytest.raises(
        ToolUnavailableError,
        match=r"O_DIRECT open refused for .*data-0\.bin "
        r"on its \w+ file system \(\[Errno 22\]",
    ):
        DirectTool().read(fd, host_buffer(8192), 0)
    with pytest.raises(OSError):  # ToolUnavailableError is an OSError too
        DirectTool().write(fd, host_buffer(8192), 0)


def test_direct_other_open_errors_pass_through(
    monkeypatch: pytest.MonkeyPatch, direct_file
) -> None:
    fd = direct_file(random_bytes(100))

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "denied")

    monkeypatch.setattr(direct_module.os, "open", denied)
    with pytest.raises(PermissionError) as caught:
        DirectTool().read(fd, host_buffer(10), 0)
    assert not isinstance(caught.value, ToolUnavailableError)


def test_direct_alignment_refused_at_read_time(
    direct_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = direct_file(random_bytes(100_000))
    before = _open_fds()

    def refuse(*args):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(direct_module.os, "preadv", refuse)
    tool = DirectTool(threads=4, task_size=8192)
    with pytest.raises(ToolUnavailableError, match="O_DIRECT read refused"):
        tool.pread(fd, host_buffer(100_000), 0).get()
    monkeypatch.undo()
    assert _open_fds() == before
    tool.close()


def test_direct_short_read_in_the_last_block(direct_file) -> None:
    data = random_bytes(3 * 4096 + 100)
    fd = direct_file(data)
    buffer = host_buffer(4 * 4096)  # congruent: the last block is read directly
    parts = ChecksumParts(data.nbytes)
    assert DirectTool(threads=1).read(fd, buffer, 0, checksum=parts) == data.nbytes
    np.testing.assert_array_equal(buffer[: data.nbytes], data)


# ---- mmap ------------------------------------------------------------------------------


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


def _spy_maps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    maps: list[tuple[int, int]] = []
    real = mmap.mmap

    def spy(fd, length, *args, offset=0, **kwargs):
        maps.append((offset, length))
        return real(fd, length, *args, offset=offset, **kwargs)

    monkeypatch.setattr(mmap_module.mmap, "mmap", spy)
    return maps


@pytest.mark.parametrize("threads", [1, 4])
def test_mmap_never_maps_past_the_end(
    threads: int, data_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mmap_module, "_CHUNK", 1024)  # several chunks on the threads
    data = random_bytes(1 << 20)
    fd = data_file(data)
    os.ftruncate(fd, 5000)  # shorter than what is asked for
    maps = _spy_maps(monkeypatch)
    buffer = host_buffer(1 << 20)
    tool = MmapTool(threads=threads)
    assert tool.read(fd, buffer, 10) == 4990
    np.testing.assert_array_equal(buffer[:4990], data[10:5000])
    assert len(maps) == 5 and all(offset + length <= 5000 for offset, length in maps)
    assert tool.read(fd, buffer, 5000) == 0
    assert tool.read(fd, buffer, 9000) == 0
    assert len(maps) == 5  # nothing mapped for reads from the end on
    assert not _mapped(data_file.paths[fd])
    tool.close()


def test_mmap_empty_file_and_empty_buffer(data_file) -> None:
    fd = data_file(b"")
    assert MmapTool().read(fd, host_buffer(4096), 0) == 0
    assert MmapTool().read(fd, host_buffer(0), 0) == 0


def test_mmap_releases_its_maps(data_file) -> None:
    fd = data_file(random_bytes((3 << 20) + 1))
    tool = MmapTool(threads=4)
    future = tool.pread(fd, host_buffer(3 << 20), 1)
    assert future.get() == 3 << 20
    assert not _mapped(data_file.paths[fd])
    tool.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_mmap_failed_copy_still_releases_the_map(
    threads: int, data_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mmap_module, "_CHUNK", 64 << 10)
    fd = data_file(random_bytes(1 << 20))
    read_only = np.zeros(1 << 20, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):  # not BufferError from close()
        MmapTool(threads=threads).pread(fd, read_only, 0).get()
    assert not _mapped(data_file.paths[fd])


def test_mmap_many_chunks_on_threads(data_file, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mmap_module, "_CHUNK", 64 << 10)
    data = random_bytes(3 << 20)
    fd = data_file(data)
    maps = _spy_maps(monkeypatch)
    buffer = host_buffer((2 << 20) + 7, shift=1)
    parts = ChecksumParts(buffer.nbytes)
    tool = MmapTool(threads=4)
    assert tool.read(fd, buffer, 4095, checksum=parts) == buffer.nbytes
    np.testing.assert_array_equal(buffer, data[4095 : 4095 + buffer.nbytes])
    assert len(maps) == 33 and all(offset % mmap.ALLOCATIONGRANULARITY == 0 for offset, _ in maps)
    assert parts.value() == crc32c.crc32c(buffer)
    tool.close()


_FORK_SCRIPT = r"""
import os, sys, time
import numpy as np
from arrayio.tools import make

path = sys.argv[1]
data = np.fromfile(path, dtype=np.uint8)
tool = make("posix", threads=4, task_size=4 << 20)
fd = os.open(path, os.O_RDONLY)
parent = np.empty_like(data)
assert tool.read(fd, parent, 0) == data.nbytes  # the pool's threads now exist
pid = os.fork()
if pid == 0:
    child = np.empty_like(data)
    ok = tool.read(fd, child, 0) == data.nbytes and bool((child == data).all())
    os._exit(0 if ok else 3)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(4)  # the child hung
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_reads_through_a_tool_its_parent_used(tmp_path):
    # The child inherits the tool but not its worker threads: a task handed to the parent's
    # pool would wait forever. (In a fresh interpreter: forking this one, with JAX's threads,
    # is unsafe in itself.)
    import subprocess
    import sys

    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 24 << 20, dtype=np.uint8))
    result = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


def test_task_bytes_spread_a_request_alone_but_not_within_a_batch() -> None:
    from arrayio.tools._io import in_batch, task_bytes

    MiB = 1 << 20
    # Alone: 16 MiB over 8 threads, but never under 4 MiB a task.
    assert task_bytes(16 * MiB, 8, 32 * MiB) == 4 * MiB
    assert task_bytes(256 * MiB, 8, 32 * MiB) == 32 * MiB
    assert task_bytes(5000, 4, 8 * MiB) == 4 * MiB
    with in_batch():  # the batch's other requests keep the threads busy
        assert task_bytes(16 * MiB, 8, 32 * MiB) == 32 * MiB
        assert task_bytes(5000, 4, 8 * MiB + 1) == 8 * MiB + 4096  # rounded to blocks
    assert task_bytes(16 * MiB, 8, 32 * MiB) == 4 * MiB  # and only within


class _FakeDevice:
    """Host bytes posing as device memory, counting the pinned buffers asked for."""

    device_index = 0
    pinned: list[int] = []

    def __init__(self, nbytes: int) -> None:
        self.data = np.zeros(nbytes, np.uint8)
        self.nbytes = nbytes

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        dst[...] = self.data[offset : offset + dst.nbytes]

    def copy_from_host(self, offset: int, src: np.ndarray) -> None:
        self.data[offset : offset + src.nbytes] = src

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        self.pinned.append(nbytes)
        return np.empty(nbytes, np.uint8)


def test_naive_staging_is_not_reallocated_for_each_new_small_size(tmp_path, monkeypatch):
    # Pinned allocations cost about a millisecond: arrays of random small sizes must reuse
    # one staging buffer, not grow it a few kilobytes at a time.
    monkeypatch.setattr(_FakeDevice, "pinned", [])
    _pinned.pool.clear()  # spares other tests left would hide the allocations
    tool = NaiveTool()
    rng = np.random.default_rng(0)
    path = tmp_path / "n.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for size in rng.integers(4096, 65536, 50):
            device = _FakeDevice(int(size))
            device.data[...] = rng.integers(0, 256, int(size), dtype=np.uint8)
            assert tool.write(fd, device, 0) == size
            back = _FakeDevice(int(size))
            assert tool.read(fd, back, 0) == size
            assert back.data.tobytes() == device.data.tobytes()
    finally:
        os.close(fd)
    assert len(_FakeDevice.pinned) == 1 and _FakeDevice.pinned[0] >= 1 << 20


# --------------------------------------------------------------------------- interpreter exit


@pytest.mark.parametrize(
    "make",
    [
        lambda: PosixTool(threads=4, task_size=1 << 16),
        lambda: DirectTool(threads=4, task_size=1 << 16),
        lambda: MmapTool(threads=4),
    ],
    ids=["posix", "direct", "mmap"],
)
def test_a_threaded_tool_finishes_its_work_once_the_interpreter_stops_thread_pools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make
) -> None:
    """What a save still running at interpreter exit meets: concurrent.futures refuses new
    work once its exit hook has run. The tool runs its tasks in the caller's thread instead
    of failing (which would also have marked it unavailable in the dispatch table)."""
    import concurrent.futures.thread

    data = random_bytes(20 << 20, seed=7)  # several of every tool's tasks
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    tool = make()
    if o_direct_refusal(tmp_path) is not None and isinstance(tool, DirectTool):
        pytest.skip("O_DIRECT refused here")
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = host_buffer(len(data))
        assert tool.pread(fd, out, 0).get() == len(data)
        np.testing.assert_array_equal(out, data)
    finally:
        os.close(fd)
        tool.close()


# Reads with the mmap tool a file that another process shrinks once the reader has mapped it
# (the first mapping truncates the file right after it is made): without a guard, the copy
# touches pages past the end of the file and the kernel kills the process with SIGBUS.
SHRUNK_UNDER_MMAP = """
import mmap, os, sys, types
import numpy as np
from arrayio.tools import mmap as mmap_module
from arrayio.tools.mmap import MmapTool
path = sys.argv[1]
size = os.stat(path).st_size

def map_then_shrink(*args, **kwargs):
    mapped = mmap.mmap(*args, **kwargs)
    os.truncate(path, min(os.stat(path).st_size, 4096))
    return mapped

mmap_module.mmap = types.SimpleNamespace(**{name: getattr(mmap, name) for name in dir(mmap)
                                            if name.isupper()}, mmap=map_then_shrink)
fd = os.open(path, os.O_RDONLY)
out = np.empty(size, np.uint8)
print(MmapTool(threads=int(sys.argv[2])).pread(fd, out, 0).get())
"""


@pytest.mark.parametrize("threads", [1, 4])
def test_mmap_reports_a_file_shrunk_under_it_as_a_short_read(tmp_path: Path, threads) -> None:
    import subprocess
    import sys

    path = tmp_path / "shrinking.bin"
    path.write_bytes(random_bytes(20 << 20, seed=3).tobytes())
    done = subprocess.run(
        [sys.executable, "-c", SHRUNK_UNDER_MMAP, str(path), str(threads)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"the reader died ({done.returncode}): {done.stderr}"
    assert int(done.stdout) < 20 << 20  # short: the dispatcher raises TruncatedFileError


def test_mmap_a_file_cut_inside_the_last_page_of_a_read_comes_up_short(tmp_path, monkeypatch):
    # A file cut inside the page a copy ends in reads as zeros past its new end, not as a
    # fault: the read must come up short (a TruncatedFileError), not return the zeros.
    from arrayio.tools import mmap as mmap_tool

    data = random_bytes(3 * 4096 + 100)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    real = mmap_tool._kernel_copy

    def cutting(destination: int, source: int, nbytes: int) -> int | None:
        os.truncate(path, 3 * 4096 + 50)  # after the map was made, before the copy
        return real(destination, source, nbytes)

    monkeypatch.setattr(mmap_tool, "_kernel_copy", cutting)
    tool = tools.make("mmap", threads=1)
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = host_buffer(data.nbytes)
        got = tool.read(fd, buffer, 0)
    finally:
        os.close(fd)
        tool.close()
    assert got == 3 * 4096 + 50
    assert bytes(buffer[:got]) == data[:got].tobytes()


def test_a_staged_transfer_waits_for_its_copies_however_it_ends(caplog):
    # Its pinned buffers go back to the pool after the block: the copies reading them are
    # waited for on failure too, and a wait that fails then does not hide the first error.
    from arrayio.tools.staged import _copies_done

    class Stream:
        def __init__(self, fails=False):
            self.waits, self.fails = 0, fails

        def synchronize(self):
            self.waits += 1
            if self.fails:
                raise RuntimeError("the stream failed too")

    stream = Stream()
    with _copies_done(stream):
        pass
    assert stream.waits == 1
    with pytest.raises(OSError, match="read failed"), _copies_done(stream):
        raise OSError("read failed")
    assert stream.waits == 2
    failing = Stream(fails=True)
    with pytest.raises(OSError, match="read failed"), _copies_done(failing):
        raise OSError("read failed")
    assert failing.waits == 1 and "copies failed too" in caplog.text
