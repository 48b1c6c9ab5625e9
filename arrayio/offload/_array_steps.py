"""Spill plans for steps that save their own arrays: JAX's jitted stages, or any code that
keeps what its backward pass needs between calls.

JAX has no hook for what ``jax.grad`` keeps, so a JAX step that offloads is written in
stages (a jitted forward per block returning its residuals, a jitted backward per block
taking them, ``examples/jax_offload.py``), and the code between the stages puts the
residuals somewhere and gets them back. An :class:`ArrayStep` is that somewhere:

* :func:`plan_array_step` records one plain step through it (every array stays on its
  device; when each is put and first got back, and its bytes, are marked), measures the
  offloader's links for the step's framework and plans it, as
  :func:`~arrayio.offload.plan_step` does for torch's autograd;
* :func:`array_step` runs a step under the plan: the ``i``-th array put (of at least
  ``min_bytes``) stays on its device where the plan says ``"device"``, and is spilled at
  once to the plan's tier otherwise (``"host"``: the offloader's host tier, for JAX arrays
  JAX's own pinned host memory; ``"disk"``: its file). Each :meth:`ArrayStep.get` of an
  offloaded array also prefetches the ``prefetch`` offloaded arrays put last before it,
  which a backward pass, going in reverse, needs next. Without a plan, every array follows
  the offloader's budget.

The marks of a JAX step are the host's clock after the device has done the work queued
before them (JAX dispatches asynchronously: the host's clock alone says when work was
queued, not when it ran); a torch step's are CUDA events, as :func:`plan_step`'s; a host
step's, the host's clock. Waiting for the device at each mark slows the recorded step a
little, never the planned ones: a planned step marks only its start and its end.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ._clock import Mark, cuda_in_use
from ._entries import Handle, describe
from ._plan import Rates, Timeline
from ._rates import measure_rates
from ._step_plan import PlanWarning, StepPlan, checked_mode, make_plan
from ._timeline import marked_timeline

if TYPE_CHECKING:
    from ._offloader import Offloader

__all__ = ["ArrayStep", "Kept", "array_step", "plan_array_step"]


class Kept:
    """An array an :class:`ArrayStep` keeps on its device (too small to offload, or kept
    by the plan), in place of an offloader :class:`~arrayio.offload.Handle`."""

    __slots__ = ("__weakref__", "array", "index")

    def __init__(self, array: Any, index: int | None) -> None:
        self.array, self.index = array, index


def _gone() -> None:
    """An order slot whose array was freed, or not put yet."""
    return None


# Frameworks whose GPU steps are marked as the device runs them (CUDA events for torch, a
# barrier for JAX); a step of another framework on a GPU cannot be recorded or timed.
_MARKED_ON_GPUS = ("torch", "jax")


class ArrayStep:
    """Where one step puts the arrays its backward pass needs: :meth:`put`, :meth:`get`,
    :meth:`free`. Made by :func:`plan_array_step` (recording) or :func:`array_step`.

    Attributes
    ----------
    plan
        The :class:`~arrayio.offload.StepPlan` this step runs under; for a recording, the
        one made from it, once the :func:`plan_array_step` block has ended (None before).
    """

    def __init__(
        self,
        offloader: Offloader,
        *,
        min_bytes: int,
        prefetch: int,
        plan: StepPlan | None,
        recording: bool,
    ) -> None:
        self.offloader = offloader
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.plan = plan
        self._recording = recording
        self._tiers = None if recording or plan is None else plan.tiers
        self._warned = False
        self._lock = threading.Lock()
        self._count = 0  # arrays of at least min_bytes put so far, in order
        # Every such array, in the order put, weakly (a handle the step drops frees its
        # array, as the offloader's handles do), and where each live one is. The weakrefs'
        # callbacks take no lock: the collector may run them on a thread holding it.
        self._order: list[Callable[[], Any]] = []
        self._position: dict[int, int] = {}
        self._framework: str | None = None
        self._cuda = False
        self._clock: Callable[[Any], Mark] | None = None
        # Recording: each array's bytes, the mark it was put at, the mark it was first got.
        self._bytes: list[int] = []
        self._made: list[Mark | None] = []
        self._needed: list[Mark | None] = []

    # ------------------------------------------------------------------ what steps call

    def put(self, array: Any) -> Handle | Kept:
        """Keep ``array`` for the backward pass: on its device, or through the offloader,
        as the plan says. Returns what :meth:`get` takes.

        Raises
        ------
        UnsupportedObjectError, UnsupportedDtypeError
            For what the offloader does not take.
        ValueError
            Recording or under a plan: for an array of another framework or memory than
            the step's first, or on a GPU of a framework other than torch and JAX.
        """
        array, request, dtype, shape = describe(array)
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes < self.min_bytes:
            return Kept(array, None)
        self._check_kind(request.framework, request.placement.is_cuda, array)
        with self._lock:  # its place in every list, taken at once
            index = self._count
            self._count += 1
            self._order.append(_gone)
            if self._recording:
                self._bytes.append(nbytes)
                self._made.append(None)
                self._needed.append(None)
        if self._recording:
            assert self._clock is not None
            self._made[index] = self._clock(array)
            return self._track(Kept(array, index), index)
        tier = None
        if self._tiers is not None:
            self._check_planned(index, nbytes)
            if index < len(self._tiers):
                tier = self._tiers[index]
                if tier == "device":
                    return self._track(Kept(array, index), index)
        handle = self.offloader.put(array, hint=None if tier is None else "spill", tier=tier)
        return self._track(handle, index)

    def _track(self, kept: Any, index: int) -> Any:
        key = id(kept)
        position = self._position
        self._position[key] = index
        self._order[index] = weakref.ref(kept, lambda _ref: position.pop(key, None))
        return kept

    def _check_planned(self, index: int, nbytes: int) -> None:
        """Warn once where the step's arrays are not the recorded step's: the plan's
        ``i``-th tier would be another array's."""
        timeline = self.plan.timeline if self.plan is not None else None
        if self._warned or timeline is None:
            return
        planned = timeline.saved
        if index < len(planned) and planned[index].nbytes == nbytes:
            return
        self._warned = True
        recorded = f"{planned[index].nbytes} bytes" if index < len(planned) else "none"
        warnings.warn(
            f"array {index} put under the spill plan has {nbytes} bytes, where the recorded "
            f"step's had {recorded}: the plan is for another step (record it again)",
            PlanWarning,
            stacklevel=3,
        )

    def get(self, kept: Handle | Kept) -> Any:
        """The array :meth:`put` returned ``kept`` for; an offloaded one read back, and the
        ``prefetch`` offloaded arrays put last before it asked for, which a backward pass
        needs next."""
        if isinstance(kept, Kept) and self._recording and kept.index is not None:
            if self._needed[kept.index] is None:
                assert self._clock is not None
                mark = self._clock(None)
                with self._lock:
                    if self._needed[kept.index] is None:
                        self._needed[kept.index] = mark
        elif self.prefetch and not self._recording and isinstance(kept, Handle):
            # Only an offloaded array's get starts reads, as torch's hooks do: reads started
            # at the gets of the arrays a plan keeps brought arrays back while those were
            # still held (docs/design/offload.md).
            handles = self._before(self._position.get(id(kept)))
            if handles:
                self.offloader.prefetch(handles)
        return kept.array if isinstance(kept, Kept) else self.offloader.get(kept)

    def _before(self, at: int | None) -> list[Handle]:
        """The ``prefetch`` live handles put last before position ``at``, latest first."""
        handles: list[Handle] = []
        if at is None:
            return handles
        for slot in reversed(self._order[:at]):
            put = slot()
            if isinstance(put, Handle):
                handles.append(put)
                if len(handles) == self.prefetch:
                    break
        return handles

    def free(self, kept: Handle | Kept) -> None:
        """Drop an array the step no longer needs (also done when its handle is garbage)."""
        at = self._position.pop(id(kept), None)
        if at is not None:
            self._order[at] = _gone
        if isinstance(kept, Handle):
            self.offloader.free(kept)

    # ------------------------------------------------------------------ marks

    def _check_kind(self, framework: str, cuda: bool, array: Any) -> None:
        """Choose the step's marks from its first array's framework and memory; check the
        later ones against it where the marks matter (recording, or under a plan)."""
        with self._lock:
            first = self._framework is None
            if first:
                self._framework, self._cuda = framework, cuda
                self._clock = _clock_for(framework, array)
        if not (self._recording or self.plan is not None):
            return
        where = "a GPU" if cuda else "the host"
        if cuda and framework not in _MARKED_ON_GPUS:
            raise ValueError(
                f"a step of {framework} arrays on a GPU cannot be recorded or timed: array "
                f"steps mark torch's (CUDA events) and JAX's (the device's queue)"
            )
        if (framework, cuda) != (self._framework, self._cuda):
            first_where = "a GPU" if self._cuda else "the host"
            raise ValueError(
                f"an array of {framework} on {where} in a step whose first array is of "
                f"{self._framework} on {first_where}: a plan is for one kind of array"
            )

    def timeline(self, start: Mark, end: Mark) -> Timeline:
        """The recorded step's timeline, from ``start`` to ``end``; an array never got back
        counts as needed at the end."""
        made = [mark if mark is not None else start for mark in self._made]
        return marked_timeline(start, end, self._bytes, made, self._needed)

    def mark(self) -> Mark:
        """A mark of the step's kind now (for JAX, once the device has run its queue)."""
        if self._clock is None:
            return Mark(False)
        return self._clock(None)

    def _recorded(self) -> None:
        """The recording is over: the step's arrays are its code's, and its later puts and
        gets are plain ones."""
        self._recording = False
        self._bytes.clear()
        self._made.clear()
        self._needed.clear()


def _clock_for(framework: str, array: Any) -> Callable[[Any], Mark]:
    """The marks of a step whose first array is ``array``, of ``framework``: a function of
    the array just put (or None) that returns a :class:`Mark`. torch on a GPU: CUDA events.
    JAX, which dispatches asynchronously on any device: the host's clock once the array's
    producer has run (at a put) or the device has run the work queued before (at a get).
    Others: the host's clock."""
    if framework == "torch" and getattr(getattr(array, "device", None), "type", None) == "cuda":
        return lambda _array: Mark(True)
    if framework == "jax":
        device = next(iter(array.devices()))

        def jax_mark(put: Any) -> Mark:
            if put is not None:
                put.block_until_ready()
            else:
                _jax_barrier(device)
            return Mark(False)

        return jax_mark
    return lambda _array: Mark(False)


def _jax_barrier(device: Any) -> None:
    """Wait until ``device`` has run the work queued on it before this call: a tiny
    computation queued after it, in order on the device, and waited for."""
    _barrier_function()(_scalar_on(device)).block_until_ready()


@functools.cache
def _barrier_function() -> Any:
    import jax

    return jax.jit(lambda x: x + 1)


@functools.cache
def _scalar_on(device: Any) -> Any:
    import jax
    import numpy as np

    return jax.device_put(np.zeros((), np.int32), device)


# ---------------------------------------------------------------------- the two blocks


class _Start:
    """A step's start, marked before its first array says what kind of marks it takes: the
    host's clock once JAX's GPUs (where JAX is in use) have run the work queued before, and
    a CUDA event where torch runs CUDA."""

    def __init__(self) -> None:
        _wait_for_jax()
        self.host = Mark(False)
        self.event = Mark(True) if cuda_in_use() else None

    def of(self, step: ArrayStep) -> Mark:
        """The mark of the kind ``step``'s arrays take."""
        if step._framework == "torch" and step._cuda:
            if self.event is not None:
                return self.event
            first = step._made[0] if step._made else None
            return first if first is not None else Mark(True)
        return self.host


def _wait_for_jax() -> None:
    """Where this process uses JAX, wait until each of its local devices has run the work
    queued on it."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    try:
        devices = jax.local_devices()
    except RuntimeError:  # no backend could start
        return
    for device in devices:
        _jax_barrier(device)


@contextlib.contextmanager
def plan_array_step(
    offloader: Offloader,
    *,
    max_overhead: float | None = None,
    device_budget_bytes: int | None = None,
    warn_above: float | None = None,
    rates: Rates | None = None,
    measure: Callable[..., Rates] = measure_rates,
    min_bytes: int = 1 << 20,
) -> Iterator[ArrayStep]:
    """Record one plain step whose code puts and gets its arrays through the
    :class:`ArrayStep` this yields (nothing leaves the device), and plan the steps like it,
    as :func:`~arrayio.offload.plan_step` does for torch's autograd: which arrays stay on
    the device and which go to ``offloader``'s host tier or disk. The plan is the step's
    ``plan`` once the block ends; give it to :func:`array_step`.

    The parameters are :func:`~arrayio.offload.plan_step`'s. The links are measured with the
    step's framework's arrays (``measure(offloader, cuda=..., sample_bytes=...,
    framework=...)``): for JAX, its host tier is JAX's pinned host memory.

    Raises
    ------
    ValueError
        If not exactly one mode is given, or a value is out of range.

    Examples
    --------
    >>> with arrayio.offload.plan_array_step(off, max_overhead=0.1) as step:
    ...     loss, grads = train_step(params, x, step)      # puts and gets through step
    >>> for x in batches:
    ...     with arrayio.offload.array_step(off, step.plan) as planned:
    ...         loss, grads = train_step(params, x, planned)
    >>> print(off.explain())
    """
    step_plan = StepPlan(checked_mode(max_overhead, device_budget_bytes, warn_above), min_bytes)
    step = ArrayStep(offloader, min_bytes=min_bytes, prefetch=0, plan=None, recording=True)
    start = _Start()
    yield step
    end = step.mark()
    timeline = step.timeline(start.of(step), end)
    step_plan.framework = step._framework or "numpy"
    make_plan(
        step_plan,
        offloader,
        timeline,
        cuda=step._cuda,
        rates=rates,
        measure=measure,
        max_overhead=max_overhead,
        device_budget_bytes=device_budget_bytes,
        warn_above=warn_above,
        framework="jax" if step_plan.framework == "jax" else "torch",
    )
    step.plan = step_plan
    step._recorded()


@contextlib.contextmanager
def array_step(
    offloader: Offloader,
    plan: StepPlan | None = None,
    *,
    min_bytes: int | None = None,
    prefetch: int = 2,
) -> Iterator[ArrayStep]:
    """Run one step whose code puts and gets its arrays through the :class:`ArrayStep`
    this yields: under ``plan`` (from :func:`plan_array_step`), each array to its tier;
    without one, every array through ``offloader`` and its budget. Under a plan the block
    is timed into it, as :func:`~arrayio.offload.activations` times a torch step, so that
    ``offloader.explain()`` sets the measured step beside the predicted one. A JAX step
    under a plan waits for its GPU at the block's start and end to time itself: from when
    the work queued before it has run until its own has.

    Parameters
    ----------
    offloader
        Where spilled arrays go.
    plan
        A :class:`~arrayio.offload.StepPlan` from :func:`plan_array_step`.
    min_bytes
        Smaller arrays stay on their device (default: the plan's, else 1 MiB).
    prefetch
        How many offloaded arrays put before the one each :meth:`ArrayStep.get` reads back
        it also starts reading back.

    Raises
    ------
    ValueError
        If ``min_bytes`` differs from the one the plan was recorded with (the ``i``-th
        array would not be the plan's ``i``-th).
    RuntimeError
        If the plan is not made yet.
    """
    if plan is not None:
        min_bytes = plan.checked_min_bytes(min_bytes)
        plan.tiers  # noqa: B018 - raises before the plan is made
    step = ArrayStep(
        offloader,
        min_bytes=1 << 20 if min_bytes is None else min_bytes,
        prefetch=prefetch,
        plan=plan,
        recording=False,
    )
    if plan is None:
        yield step
        return
    offloader._step_plan = plan
    events = plan.cuda and plan.framework == "torch"  # else the host's clock
    start = Mark(True) if events else _Start().host
    yield step
    if events:
        end = Mark(True)
    else:
        _wait_for_jax()  # (a JAX step's queue run; nothing to wait for otherwise)
        end = Mark(False)
    plan.ran(start, end)
