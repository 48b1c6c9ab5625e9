"""The host tier: spills to pinned host memory before the disk.

On the CPU, the tier's copies and buffers are host fakes (a device buffer posing as one);
the GPU tests run the CUDA driver's copies into the pinned pool."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

import arrayio
from arrayio.offload import Offloader
from arrayio.offload._host import HostTier
from arrayio.testing import Framework

MB = 1 << 20


class _Device:
    """Host bytes posing as a device buffer."""

    device_index = 0

    def __init__(self, data: np.ndarray) -> None:
        self.data = data.reshape(-1).view(np.uint8)
        self.nbytes = self.data.nbytes


def _fake_tier(budget: int, lent: list[int]) -> HostTier:
    def lend(nbytes: int):
        lent.append(nbytes)
        return contextlib.nullcontext(np.empty(nbytes + 100, np.uint8))

    return HostTier(
        budget,
        lend=lend,
        to_host=lambda device, buffer: np.copyto(buffer, device.data),
        to_device=lambda buffer, device: np.copyto(device.data, buffer),
    )


def test_the_tier_holds_copies_up_to_its_budget():
    lent: list[int] = []
    tier = _fake_tier(3 * MB, lent)
    first = tier.store(_Device(np.full(2 * MB, 1, np.uint8)))
    assert first is not None and tier.used_bytes == 2 * MB
    assert tier.store(_Device(np.full(2 * MB, 2, np.uint8))) is None  # no room: the disk's
    second = tier.store(_Device(np.full(MB, 3, np.uint8)))
    assert second is not None and tier.used_bytes == 3 * MB
    back = _Device(np.zeros(2 * MB, np.uint8))
    tier.load(first, back)
    assert (back.data == 1).all()
    first.release()
    first.release()  # once
    assert tier.used_bytes == MB
    assert tier.store(np.zeros(MB, np.uint8)) is None  # host memory skips the tier
    assert lent == [2 * MB, MB]


def test_a_failed_copy_gives_its_room_back():
    def broken(device, buffer):
        raise RuntimeError("copy failed")

    tier = HostTier(
        4 * MB, lend=lambda n: contextlib.nullcontext(np.empty(n, np.uint8)), to_host=broken
    )
    with pytest.raises(RuntimeError):
        tier.store(_Device(np.zeros(MB, np.uint8)))
    assert tier.used_bytes == 0


def test_host_arrays_go_to_the_disk(tmp_path):
    arrays = [np.full(MB // 4, i, np.float32) for i in range(4)]
    with Offloader(tmp_path, device_budget_bytes=MB, host_budget_bytes=8 * MB) as off:
        handles = [off.put(a) for a in arrays]
        stats = off.stats()
        assert stats.host_bytes == 0 and stats.disk_bytes >= 3 * MB
        for a, handle in zip(arrays, handles, strict=True):
            np.testing.assert_array_equal(off.get(handle), a)


class _HostArraysTier(HostTier):
    """A tier that takes host arrays, copying them like device ones: the offloader's
    bookkeeping of the tier, tested on the CPU."""

    def store(self, data):
        return super().store(_Device(data)) if isinstance(data, np.ndarray) else None


def test_spills_fill_the_host_tier_then_the_disk(tmp_path):
    lent: list[int] = []
    fake = _fake_tier(2 * MB, lent)
    tier = _HostArraysTier(2 * MB)
    tier._lend, tier._to_host, tier._to_device = fake._lend, fake._to_host, fake._to_device
    arrays = [np.full(MB // 4, i, np.float32) for i in range(5)]  # 1 MiB each
    with Offloader(tmp_path, device_budget_bytes=MB, host_budget_bytes=2 * MB) as off:
        off._spills.host = off.host_tier = tier
        handles = [off.put(a) for a in arrays]
        stats = off.stats()
        # The first two spills went to host memory, the next two to files.
        assert stats.host_bytes == 2 * MB and stats.disk_bytes == 2 * MB
        files = sorted(p.name for p in os.scandir(off.directory) if p.name.endswith(".bin"))
        assert files == ["2.bin", "3.bin"]  # the third and fourth spills
        for a, handle in zip(arrays, handles, strict=True):
            np.testing.assert_array_equal(off.get(handle), a)
        off.free(handles[0])
        assert tier.used_bytes == MB  # its buffer back
    assert tier.used_bytes == 0  # close gave every buffer back
    assert lent == [MB, MB]


def test_a_spill_for_the_disk_skips_the_host_tier(tmp_path):
    # A spill plan keeps the host tier for the arrays it chose: one it sent to the disk goes
    # to its file though the tier has room.
    tier = _HostArraysTier(4 * MB)
    fake = _fake_tier(4 * MB, [])
    tier._lend, tier._to_host, tier._to_device = fake._lend, fake._to_host, fake._to_device
    arrays = [np.full(MB // 4, i, np.float32) for i in range(3)]
    with Offloader(tmp_path, device_budget_bytes=4 * MB, host_budget_bytes=4 * MB) as off:
        off._spills.host = off.host_tier = tier
        handles = [
            off.put(a, hint="spill", tier=t)
            for a, t in zip(arrays, ["disk", "host", None], strict=True)
        ]
        off.wait()
        stats = off.stats()
        assert stats.host_bytes == 2 * MB and stats.disk_bytes == MB
        files = sorted(p.name for p in os.scandir(off.directory) if p.name.endswith(".bin"))
        assert files == ["0.bin"]
        for a, handle in zip(arrays, handles, strict=True):
            np.testing.assert_array_equal(off.get(handle), a)
        with pytest.raises(ValueError, match="tier"):
            off.put(arrays[0], tier="nvme")


def test_the_host_budget_is_checked():
    with pytest.raises(ValueError, match="host_budget_bytes"):
        HostTier(-1)


@pytest.mark.gpu
def test_gpu_spills_go_to_pinned_host_memory_then_to_files(tmp_path, gpu_xp: Framework):
    arrays = [np.arange(i, i + (1 << 18), dtype=np.float32) for i in range(6)]  # 1 MiB each
    with Offloader(tmp_path, device_budget_bytes=2 * MB, host_budget_bytes=2 * MB) as off:
        handles = [off.put(gpu_xp.from_numpy(a)) for a in arrays]
        stats = off.stats()
        assert stats.host_bytes == 2 * MB and stats.disk_bytes == 2 * MB
        off.prefetch(handles[:2])
        for a, handle in zip(arrays, handles, strict=True):
            got = off.get(handle)
            assert arrayio.arrays._frameworks.placement_of(got).is_cuda
            assert gpu_xp.to_bytes(got) == a.tobytes()
        for handle in handles:
            off.free(handle)
        assert off.host_tier.used_bytes == 0


@pytest.mark.gpu
def test_a_torch_spill_leaves_the_device_as_the_put_returns(tmp_path):
    # Queued on a side stream, the copy out lets the offloader drop the tensor at once (the
    # caching allocator reuses its block only after the copy has run): device memory falls
    # as the put returns. The producer is still running at the put (the copy must wait for
    # it), the freed block is filled at once by a new tensor (the copy must have read it
    # first), and the copy back is waited for by every stream that gets the tensor.
    torch = pytest.importorskip("torch")
    n = 16 * MB // 4
    expected = torch.arange(n, dtype=torch.float32)
    with Offloader(tmp_path, device_budget_bytes=1 << 30, host_budget_bytes=1 << 30) as off:
        torch.cuda._sleep(50_000_000)  # the GPU busy for a while: the host runs ahead
        x = torch.arange(n, dtype=torch.float32, device="cuda")
        before = torch.cuda.memory_allocated()
        handle = off.put(x, hint="spill")
        del x
        assert torch.cuda.memory_allocated() <= before - 16 * MB
        assert not off.resident(handle) and off.stats().host_bytes == 16 * MB
        clobber = torch.full((n,), -1.0, device="cuda")  # may take the freed block
        y = off.get(handle) * 1  # a kernel on the caller's stream, after the copy back
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            z = off.get(handle) * 1  # another stream waits for the copy back too
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), expected) and torch.equal(z.cpu(), expected)
        assert (clobber == -1).all()
        off.free(handle)
    assert off.host_tier.used_bytes == 0


def test_the_pool_keeps_a_host_tiers_buffers_while_the_tier_lives():
    # A step's spills are given back and taken again the next step: the pool keeps as many
    # spares as the tier may hold, so that no step pins them anew; no more once it is gone.
    import gc

    from arrayio.offload._host import HostTier
    from arrayio.tools._pinned import pool

    before = pool.keep_bytes
    tier = HostTier(3 << 30)
    assert pool.keep_bytes == before + (3 << 30)
    del tier
    gc.collect()
    assert pool.keep_bytes == before


def test_jax_arrays_go_to_the_host_tier_through_jaxs_memory_kinds(tmp_path, monkeypatch):
    # On a GPU, a JAX array spills to its device's pinned_host memory through JAX itself
    # (device_put with that memory kind), and comes back to device memory the same way: no
    # file, no copy of arrayio's. JAX's CPU devices have the memory kinds too; made to count
    # as a GPU's here, the path runs on the CPU.
    jax = pytest.importorskip("jax")
    from arrayio.offload import _spills

    monkeypatch.setattr(
        _spills, "jax_host_offload", lambda a: a.sharding.with_memory_kind("pinned_host")
    )
    arrays = [jax.numpy.full((MB // 4,), i, jax.numpy.float32) for i in range(5)]  # 1 MiB each
    with Offloader(tmp_path, device_budget_bytes=MB, host_budget_bytes=2 * MB) as off:
        handles = [off.put(a) for a in arrays]
        off.wait()
        stats = off.stats()
        assert stats.host_bytes == 2 * MB and stats.disk_bytes == 2 * MB  # then files
        for a, handle in zip(arrays, handles, strict=True):
            back = off.get(handle)
            assert back.sharding.memory_kind == "device"
            assert not back.committed  # as put: jitted functions take it without compiling
            np.testing.assert_array_equal(np.asarray(back), np.asarray(a))
        off.free(handles[0])
        assert off.host_tier.used_bytes == MB
    assert off.host_tier.used_bytes == 0


def test_only_gpu_jax_arrays_take_jaxs_host_offload():
    # The host already holds a CPU array: moving it to pinned_host would free no memory.
    from arrayio.offload._host import jax_host_offload

    assert jax_host_offload(np.zeros(4)) is None
    jax = pytest.importorskip("jax")
    assert jax_host_offload(jax.numpy.zeros(4)) is None


class _Event:
    """A CUDA event's face: happened or not."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_queued_copys_buffer_goes_back_only_once_its_copies_have_run():
    # A copy queued on a GPU stream may still be reading from or writing into its pinned
    # buffer when its array is freed: the buffer goes back to the pool (whose other borrowers
    # fill it from their own threads) once the copy's event has happened, or at close.
    returned: list[int] = []

    @contextlib.contextmanager
    def lend(nbytes: int):
        yield np.empty(nbytes, np.uint8)
        returned.append(nbytes)

    tier = HostTier(
        4 * MB,
        lend=lend,
        to_host=lambda device, buffer: np.copyto(buffer, device.data),
        to_device=lambda buffer, device: np.copyto(device.data, buffer),
    )
    first = tier.store(_Device(np.zeros(MB, np.uint8)))
    second = tier.store(_Device(np.zeros(2 * MB, np.uint8)))
    assert first is not None and second is not None and not first.queued
    first.busy, second.busy = _Event(), _Event()  # as HostTier.queue_out leaves them
    assert first.queued
    first.release()
    second.release()
    assert returned == [] and tier.used_bytes == 3 * MB  # their copies still run
    first.busy.done = True
    tier.reap()  # (each store and queue_out does this first)
    assert returned == [MB] and tier.used_bytes == 2 * MB
    tier.settle()  # close: waits for the rest
    assert returned == [MB, 2 * MB] and tier.used_bytes == 0
    second.release()  # once
    assert returned == [MB, 2 * MB]


def test_a_spill_queued_on_the_gpu_is_written_and_dropped_at_once(tmp_path, monkeypatch):
    # The offloader's side of GPU-ordered host copies, with the queueing faked on the host:
    # a spill the host tier queues is written (and its array dropped) as the put returns,
    # with no writer thread; its read back is queued on the caller's thread too, and the
    # get makes the caller's stream wait for it; the buffer goes back once its copies ran.
    from arrayio.arrays._dtypes import numpy_dtype
    from arrayio.offload import _offloader, _spills
    from arrayio.offload._host import HostCopy

    events: list[_Event] = []
    waited: list[_Event] = []

    def queue_to_host(self, entry):
        data = np.ascontiguousarray(entry.array).reshape(-1).view(np.uint8)
        self.host.used_bytes += data.nbytes
        busy = _Event()
        events.append(busy)
        return HostCopy(self.host, contextlib.ExitStack(), data.copy(), busy)

    def queue_from_host(self, entry):
        arrived = entry.host.busy = _Event()
        events.append(arrived)
        dtype = numpy_dtype(entry.dtype)
        return entry.host.buffer.view(dtype).reshape(entry.shape).copy(), arrived

    monkeypatch.setattr(_spills.SpillFiles, "queue_to_host", queue_to_host)
    monkeypatch.setattr(_spills.SpillFiles, "queue_from_host", queue_from_host)
    monkeypatch.setattr(_spills.SpillFiles, "queues_back", lambda self, entry: True)
    monkeypatch.setattr(_offloader, "arrived", lambda array, event: waited.append(event))
    arrays = [np.full(MB // 4, i, np.float32) for i in range(3)]
    with Offloader(tmp_path, device_budget_bytes=64 * MB, host_budget_bytes=64 * MB) as off:
        handles = [off.put(a, hint="spill") for a in arrays]
        assert [off.resident(h) for h in handles] == [False] * 3  # dropped as put returned
        stats = off.stats()
        assert stats.writes == 3 and stats.host_bytes == 3 * MB and stats.disk_bytes == 0
        np.testing.assert_array_equal(off.get(handles[1]), arrays[1])
        assert waited == [events[3]]  # the caller's stream waits for the queued copy back
        off.get(handles[1])
        assert waited == [events[3]] * 2  # and every later get's stream, too
        off.free(handles[1])
        assert off.host_tier.used_bytes == 3 * MB  # its copy back has not run yet
        events[3].done = True
        off.host_tier.reap()
        assert off.host_tier.used_bytes == 2 * MB
    assert off.host_tier.used_bytes == 0  # close waited for the rest


def test_a_copy_back_that_fails_to_queue_is_the_gets_to_raise(tmp_path, monkeypatch):
    # A read queued on the caller's thread that fails (the device out of memory for its
    # destination) is reported by the get, as a reader thread's failure is, and leaves the
    # budget's books as they were: the next read fits and runs.
    from arrayio.offload import _spills

    monkeypatch.setattr(_spills.SpillFiles, "queues_back", lambda self, entry: True)
    failures = [MemoryError("no room for the copy back")]

    def queue_from_host(self, entry):
        if failures:
            raise failures.pop()
        return np.zeros(entry.shape, np.float32), None

    monkeypatch.setattr(_spills.SpillFiles, "queue_from_host", queue_from_host)
    with Offloader(tmp_path, device_budget_bytes=MB, host_budget_bytes=0) as off:
        handle = off.put(np.ones(MB // 4, np.float32), hint="spill")
        off.wait()
        off.prefetch(handle)  # never raises: the get does
        with pytest.raises(MemoryError, match="no room"):
            off.get(handle)
        assert off._residents.reading == 0 and off._residents.held == 0  # the books kept
        assert off.get(handle).shape == (MB // 4,)
