"""The GPU CRC-32C: its arithmetic here (the host twin of the kernel's reduction), and the
kernel itself against the host CRC on the GPU machine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayio.integrity._checksum import _multiply, checksum, combine
from arrayio.integrity._device_checksum import device_checksum, segment_powers, slicing_tables


def _table_crc(data: bytes) -> int:
    """CRC-32C with the kernel's slicing-by-4 tables (bytes at a time, then words)."""
    t = slicing_tables().reshape(4, 256).astype(np.int64)
    crc = 0xFFFFFFFF
    words = len(data) // 4
    for i in range(words):
        crc ^= int.from_bytes(data[4 * i : 4 * i + 4], "little")
        crc = int(
            t[3][crc & 255] ^ t[2][(crc >> 8) & 255] ^ t[1][(crc >> 16) & 255] ^ t[0][crc >> 24]
        )
    for byte in data[4 * words :]:
        crc = int(t[0][(crc ^ byte) & 255]) ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def combine_segments(segment_crcs: list[int], segment: int, last_length: int) -> int:
    """The CRC-32C of a range from the CRCs of its segments, by the kernel's arithmetic.

    The host-side twin of the kernel's reduction (every segment ``segment`` bytes but the
    last, ``last_length``), which the CPU tests check against a direct CRC.
    """
    powers = segment_powers(segment)
    *full, last = segment_crcs
    shifted = 0
    for index, crc in enumerate(full):
        after, bit = len(full) - 1 - index, 0
        while after:
            if after & 1:
                crc = _multiply(int(powers[bit]), crc)
            after >>= 1
            bit += 1
        shifted ^= crc
    return combine(shifted, last, last_length)


@given(st.binary(max_size=300))
def test_slicing_tables_give_crc32c(data: bytes) -> None:
    assert _table_crc(data) == checksum(np.frombuffer(data, np.uint8))


@given(st.binary(min_size=1, max_size=5000), st.sampled_from([1, 3, 16, 64, 512]))
@settings(max_examples=60, deadline=None)
def test_segment_reduction_gives_the_crc_of_the_whole(data: bytes, segment: int) -> None:
    array = np.frombuffer(data, np.uint8)
    pieces = [array[start : start + segment] for start in range(0, array.nbytes, segment)]
    crcs = [checksum(piece) for piece in pieces]
    assert combine_segments(crcs, segment, pieces[-1].nbytes) == checksum(array)


def test_segment_powers_are_successive_squares() -> None:
    powers = segment_powers(4096)
    for j in range(1, 8):
        assert _multiply(int(powers[j - 1]), int(powers[j - 1])) == int(powers[j])


def test_empty_buffer_needs_no_gpu() -> None:
    class Empty:
        nbytes = 0
        device_index = 0

    assert device_checksum(Empty()) == 0  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "nbytes", [1, 15, 16, 17, 4095, 4096, 4097, 3 * 4096 + 5, (1 << 20) + 3, 64 << 20]
)
@pytest.mark.parametrize("misalign", [0, 1, 7])
def test_kernel_matches_host_crc(nbytes: int, misalign: int) -> None:
    import cupy

    from arrayio.arrays._buffers import CupyDeviceBuffer

    rng = np.random.default_rng(nbytes + misalign)
    host = rng.integers(0, 256, nbytes + misalign, dtype=np.uint8)
    device = cupy.asarray(host)[misalign:]
    assert device_checksum(CupyDeviceBuffer(device)) == checksum(host[misalign:])


@pytest.mark.gpu
@given(st.binary(min_size=1, max_size=20000), st.integers(0, 15), st.sampled_from([16, 48, 4096]))
@settings(max_examples=40, deadline=None)
def test_kernel_matches_host_crc_property(data: bytes, misalign: int, segment: int) -> None:
    import cupy

    from arrayio.arrays._buffers import CupyDeviceBuffer

    padded = cupy.asarray(np.frombuffer(bytes(misalign) + data, np.uint8))
    got = device_checksum(CupyDeviceBuffer(padded[misalign:]), segment=segment)
    assert got == checksum(np.frombuffer(data, np.uint8))


@pytest.mark.gpu
def test_a_batch_of_buffers_is_checksummed_with_one_wait() -> None:
    import cupy

    from arrayio.arrays._buffers import CupyDeviceBuffer
    from arrayio.integrity._device_checksum import device_checksums

    rng = np.random.default_rng(3)
    hosts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4097, 5 << 20, 33, 0)]
    buffers = [CupyDeviceBuffer(cupy.asarray(h)) for h in hosts]
    assert device_checksums(buffers) == [checksum(h) for h in hosts]
    assert device_checksums([]) == []


@pytest.mark.gpu
def test_kernel_on_torch_memory() -> None:
    torch = pytest.importorskip("torch")
    from arrayio.arrays._buffers import TorchDeviceBuffer

    tensor = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    expected = checksum(tensor.cpu().numpy())
    assert device_checksum(TorchDeviceBuffer(tensor)) == expected


@pytest.mark.gpu
def test_kernel_beyond_512_mib() -> None:
    # Shifts by 512 MiB and more: where a wrapping table of powers of x went wrong.
    import cupy

    from arrayio.arrays._buffers import CupyDeviceBuffer

    device = cupy.arange(600 << 18, dtype=cupy.uint32).view(cupy.uint8)  # 600 MiB
    assert device_checksum(CupyDeviceBuffer(device)) == checksum(cupy.asnumpy(device))


@pytest.mark.parametrize("nbytes", [1, 100, 1 << 20, 64 << 20, 1 << 30, 1 << 40])
def test_segments_are_powers_of_two_within_bounds(nbytes: int) -> None:
    from arrayio.integrity._device_checksum import MIN_SEGMENT_BYTES, SEGMENT_BYTES, segment_for

    segment = segment_for(nbytes)
    assert MIN_SEGMENT_BYTES <= segment <= SEGMENT_BYTES
    assert segment & (segment - 1) == 0


class _HostBackedDevice:
    """A stand-in device buffer whose bytes live in a NumPy array."""

    device_index = 0

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.nbytes = data.nbytes

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        dst[...] = self.data[offset : offset + dst.nbytes]


def test_checksum_anywhere_falls_back_to_the_host(monkeypatch) -> None:
    from arrayio.integrity import _device_checksum

    # As where the kernel cannot run (no CuPy here, or one that failed): through the host,
    # in staging pieces.
    monkeypatch.setattr(_device_checksum, "_unavailable", "pretend: no NVRTC")
    data = np.random.default_rng(3).integers(0, 256, (64 << 20) + 5, dtype=np.uint8)
    assert _device_checksum.device_checksum(_HostBackedDevice(data)) is None  # type: ignore[arg-type]
    assert _device_checksum.checksum_anywhere(_HostBackedDevice(data)) == checksum(data)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_checksums_launched_one_by_one_in_any_order_match_the_host() -> None:
    import cupy

    from arrayio.arrays._buffers import CupyDeviceBuffer
    from arrayio.integrity._device_checksum import DeviceChecksums

    rng = np.random.default_rng(5)
    hosts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5 << 20, 0, 77, 1 << 20, 9)]
    sums = DeviceChecksums([CupyDeviceBuffer(cupy.asarray(h)) for h in hosts])
    for index in (3, 1, 0, 3):  # out of order, one twice; 2 and 4 left to results()
        sums.launch(index)
    assert sums.results() == [checksum(h) for h in hosts]


@pytest.fixture(params=["cupy", "torch", "driver"])
def launcher(request, monkeypatch):
    """Each way to launch the kernel, chosen for the test."""
    from arrayio.integrity import _device_checksum, _launchers

    if request.param == "cupy":
        import cupy

        chosen = _launchers.CupyLauncher(cupy)
    elif request.param == "driver":
        if not _launchers._driver_usable():
            pytest.skip("no NVRTC library found")
        chosen = _launchers.DriverLauncher()
    else:
        torch = pytest.importorskip("torch")
        torch.empty(1, device="cuda")  # torch runs CUDA, as where it is chosen
        chosen = _launchers.TorchLauncher(torch)
    monkeypatch.setattr(_device_checksum, "_unavailable", None)
    monkeypatch.setattr(_device_checksum, "_chosen", chosen)
    return chosen


@pytest.mark.gpu
@pytest.mark.parametrize("group_buffers", [1, 3, 128])
@pytest.mark.parametrize("segment", [None, 16, 48])
def test_groups_of_many_buffers_match_the_host(
    monkeypatch, launcher, group_buffers, segment
) -> None:
    # Buffers of a few segments each put several buffers in one warp (each lane adds its
    # segment to its own buffer's row), large ones span many blocks; launched in groups of
    # 1, 3 or up to 128, ready out of order, some left to results().
    import cupy

    from arrayio.arrays._buffers import CupyDeviceBuffer
    from arrayio.integrity import _device_checksum

    monkeypatch.setattr(_device_checksum, "GROUP_BUFFERS", group_buffers)
    rng = np.random.default_rng(group_buffers)
    sizes = [int(n) for n in rng.integers(1, 300, 150)] + [0, 4096, (3 << 20) + 5, 1, 64 << 10]
    rng.shuffle(sizes)
    misaligned = cupy.asarray(rng.integers(0, 256, sum(sizes) + len(sizes), dtype=np.uint8))
    buffers, start = [], 0
    for n in sizes:  # views at odd addresses of one allocation
        start += 1
        buffers.append(CupyDeviceBuffer(misaligned[start : start + n]))
        start += n
    sums = _device_checksum.DeviceChecksums(buffers, segment, own_stream=True)
    for index in rng.permutation(len(sizes))[: len(sizes) * 2 // 3]:
        sums.launch(int(index))
    host = cupy.asnumpy(misaligned)
    expected = [
        checksum(host[b.array.data.ptr - misaligned.data.ptr :][: b.nbytes]) for b in buffers
    ]
    assert sums.results() == expected
    assert sums._gpu is launcher


@pytest.mark.gpu
def test_a_torch_load_checksums_on_the_gpu_without_importing_cupy(tmp_path) -> None:
    # CuPy's import costs a fresh process's first load more than the load itself: where
    # torch runs CUDA, torch launches the kernel.
    pytest.importorskip("torch")
    script = f"""
import sys, numpy as np, torch
torch.empty(1, device="cuda")
import arrayio
from arrayio.integrity import _device_checksum
state = {{"a": np.arange(3 << 20, dtype=np.float32), "b": np.ones(7, np.uint8)}}
arrayio.save({str(tmp_path / "m.safetensors")!r}, state)
out = arrayio.load({str(tmp_path / "m.safetensors")!r}, like="torch", device="cuda")
assert out["a"].is_cuda and int(out["a"][-1]) == (3 << 20) - 1
assert "cupy" not in sys.modules, "CuPy imported"
assert _device_checksum._chosen is not None and _device_checksum._chosen.name == "torch"
print("ok")
"""
    env = {**os.environ, "ARRAYIO_CACHE_DIR": "none"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


class _Ready:
    """A device buffer as DeviceChecksums sees it before any launch."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.device_index = nbytes, 0


def test_the_kernel_is_built_beside_the_reads_which_never_wait_for_it(monkeypatch) -> None:
    # A fresh cache directory's first build (NVRTC) outlasts a warm load of a gigabyte: the
    # buffers that land meanwhile wait for the kernel, the reads do not (launch() returns),
    # and the next group, once built, takes them all.
    from arrayio.integrity import _device_checksum

    building, release = threading.Event(), threading.Event()

    def slow_kernel(gpu, device):
        building.set()
        assert release.wait(10)

    flushed: list[list[int]] = []
    monkeypatch.setattr(_device_checksum, "_builds", {})
    monkeypatch.setattr(_device_checksum, "available", lambda: True)
    gpu = types.SimpleNamespace(
        device=lambda index: contextlib.nullcontext(),
        own_stream=lambda index: None,
        on_stream=lambda stream: contextlib.nullcontext(),
    )
    monkeypatch.setattr(_device_checksum, "_launcher", lambda: gpu)
    monkeypatch.setattr(_device_checksum, "_kernel", slow_kernel)
    monkeypatch.setattr(_device_checksum, "_first_launch", lambda gpu, device: None)
    monkeypatch.setattr(_device_checksum, "GROUP_BUFFERS", 1)
    monkeypatch.setattr(
        _device_checksum.DeviceChecksums,
        "_flush",
        lambda self, device: flushed.append(self._ready.pop(device, [])),
    )
    sums = _device_checksum.DeviceChecksums([_Ready(4096) for _ in range(3)])
    assert building.wait(10)  # started with the batch, on a thread of its own
    sums.launch(0)  # a full group, the kernel still building: no launch, no wait
    assert flushed == []
    release.set()
    assert _device_checksum._builds[0].wait(10)
    sums.launch(1)
    assert flushed == [[0, 1]]
    _device_checksum.DeviceChecksums([_Ready(4096)])  # built once a process
    assert list(_device_checksum._builds) == [0]


@pytest.mark.gpu
def test_a_kernel_that_fails_midway_falls_back_to_the_host(monkeypatch) -> None:
    import cupy

    from arrayio.arrays._buffers import CupyDeviceBuffer
    from arrayio.integrity import _device_checksum

    monkeypatch.setattr(_device_checksum, "_unavailable", None)
    real = _device_checksum._kernel
    calls = []

    def failing_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("pretend: the kernel cannot be launched")
        return real(*args)

    monkeypatch.setattr(_device_checksum, "_kernel", failing_second)
    monkeypatch.setattr(_device_checksum, "_build_ahead", lambda devices: None)  # counted here
    monkeypatch.setattr(_device_checksum, "GROUP_BUFFERS", 1)  # a launch per buffer
    hosts = [np.full(n, i, np.uint8) for i, n in enumerate((3 << 20, 5000, 1 << 20))]
    sums = _device_checksum.DeviceChecksums([CupyDeviceBuffer(cupy.asarray(h)) for h in hosts])
    sums.launch(0)
    sums.launch(1)  # fails: the rest go through the host
    assert sums.results() == [checksum(h) for h in hosts]
    assert len(calls) == 2 and "pretend" in _device_checksum._unavailable


def test_the_host_fallback_takes_empty_buffers_too(monkeypatch) -> None:
    from arrayio.integrity import _device_checksum

    # A batch's empty arrays beside full ones, where the kernel cannot run: the host's
    # staging loop must not be asked for steps of zero bytes.
    monkeypatch.setattr(_device_checksum, "_unavailable", "pretend: no NVRTC")
    data = np.arange(5000, dtype=np.uint8)
    buffers = [_HostBackedDevice(data[:0]), _HostBackedDevice(data), _HostBackedDevice(data[:0])]
    assert _device_checksum.checksums_anywhere(buffers) == [0, checksum(data), 0]  # type: ignore[arg-type]


def test_the_launcher_is_cupy_where_imported_else_torch_else_the_driver(monkeypatch) -> None:
    import types

    from arrayio.integrity import _launchers

    def fake_torch(initialized: bool) -> types.SimpleNamespace:
        cuda = types.SimpleNamespace(is_initialized=lambda: initialized)
        return types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda="13.0"))

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True))
    chosen = _launchers.choose()
    assert isinstance(chosen, _launchers.TorchLauncher) and "cupy" not in sys.modules
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace())
    assert isinstance(_launchers.choose(), _launchers.CupyLauncher)  # imported: no cost
    assert isinstance(_launchers.choose(avoid=frozenset({"cupy"})), _launchers.TorchLauncher)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(False))  # torch without CUDA yet
    monkeypatch.setattr(_launchers, "_driver_usable", lambda: False)
    assert _launchers.choose(avoid=frozenset({"cupy"})) is None
    # A JAX process (neither CuPy imported nor torch running CUDA), where NVRTC is found:
    # the driver alone, ahead of importing CuPy.
    monkeypatch.setattr(_launchers, "_driver_usable", lambda: True)
    monkeypatch.delitem(sys.modules, "cupy")
    assert isinstance(_launchers.choose(), _launchers.DriverLauncher)
    assert "cupy" not in sys.modules


def test_a_built_kernel_is_kept_in_the_cache_directory(tmp_path, monkeypatch) -> None:
    import arrayio
    from arrayio.integrity import _launchers

    builds = []

    def build(*key: str) -> bytes:
        builds.append(key)
        return b"binary of " + repr(key).encode()

    monkeypatch.setattr(_launchers, "_nvrtc", build)
    with arrayio.config.set(cache_dir=str(tmp_path)):
        first = _launchers._cubin("source", "k", "sm_90", "13")
        assert _launchers._cubin("source", "k", "sm_90", "13") == first  # a later process
        assert len(builds) == 1 and len(list(tmp_path.glob("kernel-*.cubin"))) == 1
        assert _launchers._cubin("source", "k", "sm_80", "13") != first  # another GPU
        assert len(builds) == 2
    with arrayio.config.set(cache_dir=None):  # nothing kept: built each time
        _launchers._cubin("source", "k", "sm_90", "13")
        assert len(builds) == 3


@pytest.mark.parametrize("kernel_right", [True, False])
def test_the_build_ahead_launches_once_and_a_wrong_result_sends_checksums_to_the_host(
    monkeypatch, kernel_right
) -> None:
    # Everything of a first launch (the module's loading, every segment size's table, the
    # stream) is done by the build, beside the transfers: none is left to a load. Its
    # result on zeros is known, so a kernel that gets it wrong is never trusted with a file.
    from arrayio.integrity import _device_checksum

    order: list[object] = []
    zeros_crc = checksum(np.zeros(_device_checksum._FIRST_LAUNCH_BYTES, np.uint8))

    class OneLaunch:
        def __init__(self, buffers, segment=None, *, own_stream=False) -> None:
            order.append(("launch", [b.nbytes for b in buffers], own_stream))

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def results(self) -> list[int]:
            return [zeros_crc if kernel_right else zeros_crc ^ 1]

    monkeypatch.setattr(_device_checksum, "_builds", {})
    monkeypatch.setattr(_device_checksum, "_unavailable", None)
    gpu = types.SimpleNamespace(
        device=lambda index: contextlib.nullcontext(),
        own_stream=lambda index: "arrayio's stream",
        on_stream=lambda stream: contextlib.nullcontext(order.append(stream)),
    )
    monkeypatch.setattr(_device_checksum, "_launcher", lambda: gpu)
    monkeypatch.setattr(_device_checksum, "_kernel", lambda g, d: order.append("kernel"))
    monkeypatch.setattr(
        _device_checksum, "_segment_powers_on", lambda g, d, segment: order.append(segment)
    )
    monkeypatch.setattr(_device_checksum, "_Zeros", lambda g, device, nbytes: _Ready(nbytes))
    monkeypatch.setattr(_device_checksum, "DeviceChecksums", OneLaunch)
    _device_checksum._build_ahead([0])
    assert _device_checksum._builds[0].wait(10)
    sizes = [64 << k for k in range(7)]
    assert sizes[-1] == _device_checksum.SEGMENT_BYTES
    assert order == [
        "arrayio's stream",  # everything on it, none on the device's legacy stream
        "kernel",
        *sizes,
        ("launch", [_device_checksum._FIRST_LAUNCH_BYTES], True),
    ]
    if kernel_right:
        assert _device_checksum._unavailable is None
    else:
        assert "zero bytes" in _device_checksum._unavailable
        assert not _device_checksum.available()


@pytest.mark.gpu
def test_the_build_ahead_leaves_nothing_of_a_first_launch_to_a_load(monkeypatch, launcher) -> None:
    # With each launcher: after the build, the kernel, every segment size's table and a
    # first launch are done, and its result on zeros was right.
    from arrayio.integrity import _device_checksum

    monkeypatch.setattr(_device_checksum, "_builds", {})
    monkeypatch.setattr(_device_checksum, "_on_device", {})
    _device_checksum._build_ahead([0])
    assert _device_checksum._builds[0].wait(120)
    assert _device_checksum._unavailable is None
    made = set(_device_checksum._on_device)
    assert (launcher.name, "kernel", 0) in made
    assert {(launcher.name, "powers", 0, 64 << k) for k in range(7)} <= made


@pytest.mark.parametrize(
    ("chosen", "imported", "torch_cuda", "driver", "starts"),
    [
        (None, (), False, True, True),  # JAX: the driver, whatever the allocation does
        (None, ("cupy",), False, True, False),  # CuPy will be chosen, and builds in Python
        (None, ("torch",), False, True, False),  # torch may start CUDA as it allocates
        (None, ("torch",), True, True, True),  # torch runs CUDA: torch's launcher
        (None, (), False, False, False),  # no NVRTC: CuPy would be imported
        ("cupy", (), False, True, False),
        ("torch", ("torch",), True, True, True),
        ("driver", (), False, True, True),
    ],
)
def test_a_build_beside_the_allocation_starts_only_with_a_final_launcher_outside_python(
    monkeypatch, chosen, imported, torch_cuda, driver, starts
) -> None:
    # Started beside a load's allocation of its outputs, the build must pick the launcher
    # the process keeps (a torch that starts CUDA in that allocation would otherwise leave
    # it to the driver for good) and must not build in Python (CuPy's, which lengthened
    # CuPy's allocations); at the batch's start it always starts.
    from arrayio.integrity import _device_checksum, _launchers

    started: list[list[int]] = []
    monkeypatch.setattr(_device_checksum, "available", lambda: True)
    monkeypatch.setattr(_device_checksum, "_build_ahead", lambda devices: started.append(devices))
    monkeypatch.setattr(
        _device_checksum, "_chosen", None if chosen is None else types.SimpleNamespace(name=chosen)
    )
    for name in ("cupy", "torch"):
        if name in imported:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(_launchers, "_torch_running_cuda", lambda: object() if torch_cuda else None)
    monkeypatch.setattr(_launchers, "_driver_usable", lambda: driver)
    _device_checksum.build_ahead([0], beside_python=True)
    assert started == ([[0]] if starts else [])
    _device_checksum.build_ahead([1])  # at the batch's start: always
    assert started[-1] == [1]


def test_a_batch_waits_for_the_kernels_first_launch_and_trusts_no_kernel_it_finds_wrong(
    monkeypatch,
) -> None:
    # The first batch of a process reaches its results while the kernel is still being
    # built and first launched: it waits for that, and where the first launch found the
    # kernel wrong, its checksums come from the host, not from that kernel.
    from arrayio.integrity import _device_checksum

    monkeypatch.setattr(_device_checksum, "_unavailable", None)
    monkeypatch.setattr(_device_checksum, "available", lambda: True)
    building = threading.Event()
    monkeypatch.setattr(_device_checksum, "_builds", {0: building})
    launched: list[object] = []
    monkeypatch.setattr(
        _device_checksum.DeviceChecksums, "_launch_group", lambda *args: launched.append(args)
    )

    def first_launch_finds_it_wrong() -> None:
        time.sleep(0.2)
        _device_checksum._stop_using("pretend: its CRC of zeros is wrong")
        building.set()

    data = np.arange(5000, dtype=np.uint8)
    sums = _device_checksum.DeviceChecksums([_HostBackedDevice(data)])  # type: ignore[list-item]
    threading.Thread(target=first_launch_finds_it_wrong).start()
    assert sums.results() == [checksum(data)]
    assert building.is_set() and launched == []


def test_a_device_short_of_memory_sends_one_batch_to_the_host_not_every_later_one(
    monkeypatch,
) -> None:
    from arrayio.integrity import _device_checksum

    class OutOfMemoryError(RuntimeError):  # as torch's and CuPy's are named
        pass

    def full(*args) -> None:
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(_device_checksum, "_unavailable", None)
    monkeypatch.setattr(_device_checksum, "available", lambda: True)
    monkeypatch.setattr(_device_checksum, "_builds", {0: threading.Event()})
    _device_checksum._builds[0].set()
    monkeypatch.setattr(_device_checksum, "_launcher", lambda: types.SimpleNamespace())
    monkeypatch.setattr(_device_checksum.DeviceChecksums, "_launch_group", full)
    data = np.arange(5000, dtype=np.uint8)
    sums = _device_checksum.DeviceChecksums([_HostBackedDevice(data)])  # type: ignore[list-item]
    assert sums.results() == [checksum(data)]
    assert _device_checksum._unavailable is None  # the next batch tries the GPU again
