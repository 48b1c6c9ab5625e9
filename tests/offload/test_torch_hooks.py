"""arrayio.offload.activations: torch's saved tensors through an Offloader."""

from __future__ import annotations

import gc
import os

import pytest

import arrayio
from arrayio.offload import Offloader, activations

KB = 1 << 10


def _mlp(torch, device: str, width: int = 64, depth: int = 6):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)


def _gradients(torch, model, x, offloader=None, **hooks):
    model.zero_grad(set_to_none=True)
    if offloader is None:
        loss = model(x).pow(2).mean()
        loss.backward()
    else:
        with activations(offloader, **hooks):
            loss = model(x).pow(2).mean()
            loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


def _check_identical_gradients(torch, tmp_path, device: str) -> None:
    model = _mlp(torch, device)
    x = torch.randn(256, 64, device=device)  # activations of 64 KiB each
    loss, expected = _gradients(torch, model, x)
    with Offloader(tmp_path, device_budget_bytes=3 * 64 * KB) as off:
        loss2, got = _gradients(torch, model, x, off, min_bytes=4 * KB)
        stats = off.stats()
        assert stats.writes > 0 and stats.reads > 0  # it did go through the disk
        assert stats.peak_resident_bytes <= off.budget + 64 * KB
        gc.collect()
        off.wait()
        # Backward released every saved tensor: nothing is held, no file is left.
        assert off.stats().arrays == 0
        assert [n for n in os.listdir(off.directory) if n.endswith(".bin")] == []
    assert torch.equal(loss, loss2)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_identical_gradients_with_offload(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    _check_identical_gradients(torch, tmp_path, "cpu")


def test_parameters_small_tensors_and_duplicates_are_not_put(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    # Each ReLU saves its output, which the next Linear saves again as its input.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )
    x = torch.randn(256, 64)
    put = []
    with Offloader(tmp_path, device_budget_bytes=1 << 30) as off:
        real = off.put
        monkeypatch.setattr(off, "put", lambda t, **kw: put.append(t) or real(t, **kw))
        with activations(off, min_bytes=4 * KB):
            y = model(x).sum()
        parameters = {p.data_ptr() for p in model.parameters()}
        assert put and all(t.data_ptr() not in parameters for t in put)
        assert all(t.numel() * t.element_size() >= 4 * KB for t in put)
        assert len(put) == 2  # the two ReLU outputs, once each
        assert x.data_ptr() not in {t.data_ptr() for t in put}  # the input is a leaf
        y.backward()


def test_prefetch_during_backward(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    model = _mlp(torch, "cpu", depth=8)
    x = torch.randn(256, 64)
    with Offloader(tmp_path, device_budget_bytes=4 * 64 * KB) as off:
        loss, _ = _gradients(torch, model, x, off, min_bytes=4 * KB, prefetch=3)
        assert off.stats().reads > 0


def test_no_offload_outside_the_block(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    model = _mlp(torch, "cpu", depth=2)
    with Offloader(tmp_path, device_budget_bytes=0) as off:
        with activations(off):
            pass
        model(torch.randn(256, 64)).sum().backward()
        assert off.stats().writes == 0


@pytest.mark.gpu
def test_identical_gradients_with_offload_on_gpu(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    _check_identical_gradients(torch, tmp_path, "cuda")


def test_offload_is_exported() -> None:
    assert arrayio.offload.activations is activations
    assert arrayio.Offloader is Offloader


def test_tensor_modified_in_place_between_saves_is_put_again(tmp_path) -> None:
    """y is saved (and written out), then modified in place, then saved again by another
    operation: the second save must give back the modified values, not the file's older
    ones (the alias the offloader holds shares y's version counter, so comparing the two
    versions could never tell)."""
    torch = pytest.importorskip("torch")
    n = 16 * KB  # 64 KiB of float32
    x = torch.arange(n, dtype=torch.float32, requires_grad=True)
    unused = torch.ones(n, requires_grad=True)
    p = torch.ones(n, requires_grad=True)
    with Offloader(tmp_path, device_budget_bytes=2 * 4 * n, writeback_bytes=2 * 4 * n) as off:
        with activations(off, min_bytes=0, prefetch=0):
            y = x * 1.0
            _ = y * unused  # saves y (never used by backward: not part of the loss)
            off.wait()  # y's file is complete (writeback)
            y.mul_(2)
            loss = (y * p).sum()  # saves y again, now doubled
            fillers = [off.put(torch.zeros(n)) for _ in range(2)]  # y's clean copy dropped
            loss.backward()
        del fillers
    assert torch.equal(p.grad, 2 * torch.arange(n, dtype=torch.float32))


def test_a_tensor_spilled_before_its_second_save_is_not_put_again(tmp_path) -> None:
    """y is saved, spilled and written out (the offloader holds it no more), then saved
    again by another operation: the same handle serves both (no second write), so a plan's
    count of saved tensors does not shift with how fast the disk wrote."""
    torch = pytest.importorskip("torch")
    n = 16 * KB  # 64 KiB of float32
    x = torch.arange(n, dtype=torch.float32, requires_grad=True)
    p = torch.ones(n, requires_grad=True)
    q = torch.full((n,), 3.0, requires_grad=True)
    with Offloader(tmp_path, device_budget_bytes=0) as off:
        with activations(off, min_bytes=0, prefetch=0):
            y = x * 1.0
            loss = (y * p).sum()  # saves y (p is a leaf); with no budget y is spilled
            off.wait()  # written out, dropped from memory
            loss = loss + (y * q).sum()  # saves y again
            off.wait()
            writes = off.stats().writes
            loss.backward()
    assert writes == 1
    torch.testing.assert_close(x.grad, torch.full((n,), 4.0))
    torch.testing.assert_close(q.grad, torch.arange(n, dtype=torch.float32))
