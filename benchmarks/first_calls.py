"""Loads as users meet them: GB/s of each call of a fresh process, per peer, beside the disk's
and the page cache's ceilings.

``python -m benchmarks.first_calls --out DIR [--gib 1.5] [--repeats 3] [--drop-caches]
[--patterns warm,cold_start,cold_every]
[--peers A,B] [--learned A,B|none] [--warm-calls 12] [--reloads 6] [--cold-calls 6] [--gap S]
[--call-budget S]
[--deadline EPOCH] [--dir SCRATCH] [--smoke] [--replot DIR/first_calls.json]``

The file is a transformer-like bfloat16 state dict of about ``--gib`` GiB (embeddings, each
layer's norms, q/k/v/o and MLP weights, a final norm and an output head: from 4 KiB norms
to 125 MiB embeddings), written once by ``safetensors.torch.save_file`` and once by
``arrayio.save``. Every sequence of calls runs in a process of its own
(:mod:`benchmarks._first_calls_sequence`), with an ``ARRAYIO_CACHE_DIR`` of its own: empty
(``fresh``), or for arrayio's front doors named in ``--learned`` also the one that the same
front door's fresh sequence of the same pattern and repetition left (``learned``). The
process imports its peer and makes its framework's device context before call 1 (both
reported, not timed); each call is timed until the arrays are in device memory and the
device synchronized, and checked (keys, shapes, dtypes, device; one call, the first unless
``--check-call N`` says another, also the CRC-32 of a few tensors, read back to the host:
reading JAX's arrays back slows its next load, so a later call keeps that out of calls 1
and 2).

Three patterns: ``warm``, ``--warm-calls`` calls with the file in the page cache (read twice)
before call 1; ``cold_start``, the page cache dropped before call 1, then ``--reloads`` calls
with nothing dropped; ``cold_every``, ``--cold-calls`` calls, each after the page cache was
dropped. Dropped means the file's pages evicted (``posix_fadvise``), and with
``--drop-caches`` (root) the whole page cache too. Calls follow each other as soon as the
last is checked; ``--gap S`` makes each sequence wait ``S`` seconds after each check, as a
program that works between its loads would. An arrayio sequence records, per call, what its
dispatcher was doing in the background as the call began (``background``: tools being set
up, a second pass reading) and where its load spent its time (``stages``: opening the file,
allocating, the transfers, the GPU checksums, finishing the results; the report's
``stage_medians_ms`` and its printed table give each stage's median per call, and what no
stage held, ``elsewhere``). ``--call-budget S``
ends a sequence once its calls have taken ``S`` seconds (``cut_after`` says after how
many): the slowest loaders' later calls then cost the run little, so that every peer fits
into one call of the device machine.

Each repetition runs the patterns in a shuffled order, and each pattern every peer's
sequence in a shuffled order (a learned sequence after its fresh one) with one sample of
the pattern's ceiling among them: the disk's (``O_DIRECT`` threaded read of the safetensors
file after eviction) for the cold patterns, the page cache's (16 buffered threads, warm)
for ``warm``; both settings are searched up front
(:class:`~benchmarks.peers._harness.DiskCeilings`). An untimed warm-up sequence of one call
per peer comes first (``--no-warm-up`` skips it): it finds the peers that fail before the
rounds, and reads every peer's libraries into the page cache.

``DIR/first_calls.json`` holds every call's GB/s (of the arrays' bytes) per peer, cache
state, pattern and repetition, the medians per call number and the ceilings' samples;
``DIR/first_calls.png`` plots GB/s against call number, one panel per pattern. The table
printed at the end gives, per pattern, call 1, call 2, the median of calls 3 to 6 and of
later calls, with each figure's ratio to the best peer's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks import _first_calls_sequence as sequence
from benchmarks.peers import _harness as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = sequence.PATTERNS
PEERS = sequence.PEERS
PATTERN_TEXT = {
    "warm": "the file in the page cache (read twice) before call 1",
    "cold_start": "the page cache dropped before call 1 only",
    "cold_every": "the page cache dropped before every call",
}
# Every ceiling a pattern's rounds sample, its own first: a cold start's reloads begin with the
# file's first re-read, which the kernel serves slower than later ones (DiskCeilings'
# reread_read).
CEILINGS_OF = {
    "warm": ("warm_read",),
    "cold_start": ("cold_read", "reread_read"),
    "cold_every": ("cold_read",),
}
CEILING_TEXT = {
    "warm_read": "page-cache read",
    "reread_read": "page cache, first re-read",
    "cold_read": "disk (O_DIRECT) read",
}
# The table's columns: (name, first call, last call), calls counted from 1.
COLUMNS = (("call 1", 1, 1), ("call 2", 2, 2), ("calls 3-6", 3, 6), ("later", 7, None))
DEFAULT_PEERS = {
    "cuda": (
        "safetensors",
        "fastsafetensors",
        "runai-streamer",
        "instanttensor",
        "instanttensor-buffered",
        "arrayio-torch",
        "arrayio-torch-stfile",
        "arrayio-jax",
        "arrayio-cupy",
    ),
    "cpu": (
        "safetensors",
        "safetensors-numpy",
        "fastsafetensors",
        "runai-streamer",
        "arrayio-torch",
        "arrayio-torch-stfile",
        "arrayio-jax",
        "arrayio-numpy",
        "arrayio-numpy-posix",
    ),
}
# CI: one process per sequence costs an interpreter and a framework import, so the smoke
# run keeps the peers whose imports are quick, and one learned front door.
SMOKE_PEERS = (
    "safetensors",
    "safetensors-numpy",
    "arrayio-numpy",
    "arrayio-numpy-posix",
    "arrayio-torch",
)
SMOKE_LEARNED = ("arrayio-numpy",)
CHECKED_BYTES = 192 << 20  # the CRC-32 check's budget: a few tensors, copied to the host
FRAMEWORKS = frozenset({"torch", "jax", "jaxlib", "cupy", "numpy", "ml_dtypes"})


# ------------------------------------------------------------------ the file


def layout(total_bytes: int, d_model: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a bfloat16 decoder's state dict of about ``total_bytes``: grouped
    queries (keys and values a quarter of the model width), an MLP 2.75 times as wide."""
    d, kv, ffn = d_model, max(1, d_model // 4), 64 * max(1, round(2.75 * d_model / 64))

    def layer(i: int) -> list[tuple[str, tuple[int, ...]]]:
        p = f"model.layers.{i}."
        return [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, d)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (ffn, d)),
            (p + "mlp.up_proj.weight", (ffn, d)),
            (p + "mlp.down_proj.weight", (d, ffn)),
        ]

    def elements(entries: list[tuple[str, tuple[int, ...]]]) -> int:
        return sum(math.prod(shape) for _, shape in entries)

    head = [("model.embed_tokens.weight", (vocab, d))]
    tail = [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    layers = max(1, round((total_bytes / 2 - elements(head + tail)) / elements(layer(0))))
    return head + [e for i in range(layers) for e in layer(i)] + tail


def make_state(entries: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """bfloat16 tensors in host memory, normally distributed, the same in every run."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, dtype=torch.bfloat16, generator=generator)
        for name, shape in entries
    }


def write_files(state: dict[str, Any], directory: str) -> dict[str, str]:
    """The state dict saved by safetensors and by arrayio, durable; their paths by writer."""
    from safetensors.torch import save_file

    import arrayio

    paths = {
        "safetensors": os.path.join(directory, "model.safetensors"),
        "arrayio": os.path.join(directory, "model-arrayio.safetensors"),
    }
    save_file(state, paths["safetensors"])
    h.fsync_tree(paths["safetensors"])
    # This process teaches no dispatch table: the user's own stays as it was.
    with arrayio.config.set(cache_dir=None):
        arrayio.save(paths["arrayio"], state)
    return paths


def checked_keys(state: dict[str, Any], budget: int) -> list[str]:
    """A few tensors spread over the file (its first and last among them) whose bytes fit
    in ``budget``, at least one."""
    keys = list(state)
    picks = sorted({round(i * (len(keys) - 1) / 7) for i in range(8)})
    chosen, used = [], 0
    for index in picks:
        nbytes = state[keys[index]].numel() * state[keys[index]].element_size()
        if chosen and used + nbytes > budget:
            continue
        chosen.append(keys[index])
        used += nbytes
    return chosen


def expected_of(state: dict[str, Any]) -> dict[str, Any]:
    """What every call must return (shapes and dtypes) and the sampled tensors' CRC-32."""
    return {
        "tensors": {k: [list(t.shape), sequence.dtype_name(t)] for k, t in state.items()},
        "crc32": {k: sequence.crc32(state[k]) for k in checked_keys(state, CHECKED_BYTES)},
    }


# ------------------------------------------------------------------ the peers


def choose_peers(names: list[str], device: str) -> tuple[list[str], dict[str, str]]:
    """The peers of ``names`` that can run here, and why each other one cannot (without
    importing any: a peer whose import fails later is reported by its sequence)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    chosen, unavailable = [], {}
    for name in names:
        info = PEERS[name]
        missing = [m for m in info.modules if importlib.util.find_spec(m) is None]
        if kind not in info.devices:
            unavailable[name] = f"loads to {' or '.join(info.devices)} memory, not {kind}"
        elif missing:
            unavailable[name] = f"ModuleNotFoundError: no module named {missing[0]!r}"
        else:
            chosen.append(name)
    return chosen, unavailable


@dataclasses.dataclass(frozen=True)
class Job:
    """One sequence: a peer, a pattern, a repetition (-1: the warm-up), fresh or learned."""

    peer: str
    pattern: str
    repetition: int
    learned: bool = False

    @property
    def series(self) -> str:
        return f"{self.peer} (learned)" if self.learned else self.peer

    @property
    def name(self) -> str:
        return f"{self.pattern}-{self.repetition}-{self.peer}{'-learned' * self.learned}"

    @property
    def cache_name(self) -> str:
        """The cache directory: a learned sequence takes its fresh sequence's."""
        return f"{self.pattern}-{self.repetition}-{self.peer}"


class Runner:
    """Runs sequences in processes of their own, in ``directory``."""

    def __init__(
        self,
        directory: str,
        files: dict[str, str],
        expected: dict[str, Any],
        *,
        device: str,
        drop_caches: bool,
        timeout: float,
        gap: float = 0.0,
        call_budget: float | None = None,
        check_call: int = 1,
    ) -> None:
        self.directory = directory
        self.gap = gap
        self.call_budget = call_budget
        self.check_call = check_call
        self.files = files
        self.expected = expected
        self.device = device
        self.drop = drop_caches
        self.timeout = timeout
        for sub in ("specs", "results", "caches"):
            os.makedirs(os.path.join(directory, sub), exist_ok=True)

    def run(self, job: Job, calls: int, deadline: h.Deadline) -> dict[str, Any]:
        """Run ``job`` (``calls`` calls); return what its process reported, with its wall
        time (``process_seconds``) and, where it failed, the error and its stage."""
        spec_path = os.path.join(self.directory, "specs", f"{job.name}.json")
        result_path = os.path.join(self.directory, "results", f"{job.name}.json")
        cache_dir = os.path.join(self.directory, "caches", job.cache_name)
        os.makedirs(cache_dir, exist_ok=True)
        spec = {
            "peer": job.peer,
            "device": self.device,
            "path": self.files[PEERS[job.peer].reads],
            "pattern": job.pattern,
            "calls": calls,
            "drop_caches": self.drop,
            "gap": self.gap,
            "call_budget": self.call_budget,
            "check_call": self.check_call,
            "expected": self.expected,
            "result": result_path,
        }
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, ARRAYIO_CACHE_DIR=cache_dir)
        # The deadline only decides which sequences start: one that started runs to its end
        # (a minute past the deadline at most), rather than being killed and its peer failed.
        timeout = min(self.timeout, max(deadline.left(), 0.0) + 60.0)
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks._first_calls_sequence", spec_path],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            problem = None if done.returncode == 0 else f"exit status {done.returncode}"
            stderr = done.stderr
        except subprocess.TimeoutExpired as expired:
            problem = f"timed out after {timeout:.0f} s"
            stderr = expired.stderr or ""
            if isinstance(stderr, bytes):
                stderr = stderr.decode(errors="replace")
        took = time.perf_counter() - start
        result: dict[str, Any] = {"seconds": [], "check": None, "error": None}
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
        if problem is not None and result.get("error") is None:
            result["error"] = f"{problem}: {(stderr or '').strip()[-1500:]}"
            result["failed_at"] = result.get("failed_at") or "process"
        result["process_seconds"] = took
        return result


# ------------------------------------------------------------------ rounds


def phase_order(jobs: list[Job | None], rng: random.Random) -> list[Job | None]:
    """``jobs`` (None: the ceiling's sample) shuffled, each learned sequence moved after
    its fresh one by swapping the two."""
    order = list(jobs)
    rng.shuffle(order)
    for i, job in enumerate(order):
        if job is None or not job.learned:
            continue
        fresh = order.index(dataclasses.replace(job, learned=False))
        if fresh > i:
            order[i], order[fresh] = order[fresh], order[i]
    return order


def calls_of(args: argparse.Namespace) -> dict[str, int]:
    """The calls of each pattern run (``--patterns``), in :data:`PATTERNS`' order."""
    calls = {"warm": args.warm_calls, "cold_start": 1 + args.reloads, "cold_every": args.cold_calls}
    return {pattern: calls[pattern] for pattern in PATTERNS if pattern in args.patterns}


class Predictor:
    """Each sequence's expected wall time, from the last one of its kind, for the deadline."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.seconds: dict[tuple[str, str], float] = {}  # (series, pattern)
        self.setup: dict[str, float] = {}  # peer: the warm-up's wall time

    def record(self, job: Job, seconds: float) -> None:
        if job.repetition < 0:
            self.setup[job.peer] = seconds
        else:
            self.seconds[(job.series, job.pattern)] = seconds

    def expect(self, job: Job, calls: int) -> float:
        for key in ((job.series, job.pattern), (job.peer, job.pattern)):
            if key in self.seconds:
                return self.seconds[key] * 1.2 + 2
        # Nothing of its kind yet: its startup, then every call at 1 GB/s.
        return self.setup.get(job.peer, 10.0) + calls * self.nbytes / h.GB + 2


def record_of(job: Job, calls: int, nbytes: int, result: dict[str, Any]) -> dict[str, Any]:
    """A sequence as the report holds it."""
    return {
        "peer": job.peer,
        "cache": "learned" if job.learned else "fresh",
        "series": job.series,
        "pattern": job.pattern,
        "repetition": job.repetition,
        "calls": calls,
        "GBps": [h.rate(nbytes, s) for s in result.get("seconds", [])],
        "seconds": result.get("seconds", []),
        "gc": result.get("gc", []),
        "page_cache": result.get("page_cache", []),  # what was done before each call
        "setup_seconds": result.get("setup_seconds"),
        "forced_tool": result.get("forced_tool"),  # ARRAYIO_TOOL in the sequence's process
        "second_pass": result.get("second_pass"),  # ARRAYIO_SECOND_PASS, the same way
        "process_seconds": result.get("process_seconds"),
        "cache_files_at_start": result.get("cache_files_at_start", []),
        "check": result.get("check"),
        "checked_call": result.get("checked_call"),  # whose bytes were checked (--check-call)
        "error": result.get("error"),
        "failed_at": result.get("failed_at"),
        "traceback": result.get("traceback"),
        # arrayio.explain() after the calls: which tools each context's calls ran on.
        "dispatcher": result.get("dispatcher"),
        # arrayio into JAX on a GPU: per call, outputs from the pool and newly allocated.
        "pool": result.get("pool"),
        # arrayio: per call, what its dispatcher was doing in the background as it began.
        "background": result.get("background"),
        # arrayio: per call, its load's stages (arrayio.runtime._stages), seconds each.
        "stages": result.get("stages"),
        # arrayio: per call, when it began (seconds after call 1 began); and the set-ups its
        # dispatcher ran in the background (Policy.set_ups), each one's start the same way.
        "began": result.get("began"),
        "set_ups": result.get("set_ups"),
        # Calls made before the sequence's calls took --call-budget seconds, or None.
        "cut_after": result.get("cut_after"),
    }


class Rounds:
    """The measured sequences: the warm-up, then ``repeats`` repetitions of every pattern,
    each pattern's sequences in a shuffled order with one sample of its ceiling. What would
    not end by ``deadline`` is skipped and recorded; a peer that fails is not run again."""

    def __init__(
        self,
        runner: Runner,
        ceilings: h.DiskCeilings,
        calls: dict[str, int],
        deadline: h.Deadline,
        report: dict[str, Any],
    ) -> None:
        self.runner = runner
        self.ceilings = ceilings
        self.calls = calls
        self.deadline = deadline
        self.report = report
        self.nbytes = report["file"]["bytes"]
        self.predictor = Predictor(self.nbytes)
        self.failed: set[str] = set()

    def warm_up(self, peers: list[str]) -> list[str]:
        """An untimed sequence of one warm call per peer; return the peers that passed. The
        others are reported unavailable, with the stage that failed and why."""
        passed = []
        for peer in peers:
            job = Job(peer, "warm", -1)
            result = self.runner.run(job, 1, self.deadline)
            self.predictor.record(job, result["process_seconds"])
            self.report["warm_up"][peer] = {
                k: result.get(k) for k in ("process_seconds", "setup_seconds", "check", "error")
            }
            self.report["peers"][peer]["versions"] = result.get("versions", {})
            if result.get("error"):
                reason = f"{result.get('failed_at')}: {result['error']}"
                self.report["peers_unavailable"][peer] = reason
                print(f"  warm-up {peer}: {result['error']}", flush=True)
            else:
                passed.append(peer)
        return passed

    def run(self, peers: list[str], learned: list[str], repeats: int, out_json: str) -> None:
        """Every repetition, the report rewritten after every pattern."""
        rng = random.Random(self.report["seed"])
        for repetition in range(repeats):
            patterns = list(self.calls)
            rng.shuffle(patterns)
            for pattern in patterns:
                jobs: list[Job | None] = [Job(p, pattern, repetition) for p in peers]
                jobs += [Job(p, pattern, repetition, learned=True) for p in learned]
                self.phase(phase_order([*jobs, None], rng), pattern, repetition)
                self.report["ceilings"] = self.ceilings.report()
                summarize(self.report)
                h.write_json(self.report, out_json)

    def phase(self, order: list[Job | None], pattern: str, repetition: int) -> None:
        """One pattern of one repetition: ``order``'s sequences (None: the ceiling)."""
        self.report["orders"].append(
            {
                "repetition": repetition,
                "pattern": pattern,
                "order": [j.series if j else "ceiling" for j in order],
            }
        )
        fresh_ran: set[str] = set()
        for job in order:
            if job is None:
                self.sample_ceiling(pattern, repetition)
                continue
            if job.peer in self.failed:
                continue
            late = not self.deadline.allows(self.predictor.expect(job, self.calls[pattern]))
            if late or (job.learned and job.peer not in fresh_ran):  # or its fresh one was
                self.report["skipped_for_time"].append(
                    {"series": job.series, "pattern": pattern, "repetition": repetition}
                )
            elif self.sequence(job) and not job.learned:
                fresh_ran.add(job.peer)

    def sequence(self, job: Job) -> bool:
        """Run ``job`` and record it; return whether it passed."""
        calls = self.calls[job.pattern]
        result = self.runner.run(job, calls, self.deadline)
        self.predictor.record(job, result["process_seconds"])
        record = record_of(job, calls, self.nbytes, result)
        self.report["peers"][job.peer].setdefault("versions", result.get("versions", {}))
        self.report["sequences"].append(record)
        print_sequence(record)
        if record["error"]:
            self.failed.add(job.peer)
            self.report["peers"][job.peer]["error"] = f"{record['failed_at']}: {record['error']}"
        return not record["error"]

    def sample_ceiling(self, pattern: str, repetition: int) -> None:
        """One sample of each of ``pattern``'s ceilings; the cold one reads the safetensors
        file."""
        for name in CEILINGS_OF[pattern]:
            limit = self.ceilings.limits.get(name)
            if limit is None or limit.tool is None:
                continue
            cold_file = self.runner.files["safetensors"] if name == "cold_read" else None
            self.ceilings.sample(name, cold_file)
            self.report["ceiling_samples"].append(
                {
                    "ceiling": name,
                    "pattern": pattern,
                    "repetition": repetition,
                    "GBps": h.rate(self.ceilings.nbytes, limit.samples[-1]),
                    "file": limit.files[-1],
                }
            )


# ------------------------------------------------------------------ summaries


def series_of(report: dict[str, Any]) -> list[str]:
    """Every series measured, in the order of the peers, each learned one after its fresh."""
    measured = {s["series"] for s in report["sequences"]}
    out = []
    for peer in report["peers"]:
        out += [name for name in (peer, f"{peer} (learned)") if name in measured]
    return out


def samples(report: dict[str, Any], pattern: str, series: str) -> list[list[float]]:
    """The GB/s of every call of every sequence that passed, one list per repetition."""
    return [
        s["GBps"]
        for s in report["sequences"]
        if s["pattern"] == pattern and s["series"] == series and not s["error"]
    ]


def per_call_medians(rows: list[list[float]]) -> list[float | None]:
    calls = max((len(r) for r in rows), default=0)
    return [h.median([r[i] for r in rows if len(r) > i]) for i in range(calls)]


def column_median(rows: list[list[float]], first: int, last: int | None) -> float | None:
    return h.median([v for r in rows for v in r[first - 1 : last]])


# A load's stages that no other holds (see arrayio.runtime._stages: "making tools" and the GPU
# checksums' wait happen inside the transfers); what the load took beyond them is "elsewhere".
TOP_STAGES = ("open", "target", "allocate", "transfers", "finish", "results")
STAGE_COLUMNS = (("call 1", 1, 1), ("call 2", 2, 2), ("later", 3, None))


def stage_medians(report: dict[str, Any], pattern: str, series: str) -> dict[str, Any]:
    """Per column of :data:`STAGE_COLUMNS`, the median milliseconds of each stage of the
    series' loads (every stage any of them had, and ``load`` and ``elsewhere``); empty for a
    series without stage records (the peers, or an arrayio run before they existed)."""
    calls: dict[str, list[dict[str, float]]] = {col: [] for col, _, _ in STAGE_COLUMNS}
    for run in report["sequences"]:
        if run["pattern"] != pattern or run["series"] != series or run["error"]:
            continue
        for number, record in enumerate(run.get("stages") or [], start=1):
            if not record or record.get("seconds") is None:
                continue
            stages = dict(record["stages"])
            stages["load"] = record["seconds"]
            stages["elsewhere"] = record["seconds"] - sum(
                stages.get(name, 0.0) for name in TOP_STAGES
            )
            for col, first, last in STAGE_COLUMNS:
                if first <= number and (last is None or number <= last):
                    calls[col].append(stages)
    out: dict[str, Any] = {}
    for col, records in calls.items():
        if records:
            names = dict.fromkeys(name for r in records for name in r)
            out[col] = {n: 1e3 * h.median([r.get(n, 0.0) for r in records]) for n in names}
    return out


def stage_medians_text(medians: dict[str, Any]) -> list[str]:
    """Lines for a series' :func:`stage_medians`, one per column."""
    lines = []
    for col, ms in medians.items():
        inner = [n for n in ms if n not in (*TOP_STAGES, "load", "elsewhere")]
        parts = [f"{n} {ms[n]:.1f}" for n in TOP_STAGES if n in ms]
        parts += [f"({n} {ms[n]:.1f})" for n in inner]
        lines.append(
            f"    {col}: load {ms['load']:.1f} ms: "
            + ", ".join(parts)
            + f", elsewhere {ms['elsewhere']:.1f}"
        )
    return lines


def set_up_medians(report: dict[str, Any], pattern: str, series: str) -> dict[str, Any]:
    """Per arm the series' sequences set up in the background (and whom for): how many
    did, and the medians of its seconds, of each of its steps' seconds, and of the call it
    began in (the last call begun by then, 1 for one begun before call 1 ended)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for run in report["sequences"]:
        if run["pattern"] != pattern or run["series"] != series or run["error"]:
            continue
        starts = run.get("began") or []
        for record in run.get("set_ups") or []:
            if record.get("seconds") is None:
                continue
            call = sum(1 for start in starts if start <= record["began"]) or 1
            found.setdefault(f"{record['arm']} for the {record['for']}", []).append(
                dict(record, call=call)
            )
    out: dict[str, Any] = {}
    for name, records in found.items():
        steps = dict.fromkeys(step for r in records for step in r["steps"])
        out[name] = {
            "sequences": len(records),
            "seconds": h.median([r["seconds"] for r in records]),
            "steps": {
                step: h.median([r["steps"].get(step, 0.0) for r in records]) for step in steps
            },
            "call": h.median([r["call"] for r in records]),
        }
    return out


def set_up_text(medians: dict[str, Any]) -> list[str]:
    """Lines for a series' :func:`set_up_medians`, one per arm."""
    lines = []
    for name, m in medians.items():
        steps = ", ".join(f"{step} {1e3 * s:.1f}" for step, s in m["steps"].items())
        lines.append(
            f"    set up {name}: {1e3 * m['seconds']:.1f} ms"
            + (f" ({steps})" if steps else "")
            + f", began in call {m['call']:g} (medians of {m['sequences']})"
        )
    return lines


def per_series(
    report: dict[str, Any], medians: Callable[[dict[str, Any], str, str], dict[str, Any]]
) -> dict[str, Any]:
    """Per pattern, ``medians(report, pattern, series)`` of each series that has any."""
    return {
        pattern: {
            name: found for name in series_of(report) if (found := medians(report, pattern, name))
        }
        for pattern in report["patterns"]
    }


def summarize(report: dict[str, Any]) -> None:
    """Fill the report's medians per call number and its table: per pattern and series,
    each column's median and its ratio to the best series' in that column."""
    medians: dict[str, Any] = {}
    table: dict[str, Any] = {}
    for pattern in report["patterns"]:
        rows = {name: samples(report, pattern, name) for name in series_of(report)}
        rows = {name: r for name, r in rows.items() if r}
        medians[pattern] = {name: per_call_medians(r) for name, r in rows.items()}
        values = {
            name: {col: column_median(r, first, last) for col, first, last in COLUMNS}
            for name, r in rows.items()
        }
        best = {
            col: max((v[col] for v in values.values() if v[col] is not None), default=None)
            for col, _, _ in COLUMNS
        }
        table[pattern] = {
            name: {
                col: {"GBps": v[col], "ratio_to_best": h.ratio(v[col], best[col])}
                for col, _, _ in COLUMNS
            }
            for name, v in values.items()
        }
        table[pattern]["best"] = best
    report["medians_GBps"] = medians
    report["table"] = table
    report["stage_medians_ms"] = per_series(report, stage_medians)
    report["set_up_medians"] = per_series(report, set_up_medians)
    ceilings = report["ceilings"]
    report["ceilings_GBps"] = {n: ceilings[n]["GBps"] for n in CEILING_TEXT if n in ceilings}


def print_sequence(record: dict[str, Any]) -> None:
    figures = " ".join(f"{v:.2f}" for v in record["GBps"])
    tail = f"  ERROR at {record['failed_at']}: {record['error']}" if record["error"] else ""
    print(
        f"  {record['pattern']:10s} rep {record['repetition'] + 1} {record['series']:30s} "
        f"{figures} GB/s{tail}",
        flush=True,
    )


def table_text(report: dict[str, Any]) -> str:
    """The text table: per pattern, each column's median GB/s and its ratio to the best."""
    lines = []
    ceilings = report.get("ceilings_GBps", {})
    for pattern in report["patterns"]:
        rows = report["table"].get(pattern, {})
        shown = "; ".join(
            f"{CEILING_TEXT[name]} ceiling "
            f"{'n/a' if ceilings.get(name) is None else f'{ceilings[name]:.2f}'} GB/s"
            for name in CEILINGS_OF[pattern]
        )
        lines.append(
            f"\n{pattern}: {report['patterns'][pattern]['calls']} calls, "
            f"{PATTERN_TEXT[pattern]}; {shown}"
        )
        lines.append(
            f"  {'GB/s (ratio to the best)':30s}" + "".join(f"{c:>16s}" for c, _, _ in COLUMNS)
        )
        for name, row in rows.items():
            if name == "best":
                continue
            cells = []
            for col, _, _ in COLUMNS:
                cell = row[col]
                cells.append(
                    "-"
                    if cell["GBps"] is None
                    else f"{cell['GBps']:.2f} ({cell['ratio_to_best']:.2f})"
                )
            lines.append(f"  {name:30s}" + "".join(f"{c:>16s}" for c in cells))
        staged = report.get("stage_medians_ms", {}).get(pattern, {})
        if staged:
            lines.append(
                "  where arrayio's loads spent their time (medians; in brackets, inside"
                " the transfers)"
            )
        set_ups = report.get("set_up_medians", {}).get(pattern, {})
        for name in dict.fromkeys([*staged, *set_ups]):
            lines.append(f"  {name}")
            lines += stage_medians_text(staged.get(name, {}))
            lines += set_up_text(set_ups.get(name, {}))
    return "\n".join(lines)


# ------------------------------------------------------------------ plot


def repetitions_text(report: dict[str, Any]) -> str:
    """How many repetitions the medians are of, as they ran (a deadline can cut them short)."""
    counts = collections.Counter(
        (sequence["pattern"], sequence["series"]) for sequence in report.get("sequences", [])
    )
    ran = sorted(set(counts.values()))
    if not ran or ran == [report["repeats"]]:
        return f"medians of {report['repeats']} repetitions"
    return (
        f"medians of {ran[0]} to {ran[-1]} repetitions ({report['repeats']} asked; the "
        "deadline cut the rest)"
    )


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    patterns = list(report["patterns"])
    fig, axes = plt.subplots(1, len(patterns), figsize=(6 * len(patterns), 5.6), squeeze=False)
    names = series_of(report)
    colors = {peer: f"C{i}" for i, peer in enumerate(report["peers"])}
    ceilings = report.get("ceilings_GBps", {})
    for ax, pattern in zip(axes[0], patterns, strict=True):
        for name in names:
            medians = report["medians_GBps"].get(pattern, {}).get(name)
            if not medians:
                continue
            peer = name.removesuffix(" (learned)")
            ax.plot(
                range(1, len(medians) + 1),
                medians,
                marker="o",
                markersize=3,
                color=colors[peer],
                linestyle="--" if name != peer else "-",
                label=name,
            )
        shown = CEILINGS_OF[pattern]
        if pattern == "cold_start":  # the page cache its reloads reach, too
            shown = ("warm_read", *shown)
        for ceiling in shown:
            value = ceilings.get(ceiling)
            if value:
                ax.axhline(value, color="black", linestyle=":", linewidth=1)
                ax.annotate(
                    f"{CEILING_TEXT[ceiling]} ceiling {value:.1f}",
                    (1, value),
                    fontsize=7,
                    va="bottom",
                )
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("call number (in one fresh process)")
        ax.set_ylabel("GB/s")
        ax.set_title(
            f"{pattern}: {report['patterns'][pattern]['calls']} calls, {PATTERN_TEXT[pattern]}",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    size = report["file"]["bytes"] / 1e9
    fig.suptitle(
        f"First calls: GB/s per call, each sequence in a fresh process\n{size:.3g} GB bfloat16 "
        f"state dict; {repetitions_text(report)}\n{report['date'][:10]}, "
        f"{report['machine']['summary']}; dotted: ceilings sampled in the same run",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), or None without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def names_option(value: str | None, known: dict[str, Any], parser: Any, what: str) -> list[str]:
    names = [n for n in (value or "").split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    h.common_arguments(parser)
    parser.add_argument("--gib", type=float, default=1.5, help="the state dict's size, GiB")
    parser.add_argument(
        "--patterns",
        type=lambda value: [p.strip() for p in value.split(",") if p.strip()],
        default=list(PATTERNS),
        help=f"the patterns to run, of {','.join(PATTERNS)} (default: all)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--peers", help="comma-separated (default: every peer for the device)")
    parser.add_argument(
        "--learned",
        help="arrayio front doors also measured with a learned cache dir, comma-separated, "
        "or 'none' (default: every arrayio peer measured)",
    )
    parser.add_argument("--warm-calls", type=int, default=12)
    parser.add_argument("--reloads", type=int, default=6, help="calls after the cold start")
    parser.add_argument("--cold-calls", type=int, default=6)
    parser.add_argument(
        "--call-budget",
        type=float,
        default=None,
        help="seconds of calls after which a sequence makes no more (a slow peer's later "
        "calls, to fit every peer into one run; the report says where each was cut)",
    )
    parser.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="seconds each sequence waits after each call's check (a program's own work "
        "between its loads; default none: back to back)",
    )
    parser.add_argument(
        "--check-call",
        type=int,
        default=1,
        help="the call whose results' bytes are checked (a few tensors' CRC-32, read back to "
        "the host; every call's keys, shapes, dtypes and device are checked). Reading JAX "
        "arrays back slows JAX's next load: a later call keeps that out of calls 1 and 2. "
        "A sequence with fewer calls, or cut short by --call-budget, checks its last",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="wall-clock time (seconds since the epoch) to finish by",
    )
    parser.add_argument("--seed", default=None, help="the rounds' shuffle (default: a new one)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    parser.add_argument(
        "--no-precompile",
        dest="precompile",
        action="store_false",
        help="do not compile arrayio's and the loaders' bytecode first",
    )
    parser.add_argument("--sequence-timeout", type=float, default=300.0)
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's)")
    args = parser.parse_args(argv)
    unknown = [p for p in args.patterns if p not in PATTERNS]
    if unknown or not args.patterns:
        parser.error(f"--patterns takes some of {', '.join(PATTERNS)}, got {args.patterns}")
    if args.smoke:
        args.device, args.gib, args.d_model, args.vocab, args.repeats = "cpu", 0.004, 128, 1024, 1
        args.warm_calls, args.reloads, args.cold_calls = 2, 1, 2
        args.precompile = False
        args.peers = args.peers or ",".join(SMOKE_PEERS)
        args.learned = args.learned or ",".join(SMOKE_LEARNED)
    return args, parser


def select_peers(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[str], dict[str, str], list[str]]:
    """The peers to measure, those unavailable (and why), and the learned front doors."""
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    wanted = names_option(args.peers, PEERS, parser, "peers") or list(DEFAULT_PEERS[kind])
    peers, unavailable = choose_peers(wanted, args.device)
    front_doors = {p: None for p in peers if PEERS[p].learns}
    if args.learned == "none":
        return peers, unavailable, []
    learned = names_option(args.learned, front_doors, parser, "learned (measured arrayio peers)")
    return peers, unavailable, learned or list(front_doors)


def new_report(
    args: argparse.Namespace,
    argv: list[str] | None,
    peers: list[str],
    unavailable: dict[str, str],
    learned: list[str],
) -> dict[str, Any]:
    report = h.header("first-calls", "benchmarks.first_calls", argv)
    report.update(
        commit=args.commit or commit(),
        device=args.device,
        smoke=args.smoke,
        repeats=args.repeats,
        drop_caches=args.drop_caches,
        gap_seconds=args.gap,
        call_budget_seconds=args.call_budget,
        check_call=args.check_call,
        root=os.geteuid() == 0,
        seed=args.seed or secrets.token_hex(4),
        warm_passes=h.WARM_PASSES,
        patterns={p: {"calls": n, "cache": PATTERN_TEXT[p]} for p, n in calls_of(args).items()},
        arrayio_environment={k: v for k, v in os.environ.items() if k.startswith("ARRAYIO_")},
        peers={p: {"note": PEERS[p].note, "reads": PEERS[p].reads} for p in peers},
        peers_unavailable=unavailable,
        learned=learned,
        warm_up={},
        sequences=[],
        orders=[],
        ceiling_samples=[],
        skipped_for_time=[],
    )
    return report


def make_file(
    args: argparse.Namespace, directory: str, report: dict[str, Any]
) -> tuple[dict[str, str], dict[str, Any]]:
    """Write the state dict's two files into ``directory`` and describe them in the
    report; return their paths and what every call must return."""
    entries = layout(int(args.gib * (1 << 30)), args.d_model, args.vocab)
    state = make_state(entries)
    sizes = [t.numel() * t.element_size() for t in state.values()]
    files = write_files(state, directory)
    expected = expected_of(state)
    report["file"] = {
        "gib": args.gib,
        "bytes": sum(sizes),
        "tensors": len(sizes),
        "layers": sum(1 for name, _ in entries if name.endswith("q_proj.weight")),
        "d_model": args.d_model,
        "vocab": args.vocab,
        "dtype": "bfloat16",
        "smallest_bytes": min(sizes),
        "largest_bytes": max(sizes),
        "file_bytes": {writer: os.path.getsize(path) for writer, path in files.items()},
        "checked_tensors": list(expected["crc32"]),
    }
    return files, expected


def precompile(peers: list[str]) -> list[str]:
    """Compile the bytecode of arrayio and of every peer's modules, so that no sequence
    compiles Python source inside a timed call, as none would where the packages were
    installed (pip writes the bytecode; a machine with ``PYTHONDONTWRITEBYTECODE`` set would
    otherwise compile them again in every fresh process). Returns the directories
    compiled."""
    import compileall

    names = {"arrayio", "benchmarks", "kvikio", "cuda"}  # cuda: KvikIO's cuda.pathfinder
    for peer in peers:
        names.update(module.split(".")[0] for module in PEERS[peer].modules)
    names -= FRAMEWORKS  # imported before call 1, untimed; and large
    compiled = []
    for name in sorted(names):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            if os.access(location, os.W_OK):
                compileall.compile_dir(location, quiet=1, workers=os.cpu_count() or 1)
                compiled.append(location)
    return compiled


def measure(
    args: argparse.Namespace,
    report: dict[str, Any],
    peers: list[str],
    learned: list[str],
    out_json: str,
) -> None:
    """The file, the ceilings' search, the warm-up and the rounds, in a scratch directory
    removed at the end."""
    started = time.time()
    if args.precompile:
        report["precompiled"] = precompile(peers)
    directory = tempfile.mkdtemp(prefix="arrayio-first-calls-", dir=args.dir)
    ceilings = None
    try:
        files, expected = make_file(args, directory, report)
        report["machine"] = h.machine()
        ceiling_names = ["cold_read", "warm_read"]
        ceiling_names += [name for pattern in args.patterns for name in CEILINGS_OF[pattern]]
        ceilings = h.DiskCeilings(
            directory,
            os.path.getsize(files["safetensors"]),
            drop=args.drop_caches,
            limits=tuple(dict.fromkeys(ceiling_names)),
        )
        report["ceiling_search_seconds"], _ = h.timed(ceilings.search)
        report["ceilings"] = ceilings.report()
        runner = Runner(
            directory,
            files,
            expected,
            device=args.device,
            drop_caches=args.drop_caches,
            timeout=args.sequence_timeout,
            gap=args.gap,
            call_budget=args.call_budget,
            check_call=args.check_call,
        )
        rounds = Rounds(runner, ceilings, calls_of(args), h.Deadline(args.deadline), report)
        if args.warm_up:
            peers = rounds.warm_up(peers)
            learned = [p for p in learned if p in peers]
        h.write_json(report, out_json)
        rounds.run(peers, learned, args.repeats, out_json)
        report["ceilings"] = ceilings.report()
        summarize(report)
        report["seconds"] = time.time() - started
        h.write_json(report, out_json)
    finally:
        if ceilings is not None:
            ceilings.close()
        h.remove(directory)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args, parser = parse(argv)
    if args.replot:
        h.replot(plot, args.replot)
        return None
    if not args.out:
        parser.error("--out is required")
    peers, unavailable, learned = select_peers(args, parser)
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "first_calls.json")
    report = new_report(args, argv, peers, unavailable, learned)
    measure(args, report, peers, learned, out_json)
    print(table_text(report), flush=True)
    for name, reason in report["peers_unavailable"].items():
        print(f"  unavailable: {name}: {reason}", flush=True)
    if report["skipped_for_time"]:
        print(f"  skipped for time: {len(report['skipped_for_time'])} sequences", flush=True)
    h.try_plot(plot, report, os.path.join(args.out, "first_calls.png"))
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
