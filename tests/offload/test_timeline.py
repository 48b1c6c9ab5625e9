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


def test_a_plan_spills_what_it_says_and_keeps_the_rest(tmp_path):
    import arrayio
    from arrayio.offload._plan import simulate

    # Layers of different widths: the bytes spilled tell which tensors were.
    torch.manual_seed(0)
    widths = [256, 128, 192, 64, 320]
    blocks = []
    for a, b in zip(widths, widths[1:], strict=False):
        blocks += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*blocks)
    x = torch.randn(512, 256)
    with record_step(min_bytes=64 << 10, cuda=False) as recorder:
        model(x).square().sum().backward()
    timeline = recorder.timeline()
    assert [s.nbytes for s in timeline.saved] == [512 * w * 4 for w in widths[1:]]
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    tiers = ["device", "disk", "device", "disk"]
    chosen = simulate(timeline, Rates(1e12, 1e12, 1e9, 1e9, 0), tiers)
    with arrayio.Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        with arrayio.offload.activations(off, min_bytes=64 << 10, plan=chosen):
            model(x).square().sum().backward()
        off.wait()  # the spills run in the background
        stats = off.stats()
    # The second and fourth spilled at once (though the budget had room), the others kept.
    assert stats.writes == 2 and stats.bytes_written == 512 * (192 + 320) * 4
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name])
