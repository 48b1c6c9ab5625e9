"""Where zstd chunks bound for a GPU are decoded: by nvCOMP, by the host's cores, or both.

nvCOMP decodes a batch of chunks with one chunk per unit of the GPU's work, so its rate
grows with the number of chunks and falls with their size: many small chunks decode far
faster on the GPU than on the host, while a few chunks of many megabytes decode faster on
the host's cores (numcodecs releases the GIL), with one copy of the decoded bytes to the
GPU after. Neither is the better choice everywhere, and where the line falls depends on the
GPU, the cores and the chunks. So the pipeline measures it.

Per context (the GPU, and the batch's decoded chunk size and chunk count, each rounded to
a power of two):

* the first batch is split in half, and each side's rate (decoded bytes over the seconds
  from its start to its chunks being on the GPU) is measured within the call;
* the rates give the candidates: the batch shared in proportion to them, so that both
  sides finish together, and the faster side alone. A side whose share would be under
  :data:`SNAP` gets none (a few chunks on a slow side would make the whole call wait for
  them), and then the faster side alone is the candidate. nvCOMP alone is a candidate
  in every case (so up to three): its rate measured beside the host's threads is not its
  rate alone (its per-batch work waits for the interpreter while they decode), so a
  shared batch can make it look many times slower than it is;
* the rates are not additive (both sides need the interpreter and the cores, and nvCOMP's
  time barely shrinks with fewer chunks), so each candidate runs one batch, its overall
  rate measured, and later batches go to the candidate that ran fastest. A shared batch
  measures the sides' rates again.

A batch of one chunk goes to nvCOMP. What was learned lasts for the process;
:func:`report` says what each context does and why.
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["GPU", "HOST", "SHARED", "SNAP", "Placement", "placement", "record", "report"]

SNAP = 0.15  # a side earning less than this share of a batch gets none of it


SHARED, GPU, HOST, MEASURING = "shared", "nvCOMP alone", "the host alone", "measuring"


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """How many of a batch's chunks the host decodes (the rest go to nvCOMP), and why."""

    host_chunks: int
    context: tuple[int, int, int]
    why: str
    mode: str = MEASURING  # what the batch's overall rate is recorded as


@dataclasses.dataclass
class _Learned:
    gpu_rate: float | None = None  # decoded bytes per second, the last shared batch
    host_rate: float | None = None
    modes: dict[str, float] = dataclasses.field(default_factory=dict)  # overall rates
    batches: int = 0


_learned: dict[tuple[int, int, int], _Learned] = {}
_lock = threading.Lock()


def _power_of_two(value: int) -> int:
    return max(0, int(value) - 1).bit_length()


def context_of(device_id: int, chunk_bytes: int, chunks: int) -> tuple[int, int, int]:
    """The context of a batch: its GPU, and its chunk size and count as powers of two."""
    return (device_id, _power_of_two(chunk_bytes), _power_of_two(chunks))


def placement(device_id: int, chunk_bytes: int, chunks: int) -> Placement:
    """How a batch of ``chunks`` zstd chunks, each decoding to about ``chunk_bytes``, is
    shared between the host and nvCOMP on GPU ``device_id``."""
    context = context_of(device_id, chunk_bytes, chunks)
    if chunks < 2:
        return Placement(0, context, "one chunk: nvCOMP", GPU)
    with _lock:
        learned = _learned.get(context)
        gpu, host = (learned.gpu_rate, learned.host_rate) if learned else (None, None)
        modes = dict(learned.modes) if learned else {}
    if gpu is None or host is None:
        return Placement(chunks // 2, context, "nothing measured yet: half on each, measured")
    share = host / (host + gpu)
    rates = f"host {host / 1e9:.2f} GB/s, nvCOMP {gpu / 1e9:.2f} GB/s when shared"
    alone = HOST if host > gpu else GPU
    candidates = [alone] if share < SNAP or share > 1 - SNAP else [SHARED, alone]
    if GPU not in candidates:
        # nvCOMP's rate in a shared batch is the one sharing distorts: its per-batch work
        # (the frame scan, the copy in, the launch) waits for the interpreter's lock while
        # the host's threads decode, and a small batch is little else. Alone it may win.
        candidates.append(GPU)
    untried = [mode for mode in candidates if mode not in modes]
    mode = untried[0] if untried else max(candidates, key=modes.__getitem__)
    if untried:
        why = f"{mode}: tried once ({rates})"
    else:
        ran = ", ".join(f"{m} {modes[m] / 1e9:.2f} GB/s" for m in candidates)
        why = f"{mode}: the fastest overall ({ran}; {rates})"
    if mode == SHARED:
        return Placement(min(chunks - 1, max(1, round(share * chunks))), context, why, SHARED)
    return Placement(chunks if mode == HOST else 0, context, why, mode)


def record(
    chosen: Placement,
    gpu_rate: float | None,
    host_rate: float | None,
    overall_rate: float | None = None,
) -> None:
    """What a batch placed as ``chosen`` measured: each side's rate where both ran (None:
    not measured) and the batch's overall rate."""
    with _lock:
        learned = _learned.setdefault(chosen.context, _Learned())
        if gpu_rate is not None and host_rate is not None:
            learned.gpu_rate, learned.host_rate = gpu_rate, host_rate
        if overall_rate is not None and chosen.mode != MEASURING:
            learned.modes[chosen.mode] = overall_rate
        learned.batches += 1


def report() -> list[str]:
    """One line per context learned in this process."""
    lines = []
    with _lock:
        items = sorted(_learned.items())
    for (device_id, size, count), learned in items:
        decided = placement(device_id, 1 << size, 1 << count)
        lines.append(
            f"cuda:{device_id}, chunks of about 2^{size} bytes, batches of about 2^{count}: "
            f"{decided.why}; {learned.batches} batches"
        )
    return lines


def forget() -> None:
    """Forget what was learned (tests)."""
    with _lock:
        _learned.clear()
