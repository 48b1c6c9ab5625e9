"""Choosing the result's framework and device, and clear errors where a framework lacks a
dtype or a device makes no sense."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

import arrayio
from arrayio.arrays._dtypes import by_name
from arrayio.arrays._frameworks import Placement, parse_target
from arrayio.testing import random_array


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "x.safetensors"
    tree = {
        "f64": random_array(by_name("float64"), (4,)),
        "bf16": random_array(by_name("bfloat16"), (2, 3)),
        "f32": np.arange(6, dtype=np.float32),
    }
    arrayio.save(path, tree)
    return path, tree


@pytest.mark.parametrize(
    ("like", "device", "framework", "placement"),
    [
        (None, None, "numpy", Placement("cpu")),
        ("numpy", "cpu", "numpy", Placement("cpu")),
        (None, "cuda", "cupy", Placement("cuda", 0)),
        ("torch", "cuda:1", "torch", Placement("cuda", 1)),
        ("jax", "gpu:0", "jax", Placement("cuda", 0)),
    ],
)
def test_parse_target(like, device, framework, placement, monkeypatch) -> None:
    # Only the parsing is under test: pretend every framework is importable, every GPU usable.
    monkeypatch.setattr("arrayio.arrays._frameworks.require", lambda name: None)
    monkeypatch.setattr("arrayio.arrays._frameworks._check_cuda", lambda *args: args[2])
    request = parse_target(like, device)
    assert (request.framework, request.placement) == (framework, placement)


@pytest.mark.parametrize(
    ("like", "device", "error"),
    [
        ("numpy", "cuda", arrayio.DeviceError),
        ("cupy", "cpu", arrayio.DeviceError),
        (None, "tpu:0", arrayio.DeviceError),
        (None, "cuda:x", arrayio.DeviceError),
        ("tensorflow", None, ValueError),
        (object(), None, ValueError),
    ],
)
def test_bad_targets(like, device, error) -> None:
    with pytest.raises(error):
        parse_target(like, device)


def test_device_error_is_value_error() -> None:
    with pytest.raises(ValueError, match="cuda"):
        parse_target("numpy", "cuda:0")


def test_like_an_example_array_picks_framework(saved) -> None:
    torch = pytest.importorskip("torch")
    path, tree = saved
    loaded = arrayio.load(path, like=torch.zeros(1))
    assert isinstance(loaded["f32"], torch.Tensor)
    assert loaded["f32"].tolist() == tree["f32"].tolist()


def test_numpy_without_ml_dtypes_is_a_clear_error(saved, monkeypatch) -> None:
    path, tree = saved
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` fail
    with pytest.raises(arrayio.FrameworkNotAvailableError, match="ml_dtypes"):
        arrayio.load(path)
    # Arrays of NumPy's own dtypes still load.
    assert arrayio.load(path, keys="f32").tolist() == tree["f32"].tolist()


def test_jax_without_x64_refuses_to_narrow(saved) -> None:
    jax = pytest.importorskip("jax")
    path, tree = saved
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(arrayio.UnsupportedDtypeError, match="jax_enable_x64"):
            arrayio.load(path, like="jax")
        bf16 = arrayio.load(path, like="jax", keys="bf16")
        assert np.asarray(bf16).tobytes() == tree["bf16"].tobytes()
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_jax_bfloat16_to_torch_and_numpy(tmp_path) -> None:
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    x = jax.numpy.linspace(-3, 3, 24, dtype=jax.numpy.bfloat16).reshape(4, 6)
    path = tmp_path / "bf16.safetensors"
    arrayio.save(path, {"x": x})
    as_torch = arrayio.load(path, like="torch")["x"]
    as_numpy = arrayio.load(path)["x"]
    assert as_torch.dtype == torch.bfloat16
    assert as_torch.view(torch.int16).numpy().tobytes() == np.asarray(x).tobytes()
    assert as_numpy.dtype.name == "bfloat16"
    assert as_numpy.tobytes() == np.asarray(x).tobytes()
    assert arrayio.open(path).framework == "jax"


def test_jax_load_on_cpu_is_zero_copy_for_native_dtypes(tmp_path) -> None:
    jax = pytest.importorskip("jax")
    from arrayio.arrays._frameworks import allocate

    request = parse_target("jax", "cpu")
    target = allocate(request, by_name("float32"), (8, 8))
    target.data[:] = 7
    result = target.finish()
    assert isinstance(result, jax.Array)
    assert result.unsafe_buffer_pointer() == target.data.ctypes.data


def test_numpy_save_is_zero_copy_for_contiguous_arrays() -> None:
    from arrayio.arrays._frameworks import export

    a = np.arange(1000, dtype=np.float64)
    assert np.shares_memory(export(a).data, a)
    strided = a[::2]
    assert not np.shares_memory(export(strided).data, a)  # made contiguous: a copy


# --------------------------------------------------------------------------- GPUs


@pytest.fixture
def no_cuda_driver():
    """Skips unless this machine has no CUDA driver at all (as CI and laptops)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    pytest.skip("this machine has a CUDA driver")


@pytest.mark.parametrize("like", [None, "cupy", "torch", "jax"])
def test_a_gpu_request_without_a_driver_is_a_device_error(saved, no_cuda_driver, like):
    path, _ = saved
    with pytest.raises(arrayio.DeviceError) as caught:
        arrayio.load(path, like=like, device="cuda:0")
    message = str(caught.value)
    assert "no usable CUDA GPU" in message and "no NVIDIA driver" in message
    assert "device='cpu'" in message
    with (
        arrayio.open(path) as reader,
        pytest.raises(arrayio.DeviceError, match="no usable CUDA GPU"),
    ):
        reader.read("f32", device="cuda")


def test_the_driver_check_imports_no_framework(saved, no_cuda_driver):
    import subprocess

    path, _ = saved
    code = (
        "import sys, arrayio\n"
        "try:\n"
        f"    arrayio.load({str(path)!r}, device='cuda')\n"
        "except arrayio.DeviceError:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={"ARRAYIO_CACHE_DIR": "none", "PATH": ""},
    )
    assert result.stdout.strip() == "[]"


def test_a_cpu_only_torch_says_so(saved, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("torch is a CUDA build")
    monkeypatch.setattr("arrayio.arrays._frameworks._cuda_driver", lambda: (1, None))  # a GPU
    path, _ = saved
    with pytest.raises(arrayio.DeviceError, match="CPU-only build of torch") as caught:
        arrayio.load(path, like="torch", device="cuda")
    assert "pytorch.org" in str(caught.value)


def test_a_cpu_only_jax_says_so(saved, monkeypatch):
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
        pytest.skip("JAX has a GPU backend")
    except RuntimeError:
        pass
    monkeypatch.setattr("arrayio.arrays._frameworks._cuda_driver", lambda: (1, None))
    path, _ = saved
    with pytest.raises(arrayio.DeviceError, match="no GPU backend") as caught:
        arrayio.load(path, like="jax", device="cuda", keys="f32")
    assert "jax[cuda" in str(caught.value)


def test_a_device_index_beyond_the_gpus_is_a_device_error(monkeypatch):
    monkeypatch.setattr("arrayio.arrays._frameworks._cuda_driver", lambda: (2, None))
    with pytest.raises(arrayio.DeviceError, match=r"cuda:2.*2 CUDA GPUs \(cuda:0 to cuda:1\)"):
        parse_target("cupy", "cuda:2")


def test_only_results_that_read_no_bytes_are_made_while_the_bytes_move() -> None:
    # A load makes these results while its transfers run (Target.wraps): a view of NumPy's
    # buffer may be; a JAX array on the host, which JAX may copy, is made after.
    from arrayio.arrays._frameworks import allocate

    assert allocate(parse_target("numpy", "cpu"), by_name("float32"), (4,)).wraps
    if importlib.util.find_spec("jax") is not None:
        assert not allocate(parse_target("jax", "cpu"), by_name("float32"), (4,)).wraps


def test_a_load_makes_its_wrapping_results_during_its_reads(tmp_path, monkeypatch) -> None:
    from arrayio.dispatch import _transfer

    arrays = {f"a{i}": np.full(300_000, i, np.float32) for i in range(4)}
    path = tmp_path / "w.safetensors"
    arrayio.save(path, arrays)
    real = _transfer.read_many
    seen: list[bool] = []

    def read_many(*args, meanwhile=None, **kwargs):
        seen.append(meanwhile is not None)
        return real(*args, meanwhile=meanwhile, **kwargs)

    monkeypatch.setattr(_transfer, "read_many", read_many)
    loaded = arrayio.load(path)
    assert seen and all(seen)
    for key, value in arrays.items():
        np.testing.assert_array_equal(loaded[key], value)
