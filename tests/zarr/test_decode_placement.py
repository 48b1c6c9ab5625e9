"""Where zstd chunks bound for a GPU are decoded (:mod:`arrayio.zarr._decode_placement`):
the first batch of a context is split and measured, later ones are shared by the measured
rates, and a side that would get only a sliver gets nothing."""

from __future__ import annotations

import pytest

from arrayio.zarr import _decode_placement as placement

MiB = 1 << 20


@pytest.fixture(autouse=True)
def nothing_learned(monkeypatch):
    monkeypatch.setattr(placement, "_learned", {})


def test_a_context_nothing_was_measured_for_is_split_in_half():
    chosen = placement.placement(0, MiB, 1024)
    assert chosen.host_chunks == 512 and "half on each" in chosen.why
    assert placement.placement(0, MiB, 7).host_chunks == 3


def test_one_chunk_goes_to_nvcomp():
    assert placement.placement(0, 64 * MiB, 1).host_chunks == 0


def test_later_batches_are_shared_by_the_measured_rates():
    context = placement.context_of(0, 16 * MiB, 64)
    placement.record(context, gpu_rate=2e9, host_rate=6e9)
    chosen = placement.placement(0, 16 * MiB, 64)
    assert chosen.host_chunks == 48  # 6 / (2 + 6) of 64: both sides finish together
    assert "shared by rate" in chosen.why and "host 6.00 GB/s" in chosen.why


@pytest.mark.parametrize(
    ("gpu", "host", "expected"), [(20e9, 2e9, 0), (2e9, 20e9, 64), (1e9, 1e9, 32)]
)
def test_a_side_that_would_get_a_sliver_gets_nothing(gpu, host, expected):
    placement.record(placement.context_of(0, MiB, 64), gpu_rate=gpu, host_rate=host)
    assert placement.placement(0, MiB, 64).host_chunks == expected


def test_a_shared_batch_leaves_each_side_at_least_one_chunk():
    placement.record(placement.context_of(0, MiB, 2), gpu_rate=1e9, host_rate=4e9)
    # 0.8 of 2 chunks rounds to 2: the host would take both, though the share says both run
    assert placement.placement(0, MiB, 2).host_chunks == 1


def test_a_side_that_did_not_run_keeps_its_last_rate():
    context = placement.context_of(0, MiB, 64)
    placement.record(context, gpu_rate=3e9, host_rate=1e9)
    placement.record(context, gpu_rate=None, host_rate=3e9)
    assert placement.placement(0, MiB, 64).host_chunks == 32


def test_contexts_are_the_gpu_and_the_chunks_size_and_count_as_powers_of_two():
    placement.record(placement.context_of(0, MiB, 1024), gpu_rate=50e9, host_rate=1e9)
    assert placement.placement(0, MiB - 1, 1000).host_chunks == 0  # the same context
    assert placement.placement(1, MiB, 1024).host_chunks == 512  # another GPU
    assert placement.placement(0, 2 * MiB, 1024).host_chunks == 512  # larger chunks
    assert placement.placement(0, MiB, 64).host_chunks == 32  # fewer chunks


def test_the_report_says_what_each_context_does_and_why():
    assert placement.report() == []
    context = placement.context_of(0, 16 * MiB, 64)
    placement.record(context, gpu_rate=1e9, host_rate=10e9)
    placement.record(context, gpu_rate=None, host_rate=10e9)
    [line] = placement.report()
    assert line.startswith("cuda:0, chunks of about 2^24 bytes, batches of about 2^6: ")
    assert "the host alone" in line and "2 batches" in line
