"""Points in a training step: CUDA events on the GPU, the host's clock on the CPU.

The host runs ahead of the device, so the host's clock at a hook says when a kernel was
queued, not when it ran: on the GPU a mark is an event recorded on the current stream, read
once the work before it is done.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Mark", "cuda_in_use"]


class Mark:
    """A point in the step: a CUDA event, or the host's clock."""

    __slots__ = ("event", "seconds")

    def __init__(self, cuda: bool) -> None:
        self.event: Any = None
        self.seconds = 0.0
        if cuda:
            import torch

            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.seconds = time.perf_counter()

    def since(self, start: Mark) -> float:
        """Seconds from ``start`` to this mark, waiting for the device to reach it."""
        if self.event is not None:
            self.event.synchronize()
            return float(start.event.elapsed_time(self.event)) / 1e3
        return self.seconds - start.seconds


def cuda_in_use() -> bool:
    """Whether torch runs CUDA in this process (without importing torch where it is not)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
