"""The process's pool of pinned staging buffers (with plain memory standing in for pinned)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from arrayio.tools import _pinned
from arrayio.tools._pinned import BLOCK, SLACK, Borrowed, PinnedPool, size_class


class Counting:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> np.ndarray:
        self.sizes.append(nbytes)
        return np.empty(nbytes, np.uint8)


def test_size_classes_are_powers_of_two_with_slack_and_a_floor() -> None:
    assert size_class(1) == 1 << 20
    assert size_class((8 << 20) + SLACK) == 8 << 20  # a chunk plus its slack: no doubling
    assert size_class((8 << 20) + SLACK + 1) == 16 << 20


def test_a_loan_is_block_aligned_and_big_enough() -> None:
    pool = PinnedPool(allocate=Counting())
    for nbytes in (1, 4096, (3 << 20) + 5, (8 << 20) + SLACK):
        with pool.lend(nbytes) as buffer:
            assert buffer.nbytes >= nbytes
            assert buffer.ctypes.data % BLOCK == 0


def test_a_spare_is_lent_again_to_any_request_it_fits() -> None:
    allocate = Counting()
    pool = PinnedPool(allocate=allocate)
    with pool.lend(16 << 20) as big:
        first = big.ctypes.data
    with pool.lend(3 << 20) as small:  # a smaller request of another arm takes the spare
        assert small.ctypes.data == first
    assert pool.allocated == 1 and len(allocate.sizes) == 1


def test_the_smallest_fitting_spare_is_taken() -> None:
    pool = PinnedPool(allocate=Counting())
    with pool.lend(16 << 20) as big, pool.lend(1 << 20) as small:
        big_address, small_address = big.ctypes.data, small.ctypes.data
    with pool.lend(1 << 20) as again:
        assert again.ctypes.data == small_address
    with pool.lend(4 << 20) as larger:
        assert larger.ctypes.data == big_address


def test_concurrent_borrowers_never_share_a_buffer() -> None:
    pool = PinnedPool(allocate=Counting())
    seen: list[int] = []
    barrier = threading.Barrier(8)

    def borrow() -> None:
        with pool.lend(1 << 20) as buffer:
            seen.append(buffer.ctypes.data)
            barrier.wait()  # every loan is out at once

    threads = [threading.Thread(target=borrow) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(seen)) == 8
    assert pool.allocated == 8


def test_a_pipeline_s_first_buffers_come_from_one_pinning_each_slab() -> None:
    # Pinning is most of a fresh process's first load beyond the transfer: 8 workers each
    # wanting a 4 MiB buffer at once wait for whole slabs, not for 8 pinnings of their own.
    allocate = Counting()
    pool = PinnedPool(allocate=allocate, slab_bytes=32 << 20)
    chunk = (4 << 20) + SLACK
    barrier = threading.Barrier(8)
    spans: list[tuple[int, int]] = []

    def borrow() -> None:
        with pool.lend(chunk) as buffer:
            spans.append((buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes))
            assert buffer.ctypes.data % BLOCK == 0 and buffer.nbytes >= chunk
            barrier.wait()

    threads = [threading.Thread(target=borrow) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    per_slab = (32 << 20) // (size_class(chunk) + SLACK)
    assert pool.slabs == len(allocate.sizes) == -(-8 // per_slab) == 2
    spans.sort()
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))  # disjoint


def test_a_request_larger_than_a_slab_is_pinned_alone() -> None:
    allocate = Counting()
    pool = PinnedPool(allocate=allocate, slab_bytes=4 << 20)
    with pool.lend(16 << 20) as big, pool.lend(1 << 20) as small:
        assert big.nbytes >= 16 << 20 and small.nbytes >= 1 << 20
        assert small.ctypes.data >= big.ctypes.data + big.nbytes or (
            small.ctypes.data + small.nbytes <= big.ctypes.data
        )
    assert allocate.sizes[0] >= 16 << 20 and pool.slabs == 2


def test_a_slab_pinned_ahead_serves_the_first_buffers_and_is_pinned_once() -> None:
    from arrayio.runtime import _background

    allocate = Counting()
    pool = PinnedPool(allocate=allocate, slab_bytes=32 << 20)
    pool.pin_ahead()
    _background.join(10)
    assert pool.slabs == 1
    pool.pin_ahead()  # room left: nothing more pinned
    _background.join(10)
    assert pool.slabs == 1
    with pool.lend((4 << 20) + SLACK), pool.lend((4 << 20) + SLACK):
        assert pool.slabs == len(allocate.sizes) == 1  # cut from the slab pinned ahead
    pool.pin_ahead()  # spares now: the next loans take them
    _background.join(10)
    assert pool.slabs == 1


def test_spares_are_bounded_in_bytes_oldest_dropped_first() -> None:
    pool = PinnedPool(keep_bytes=3 * ((1 << 20) + SLACK), allocate=Counting())
    loans = [pool.lend(1) for _ in range(4)]
    addresses = [loan.__enter__().ctypes.data for loan in loans]
    for loan in loans:  # given back first to last: the first is the oldest spare
        loan.__exit__(None, None, None)
    assert pool.spare_bytes <= pool.keep_bytes
    kept = set()
    for _ in range(3):
        stack = pool.lend(1)
        kept.add(stack.__enter__().ctypes.data)
    assert addresses[0] not in kept  # the oldest spare went
    assert kept == set(addresses[1:])


def test_borrowed_takes_its_second_buffer_only_when_asked() -> None:
    pool = PinnedPool(allocate=Counting())
    with Borrowed(1 << 20, pool) as slots:
        slots[0]
        slots[0]
        assert pool.allocated == 1
        assert slots[1].ctypes.data != slots[0].ctypes.data
        assert pool.allocated == 2
    assert pool.spare_bytes == 2 * ((1 << 20) + SLACK)  # both given back


@pytest.mark.gpu
def test_the_default_allocator_pins_through_the_driver() -> None:
    from arrayio.arrays import _cuda
    from arrayio.testing import gpu_available

    if not gpu_available():
        pytest.skip("no CUDA device")
    with _pinned.pool.lend(1 << 20) as buffer:
        buffer[:] = 7
        assert buffer.nbytes >= 1 << 20
    # Registered huge-page memory, odd sizes included, and copies through it both ways.
    for nbytes in (1, 4096 + 3, (3 << 20) + 5):
        host = _cuda.alloc_pinned(nbytes)
        host[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
        device = _cuda.DeviceMemory(nbytes, 0)
        stream = _cuda.thread_stream(0)
        _cuda.copy_to_device(device.address, host, stream)
        back = _cuda.alloc_pinned(nbytes)
        _cuda.copy_to_host(back, device.address, stream)
        stream.synchronize()
        np.testing.assert_array_equal(back, host)
        del host, back
        device.free()
