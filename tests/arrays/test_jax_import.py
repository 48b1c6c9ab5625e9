"""The direct JAX import falls back to ``jax.dlpack.from_dlpack`` for good when jaxlib's
private call fails or gives anything but the same memory; the GPU suite checks it is taken
on the GPU machine's jaxlib (tests/gpu)."""

from __future__ import annotations

import types

import pytest

from arrayio.arrays import _jax_import


class FakeArray:
    """A stand-in for both sides: ``.data.ptr`` as CuPy has it, ``unsafe_buffer_pointer()``
    as JAX has it."""

    def __init__(self, ptr: int, shape=(2, 3), dtype="float32") -> None:
        self.shape, self.dtype, self.size = shape, dtype, 6
        self.data = types.SimpleNamespace(ptr=ptr)

    def unsafe_buffer_pointer(self) -> int:
        return self.data.ptr


@pytest.fixture
def fake_jax(monkeypatch):
    public: list[FakeArray] = []

    def from_dlpack(x):
        public.append(x)
        return ("public", x)

    jax = types.SimpleNamespace(
        Array=FakeArray, dlpack=types.SimpleNamespace(from_dlpack=from_dlpack)
    )
    _jax_import.reset()
    yield jax, public
    _jax_import.reset()


def test_a_checked_direct_import_is_kept(fake_jax, monkeypatch):
    jax, public = fake_jax
    monkeypatch.setattr(_jax_import, "_direct", lambda x, dev: FakeArray(x.data.ptr))
    for ptr in (4096, 8192):
        got = _jax_import.to_jax(jax, FakeArray(ptr), "gpu0")
        assert isinstance(got, FakeArray) and got.data.ptr == ptr
    assert _jax_import._state == "direct" and public == []


@pytest.mark.parametrize(
    "wrong",
    [
        lambda x, dev: FakeArray(x.data.ptr + 512),  # a copy, not a view
        lambda x, dev: FakeArray(x.data.ptr, shape=(6,)),
        lambda x, dev: FakeArray(x.data.ptr, dtype="bfloat16"),
        lambda x, dev: ("not", "an array"),
    ],
)
def test_a_first_result_that_differs_sends_everything_public(fake_jax, monkeypatch, wrong):
    jax, public = fake_jax
    monkeypatch.setattr(_jax_import, "_direct", wrong)
    first, second = FakeArray(4096), FakeArray(8192)
    assert _jax_import.to_jax(jax, first, "gpu0") == ("public", first)
    monkeypatch.setattr(_jax_import, "_direct", lambda x, dev: FakeArray(x.data.ptr))
    assert _jax_import.to_jax(jax, second, "gpu0") == ("public", second)  # not tried again
    assert _jax_import._state == "public" and public == [first, second]


def test_a_later_failure_falls_back_for_that_array_and_the_rest(fake_jax, monkeypatch):
    jax, public = fake_jax
    calls: list[int] = []

    def flaky(x, dev):
        calls.append(x.data.ptr)
        if len(calls) > 1:
            raise TypeError("incompatible function arguments")
        return FakeArray(x.data.ptr)

    monkeypatch.setattr(_jax_import, "_direct", flaky)
    arrays = [FakeArray(4096 * (i + 1)) for i in range(4)]
    got = [_jax_import.to_jax(jax, a, "gpu0") for a in arrays]
    assert isinstance(got[0], FakeArray)
    assert got[1:] == [("public", a) for a in arrays[1:]] and len(calls) == 2


def test_an_empty_array_goes_public_and_decides_nothing(fake_jax, monkeypatch):
    jax, public = fake_jax
    monkeypatch.setattr(_jax_import, "_direct", lambda x, dev: FakeArray(x.data.ptr))
    empty = FakeArray(0)
    empty.size = 0
    assert _jax_import.to_jax(jax, empty, "gpu0") == ("public", empty)
    assert _jax_import._state == "untried"


def test_without_jaxlib_s_private_call_it_is_the_public_path(fake_jax, monkeypatch):
    jax, public = fake_jax  # the fake jax has no jax._src: the real import of it may not match
    monkeypatch.setattr(_jax_import, "_direct", None)
    monkeypatch.setitem(__import__("sys").modules, "jax._src.lib", None)  # import fails
    a = FakeArray(4096)
    assert _jax_import.to_jax(jax, a, "gpu0") == ("public", a)
    assert _jax_import._state == "public"
