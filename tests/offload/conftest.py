"""The offload tests compare gradients bit for bit with and without offloading. torch's CPU
kernels may split a reduction over as many threads as they find free at the moment, and
sum in a different order when they find fewer: two identical steps, one of them beside a
background thread of the process, then differ in their last bits (a CI run on 2 cores saw a
weight gradient differ by about 1e-5 of its size). One thread sums in one order."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_cpu_thread_for_torch() -> Iterator[None]:
    if importlib.util.find_spec("torch") is None:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
