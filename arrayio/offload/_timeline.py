"""A training step's timeline, recorded: each tensor autograd saves for backward, its bytes,
when forward made it and when backward first needed it, as the spill planner
(:mod:`arrayio.offload._plan`) takes it.

Recorded through ``torch.autograd.graph.saved_tensors_hooks`` over one forward and backward
pass, offloading nothing. On the GPU the marks are CUDA events recorded on the current
stream, read once the step is done: the host runs ahead of the device, so the host's clock
at a hook says when the kernel was queued, not when it ran. On the CPU they are the host's
clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from ._clock import Mark, cuda_in_use
from ._plan import Saved, Timeline
from ._torch_hooks import offloadable

__all__ = ["StepRecorder", "marked_timeline", "record_step"]


class _Recorded:
    """What autograd keeps in place of a recorded tensor: the tensor itself, and its index."""

    __slots__ = ("index", "tensor")

    def __init__(self, tensor: Any, index: int) -> None:
        self.tensor, self.index = tensor, index


class StepRecorder:
    """The saved tensors' marks of one step; :meth:`timeline` once the block is done."""

    def __init__(self, min_bytes: int, cuda: bool) -> None:
        self.min_bytes = min_bytes
        self.cuda = cuda
        self._start: Mark | None = None
        self._end: Mark | None = None
        self._bytes: list[int] = []
        self._made: list[Mark] = []
        self._needed: list[Mark | None] = []
        self._by_id: dict[int, _Recorded] = {}

    def pack(self, tensor: Any) -> Any:
        if not offloadable(tensor, self.min_bytes):
            return tensor
        known = self._by_id.get(id(tensor))
        if known is not None and known.tensor is tensor:  # saved by several operations
            return known
        recorded = self._by_id[id(tensor)] = _Recorded(tensor, len(self._bytes))
        self._bytes.append(tensor.numel() * tensor.element_size())
        self._made.append(Mark(self.cuda))
        self._needed.append(None)
        return recorded

    def unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Recorded):
            return packed
        if self._needed[packed.index] is None:
            self._needed[packed.index] = Mark(self.cuda)
        return packed.tensor

    def timeline(self, base_bytes: int = 0) -> Timeline:
        """The step's timeline; a tensor backward never needed counts as needed at the end.

        Raises
        ------
        RuntimeError
            Before the recording block has ended.
        """
        if self._start is None or self._end is None:
            raise RuntimeError("the step is still being recorded")
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return marked_timeline(
            self._start, self._end, self._bytes, self._made, self._needed, base_bytes
        )


def marked_timeline(
    start: Mark,
    end: Mark,
    sizes: Sequence[int],
    made: Sequence[Mark],
    needed: Sequence[Mark | None],
    base_bytes: int = 0,
) -> Timeline:
    """The timeline of a step from ``start`` to ``end`` whose saved arrays have ``sizes``,
    were made at the marks ``made`` and first needed at ``needed`` (None: never, which
    counts as needed at the end), each clamped into the step."""
    step = end.since(start)
    saved = []
    for nbytes, made_at, needed_at in zip(sizes, made, needed, strict=True):
        produced = min(max(made_at.since(start), 0.0), step)
        need = needed_at.since(start) if needed_at is not None else step
        saved.append(Saved(nbytes, produced, min(max(need, produced), step)))
    return Timeline(tuple(saved), step, base_bytes)


@contextlib.contextmanager
def record_step(*, min_bytes: int = 1 << 20, cuda: bool | None = None) -> Iterator[StepRecorder]:
    """Record the tensors autograd saves in the block (one forward and backward pass), as
    :func:`~arrayio.offload.activations` would see them (smaller than ``min_bytes``, and
    leaves, are left out); ``cuda`` (default: whether torch runs CUDA) says whether the
    marks are CUDA events."""
    import torch

    if cuda is None:
        cuda = cuda_in_use()
    recorder = StepRecorder(min_bytes, cuda)
    recorder._start = Mark(cuda)
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
            yield recorder
        recorder._end = Mark(cuda)
    finally:
        recorder._by_id.clear()  # the step's tensors are autograd's to free
