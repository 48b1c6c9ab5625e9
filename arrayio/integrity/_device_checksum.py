"""CRC-32C of device memory, computed on the GPU.

Verifying a read into GPU memory on the host costs a pass over the bytes there, on the
threads that should be moving them; with GPUDirect Storage the bytes never touch the host at
all. So device buffers are checksummed where they are: one CUDA kernel (launched through
CuPy or torch, :mod:`~arrayio.integrity._launchers`; one launch for a group of buffers)
splits each range into segments, each thread computes the standard CRC-32C of its segment
(slicing-by-4 tables in shared memory), shifts it to its place in the range by multiplying
by ``x^(8 * bytes after it)`` modulo the polynomial (the arithmetic of zlib's
``crc32_combine``), and the shifted values are XORed together. The host finishes with one
:func:`~arrayio.integrity._checksum.combine` for the last, possibly shorter, segment.

No library offers this (nvCOMP has no CRC-32C; CuPy has no CRC at all), hence the kernel.
Where neither can run it (no CuPy, and no torch running CUDA) :func:`device_checksum`
returns None and the tools checksum on the host as the bytes pass through their staging
buffers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..runtime import _background
from ..tools._pinned import pool as pinned_pool
from . import _launchers
from ._checksum import _POLY, _x8n, combine
from ._checksum import checksum as host_checksum_of
from ._launchers import Launcher

if TYPE_CHECKING:
    from ..arrays._buffers import DeviceBuffer

__all__ = [
    "GROUP_BUFFERS",
    "GROUP_BYTES",
    "SEGMENT_BYTES",
    "DeviceChecksums",
    "available",
    "build_ahead",
    "checksum_anywhere",
    "checksums_anywhere",
    "device_checksum",
    "device_checksums",
    "host_checksum",
    "segment_for",
    "segment_powers",
    "slicing_tables",
]

logger = logging.getLogger("arrayio")

# Bytes per thread: up to SEGMENT_BYTES, where the per-thread shift (a few dozen carry-less
# multiplications) is noise next to the CRC, and down to MIN_SEGMENT_BYTES for small buffers,
# so that a megabyte still spreads over every SM (at 4 KiB a segment, 1 MiB is one block
# and takes 100 µs; spread out it takes a kernel launch).
SEGMENT_BYTES = 4096
MIN_SEGMENT_BYTES = 64
_TARGET_THREADS = 1 << 16
_THREADS = 256
# A launch checksums the buffers said ready since the last one, once they reach either
# bound: few launches for a batch of small arrays, and kernels that start while later
# reads are still moving (the last group's is all that is left after the last read).
GROUP_BYTES = 256 << 20
GROUP_BUFFERS = 128
_MAX_POWERS = 48  # shifts by up to 2^48 segments: more than any device holds

_SOURCE = r"""
extern "C" {

__device__ __forceinline__ unsigned int multiply(unsigned int a, unsigned int b) {
    // a * b modulo the reflected CRC-32C polynomial (zlib's multmodp); a is never 0 here.
    unsigned int m = 1u << 31, product = 0;
    while (m) {
        if (a & m) {
            product ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return product;
}

__device__ __forceinline__ unsigned int word(const unsigned int (*t)[256], unsigned int c) {
    // Four bytes at once (slicing-by-4), the word's bytes already XORed into the CRC.
    return t[3][c & 255] ^ t[2][(c >> 8) & 255] ^ t[1][(c >> 16) & 255] ^ t[0][c >> 24];
}

__global__ void crc32c_group(const unsigned long long* __restrict__ meta, int count,
                             int total_segments,
                             const unsigned int* __restrict__ tables,
                             unsigned int* __restrict__ out) {
    // A group of buffers in one launch: thread i takes segment i of their segments laid end
    // to end. meta holds FIELDS numbers a buffer: address, bytes, bytes per segment, its
    // first segment's index in the group, its row of out, the address of its segment's
    // powers of x.
    const unsigned long long total = (unsigned int)total_segments;
    __shared__ unsigned int t[4][256];
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) t[i >> 8][i & 255] = tables[i];
    __syncthreads();

    unsigned long long index = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    int b = -1;
    unsigned int value = 0;
    if (index < total) {
        int lo = 0, hi = count - 1;  // the last buffer whose first segment is <= index
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (meta[mid * FIELDS + 3] <= index) lo = mid; else hi = mid - 1;
        }
        b = lo;
        const unsigned long long* m = meta + b * FIELDS;
        unsigned long long nbytes = m[1], segment = m[2], local = index - m[3];
        unsigned long long segments = (b + 1 < count ? meta[(b + 1) * FIELDS + 3] : total) - m[3];
        const unsigned int* powers = (const unsigned int*)m[5];
        unsigned long long start = local * segment;
        unsigned long long stop = start + segment < nbytes ? start + segment : nbytes;
        const unsigned char* p = (const unsigned char*)m[0] + start;
        const unsigned char* end = (const unsigned char*)m[0] + stop;
        unsigned int crc = 0xFFFFFFFFu;
        while (p < end && ((unsigned long long)p & 15)) {
            crc = t[0][(crc ^ *p++) & 255] ^ (crc >> 8);
        }
        while (p + 16 <= end) {
            uint4 v = *(const uint4*)p;
            p += 16;
            crc = word(t, crc ^ v.x);
            crc = word(t, crc ^ v.y);
            crc = word(t, crc ^ v.z);
            crc = word(t, crc ^ v.w);
        }
        while (p < end) {
            crc = t[0][(crc ^ *p++) & 255] ^ (crc >> 8);
        }
        crc ^= 0xFFFFFFFFu;
        if (local == segments - 1) {
            out[2 * m[4] + 1] = crc;  // the last segment: the host shifts the rest by its length
        } else {
            // Full segments after this one, up to the last: shift by that many segments.
            unsigned long long after = segments - 2 - local;
            for (int bit = 0; after; ++bit, after >>= 1) {
                if (after & 1) crc = multiply(powers[bit], crc);
            }
            value = crc;
        }
    }
    int first = __shfl_sync(0xFFFFFFFFu, b, 0);
    if (__all_sync(0xFFFFFFFFu, b == first)) {  // one buffer in the warp (the usual case)
        for (int offset = 16; offset > 0; offset >>= 1) {
            value ^= __shfl_xor_sync(0xFFFFFFFFu, value, offset);
        }
        if ((threadIdx.x & 31) == 0 && value) atomicXor(out + 2 * meta[b * FIELDS + 4], value);
    } else if (value) {  // a boundary between buffers: each lane to its own
        atomicXor(out + 2 * meta[b * FIELDS + 4], value);
    }
}

}
""".replace("POLY", f"{_POLY:#x}u").replace("FIELDS", "6")


def slicing_tables() -> np.ndarray:
    """The four 256-entry tables of slicing-by-4 CRC-32C (reflected), as ``uint32[1024]``."""
    table = np.zeros((4, 256), dtype=np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table[0, byte] = crc
    for k in range(1, 4):
        previous = table[k - 1]
        table[k] = (previous >> 8) ^ table[0][previous & 255]
    return table.reshape(-1)


@functools.lru_cache(maxsize=8)
def segment_powers(segment: int) -> np.ndarray:
    """``x^(8 * segment * 2^j)`` modulo the polynomial for j = 0..47, as ``uint32[48]``."""
    return np.array([_x8n(segment << j) for j in range(_MAX_POWERS)], dtype=np.uint32)


_lock = threading.Lock()
_on_device: dict[tuple[Any, ...], Any] = {}  # what _made_once made, per launcher and GPU


def _made_once(launcher: Launcher, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """``make()`` on the current GPU, the first time ``key`` is asked for there (a
    host-to-device copy per call would cost more than the kernel on a megabyte)."""
    key = (launcher.name, *key)
    with _lock:
        made = _on_device.get(key)
        if made is None:
            made = make()
            # Kernels on other streams use what was copied (DeviceChecksums' own stream):
            # the copies from pageable memory must have landed before anyone gets them.
            launcher.current_stream(key[2]).synchronize()
            _on_device[key] = made
        return made


def _kernel(launcher: Launcher, device_index: int) -> tuple[Any, Any]:
    """The compiled kernel and its tables on ``device_index`` (current)."""
    return _made_once(  # type: ignore[no-any-return]
        launcher,
        ("kernel", device_index),
        lambda: (
            launcher.compile(_SOURCE, "crc32c_group"),
            launcher.upload(slicing_tables()),
        ),
    )


# The devices whose kernel a thread of its own builds or has built, and when it is done.
_builds: dict[int, threading.Event] = {}
_builds_lock = threading.Lock()  # not _lock, which a build holds


def _build_ahead(devices: Sequence[int]) -> None:
    """Start building the kernel for ``devices`` on a thread of its own, once a process. A
    fresh cache directory's first build (NVRTC) takes longer than a warm load of a gigabyte
    does: built beside the transfers, it delays none, where built at the first launch it held
    up the call's thread (see :meth:`DeviceChecksums.launch`)."""
    with _builds_lock:
        todo = [device for device in devices if device not in _builds]
        for device in todo:
            _builds[device] = threading.Event()
    for device in todo:
        _background.start(_build, device, name="arrayio-kernel-build")


def build_ahead(devices: Sequence[int], *, beside_python: bool = False) -> None:
    """Start building the kernel for ``devices`` in the background where the GPU can
    checksum here: as a verified load into a GPU starts, or for a read checksummed on the
    host (from the disk) whose process will checksum its later reads (from the page cache)
    on the GPU.

    ``beside_python``: the caller goes on to allocate a load's outputs, work of the
    interpreter's that may start a framework's CUDA. The build starts now only where the
    launcher chosen now is the one chosen after (:func:`_early_launcher`) and builds
    outside the interpreter: torch's or the driver's (NVRTC and the driver through
    ``ctypes``). CuPy builds and loads its kernel in Python, and beside CuPy's allocations
    it made them two to four times as long; a torch that has not started CUDA yet would
    leave the choice to the driver (or CuPy) for the whole process. Those builds start with
    the batch's transfers."""
    if not devices or not available():
        return
    if beside_python and _early_launcher() not in ("torch", "driver"):
        return
    _build_ahead(devices)


def _early_launcher() -> str | None:
    """The launcher this process uses, or would choose now where that choice is final; None
    where the allocation about to run may change it (torch imported, CUDA not started)."""
    if _chosen is not None:
        return _chosen.name
    name = _launchers.choice()
    if name != "torch" and "torch" in sys.modules and "cupy" not in sys.modules:
        return None  # torch's launcher once the allocation starts its CUDA
    return name


# Marks the thread that runs a build: its first launch's results() must not wait for it.
_in_build = threading.local()


def _build(device: int) -> None:
    _in_build.active = True
    try:
        gpu = _launcher()
        if gpu is not None:
            # On arrayio's own stream, which blocks no other: the uploads of tables from
            # pageable memory on the device's legacy stream would wait for the tools' copies
            # in flight (and hold up the later ones), as a load's kernels would.
            with gpu.device(device), gpu.on_stream(gpu.own_stream(device)):
                _kernel(gpu, device)
                _first_launch(gpu, device)
    except Exception as error:  # noqa: BLE001 - the first launch builds it, and says why not
        logger.debug("arrayio: building the checksum kernel ahead failed: %s", error)
    finally:
        _in_build.active = False
        _builds[device].set()


# A buffer for the first launch: a few segments of every size a buffer may get.
_FIRST_LAUNCH_BYTES = 4 * SEGMENT_BYTES


def _first_launch(gpu: Launcher, device: int) -> None:
    """Launch the kernel once on zeros of ``device`` (current) and check its result, so that
    nothing of a first launch is left to a load's transfers: the module's loading (CUDA
    loads a kernel at its first launch, and may wait for the device's other work meanwhile),
    every segment size's table, arrayio's stream and the pinned rows of launches. A kernel
    that gets zeros wrong here (a GPU it miscompiles for) is not used: the checksums go
    through the host instead, rather than calling sound files damaged."""
    segment = MIN_SEGMENT_BYTES
    while segment <= SEGMENT_BYTES:
        _segment_powers_on(gpu, device, segment)
        segment *= 2
    zeros = _Zeros(gpu, device, _FIRST_LAUNCH_BYTES)
    with DeviceChecksums([zeros], own_stream=True) as crcs:  # type: ignore[list-item]
        got = crcs.results()[0]
    expected = host_checksum_of(np.zeros(_FIRST_LAUNCH_BYTES, np.uint8))
    if _unavailable is None and got != expected:
        _stop_using(
            f"its CRC-32C of {_FIRST_LAUNCH_BYTES} zero bytes is {got:08x}, not {expected:08x}"
        )


class _Zeros:
    """``nbytes`` (a multiple of 4) of zeros on ``device`` (current) as a device buffer, made
    by the launcher on its current stream: no allocation of the driver's, which may wait for
    the device's other work."""

    def __init__(self, gpu: Launcher, device: int, nbytes: int) -> None:
        self._gpu, self.device_index, self.nbytes = gpu, device, nbytes
        self.array = gpu.zeros_uint32((nbytes // 4,))  # on the current stream
        self.data_ptr = gpu.address(self.array)

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        with self._gpu.device(self.device_index):
            stream = self._gpu.current_stream(self.device_index)
            host = self._gpu.download(self.array, stream).view(np.uint8)
        dst[...] = host[offset : offset + dst.nbytes]


def _built_on(device: int) -> bool:
    """Whether the kernel for ``device`` was built ahead (or never asked to be)."""
    build = _builds.get(device)
    return build is None or build.is_set()


def _segment_powers_on(launcher: Launcher, device_index: int, segment: int) -> int:
    """The address of ``segment_powers(segment)`` on ``device_index`` (current)."""
    return launcher.address(
        _made_once(
            launcher,
            ("powers", device_index, segment),
            lambda: launcher.upload(segment_powers(segment)),
        )
    )


# Why the kernel cannot run here (no CuPy nor torch running CUDA, or it failed once: no
# NVRTC, say); None: it can.
_unavailable: str | None = None
_chosen: Launcher | None = None


def _launcher() -> Launcher | None:
    """The framework that runs the kernel in this process (:func:`_launchers.choose`), chosen
    at its first use; None where none can."""
    global _unavailable, _chosen
    with _lock:
        if _chosen is None and _unavailable is None:
            _chosen = _launchers.choose()
            if _chosen is None:
                _unavailable = "neither CuPy nor torch running CUDA is here"
        return _chosen if _unavailable is None else None


def available() -> bool:
    """Whether device buffers can be checksummed on the GPU here. Imports nothing: asked
    for every GPU transfer's candidates, before any is chosen."""
    return _unavailable is None and (_chosen is not None or _launchers.usable())


def segment_for(nbytes: int) -> int:
    """Bytes per thread for a buffer of ``nbytes``: a power of two, so that segments start
    as aligned as the buffer."""
    wanted = max(1, nbytes // _TARGET_THREADS)
    return min(SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, 1 << (wanted.bit_length() - 1)))


def device_checksum(buffer: DeviceBuffer, segment: int | None = None) -> int | None:
    """The CRC-32C of a device buffer's bytes, computed on its GPU.

    The kernel runs on the current stream of the framework that launches it, and this
    function waits for it.
    ``segment`` (bytes per GPU thread) is for tests; by default it follows the size.

    Returns
    -------
    int or None
        The CRC; None where the GPU cannot compute it (:func:`available` is false), and the
        caller must checksum on the host.
    """
    if buffer.nbytes == 0:
        return 0
    if not available():
        return None
    return DeviceChecksums([buffer], segment).results()[0]


def device_checksums(buffers: Sequence[DeviceBuffer]) -> list[int] | None:
    """The CRC-32C of each device buffer, with one wait for the whole batch; None where the
    GPU cannot compute them (see :func:`device_checksum`)."""
    if not any(buffer.nbytes for buffer in buffers):
        return [0] * len(buffers)
    if not available():
        return None
    return DeviceChecksums(buffers).results()


def checksum_anywhere(buffer: DeviceBuffer) -> int:
    """The CRC-32C of a device buffer: on its GPU where possible, else through the host."""
    return checksums_anywhere([buffer])[0]


def checksums_anywhere(buffers: Sequence[DeviceBuffer]) -> list[int]:
    """The CRC-32C of each device buffer: on the GPU with one wait where possible (see
    :func:`device_checksums`), else through the host."""
    return DeviceChecksums(buffers).results()


class DeviceChecksums:
    """The CRC-32C of several device buffers, computed on their GPUs.

    :meth:`launch` says a buffer is ready (a batch read calls it as each read lands), and the
    ready buffers are checksummed in groups, one kernel launch a group of up to
    :data:`GROUP_BYTES` or :data:`GROUP_BUFFERS`, while later reads are still moving.
    :meth:`results` launches the rest and waits once for all of them: a launch per buffer
    costs the host tens of microseconds, a tenth of a warm load of hundreds of arrays
    (docs/design/loads.md).

    The kernels run on the launching framework's current stream (CuPy's or torch's; both
    default to the device's legacy stream), after whatever was queued there to fill the
    buffers. With ``own_stream`` they run on a non-blocking stream of arrayio's own per
    device instead, so that they neither wait for nor hold up the tools' copies on other
    streams; then every write into a buffer must be complete when it is launched (a
    tool's finished transfer, or after :func:`~arrayio.arrays._buffers.synchronize_device`): a
    copy still in flight on another stream, such as CuPy's from pageable memory, would
    race the kernel.

    Where the GPU cannot compute them (no launcher, or a kernel that fails: no NVRTC, say), the
    checksums are computed through the host instead, and the GPU is not tried again.

    As a context manager, it calls :meth:`abandon` when the block raises: a failed
    batch must not leave kernels reading buffers that a fallback tool refills.
    """

    def __init__(
        self,
        buffers: Sequence[DeviceBuffer],
        segment: int | None = None,
        *,
        own_stream: bool = False,
    ) -> None:
        self.buffers = list(buffers)
        self._segment = segment
        self._own_stream = own_stream
        self._launched = [False] * len(self.buffers)
        self._shapes: dict[int, tuple[int, int, int]] = {}  # index: nbytes, segment, segments
        self._rows: dict[int, tuple[int, int]] = {}  # index: device, row of its results
        self._counts: dict[int, int] = {}  # device: rows
        for index, buffer in enumerate(self.buffers):
            if buffer.nbytes:
                device = buffer.device_index
                self._rows[index] = (device, self._counts.get(device, 0))
                self._counts[device] = self._rows[index][1] + 1
        self._out: dict[int, Any] = {}  # device: its results, (rows, 2) uint32 on the GPU
        self._ready: dict[int, list[int]] = {}  # device: buffers ready, not yet launched
        self._ready_bytes: dict[int, int] = {}
        self._metas: list[Any] = []  # each launch's description, alive until the results
        # Pinned rows for the launches' descriptions, each launch's after the last's: a copy
        # from pageable memory waits for its stream first, so each launch would wait for the
        # last group's kernel, and the reads' callbacks with it.
        self._meta_rows: np.ndarray | None = None
        self._meta_used = 0
        self._meta_loan = contextlib.ExitStack()
        self._on_gpu = bool(self._rows) and available()
        self._gpu: Launcher | None = None  # chosen at the first launch
        if self._on_gpu:
            _build_ahead(list(self._counts))

    def __enter__(self) -> DeviceChecksums:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.abandon()

    def launch(self, index: int) -> None:
        """Buffer ``index``'s bytes are final: checksum it with the next group (no-op if
        already said)."""
        if self._launched[index] or not self._on_gpu:
            return
        self._launched[index] = True
        if index not in self._rows:
            return
        device = self._rows[index][0]
        ready = self._ready.setdefault(device, [])
        ready.append(index)
        self._ready_bytes[device] = self._ready_bytes.get(device, 0) + self.buffers[index].nbytes
        full = self._ready_bytes[device] >= GROUP_BYTES or len(ready) >= GROUP_BUFFERS
        # While the kernel is being built, the buffers wait for it (a later group, or the
        # results) rather than the reads.
        if full and _built_on(device):
            self._flush(device)

    def results(self) -> list[int]:
        """The CRC of every buffer, in order, after one wait per device.

        Where the kernel is being built (and first launched, its result checked), this waits
        for it: a batch's first kernels run only once it is known to be right."""
        if self._on_gpu and not getattr(_in_build, "active", False):
            for device in self._counts:
                build = _builds.get(device)
                if build is not None:
                    build.wait()
        for index in range(len(self.buffers)):
            self.launch(index)
        for device in list(self._ready):
            self._flush(device)
        try:
            if self._on_gpu and self._gpu is not None:
                try:
                    return self._collect(self._gpu)
                except MemoryError:
                    raise
                except Exception as error:  # noqa: BLE001 - as in _flush
                    self._give_up(error)
        finally:
            if self._meta_rows is not None:
                self.abandon()  # the copies of the rows are done before the rows go back
        return [host_checksum(buffer) if buffer.nbytes else 0 for buffer in self.buffers]

    def abandon(self) -> None:
        """Wait for the kernels already started, without their results: before the buffers
        are freed or filled again (a failed read, a fallback to another tool)."""
        self._ready.clear()
        gpu = self._gpu
        if self._metas and gpu is not None:
            for device in self._counts:
                try:
                    with gpu.device(device):
                        self._stream(gpu, device).synchronize()
                except Exception:  # noqa: BLE001 - the caller is already failing
                    pass
        self._metas.clear()
        self._meta_loan.close()  # the rows go back to the pool: none is written again
        self._meta_rows, self._meta_used = None, 0

    def _rows_for(self, count: int) -> np.ndarray:
        """``count`` rows of 6 ``uint64`` for a launch's description: pinned, after the last
        launch's, where the loan has room (one loan for the batch's every buffer), else
        pageable."""
        if self._meta_rows is None:
            nbytes = 48 * max(count, len(self._rows))
            try:
                loan = self._meta_loan.enter_context(pinned_pool.lend(nbytes))
                self._meta_rows = loan[:nbytes].view(np.uint64).reshape(-1, 6)
            except Exception:  # noqa: BLE001 - pageable rows work, with a wait each
                self._meta_rows = np.empty((0, 6), np.uint64)
        start = self._meta_used
        if start + count > len(self._meta_rows):
            return np.empty((count, 6), dtype=np.uint64)
        self._meta_used += count
        return self._meta_rows[start : start + count]

    def _flush(self, device: int) -> None:
        """Launch one kernel for the buffers of ``device`` said ready since the last one."""
        group = self._ready.pop(device, [])
        self._ready_bytes[device] = 0
        if not group or not self._on_gpu:
            return
        if _unavailable is not None:  # (the first launch found the kernel wrong meanwhile)
            self._through_the_host()
            return
        if self._gpu is None:
            self._gpu = _launcher()
            if self._gpu is None:  # none after all: through the host
                self._on_gpu = False
                return
        try:
            self._launch_group(self._gpu, device, group)
        except MemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - a kernel that cannot be built or run here
            if _out_of_device_memory(error):  # passing: this batch through the host
                self._through_the_host()
                return
            self._give_up(error)

    def _launch_group(self, gpu: Launcher, device: int, group: list[int]) -> None:
        meta = self._rows_for(len(group))
        total = 0
        with gpu.device(device), gpu.on_stream(self._stream(gpu, device)):
            for k, index in enumerate(group):
                buffer = self.buffers[index]
                nbytes = buffer.nbytes
                per_thread = self._segment or segment_for(nbytes)
                segments = -(-nbytes // per_thread)
                # The address as a number, not a view of the buffer: a CuPy view of a torch
                # tensor costs tens of microseconds.
                meta[k] = (
                    buffer.data_ptr,
                    nbytes,
                    per_thread,
                    total,
                    self._rows[index][1],
                    _segment_powers_on(gpu, device, per_thread),
                )
                self._shapes[index] = (nbytes, per_thread, segments)
                total += segments
            if total >= 1 << 31:  # the kernel counts segments in a C int
                raise OverflowError(f"{total} segments in one launch")
            out = self._out.get(device)
            if out is None:
                out = self._out[device] = gpu.zeros_uint32((self._counts[device], 2))
            kernel, tables = _kernel(gpu, device)
            on_device = gpu.upload(meta)  # on this stream, before the kernel
            self._metas.append((meta, on_device))
            gpu.launch(
                kernel, -(-total // _THREADS), _THREADS, (on_device, len(group), total, tables, out)
            )

    def _collect(self, gpu: Launcher) -> list[int]:
        values = {}
        for device, out in self._out.items():
            with gpu.device(device):
                values[device] = gpu.download(out, self._stream(gpu, device))
        results = [0] * len(self.buffers)
        for index, (nbytes, segment, segments) in self._shapes.items():
            device, row = self._rows[index]
            shifted, last = (int(v) for v in values[device][row])
            results[index] = combine(shifted, last, nbytes - (segments - 1) * segment)
        return results

    def _stream(self, gpu: Launcher, device: int) -> Any:
        """The stream the kernels run on (call with ``device`` current)."""
        return gpu.own_stream(device) if self._own_stream else gpu.current_stream(device)

    def _through_the_host(self) -> None:
        """This batch's checksums from the host: the kernels started are waited for."""
        self.abandon()
        self._on_gpu = False

    def _give_up(self, error: Exception) -> None:
        """This batch's and every later one's checksums from the host, for ``error``."""
        self._through_the_host()
        _stop_using(f"{type(error).__name__}: {error}")


def _out_of_device_memory(error: Exception) -> bool:
    """Whether ``error`` is a framework's out-of-memory error (torch's and CuPy's are not
    ``MemoryError``s): a full device, for a moment, not a kernel that cannot run here."""
    return "OutOfMemory" in type(error).__name__ or "out of memory" in str(error).lower()


def _stop_using(reason: str) -> None:
    """Checksum device memory through the host from now on, for ``reason``."""
    global _unavailable
    _unavailable = reason
    logger.warning("arrayio: checksums of GPU memory fall back to the host: %s", reason)


def host_checksum(buffer: DeviceBuffer) -> int:
    """The CRC through host memory, a staging buffer at a time (the fallback's fallback)."""
    from ._checksum import checksum

    staging = np.empty(min(buffer.nbytes, 64 << 20), dtype=np.uint8)
    crc = 0
    for start in range(0, buffer.nbytes, staging.nbytes):
        piece = staging[: min(staging.nbytes, buffer.nbytes - start)]
        buffer.copy_to_host(start, piece)
        crc = checksum(piece, crc)
    return crc
