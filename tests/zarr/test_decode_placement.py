"""Where zstd chunks bound for a GPU are decoded (:mod:`arrayio.zarr._decode_placement`):
the first batch of a context is split and both sides timed; then the batch shared by those
rates and the faster side alone each run once (and nvCOMP alone, whatever sharing made it
look like), and the faster of them overall keeps the context. A side that would get only a
sliver gets nothing."""

from __future__ import annotations

import pytest

from arrayio.zarr import _decode_placement as placement

MiB = 1 << 20


@pytest.fixture(autouse=True)
def nothing_learned(monkeypatch):
    monkeypatch.setattr(placement, "_learned", {})


def run(chosen, gpu=None, host=None, overall=None):
    """Record a batch placed as ``chosen``; return what the next batch gets."""
    placement.record(chosen, gpu, host, overall)
    return placement.placement(chosen.context[0], 1 << chosen.context[1], 1 << chosen.context[2])


def test_a_context_nothing_was_measured_for_is_split_in_half():
    chosen = placement.placement(0, MiB, 1024)
    assert chosen.host_chunks == 512 and "half on each" in chosen.why
    assert chosen.mode == placement.MEASURING
    assert placement.placement(0, MiB, 7).host_chunks == 3


def test_one_chunk_goes_to_nvcomp():
    assert placement.placement(0, 64 * MiB, 1).host_chunks == 0


def test_the_shared_batch_then_the_faster_side_alone_are_tried_and_the_faster_kept():
    first = placement.placement(0, MiB, 64)
    shared = run(first, gpu=2e9, host=6e9, overall=5e9)
    assert shared.mode == placement.SHARED and "tried once" in shared.why
    assert shared.host_chunks == 48  # 6 / (2 + 6) of 64: both sides finish together
    alone = run(shared, gpu=2e9, host=6e9, overall=7e9)
    assert alone.mode == placement.HOST and alone.host_chunks == 64
    nvcomp_alone = run(alone, overall=6.5e9)  # sharing made nvCOMP look slow: it gets a try
    assert nvcomp_alone.mode == placement.GPU and nvcomp_alone.host_chunks == 0
    kept = run(nvcomp_alone, overall=3e9)
    assert kept.mode == placement.SHARED and "the fastest overall" in kept.why
    # the shared batch ran slower than the side alone next time: the side alone keeps it
    assert run(kept, gpu=2e9, host=6e9, overall=5e9).mode == placement.HOST


def test_when_sharing_runs_slower_than_nvcomp_alone_nvcomp_keeps_the_context():
    # Rates that are not additive: each side timed in a shared batch looks slower than
    # nvCOMP alone runs, and the shared batch is slower overall.
    first = placement.placement(0, MiB, 1024)
    shared = run(first, gpu=4.3e9, host=3.8e9, overall=5.0e9)
    assert shared.mode == placement.SHARED
    alone = run(shared, gpu=4.5e9, host=3.9e9, overall=5.1e9)
    assert alone.mode == placement.GPU and alone.host_chunks == 0
    assert run(alone, overall=5.7e9).mode == placement.GPU


@pytest.mark.parametrize(
    ("gpu", "host", "mode", "host_chunks"),
    [
        (20e9, 2e9, placement.GPU, 0),
        (0.45e9, 6.5e9, placement.HOST, 64),
    ],
)
def test_a_side_that_would_get_a_sliver_gets_nothing(gpu, host, mode, host_chunks):
    first = placement.placement(0, 16 * MiB, 64)
    chosen = run(first, gpu=gpu, host=host, overall=2.3e9)
    assert (chosen.mode, chosen.host_chunks) == (mode, host_chunks)
    if mode == placement.HOST:  # nvCOMP alone is tried once too, then the faster kept
        assert run(chosen, overall=6e9).mode == placement.GPU
        chosen = run(run(chosen, overall=6e9), overall=1e9)
    assert chosen.mode == mode
    assert run(chosen, overall=6e9).mode == mode


def test_nvcomp_alone_gets_a_try_however_slow_sharing_made_it_look():
    # A small batch: beside the host's threads nvCOMP measured a fifth of the host's rate,
    # but alone it is the faster, and keeps the context.
    first = placement.placement(0, MiB, 100)
    host_alone = run(first, gpu=0.7e9, host=4.1e9, overall=2.8e9)
    assert host_alone.mode == placement.HOST
    nvcomp_alone = run(host_alone, overall=5.0e9)
    assert nvcomp_alone.mode == placement.GPU and nvcomp_alone.host_chunks == 0
    assert "tried once" in nvcomp_alone.why
    kept = run(nvcomp_alone, overall=12e9)
    assert kept.mode == placement.GPU and "the fastest overall" in kept.why
    assert "nvCOMP alone 12.00 GB/s" in kept.why


def test_the_first_split_is_not_recorded_as_the_shared_mode():
    first = placement.placement(0, MiB, 64)
    run(first, gpu=1e9, host=1e9, overall=9e9)
    assert placement._learned[first.context].modes == {}


def test_a_shared_batch_leaves_each_side_at_least_one_chunk():
    first = placement.placement(0, MiB, 2)
    # 0.8 of 2 chunks rounds to 2: the host would take both, though the share says both run
    assert run(first, gpu=1e9, host=4e9, overall=1e9).host_chunks == 1


def test_contexts_are_the_gpu_and_the_chunks_size_and_count_as_powers_of_two():
    run(placement.placement(0, MiB, 1024), gpu=50e9, host=1e9, overall=1e9)
    assert placement.placement(0, MiB - 1, 1000).host_chunks == 0  # the same context
    assert placement.placement(1, MiB, 1024).host_chunks == 512  # another GPU
    assert placement.placement(0, 2 * MiB, 1024).host_chunks == 512  # larger chunks
    assert placement.placement(0, MiB, 64).host_chunks == 32  # fewer chunks


def test_the_report_says_what_each_context_does_and_why():
    assert placement.report() == []
    first = placement.placement(0, 16 * MiB, 64)
    run(run(run(first, gpu=1e9, host=10e9, overall=2e9), overall=7e9), overall=3e9)
    [line] = placement.report()
    assert line.startswith("cuda:0, chunks of about 2^24 bytes, batches of about 2^6: ")
    assert "the host alone: the fastest overall (the host alone 7.00 GB/s" in line
    assert "nvCOMP alone 3.00 GB/s" in line
    assert line.endswith("; 3 batches")


def test_the_pipeline_explains_the_placements_it_learned():
    zarr = pytest.importorskip("zarr")
    from arrayio.zarr import CodecPipeline

    pipeline = CodecPipeline.from_codecs([zarr.codecs.BytesCodec(), zarr.codecs.ZstdCodec()])
    assert "zstd into GPU memory" not in pipeline.explain()
    run(placement.placement(0, MiB, 64), gpu=9e9, host=1e9, overall=8e9)
    explained = pipeline.explain().splitlines()
    assert explained[0].startswith("whole-batch reads (bytes, zstd)")
    assert explained[1].startswith("zstd into GPU memory, cuda:0, chunks of about 2^20 bytes")
    assert "nvCOMP alone: tried once" in explained[1]
