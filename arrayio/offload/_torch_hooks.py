"""Offloading torch activations through ``torch.autograd.graph.saved_tensors_hooks``.

Autograd keeps, for the backward pass, the tensors that each operation saves (inputs of a
matmul, outputs of a ReLU...): the activations. Inside :func:`activations`, each saved
tensor goes to an :class:`~arrayio.offload.Offloader` instead (``pack`` puts it, ``unpack``
gets it back), so those beyond the offloader's budget live on NVMe between the forward and
the backward pass.

Not offloaded (returned to autograd as they are):

* tensors smaller than ``min_bytes``: their I/O would cost more than the memory they hold;
* leaves (parameters, inputs, and what requires no grad but is not computed here) and views
  of leaves (a Linear layer saves ``weight.t()``): they stay in memory anyway.

A tensor saved by several operations (a ReLU output saved by the ReLU and by the next
Linear) is put once while it is resident. During the backward pass, each ``unpack`` also
prefetches the ``prefetch`` tensors saved just before it, which the backward pass, going in
reverse, needs next.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._entries import Handle
    from ._offloader import Offloader
    from ._plan import Plan
    from ._step_plan import StepPlan

__all__ = ["activations"]


class _Saved:
    """What autograd keeps in place of an offloaded tensor."""

    __slots__ = ("__weakref__", "handle", "index", "source", "version")

    def __init__(self, handle: Handle, index: int, version: int, source: Any) -> None:
        self.handle = handle
        self.index = index
        self.version = version  # the tensor's version counter when it was put
        self.source = weakref.ref(source)  # the tensor saved, while it lives


class _Hooks:
    def __init__(
        self, offloader: Offloader, min_bytes: int, prefetch: int, tiers: Sequence[str] | None
    ) -> None:
        self.offloader = offloader
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.tiers = tiers
        # Tensors the plan kept with autograd: they count in the order, once each, as a
        # recording of the step counted them.
        self.kept_ids: dict[int, weakref.ref[Any]] = {}
        self.lock = threading.Lock()
        self.order: list[weakref.ref[_Saved]] = []
        self.by_id: dict[int, weakref.ref[_Saved]] = {}

    def pack(self, tensor: Any) -> Any:
        if not offloadable(tensor, self.min_bytes):
            return tensor
        with self.lock:
            known = self.by_id.get(id(tensor))
            saved = known() if known is not None else None
        if saved is not None and (
            # Saved again by another operation: once spilled, the offloader holds it no more,
            # so the tensor itself tells (or a plan would count it twice, and shift).
            (tensor._version == saved.version and saved.source() is tensor)
            or _same(self.offloader.peek(saved.handle), tensor, saved.version)
        ):
            return saved
        hint = tier = None
        if self.tiers is not None:
            with self.lock:
                kept = self.kept_ids.get(id(tensor))
                if kept is not None and kept() is tensor:
                    return tensor  # kept, and saved again by another operation
                index = len(self.order) + len(self.kept_ids)
                if index < len(self.tiers) and self.tiers[index] == "device":
                    self.kept_ids[id(tensor)] = weakref.ref(tensor)
                    return tensor  # the plan keeps it
            if index < len(self.tiers):
                hint, tier = "spill", self.tiers[index]
        version = tensor._version
        # Detached: the offloader must not hold the tensor's grad_fn, whose saved variables
        # hold this very handle (a reference cycle through autograd's C++ graph).
        handle = self.offloader.put(tensor.detach(), hint=hint, tier=tier)
        with self.lock:
            saved = _Saved(handle, len(self.order), version, tensor)
            self.order.append(weakref.ref(saved))
            self.by_id[id(tensor)] = weakref.ref(saved, self._forget(id(tensor)))
        return saved

    def _forget(self, key: int) -> Any:
        def callback(ref: weakref.ref[_Saved]) -> None:
            # Without waiting: the collector may run this on a thread that holds the lock.
            # An entry left behind is dead, and pack treats it as unknown.
            if self.lock.acquire(blocking=False):
                try:
                    if self.by_id.get(key) is ref:
                        del self.by_id[key]
                finally:
                    self.lock.release()

        return callback

    def unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Saved):
            return packed
        if self.prefetch:
            with self.lock:
                previous = [
                    ref() for ref in self.order[max(0, packed.index - self.prefetch) : packed.index]
                ]
            handles = [saved.handle for saved in reversed(previous) if saved is not None]
            if handles:
                self.offloader.prefetch(handles)
        return self.offloader.get(packed.handle)


def _same(held: Any, tensor: Any, version: int) -> bool:
    """Whether the tensor the offloader holds (a detached alias) is ``tensor``'s data, as it
    was when put (``version``).

    While the offloader holds it, its memory cannot have been given to another tensor, so
    equal pointers, shapes, strides and dtypes mean the same memory. Whether it was modified
    in place since (its spill file, if written, holds the older values) is told by the
    version recorded at put: the alias shares ``tensor``'s version counter, so comparing
    the two tensors' versions could never tell.
    """
    return (
        held is not None
        and held.data_ptr() == tensor.data_ptr()
        and held.shape == tensor.shape
        and held.stride() == tensor.stride()
        and held.dtype == tensor.dtype
        and tensor._version == version
    )


def offloadable(tensor: Any, min_bytes: int) -> bool:
    """Whether :func:`activations` offloads ``tensor`` (and a step's recording counts it):
    ``min_bytes`` or more, and not a leaf's data."""
    return tensor.numel() * tensor.element_size() >= min_bytes and not _is_leaf_data(tensor)


def _is_leaf_data(tensor: Any) -> bool:
    """A leaf, or a view of one (``weight.t()``): memory that stays allocated anyway."""
    if tensor.is_leaf:
        return True
    base = tensor._base
    return base is not None and base.is_leaf


@contextlib.contextmanager
def activations(
    offloader: Offloader,
    *,
    min_bytes: int | None = None,
    prefetch: int = 2,
    plan: StepPlan | Plan | None = None,
) -> Iterator[None]:
    """Offload the tensors autograd saves for backward while in this block.

    Parameters
    ----------
    offloader
        Where the tensors go; its budget bounds the activations held on the device.
    min_bytes
        Smaller tensors are left to autograd (default: the plan's, else 1 MiB).
    prefetch
        During backward, how many earlier-saved tensors each unpack starts reading back.
    plan
        A spill plan for a step like the one recorded: a
        :class:`~arrayio.offload.StepPlan` from :func:`~arrayio.offload.plan_step` (the
        block, one forward and backward pass, is then timed into it, and
        ``offloader.explain()`` shows it), or a bare :class:`~arrayio.offload._plan.Plan`
        for a :mod:`~arrayio.offload._timeline` recording with the same ``min_bytes``.
        The ``i``-th tensor saved stays with autograd where the plan says ``"device"``,
        and is spilled at once otherwise, to the plan's tier (``"host"``: the
        offloader's host tier while it has room, then the disk; ``"disk"``: the disk);
        tensors past the plan's follow the budget. None: every tensor follows the budget.

    Raises
    ------
    ValueError
        If ``min_bytes`` differs from the one the :class:`StepPlan` recorded with (the
        ``i``-th tensor would not be the plan's ``i``-th).
    RuntimeError
        If the :class:`StepPlan` is not made yet (its ``plan_step`` block has not ended).

    Examples
    --------
    >>> with arrayio.Offloader("/mnt/nvme/scratch", device_budget_bytes=8 << 30) as off:
    ...     with arrayio.offload.activations(off):
    ...         loss = model(x).sum()
    ...         loss.backward()
    """
    import torch

    # Here, not at the top: _step_plan records through _timeline, which imports this module.
    from ._clock import Mark
    from ._step_plan import StepPlan

    step_plan = plan if isinstance(plan, StepPlan) else None
    if step_plan is not None:
        min_bytes = step_plan.checked_min_bytes(min_bytes)
    tiers = plan.tiers if plan is not None else None
    hooks = _Hooks(offloader, 1 << 20 if min_bytes is None else min_bytes, prefetch, tiers)
    if step_plan is not None:
        offloader._step_plan = step_plan
        start = Mark(step_plan.cuda)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        yield
    if step_plan is not None:
        step_plan.ran(start, Mark(step_plan.cuda))
