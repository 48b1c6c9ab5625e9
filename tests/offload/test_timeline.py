"""A step's timeline recorded through torch's saved-tensor hooks (on the CPU here)."""

from __future__ import annotations

import pytest

from arrayio.offload._plan import Rates, plan
from arrayio.offload._timeline import record_step

torch = pytest.importorskip("torch")


def _model(layers: int = 4, width: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def test_forward_makes_in_order_and_backward_needs_in_reverse():
    model = _model()
    x = torch.randn(512, 256)
    with record_step(min_bytes=64 << 10, cuda=False) as recorder:
        model(x).square().sum().backward()
    timeline = recorder.timeline()
    # Each Tanh saves its output; the next Linear (or the square) saves it again as its
    # input: recorded once. The first Linear's input is a leaf.
    assert len(timeline.saved) == 4
    assert {s.nbytes for s in timeline.saved} == {512 * 256 * 4}
    made = [s.produced for s in timeline.saved]
    needed = [s.needed for s in timeline.saved]
    assert made == sorted(made)
    assert needed == sorted(needed, reverse=True)
    assert all(0 <= s.produced <= s.needed <= timeline.step_seconds for s in timeline.saved)
    assert max(made) < min(needed)  # forward, then backward
    result = plan(timeline, Rates(1e12, 1e12, 1e9, 1e9, 1 << 30), max_overhead=0.1)
    assert result.peak_bytes <= result.plain_peak_bytes


def test_small_tensors_and_leaves_are_left_out():
    model = _model(layers=2, width=16)
    with record_step(min_bytes=1 << 20, cuda=False) as recorder:
        model(torch.randn(4, 16)).sum().backward()
    assert recorder.timeline().saved == ()


def test_the_timeline_waits_for_the_step():
    with record_step(cuda=False) as recorder, pytest.raises(RuntimeError, match="recorded"):
        recorder.timeline()
