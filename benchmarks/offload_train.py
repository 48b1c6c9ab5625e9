"""Training with activations offloaded to NVMe (``arrayio.Offloader``), in torch and JAX.

``python -m benchmarks.offload_train --out DIR [--budget-gib 4] [--framework torch,jax]``
``python -m benchmarks.offload_train --smoke --out DIR``  (tiny, on the CPU, for CI)

The model is a stack of residual MLP blocks (``x + W2 gelu(W1 x)``, hidden width 4x), in
bfloat16, trained with plain SGD (no optimizer state), on batches of ``B`` token vectors:
what a transformer's feed-forward layers do, with their large activations.

* **torch**: :func:`arrayio.offload.activations` around the forward and backward pass
  (every saved tensor of 64 KiB or more goes through the offloader).
* **JAX**: one jitted forward stage per block returning its residuals (the block's input
  and the pre-activation ``h = W1 x``; the GELU is recomputed in the jitted backward stage),
  which are offloaded between stages (the pattern of ``examples/jax_offload.py``, with
  explicit residuals rather than a recomputed stage). The baseline is the same staged loop
  with the residuals kept in memory (not ``jax.grad`` of the whole model, whose program XLA
  optimises as a whole).

What is measured, against a GPU memory budget ``--budget-gib`` (enforced, not estimated):
torch runs under ``torch.cuda.set_per_process_memory_fraction(budget / total)``, JAX in
subprocesses with ``XLA_PYTHON_CLIENT_MEM_FRACTION = budget / total`` (preallocated), so a
step that needs more raises an out-of-memory error. Peaks come from the frameworks' own
statistics (``torch.cuda.max_memory_allocated``, JAX's ``peak_bytes_in_use``; JAX cannot
reset its peak, so each JAX configuration that must be told apart runs in its own process,
batch sizes ascending).

1. **Largest batch** that runs, without offloading and with it, over a grid of batch sizes.
   With offloading, the offloader's budget for batch ``B`` is the memory budget minus what
   the step needs besides the offloadable activations (measured, without offloading, at
   the batches that fit, and extrapolated linearly in ``B``), minus a margin for the
   activations of one block in use during backward; on an out-of-memory error it is halved
   once. The search stops at ``--max-batch`` or when the time limit is near: a largest batch
   marked ``capped`` is a lower bound.
2. **Step-time overhead** at the largest batch that fits in memory: median step time with
   offloading (offloader budget a fraction of the activations, ``--keep-fractions``) over
   the median without; also with the hooks and no I/O (budget larger than everything).
3. **Peak reduction** at that batch: 1 - peak with offloading / peak without.
4. **Planned modes** (``--modes max_overhead=0.1,budget=0.3``) at that batch (JAX: the largest
   whose plain peak is under 0.95 of the budget, see ``run_jax``): a plain
   step recorded by :func:`arrayio.offload.plan_step` (JAX: by
   :func:`arrayio.offload.plan_array_step`, in a process of its own without the memory
   limit), the offloader's links measured (the host tier's with ``--host-budget-gib``; none
   on the CPU), a spill plan made within the overhead, or within a device budget given as a
   fraction of the activations, and steps run under it (``activations(plan=...)``; JAX:
   ``array_step``, in another process, under the limit). Per mode: peak device memory, median step,
   the plain step timed in the same run, the predicted step, the roofline (each tier's bytes
   over its rate measured in the same run, against the compute), bytes per tier, and the
   planned step's gradients against the plain ones, beside the plain steps' own
   step-to-step difference.
5. **The largest batch a plan trains** (where ``--modes`` asks for planned modes):
   each batch above the largest that fits without offloading, under a plan that meets the
   memory budget (the budget less the step's other memory, as in 1), recorded from a plain
   step run without the memory limit, then run under it. Its overhead over that plain step
   says whether the larger batch pays (the issue's bound: 10%).

One more row is an experiment, not arrayio's behaviour: the same offloaded run with the
dispatcher's per-write flush (``sync_file_range``, which makes every write durable before it
is timed) replaced by a no-op, so that the page cache absorbs the spills. Activations are
scratch data: this shows what a non-durable write path would give.

Results go to ``DIR/offload_train.json``, written after every measurement, and the planned
rows' steps beside their predictions and rooflines to ``DIR/offload_train.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

import arrayio

GiB = 1 << 30
MiB = 1 << 20
# JAX's planned modes run at the largest batch whose plain peak is under this share of the
# memory budget (see run_jax).
JAX_PLANNED_PEAK = 0.95
DEFAULT_BATCHES = [1024, 2048, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536]


@dataclasses.dataclass
class Config:
    width: int
    depth: int
    budget: int
    steps: int
    batches: list[int]
    max_batch: int
    keep_fractions: list[float]
    scratch: str
    deadline: float
    device: str
    smoke: bool
    min_bytes: int = 64 << 10
    prefetch: int = 2
    writeback_fraction: float | None = None  # None: the offloader's default
    # Planned modes: ("max_overhead", 0.1) or ("budget", fraction of the activations).
    modes: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    host_budget: int = 0
    warn_above: float = 2.0


def _parse_modes(text: str) -> list[tuple[str, float]]:
    """``"max_overhead=0.1,budget=0.3"`` as ``[("max_overhead", 0.1), ("budget", 0.3)]``."""
    modes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in ("max_overhead", "budget") or not value:
            raise ValueError(f"a mode is max_overhead=FRACTION or budget=FRACTION, got {item!r}")
        modes.append((name, float(value)))
    return modes


def _finite(value: float) -> float | None:
    """JSON has no infinity: a link that costs nothing is written as null."""
    return value if math.isfinite(value) else None


def _stats(off: arrayio.Offloader | None) -> dict[str, int] | None:
    return None if off is None else dataclasses.asdict(off.stats())


@contextlib.contextmanager
def _no_flush() -> Any:
    """The experiment: the dispatcher's per-write flush, and the writeback each buffered
    piece starts as it is written, replaced by no-ops (so the page cache absorbs the
    spills)."""
    from arrayio.dispatch import batches
    from arrayio.tools import _io

    real, started = batches.flush_range, _io.start_writeback
    batches.flush_range = lambda fd, offset, nbytes: None
    _io.start_writeback = lambda fd, offset, nbytes: None
    try:
        yield
    finally:
        batches.flush_range, _io.start_writeback = real, started


def _did_not_fit(row: dict[str, Any], error: BaseException) -> None:
    row["fits"] = False
    row["error"] = str(error).splitlines()[0][:200]


def _offload_budget(cfg: Config, line: tuple[float, float], per_token: float, tokens: int) -> int:
    """The offloader's budget for a batch of ``tokens`` (see (1)): the memory budget less
    the step's other memory (``line``: its fit, bytes at 0 and per token) and a margin for
    one block's activations in use during backward."""
    working = line[0] + line[1] * tokens
    margin = per_token * tokens / cfg.depth + 64 * MiB
    return int(cfg.budget - working - margin)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` (a constant through one point)."""
    if len(points) == 1:
        return float(points[0][1]), 0.0
    xs, ys = zip(*points, strict=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


# --------------------------------------------------------------------------- torch


def _torch_model(torch: Any, cfg: Config) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
            self.down = nn.Linear(4 * cfg.width, cfg.width, bias=False)

        def forward(self, x: Any) -> Any:
            return x + self.down(nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(cfg.depth)])
    with torch.no_grad():
        for block in model:
            block.down.weight.mul_(1 / math.sqrt(cfg.depth))
    dtype = torch.float32 if cfg.smoke else torch.bfloat16
    return model.to(device=cfg.device, dtype=dtype)


class _TorchRunner:
    def __init__(self, cfg: Config) -> None:
        import torch

        self.torch = torch
        self.cfg = cfg
        self.cuda = cfg.device.startswith("cuda")
        self.model = _torch_model(torch, cfg)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-6)
        if self.cuda:
            self.total = torch.cuda.get_device_properties(0).total_memory
            self.limit_memory(True)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def batch(self, tokens: int) -> Any:
        generator = self.torch.Generator(device=self.cfg.device).manual_seed(tokens)
        return self.torch.randn(
            tokens,
            self.cfg.width,
            device=self.cfg.device,
            dtype=next(self.model.parameters()).dtype,
            generator=generator,
        )

    def step(
        self,
        x: Any,
        off: arrayio.Offloader | None = None,
        *,
        plan: Any = None,
        update: bool = True,
    ) -> float:
        self.opt.zero_grad(set_to_none=True)
        hooks = (
            arrayio.offload.activations(
                off, min_bytes=self.cfg.min_bytes, prefetch=self.cfg.prefetch, plan=plan
            )
            if off is not None
            else contextlib.nullcontext()
        )
        with hooks:
            loss = self.model(x).float().pow(2).mean()
            loss.backward()
        if update:
            self.opt.step()
        return float(loss.detach())

    def gradients(self) -> list[Any]:
        """The step's gradients, copied to the host (the device has no room to spare)."""
        return [p.grad.detach().to("cpu", copy=True) for p in self.model.parameters()]

    def distance(self, grads: list[Any], reference: list[Any]) -> float:
        """``||grads - reference|| / ||reference||`` over every parameter, in float32 (on
        the device, a parameter at a time)."""
        device = self.cfg.device
        diff = norm = 0.0
        for g, r in zip(grads, reference, strict=True):
            g, r = g.to(device).float(), r.to(device).float()
            diff += float((g - r).pow(2).sum())
            norm += float(r.pow(2).sum())
        return math.sqrt(diff / norm) if norm else math.sqrt(diff)

    def timed_steps(self, x: Any, steps: int, off: Any = None, plan: Any = None) -> list[float]:
        times = []
        for _ in range(steps):
            self.sync()
            start = time.perf_counter()
            self.step(x, off, plan=plan)
            self.sync()
            times.append(time.perf_counter() - start)
        return times

    def limit_memory(self, limited: bool) -> None:
        """Hold the process to the memory budget (the default), or lift the limit."""
        if self.cuda:
            self.torch.cuda.empty_cache()
            fraction = min(1.0, self.cfg.budget / self.total) if limited else 1.0
            self.torch.cuda.set_per_process_memory_fraction(fraction)

    def measure_planned(
        self,
        tokens: int,
        mode: str,
        value: float,
        activations: int,
        *,
        steps: int,
        record_unlimited: bool = False,
    ) -> dict[str, Any]:
        """Plain steps, a plain step recorded and planned from, then the planned steps; see
        the module docstring (4). With ``record_unlimited`` (a batch too large for the
        budget without offloading, see (5)), the plain steps and the recording run without
        the memory limit, and the planned steps under it."""
        torch, cfg = self.torch, self.cfg
        budget = int(value * activations) if mode == "budget" else None
        row: dict[str, Any] = {
            "mode": f"{mode}={value:g}",
            "batch_tokens": tokens,
            "device_budget_bytes": budget,
            "host_budget_bytes": cfg.host_budget,
            "recorded_without_the_limit": record_unlimited,
        }
        x = None
        try:
            if record_unlimited:
                self.limit_memory(False)
            x = self.batch(tokens)
            if self.cuda:
                torch.cuda.empty_cache()
            self.step(x)  # warm-up
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            plain = self.timed_steps(x, steps)
            row["plain_step_s"], row["plain_step_s_all"] = _median(plain), plain
            if self.cuda:
                row["plain_peak_bytes"] = torch.cuda.max_memory_allocated()
            kwargs: dict[str, Any] = (
                {"max_overhead": value} if budget is None else {"device_budget_bytes": budget}
            )
            with arrayio.Offloader(
                cfg.scratch,
                # The plan decides what leaves; the offloader's own budget only bounds what
                # it holds, the same bytes (never binding without a device budget).
                device_budget_bytes=budget if budget is not None else activations,
                host_budget_bytes=cfg.host_budget,
            ) as off:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", arrayio.offload.PlanWarning)
                    with arrayio.offload.plan_step(
                        off, warn_above=cfg.warn_above, min_bytes=cfg.min_bytes, **kwargs
                    ) as step_plan:
                        self.step(x, update=False)
                row["warnings"] = [str(w.message) for w in caught]
                # Gradients at the same parameters: the recorded plain step's, the first
                # planned step's; then a plain step after an update, for the plain steps'
                # own step-to-step difference.
                reference = self.gradients()
                self.step(x, off, plan=step_plan, update=False)
                planned = self.gradients()
                self.opt.step()
                self.step(x, update=False)
                row["grad_rel_diff"] = self.distance(planned, reference)
                row["plain_step_to_step_rel_diff"] = self.distance(self.gradients(), reference)
                row["grads_agree"] = row["grad_rel_diff"] <= row["plain_step_to_step_rel_diff"]
                del reference, planned
                self.opt.zero_grad(set_to_none=True)
                if record_unlimited:
                    self.limit_memory(True)
                if self.cuda:
                    torch.cuda.reset_peak_memory_stats()
                times = self.timed_steps(x, steps, off, step_plan)
                row["step_s"], row["step_s_all"] = _median(times), times
                if self.cuda:
                    row["peak_bytes"] = torch.cuda.max_memory_allocated()
                off.wait()
                explained = off.explain()
                row["offloader"] = _stats(off)
            row.update(_plan_fields(explained, step_plan.timeline))
            row["fits"] = True
        except torch.cuda.OutOfMemoryError as error:
            _did_not_fit(row, error)
        finally:
            del x
            self.release()
            if record_unlimited:
                self.limit_memory(True)
        _against_plain(row)
        return row

    def release(self) -> None:
        """Drop a row's gradients and the allocator's cached blocks before the next row."""
        self.opt.zero_grad(set_to_none=True)
        if self.cuda:
            self.torch.cuda.empty_cache()

    def measure(
        self, tokens: int, *, budget: int | None, steps: int, no_flush: bool = False
    ) -> dict[str, Any]:
        """Warm-up step, then ``steps`` timed steps; peak memory over all of them."""
        torch = self.torch
        row: dict[str, Any] = {
            "batch_tokens": tokens,
            "offload_budget_bytes": budget,
            "no_flush_experiment": no_flush,
        }
        x = self.batch(tokens)
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times: list[float] = []
        off = None
        try:
            with contextlib.ExitStack() as stack:
                if no_flush:
                    stack.enter_context(_no_flush())
                if budget is not None:
                    writeback = (
                        None
                        if self.cfg.writeback_fraction is None
                        else int(self.cfg.writeback_fraction * budget)
                    )
                    off = stack.enter_context(
                        arrayio.Offloader(
                            self.cfg.scratch, device_budget_bytes=budget, writeback_bytes=writeback
                        )
                    )
                for i in range(1 + steps):
                    self.sync()
                    start = time.perf_counter()
                    row["loss"] = self.step(x, off)
                    self.sync()
                    if i:
                        times.append(time.perf_counter() - start)
                row["offloader"] = _stats(off)
            row["fits"] = True
        except torch.cuda.OutOfMemoryError as error:
            _did_not_fit(row, error)
        finally:
            del x
            self.release()
        row["step_s"] = _median(times)
        row["step_s_all"] = times
        if self.cuda:
            row["peak_bytes"] = torch.cuda.max_memory_allocated()
        return row

    def activation_bytes(self, tokens: int) -> int:
        """Bytes the hooks would offload in one step (an offloader that never spills)."""
        cfg = self.cfg
        with arrayio.Offloader(cfg.scratch, device_budget_bytes=1 << 60) as off:
            x = self.batch(tokens)
            with arrayio.offload.activations(off, min_bytes=cfg.min_bytes):
                loss = self.model(x).float().pow(2).mean()
            held = off.stats().resident_bytes
            del loss, x
        return held


def run_torch(cfg: Config, report: dict[str, Any], save: Any) -> None:
    runner = _TorchRunner(cfg)
    torch = runner.torch
    section: dict[str, Any] = {
        "model": {
            "width": cfg.width,
            "depth": cfg.depth,
            "hidden": 4 * cfg.width,
            "dtype": str(next(runner.model.parameters()).dtype),
            "parameters": sum(p.numel() for p in runner.model.parameters()),
        },
        "memory_limit": "torch.cuda.set_per_process_memory_fraction" if runner.cuda else None,
        "search": {"memory": [], "offload": []},
    }
    report["torch"] = section
    runner.measure(cfg.batches[0], budget=None, steps=1)  # cuBLAS and allocator warm-up

    # 1a. Without offloading: ascending until a batch does not fit.
    fitting: list[dict[str, Any]] = []
    for tokens in cfg.batches:
        if time.monotonic() > cfg.deadline:
            break
        row = runner.measure(tokens, budget=None, steps=cfg.steps)
        row["activation_bytes"] = runner.activation_bytes(tokens) if row["fits"] else None
        section["search"]["memory"].append(row)
        save()
        print(
            f"torch memory  B={tokens}: fits={row['fits']} peak="
            f"{row.get('peak_bytes', 0) / GiB:.2f} GiB step={row['step_s']}",
            flush=True,
        )
        if not row["fits"]:
            break
        fitting.append(row)
    if not fitting:
        return
    largest_memory = fitting[-1]

    # 2 and 3. Overhead and peak reduction at the largest batch that fits.
    tokens = largest_memory["batch_tokens"]
    activations = largest_memory["activation_bytes"]
    fit: dict[str, Any] = {
        "batch_tokens": tokens,
        "activation_bytes": activations,
        "memory": largest_memory,
    }
    section["fit"] = fit
    fit["hooks_no_io"] = runner.measure(tokens, budget=1 << 60, steps=cfg.steps)
    fit["offload"], fit["offload_no_flush_experiment"] = [], []
    for keep in cfg.keep_fractions:
        for no_flush, rows in ((False, fit["offload"]), (True, fit["offload_no_flush_experiment"])):
            if time.monotonic() > cfg.deadline and rows:
                continue
            row = runner.measure(
                tokens, budget=int(keep * activations), steps=cfg.steps, no_flush=no_flush
            )
            row["keep_fraction"] = keep
            _compare(row, largest_memory)
            rows.append(row)
            save()
            print(
                f"torch offload B={tokens} keep={keep} no_flush={no_flush}: "
                f"step={row['step_s']} overhead={row.get('overhead')} "
                f"peak_reduction={row.get('peak_reduction')}",
                flush=True,
            )

    # 4. Planned modes at the same batch.
    fit["planned"] = []
    for mode, value in cfg.modes:
        if time.monotonic() > cfg.deadline and fit["planned"]:
            break
        try:
            row = runner.measure_planned(tokens, mode, value, activations, steps=cfg.steps)
        except Exception:  # noqa: BLE001 - recorded; the rows after it still run
            row = {"mode": f"{mode}={value:g}", "fits": False, "error": traceback.format_exc()}
            print(row["error"], file=sys.stderr, flush=True)
            if runner.cuda:
                torch.cuda.empty_cache()
        fit["planned"].append(row)
        save()
        print(
            f"torch planned B={tokens} {row['mode']}: step={row.get('step_s')} "
            f"plain={row.get('plain_step_s')} predicted={row.get('predicted_step_s')} "
            f"roofline={row.get('roofline_s')} bound={row.get('bound')} "
            f"peak_reduction={row.get('peak_reduction')} grads_agree={row.get('grads_agree')}",
            flush=True,
        )

    # 1b. With offloading: from the next batch up, while it fits.
    if runner.cuda:
        # Non-offloadable memory W(B) = peak - activations, fitted on the batches that fit.
        line = _fit_line(
            [(r["batch_tokens"], r["peak_bytes"] - r["activation_bytes"]) for r in fitting]
        )
        per_token = activations / tokens
        section["working_set_fit"] = {
            "bytes_at_0": line[0],
            "bytes_per_token": line[1],
            "activation_bytes_per_token": per_token,
        }
        largest_offload, capped = largest_memory["batch_tokens"], True
        for tokens in [b for b in cfg.batches if b > largest_memory["batch_tokens"]]:
            if tokens > cfg.max_batch or time.monotonic() > cfg.deadline:
                break
            budget = _offload_budget(cfg, line, per_token, tokens)
            row = None
            for attempt in range(2):
                if budget <= 0:
                    break
                row = runner.measure(tokens, budget=budget, steps=1)
                row["attempt"] = attempt
                row["activation_bytes"] = int(per_token * tokens)
                section["search"]["offload"].append(row)
                save()
                print(
                    f"torch offload B={tokens} budget={budget / GiB:.2f} GiB: "
                    f"fits={row['fits']} peak={row['peak_bytes'] / GiB:.2f} GiB "
                    f"step={row['step_s']}",
                    flush=True,
                )
                if row["fits"]:
                    break
                budget //= 2
            if row is None or not row["fits"]:
                capped = False
                break
            largest_offload = tokens
        section["largest_batch"] = {
            "memory": largest_memory["batch_tokens"],
            "offload": largest_offload,
            "offload_capped": capped,
        }
    if cfg.modes:
        _planned_batches(runner, cfg, section, fitting, save)
    del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PLANNED_OVERHEAD = 0.1  # the bound on the overhead of a larger batch
# The planned batches stop once a step runs this many times its plain step: past that the
# larger batches are only slower, and the run's time goes to them for nothing. Set high
# enough that a plan which moves every byte it planned (as the host tier's queued copies
# do) still runs the 4x batch.
PLANNED_STOP_RATIO = 8


def _planned_batches(
    runner: _TorchRunner,
    cfg: Config,
    section: dict[str, Any],
    fitting: list[dict[str, Any]],
    save: Any,
) -> None:
    """(5) The batches above the largest that fits without offloading, each run under a
    spill plan that meets the memory budget (``device_budget_bytes``: the budget less the
    step's other memory, as in (1b)), recorded from a plain step without the limit (the
    first planned step too, whose gradients are compared) and timed under it; ascending,
    until one does not fit, fails, or its step passes ``PLANNED_STOP_RATIO`` times the plain
    step's (the batches above it would only be slower); each row into
    ``section["fit"]["planned_batches"]`` as it is measured. Its overhead
    over the plain step at the same batch says whether the larger batch pays: the largest
    trainable batch within ``PLANNED_OVERHEAD`` is the issue's figure. On the CPU (no memory
    limit) one batch of twice the largest, planned within 0.3 of its activations, runs the
    path."""
    largest = fitting[-1]
    per_token = largest["activation_bytes"] / largest["batch_tokens"]
    above = [b for b in cfg.batches if b > largest["batch_tokens"] and b <= cfg.max_batch]
    if not runner.cuda:
        above = [2 * largest["batch_tokens"]]
    rows: list[dict[str, Any]] = section["fit"].setdefault("planned_batches", [])
    for tokens in above:
        if time.monotonic() > cfg.deadline:
            break
        activations = int(per_token * tokens)
        if runner.cuda:
            fit = section["working_set_fit"]
            line = (fit["bytes_at_0"], fit["bytes_per_token"])
            budget = _offload_budget(cfg, line, per_token, tokens)
        else:
            budget = int(0.3 * activations)
        if budget <= 0:
            break
        try:
            row = runner.measure_planned(
                tokens,
                "budget",
                budget / activations,
                activations,
                steps=cfg.steps,
                record_unlimited=True,
            )
        except Exception:  # noqa: BLE001 - recorded, as in (4); the run goes on
            row = {"mode": "budget", "batch_tokens": tokens, "fits": False}
            row["error"] = traceback.format_exc()
            print(row["error"], file=sys.stderr, flush=True)
        rows.append(row)
        save()
        print(
            f"torch planned batch B={tokens} budget={budget / GiB:.2f} GiB: "
            f"fits={row.get('fits')} step={row.get('step_s')} plain={row.get('plain_step_s')} "
            f"overhead={row.get('overhead')} bound={row.get('bound')}",
            flush=True,
        )
        if not row.get("fits") or (row.get("overhead") or 0) > PLANNED_STOP_RATIO - 1:
            break


def _plan_fields(explained: Any, timeline: Any) -> dict[str, Any]:
    """A planned row's plan: what the offloader's ``explain()`` says of it, and of the
    recorded step's ``timeline``."""
    plan = explained.plan
    rates = plan.rates
    return {
        "explain": str(explained),
        "recorded_step_s": plan.plain_step_seconds,
        # The recorded forward pass: until the last saved tensor was made.
        "recorded_forward_s": max((t.produced for t in timeline.saved), default=0.0),
        "saved_bytes": sum(t.nbytes for t in timeline.saved),
        "predicted_step_s": plan.predicted_step_seconds,
        "predicted_overhead": plan.predicted_step_seconds / plan.plain_step_seconds - 1,
        # The activations blocks (forward and backward) under the plan, timed as the
        # recorded step was: the like-for-like comparison with the prediction.
        "planned_block_s": plan.measured_step_seconds,
        "planned_blocks": plan.measured_steps,
        "roofline_s": plan.roofline_seconds,
        "roofline_terms_s": plan.link_seconds,
        "bound": plan.bound,
        "tiers": {s.tier: {"tensors": s.tensors, "bytes": s.nbytes} for s in plan.tiers},
        "predicted_peak_saved_bytes": plan.peak_bytes,
        "plain_peak_saved_bytes": plan.plain_peak_bytes,
        "rates": {
            "to_host": _finite(rates.to_host),
            "from_host": _finite(rates.from_host),
            "disk_write": _finite(rates.disk_write),
            "disk_read": _finite(rates.disk_read),
            "host_bytes": rates.host_bytes,
        },
        "host_tier": plan.host_tier,
    }


def _compare(row: dict[str, Any], base: dict[str, Any]) -> None:
    if row.get("step_s") and base.get("step_s"):
        row["overhead"] = row["step_s"] / base["step_s"] - 1
    if row.get("peak_bytes") and base.get("peak_bytes"):
        row["peak_reduction"] = 1 - row["peak_bytes"] / base["peak_bytes"]


def _against_plain(row: dict[str, Any]) -> None:
    """A planned row's overhead and peak reduction, against its own plain step's."""
    _compare(row, {"step_s": row.get("plain_step_s"), "peak_bytes": row.get("plain_peak_bytes")})


# --------------------------------------------------------------------------- JAX


def _jax_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a subprocess: one mode, batch sizes ascending (JAX's peak is cumulative)."""
    import jax
    import jax.numpy as jnp

    cfg = spec["config"]
    width, depth, steps = cfg["width"], cfg["depth"], cfg["steps"]
    dtype = jnp.float32 if cfg["smoke"] else jnp.bfloat16
    device = jax.devices()[0]

    def forward(p, x):  # returns the block's output and its residuals: x and h
        h = x @ p[0]
        return x + jax.nn.gelu(h) @ p[1], h

    def backward(p, x, h, g):  # recomputes the GELU from h, as torch's GELU does not
        a, gelu_vjp = jax.vjp(jax.nn.gelu, h)
        (dh,) = gelu_vjp(g @ p[1].T)
        return (x.T @ dh, a.T @ g), g + dh @ p[0].T

    stage_forward = jax.jit(forward)
    stage_backward = jax.jit(backward)
    loss_and_grad = jax.jit(
        jax.value_and_grad(lambda y: jnp.mean(jnp.square(y.astype(jnp.float32))))
    )
    sgd = jax.jit(
        lambda p, g: jax.tree.map(lambda a, b: a - 1e-6 * b.astype(a.dtype), p, g), donate_argnums=0
    )

    key = jax.random.PRNGKey(0)
    params = []
    for _ in range(depth):
        key, k1, k2 = jax.random.split(key, 3)
        params.append(
            (
                (jax.random.normal(k1, (width, 4 * width)) / math.sqrt(width)).astype(dtype),
                (jax.random.normal(k2, (4 * width, width)) / math.sqrt(4 * width * depth)).astype(
                    dtype
                ),
            )
        )

    def step(
        params: list, x: Any, off: arrayio.Offloader | None, stash: Any = None
    ) -> tuple[Any, list]:
        """One step; the residuals through ``off`` (its budget), or through ``stash`` (an
        ``arrayio.offload.ArrayStep``: recorded, or under a plan), or kept."""
        saved = []  # per block: its input (the batch itself for the first) and h
        for k, p in enumerate(params):
            y, h = stage_forward(p, x)
            if stash is not None:
                saved.append((stash.put(x) if k else x, stash.put(h)))
            elif off is not None:
                saved.append((off.put(x) if k else x, off.put(h)))
            else:
                saved.append((x, h))
            x = y
            del y, h
        loss, g = loss_and_grad(x)
        del x
        grads = [None] * len(params)
        for k in reversed(range(len(params))):
            x, h = saved.pop()
            if stash is not None:  # (a get prefetches the residuals put before)
                x = stash.get(x) if k else x
                h = stash.get(h)
            elif off is not None:
                off.prefetch(
                    [
                        a
                        for pair in saved[-cfg["prefetch"] :][::-1]
                        for a in pair[::-1]
                        if isinstance(a, arrayio.offload.Handle)
                    ]
                )
                x = off.get(x) if isinstance(x, arrayio.offload.Handle) else x
                h = off.get(h)
            grads[k], g = stage_backward(params[k], x, h, g)
            del x, h
        return loss, grads

    def peak() -> int | None:
        stats = device.memory_stats()
        return None if stats is None else stats.get("peak_bytes_in_use")

    def compile_stages(batch: Any) -> None:
        """Each stage run once on one block, holding nothing else: XLA compiles and
        autotunes a stage at its first call, with scratch memory of its own, and a step's
        first backward stage runs with every residual held. Compiled here, the process's
        peak is its steps' (both processes of a planned row do this, so their peaks
        compare)."""
        y, h = stage_forward(params[0], batch)
        _loss, g = loss_and_grad(y)
        out = stage_backward(params[0], batch, h, g)
        jax.block_until_ready(out)
        del y, h, g, out

    if spec["mode"] in ("plan", "planned"):
        worker = _jax_plan if spec["mode"] == "plan" else _jax_planned
        planned_rows = []

        def step_on(batch: Any, stash: Any = None) -> tuple[Any, list]:
            return step(params, batch, None, stash)

        for run in spec["runs"]:
            tokens = run["batch_tokens"]
            batch = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, width), dtype)
            planned: dict[str, Any] = {"batch_tokens": tokens, "mode": run["mode"]}
            try:
                compile_stages(batch)
                planned.update(worker(cfg, run, functools.partial(step_on, batch)))
                planned["fits"] = True
            except Exception as error:  # XlaRuntimeError: RESOURCE_EXHAUSTED
                if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error):
                    raise
                _did_not_fit(planned, error)
            planned["peak_bytes"] = peak()
            print("ROW " + json.dumps(planned), flush=True)
            planned_rows.append(planned)
            del batch
        return {"mode": spec["mode"], "rows": planned_rows}

    rows = []
    for run in spec["runs"]:
        if time.time() > spec["deadline"] and rows:
            break
        tokens, budget = run["batch_tokens"], run.get("budget")
        row: dict[str, Any] = {"batch_tokens": tokens, "offload_budget_bytes": budget}
        times: list[float] = []
        try:
            x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, width), dtype)
            with contextlib.ExitStack() as stack:
                off = None
                if budget is not None:
                    off = stack.enter_context(
                        arrayio.Offloader(cfg["scratch"], device_budget_bytes=budget)
                    )
                for i in range(1 + steps):
                    start = time.perf_counter()
                    loss, grads = step(params, x, off)
                    params = sgd(params, grads)
                    jax.block_until_ready(params)
                    if i:
                        times.append(time.perf_counter() - start)
                    del grads
                row["loss"] = float(loss)
                row["offloader"] = _stats(off)
            del x
            row["fits"] = True
        except Exception as error:  # XlaRuntimeError: RESOURCE_EXHAUSTED
            if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error):
                raise
            _did_not_fit(row, error)
        row["step_s"] = _median(times)
        row["step_s_all"] = times
        row["peak_bytes"] = peak()
        # Residuals given to the offloader: every block's h, every block's input but the
        # first (the batch).
        row["activation_bytes"] = (
            ((depth - 1) * width + depth * 4 * width) * tokens * (jnp.dtype(dtype).itemsize)
        )
        rows.append(row)
        print(
            f"jax {spec['mode']} B={tokens} budget={budget}: fits={row['fits']} "
            f"peak={row['peak_bytes']} step={row['step_s']}",
            file=sys.stderr,
            flush=True,
        )
        print("ROW " + json.dumps(row), flush=True)  # the parent keeps what came before a kill
        if not row["fits"]:
            break
    return {"mode": spec["mode"], "rows": rows}


def _jax_grads_digest(grads: list) -> list[str]:
    """Each gradient's bytes, hashed: JAX's kernels here sum in a fixed order, so the same
    step at the same parameters gives the same bytes (a plain step's own step-to-step
    digest says whether that held in the run)."""
    import hashlib

    import numpy as np

    return [
        hashlib.sha256(np.asarray(a).tobytes()).hexdigest()[:16] for pair in grads for a in pair
    ]


def _jax_plan(cfg: dict[str, Any], run: dict[str, Any], step: Any) -> dict[str, Any]:
    """A planned mode's first process: plain steps timed, one recorded through
    ``plan_array_step`` and planned; the plan is written to ``run["plan_path"]`` for the
    process that runs the planned steps (JAX cannot reset its peak statistic, and the
    recorded step holds the plain step's peak)."""
    import jax

    out: dict[str, Any] = {}
    _loss, grads = step()  # compiles
    jax.block_until_ready(grads)
    times = []
    for _ in range(cfg["steps"]):
        start = time.perf_counter()
        _loss, grads = step()
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - start)
    out["plain_step_s"], out["plain_step_s_all"] = _median(times), times
    out["plain_grads"] = _jax_grads_digest(grads)
    del grads
    mode, value = run["mode"].split("=")
    kwargs: dict[str, Any] = (
        {"max_overhead": float(value)}
        if mode == "max_overhead"
        else {"device_budget_bytes": run["device_budget_bytes"]}
    )
    with arrayio.Offloader(
        cfg["scratch"],
        device_budget_bytes=run["offloader_budget_bytes"],
        host_budget_bytes=cfg["host_budget"],
    ) as off:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", arrayio.offload.PlanWarning)
            with arrayio.offload.plan_array_step(
                off, warn_above=cfg["warn_above"], min_bytes=cfg["min_bytes"], **kwargs
            ) as recording:
                _loss, grads = step(recording)
                jax.block_until_ready(grads)
    out["warnings"] = [str(w.message) for w in caught]
    out["recorded_grads"] = _jax_grads_digest(grads)
    del grads
    step_plan = recording.plan
    with open(run["plan_path"], "w") as f:
        json.dump(_plan_json(step_plan), f)
    return out


def _jax_planned(cfg: dict[str, Any], run: dict[str, Any], step: Any) -> dict[str, Any]:
    """A planned mode's second process: the plan read back, a planned step whose gradients
    are compared, then ``steps`` planned steps timed; this process's peak is theirs."""
    import jax

    with open(run["plan_path"]) as f:
        step_plan = _plan_from_json(json.load(f))
    out: dict[str, Any] = {}
    with arrayio.Offloader(
        cfg["scratch"],
        device_budget_bytes=run["offloader_budget_bytes"],
        host_budget_bytes=cfg["host_budget"],
    ) as off:
        with arrayio.offload.array_step(off, step_plan, prefetch=cfg["prefetch"]) as stash:
            _loss, grads = step(stash)  # compiles
        jax.block_until_ready(grads)
        out["planned_grads"] = _jax_grads_digest(grads)
        del grads
        step_plan.forget_runs()  # the plan's measured step: the timed steps', not the compile's
        times = []
        for _ in range(cfg["steps"]):
            start = time.perf_counter()
            with arrayio.offload.array_step(off, step_plan, prefetch=cfg["prefetch"]) as stash:
                _loss, grads = step(stash)
            jax.block_until_ready(grads)
            times.append(time.perf_counter() - start)
            del grads
        out["step_s"], out["step_s_all"] = _median(times), times
        off.wait()
        out.update(_plan_fields(off.explain(), step_plan.timeline))
        out["offloader"] = _stats(off)
    return out


def _jax_planned_rows(
    cfg: Config,
    tokens: int,
    activations: int,
    plain: dict[str, Any],
    fraction: float | None,
    save: Any,
) -> list[dict[str, Any]]:
    """JAX's planned modes at the largest batch that fits (see the module docstring, 4).
    ``plain`` is that batch's row of the memory search: its peak is the plain step's."""
    rows: list[dict[str, Any]] = []
    for mode, value in cfg.modes:
        if time.monotonic() > cfg.deadline and rows:
            break
        budget = int(value * activations) if mode == "budget" else None
        rows.append(
            _jax_planned_row(
                cfg,
                tokens,
                f"{mode}={value:g}",
                budget,
                activations,
                fraction,
                plain_peak_bytes=plain.get("peak_bytes"),
            )
        )
        save()
    return rows


def _jax_planned_batches(
    cfg: Config,
    section: dict[str, Any],
    line: tuple[float, float],
    per_token: float,
    fraction: float | None,
    save: Any,
) -> None:
    """(5) for JAX: the batches above the largest that fits without offloading, each under
    a plan that meets the memory budget (as torch's, :func:`_planned_batches`); their plain
    peak is the recording's, which ran without the limit."""
    rows: list[dict[str, Any]] = section["fit"].setdefault("planned_batches", [])
    largest = section["fit"]["batch_tokens"]
    for tokens in [b for b in cfg.batches if largest < b <= cfg.max_batch]:
        if time.monotonic() > cfg.deadline:
            break
        budget = _offload_budget(cfg, line, per_token, tokens)
        if budget <= 0:
            break
        activations = int(per_token * tokens)
        row = _jax_planned_row(
            cfg, tokens, f"budget={budget / activations:.3g}", budget, activations, fraction
        )
        rows.append(row)
        save()
        if not row.get("fits") or (row.get("overhead") or 0) > PLANNED_STOP_RATIO - 1:
            break


def _jax_planned_row(
    cfg: Config,
    tokens: int,
    mode: str,
    budget: int | None,
    activations: int,
    fraction: float | None,
    *,
    plain_peak_bytes: int | None = None,
) -> dict[str, Any]:
    """One planned row of JAX's: a process that times plain steps and records and plans one,
    without the memory limit (a fresh process's first steps at the limit's edge can run out
    of memory where the memory search's, warmed by smaller batches, did not), then one that
    runs the planned steps under it, whose peak is then theirs alone."""
    run = {
        "batch_tokens": tokens,
        "mode": mode,
        "device_budget_bytes": budget,
        # The plan decides what leaves; the offloader's own budget only bounds what it
        # holds, the same bytes (never binding without a device budget).
        "offloader_budget_bytes": budget if budget is not None else activations,
        "plan_path": os.path.join(cfg.scratch, f"jax-plan-{tokens}-{mode}.json"),
    }
    row: dict[str, Any] = {
        "mode": mode,
        "batch_tokens": tokens,
        "device_budget_bytes": budget,
        "host_budget_bytes": cfg.host_budget,
        "recorded_without_the_limit": True,
    }
    recorded = _run_jax_worker(cfg, "plan", [run], None)
    first = recorded["rows"][0] if recorded["rows"] else {"fits": False}
    row.update({k: v for k, v in first.items() if k not in ("peak_bytes", "mode")})
    row["recording_peak_bytes"] = first.get("peak_bytes")
    row["error"] = first.get("error") or recorded.get("error")
    if first.get("fits"):
        ran = _run_jax_worker(cfg, "planned", [run], fraction)
        second = ran["rows"][0] if ran["rows"] else {"fits": False}
        row.update({k: v for k, v in second.items() if k != "mode"})
        row["error"] = second.get("error") or ran.get("error")
    # The plain peak: the memory search's at that batch where given, else the recording's
    # (a batch that runs only with a plan, recorded without the limit).
    row["plain_peak_bytes"] = (
        plain_peak_bytes if plain_peak_bytes is not None else row.get("recording_peak_bytes")
    )
    _against_plain(row)
    if row.get("planned_grads") and row.get("plain_grads"):
        row["grads_agree"] = row["planned_grads"] == row["plain_grads"]
        # The recorded step is a plain step at the same parameters: the plain steps' own
        # agreement, the noise the planned one is judged beside.
        row["plain_steps_agree"] = row.get("recorded_grads") == row["plain_grads"]
    print(
        f"jax planned B={tokens} {mode}: fits={row.get('fits')} step={row.get('step_s')} "
        f"plain={row.get('plain_step_s')} peak={row.get('peak_bytes')} "
        f"grads_agree={row.get('grads_agree')}",
        file=sys.stderr,
        flush=True,
    )
    return row


def _plan_json(step_plan: Any) -> dict[str, Any]:
    """A StepPlan as JSON (infinite rates as null), for :func:`_plan_from_json`."""
    rates = dataclasses.asdict(step_plan.rates)
    return {
        "mode": step_plan.mode,
        "min_bytes": step_plan.min_bytes,
        "framework": step_plan.framework,
        "cuda": step_plan.cuda,
        "host_tier": step_plan.host_tier,
        "timeline": dataclasses.asdict(step_plan.timeline),
        "rates": {k: (None if v == math.inf else v) for k, v in rates.items()},
        "plan": dataclasses.asdict(step_plan.plan),
    }


def _plan_from_json(data: dict[str, Any]) -> Any:
    from arrayio.offload._plan import Plan, Rates, Saved, Timeline

    step_plan = arrayio.offload.StepPlan(data["mode"], data["min_bytes"])
    step_plan.framework, step_plan.cuda = data["framework"], data["cuda"]
    step_plan.host_tier = data["host_tier"]
    timeline = data["timeline"]
    step_plan.timeline = Timeline(
        tuple(Saved(**saved) for saved in timeline["saved"]),
        timeline["step_seconds"],
        timeline["base_bytes"],
    )
    rates: dict[str, Any] = {k: (math.inf if v is None else v) for k, v in data["rates"].items()}
    step_plan.rates = Rates(**rates)
    plan = data["plan"]
    step_plan.plan = Plan(
        **{**plan, "tiers": tuple(plan["tiers"]), "returns": tuple(plan["returns"])}
    )
    return step_plan


def _run_jax_worker(
    cfg: Config, mode: str, runs: list[dict[str, Any]], fraction: float | None
) -> dict[str, Any]:
    spec = {
        "mode": mode,
        "runs": runs,
        "deadline": time.time() + cfg.deadline - time.monotonic(),
        "config": {
            "width": cfg.width,
            "depth": cfg.depth,
            "steps": cfg.steps,
            "smoke": cfg.smoke,
            "scratch": cfg.scratch,
            "min_bytes": cfg.min_bytes,
            "prefetch": cfg.prefetch,
            "host_budget": cfg.host_budget,
            "warn_above": cfg.warn_above,
        },
    }
    env = dict(os.environ)
    if fraction is not None:
        env.update(
            XLA_PYTHON_CLIENT_PREALLOCATE="true", XLA_PYTHON_CLIENT_MEM_FRACTION=f"{fraction:.4f}"
        )
    if cfg.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    error = None
    try:
        result = subprocess.run(
            [sys.executable, "-m", "benchmarks.offload_train", "--jax-worker", f.name],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=max(60.0, cfg.deadline - time.monotonic() + 60),
        )
        stdout, stderr = result.stdout, result.stderr
        if result.returncode != 0:
            error = stderr[-2000:]
    except subprocess.TimeoutExpired as expired:
        stdout, stderr = (_text(expired.stdout), _text(expired.stderr))
        error = "timed out"
    finally:
        os.unlink(f.name)
    sys.stderr.write(stderr)
    rows = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
    return {"mode": mode, "rows": rows, "error": error}


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def run_jax(cfg: Config, report: dict[str, Any], save: Any, total: int | None) -> None:
    fraction = None if total is None else min(1.0, cfg.budget / total)
    section: dict[str, Any] = {
        "model": {
            "width": cfg.width,
            "depth": cfg.depth,
            "hidden": 4 * cfg.width,
            "stages": cfg.depth,
            "dtype": "float32" if cfg.smoke else "bfloat16",
        },
        "memory_limit": None
        if fraction is None
        else f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:.4f} (preallocated)",
        # JAX cannot reset peak_bytes_in_use: within one worker process (one list of rows),
        # each row's peak is the highest so far, an upper bound for that row.
        "peak_is_cumulative_per_worker": True,
        "search": {},
    }
    report["jax"] = section
    memory = _run_jax_worker(cfg, "memory", [{"batch_tokens": b} for b in cfg.batches], fraction)
    section["search"]["memory"] = memory
    save()
    fitting = [r for r in memory["rows"] if r["fits"]]
    if not fitting:
        return
    largest_memory = fitting[-1]
    tokens, activations = largest_memory["batch_tokens"], largest_memory["activation_bytes"]
    # Budgets ascending, so that each run's peak is above the last (cumulative statistic).
    keeps = sorted(cfg.keep_fractions)
    fit_runs = [{"batch_tokens": tokens, "budget": int(k * activations)} for k in keeps]
    offload = _run_jax_worker(cfg, "offload-fit", fit_runs, fraction)
    for row, keep in zip(offload["rows"], keeps, strict=False):
        row["keep_fraction"] = keep
        _compare(row, largest_memory)
    section["fit"] = {
        "batch_tokens": tokens,
        "activation_bytes": activations,
        "memory": largest_memory,
        "offload": offload["rows"],
        "error": offload.get("error"),
    }
    save()
    if cfg.modes:
        # The modes run at the largest batch whose plain peak leaves room under the limit:
        # at the limit's edge JAX's peak statistic is XLA's autotuning, which takes the
        # free memory when it compiles, and a plan that keeps most residuals fits there or
        # not by chance (torch's largest batch sits at about 0.8 of its limit).
        roomy = [
            r
            for r in fitting
            if r.get("peak_bytes") is None or r["peak_bytes"] < JAX_PLANNED_PEAK * cfg.budget
        ]
        at = (roomy or fitting)[-1]
        section["fit"]["planned_batch_tokens"] = at["batch_tokens"]
        section["fit"]["planned"] = _jax_planned_rows(
            cfg, at["batch_tokens"], at["activation_bytes"], at, fraction, save
        )
        save()
    if (
        fraction is None
        or time.monotonic() > cfg.deadline
        or any(r["peak_bytes"] is None for r in fitting)
    ):
        return
    line = _fit_line(
        [(r["batch_tokens"], r["peak_bytes"] - r["activation_bytes"]) for r in fitting]
    )
    per_token = activations / tokens
    section["working_set_fit"] = {
        "bytes_at_0": line[0],
        "bytes_per_token": line[1],
        "activation_bytes_per_token": per_token,
    }
    if cfg.modes:  # before the unplanned search, which the disk makes slow
        _jax_planned_batches(cfg, section, line, per_token, fraction, save)
        save()
    runs = []
    for b in cfg.batches:
        if b <= tokens or b > cfg.max_batch:
            continue
        budget = _offload_budget(cfg, line, per_token, b)
        if budget <= 0:
            break
        runs.append({"batch_tokens": b, "budget": budget})
    search = _run_jax_worker(cfg, "offload-search", runs, fraction) if runs else {"rows": []}
    section["search"]["offload"] = search
    fits = [r["batch_tokens"] for r in search["rows"] if r["fits"]]
    section["largest_batch"] = {
        "memory": tokens,
        "offload": max(fits, default=tokens),
        # A lower bound unless a batch failed (or the grid or the time limit ended it).
        "offload_capped": all(r["fits"] for r in search["rows"]),
    }
    save()


# --------------------------------------------------------------------------- main


def _summary(section: dict[str, Any]) -> dict[str, Any]:
    fit = section.get("fit") or {}
    rows = [r for r in fit.get("offload", []) if r.get("fits")]
    best = max(rows, key=lambda r: r.get("peak_reduction") or -1, default=None)
    planned = [r for r in fit.get("planned", []) if r.get("fits")]
    batches = fit.get("planned_batches", [])
    within = [
        r["batch_tokens"]
        for r in batches
        if r.get("fits") and r.get("overhead") is not None and r["overhead"] <= PLANNED_OVERHEAD
    ]
    return {
        "largest_batch": section.get("largest_batch"),
        "fit_batch_tokens": fit.get("batch_tokens"),
        "offload_rows": [
            {k: r.get(k) for k in ("keep_fraction", "overhead", "peak_reduction", "step_s")}
            for r in rows
        ],
        "best_peak_reduction": None if best is None else best.get("peak_reduction"),
        "overhead_at_best": None if best is None else best.get("overhead"),
        "planned_rows": [
            {
                k: r.get(k)
                for k in (
                    "mode",
                    "overhead",
                    "predicted_overhead",
                    "peak_reduction",
                    "step_s",
                    "plain_step_s",
                    "predicted_step_s",
                    "roofline_s",
                    "bound",
                    "grads_agree",
                )
            }
            for r in planned
        ],
        "planned_batch_rows": [
            {
                k: r.get(k)
                for k in (
                    "batch_tokens",
                    "fits",
                    "device_budget_bytes",
                    "overhead",
                    "step_s",
                    "plain_step_s",
                    "predicted_step_s",
                    "roofline_s",
                    "bound",
                    "peak_bytes",
                )
            }
            for r in batches
        ],
        "largest_planned_batch_within_overhead": max(within, default=None),
    }


def _mode_label(mode: str) -> str:
    """``budget=0.771313`` as ``budget 0.77``, ``max_overhead=0.1`` as ``overhead 0.1``."""
    name, _, value = mode.partition("=")
    return f"{'overhead' if name == 'max_overhead' else name} {float(value):.2g}"


def plot(report: dict[str, Any], path: str) -> None:
    """The planned rows (modes, then larger batches): each measured step beside the plain
    step, the planner's prediction and the roofline (ms), and the peak device memory as a
    fraction of the plain step's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, labels = [], []
    for framework in ("torch", "jax"):
        fit = (report.get(framework) or {}).get("fit") or {}
        for r in fit.get("planned", []) + fit.get("planned_batches", []):
            if r.get("fits"):
                rows.append(r)
                labels.append(f"{framework}: {_mode_label(r['mode'])}\nB={r['batch_tokens']}")
    if not rows:
        return
    fig, (steps, peaks) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(3, 2))
    series = [
        ("plain_step_s", "plain step"),
        ("step_s", "planned step, measured"),
        ("predicted_step_s", "predicted"),
        ("roofline_s", "roofline"),
    ]
    width = 0.8 / len(series)
    for k, (key, name) in enumerate(series):
        values = [1e3 * (r.get(key) or 0.0) for r in rows]
        offsets = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        steps.bar(offsets, values, width, label=name)
    steps.set_xticks(range(len(rows)), labels, fontsize=8)
    steps.set_ylabel("ms per step (median)")
    steps.set_yscale("log")
    steps.legend(fontsize=8)
    fractions = [
        r["peak_bytes"] / r["plain_peak_bytes"]
        if r.get("peak_bytes") and r.get("plain_peak_bytes")
        else 0.0
        for r in rows
    ]
    peaks.bar(range(len(rows)), fractions, 0.6, color="tab:gray")
    peaks.axhline(1.0, color="k", linestyle=":", linewidth=1)
    peaks.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    peaks.set_ylabel("peak device memory / plain step's")
    fig.suptitle(f"offload_train, planned modes ({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for offload_train.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on the CPU")
    parser.add_argument("--framework", default="torch,jax")
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batches", default=None, help="token counts, comma-separated")
    parser.add_argument("--max-batch", type=int, default=32768)
    parser.add_argument(
        "--keep-fractions",
        default="0.5,0.25",
        help="offloader budgets, as fractions of the activations",
    )
    parser.add_argument(
        "--modes",
        default="max_overhead=0.1,budget=0.3",
        help="planned modes, comma-separated: max_overhead=FRACTION (as little device "
        "memory as possible within that slowdown) or budget=FRACTION (of the activations); "
        "empty for none",
    )
    parser.add_argument(
        "--host-budget-gib",
        type=float,
        default=16.0,
        help="on the GPU: the planned modes' host tier (pinned host memory)",
    )
    parser.add_argument(
        "--warn-above",
        type=float,
        default=2.0,
        help="planned modes: warn (recorded in the row) when the predicted step exceeds "
        "this many plain steps",
    )
    parser.add_argument("--scratch", default=None, help="spill directory (default: a temp dir)")
    parser.add_argument(
        "--writeback-fraction",
        type=float,
        default=None,
        help="torch: the offloader's writeback_bytes as a fraction of its "
        "budget (default: the offloader's own)",
    )
    parser.add_argument("--time-limit", type=float, default=200.0, help="seconds, roughly")
    parser.add_argument("--jax-worker", help=argparse.SUPPRESS)
    parser.add_argument("--replot", default=None, help="plot DIR/offload_train.json again")
    args = parser.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.replot, "offload_train.json")) as f:
            plot(json.load(f), os.path.join(args.replot, "offload_train.png"))
        return

    if args.jax_worker:
        with open(args.jax_worker) as f:
            _jax_worker(json.load(f))
        return
    if not args.out:
        parser.error("--out is required")
    try:
        modes = _parse_modes(args.modes)
    except ValueError as error:
        parser.error(str(error))
    started = time.monotonic()
    frameworks = [name.strip() for name in args.framework.split(",") if name.strip()]
    if args.smoke:
        args.width, args.depth, args.steps, args.budget_gib = 64, 4, 1, 1.0
        batches = [256, 512]
    else:
        batches = DEFAULT_BATCHES
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    scratch_parent = args.scratch or tempfile.gettempdir()
    device = "cpu"
    total = None
    gpu = None
    # torch reads the GPU's memory for JAX's run too (JAX runs in worker processes; torch
    # is on the GPU machine): the budget's fraction, and the host tier, need it.
    if not args.smoke and importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            device = "cuda"
            total = torch.cuda.get_device_properties(0).total_memory
            gpu = torch.cuda.get_device_name()
    share = args.time_limit / max(1, len(frameworks))
    report: dict[str, Any] = {
        "benchmark": "offload_train",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [
                os.path.basename(sys.executable),
                "-m",
                "benchmarks.offload_train",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "machine": {
            "host": platform.node(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "gpu": gpu,
            "gpu_total_bytes": total,
        },
        "smoke": args.smoke,
        "budget_bytes": int(args.budget_gib * GiB),
        "scratch": scratch_parent,
    }
    path = os.path.join(args.out, "offload_train.json")

    def save() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=2)
        os.replace(path + ".tmp", path)

    with tempfile.TemporaryDirectory(dir=scratch_parent, prefix="offload-bench-") as scratch:
        for index, name in enumerate(frameworks):
            cfg = Config(
                width=args.width,
                depth=args.depth,
                budget=int(args.budget_gib * GiB),
                steps=args.steps,
                batches=batches,
                max_batch=args.max_batch,
                keep_fractions=[float(k) for k in args.keep_fractions.split(",")],
                scratch=scratch,
                deadline=started + share * (index + 1),
                device=device,
                smoke=args.smoke,
                writeback_fraction=args.writeback_fraction,
                modes=modes,
                # On the host, arrays skip the host tier: none, and the plans say so.
                host_budget=int(args.host_budget_gib * GiB) if device == "cuda" else 0,
                warn_above=args.warn_above,
            )
            if name == "torch":
                run_torch(cfg, report, save)
            elif name == "jax":
                run_jax(cfg, report, save, total)
            else:
                parser.error(f"unknown framework {name!r}")
            report[name]["summary"] = _summary(report[name])
            save()
    report["seconds"] = time.monotonic() - started
    save()
    try:
        plot(report, os.path.join(args.out, "offload_train.png"))
    except ImportError:  # matplotlib is optional (the dev extra has it)
        pass
    print(json.dumps({name: report[name]["summary"] for name in frameworks}, indent=2))


if __name__ == "__main__":
    main()
