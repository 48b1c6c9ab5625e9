"""GPU round trips: CuPy, JAX and torch on cuda:0, every dtype, bit for bit; zero-copy
exchange between CuPy and JAX; in-place reads into device memory; the staging path in
several chunks. Run on the GPU machine with ``pytest -m gpu``; skipped cleanly elsewhere."""

from __future__ import annotations

import os

import numpy as np
import pytest

import arrayio
from arrayio.arrays._dtypes import DTYPES, by_name
from arrayio.testing import (
    FRAMEWORK_PARAMS,
    Framework,
    damage_array,
    flip_byte,
    random_array,
    supports,
)

pytestmark = pytest.mark.gpu

GPU_FRAMEWORKS = [f for f in FRAMEWORK_PARAMS if f.device == "cuda"]
ALL_FRAMEWORKS = list(FRAMEWORK_PARAMS)
SHAPES = [(), (0,), (7,), (3, 5, 2)]


def _assert_same(framework: Framework, loaded, expected: np.ndarray) -> None:
    assert tuple(loaded.shape) == expected.shape
    assert framework.dtype_name(loaded) == expected.dtype.name
    assert framework.to_bytes(loaded) == expected.tobytes()


@pytest.mark.parametrize("target", ALL_FRAMEWORKS, ids=lambda f: f.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_gpu_round_trip_every_dtype(tmp_path, gpu_xp: Framework, target: Framework, dtype):
    if target.usable() is not None:
        pytest.skip(target.usable())
    if not (supports(gpu_xp, dtype) and supports(target, dtype)):
        pytest.skip(f"{gpu_xp.name} or {target.name} has no {dtype.name}")
    tree = {str(i): random_array(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)}
    path = tmp_path / "gpu.safetensors"
    arrayio.save(path, {k: gpu_xp.from_numpy(v) for k, v in tree.items()})
    loaded = arrayio.load(path, like=target.name, device=target.device)
    for key, expected in tree.items():
        _assert_same(target, loaded[key], expected)


def test_cupy_has_no_float8_and_says_so(tmp_path):
    path = tmp_path / "f8.safetensors"
    arrayio.save(path, {"x": random_array(by_name("float8_e4m3fn"), (4,))})
    with pytest.raises(arrayio.UnsupportedDtypeError, match="CuPy"):
        arrayio.load(path, like="cupy", device="cuda")


def test_cupy_and_jax_exchange_buffers_zero_copy():
    cupy = pytest.importorskip("cupy")
    jax = pytest.importorskip("jax")
    from arrayio.arrays._frameworks import allocate, export, parse_target

    for dtype in ("float32", "bfloat16", "int8"):
        x = jax.device_put(np.arange(64).astype(np.float32), jax.devices("gpu")[0]).astype(dtype)
        exported = export(x)
        assert exported.data.array.data.ptr == x.unsafe_buffer_pointer(), dtype
        # A JAX load's memory is the driver's, handed over by DLPack without a copy.
        target = allocate(parse_target("jax", "cuda:0"), by_name(dtype), (8, 8))
        target.data.copy_from_host(0, np.full(target.data.nbytes, 7, np.uint8))
        y = target.finish()
        assert y.unsafe_buffer_pointer() == target.data.data_ptr, dtype
        assert set(np.asarray(y).reshape(-1).view(np.uint8).tolist()) == {7}, dtype
    c = cupy.arange(10, dtype=cupy.float32)
    assert jax.dlpack.from_dlpack(c).unsafe_buffer_pointer() == c.data.ptr


def test_jax_results_take_the_direct_import_and_match_the_public_one(tmp_path):
    # arrayio.arrays._jax_import skips from_dlpack's per-array stream and re-wrapping: its arrays
    # must be what from_dlpack gives (memory, shape, dtype, device, commitment, bytes), and
    # on this jaxlib the direct call must be the one taken (not the fallback).
    cupy = pytest.importorskip("cupy")
    jax = pytest.importorskip("jax")
    from arrayio.arrays import _jax_import

    _jax_import.reset()
    tree = {
        f"{dtype}{i}": random_array(by_name(dtype), shape, seed=i)
        for i, shape in enumerate([(3, 5), (0,), (), (1 << 16,)])
        for dtype in ("bfloat16", "float32", "bool", "float8_e4m3fn", "int8")
    }
    path = tmp_path / "j.safetensors"
    arrayio.save(path, tree)
    back = arrayio.load(path, like="jax", device="cuda")
    assert _jax_import._state == "direct"
    device = jax.devices("gpu")[0]
    for key, expected in tree.items():
        got = back[key]
        assert isinstance(got, jax.Array) and got.devices() == {device}, key
        assert np.asarray(got).tobytes() == expected.tobytes(), key
        copied = jax.numpy.copy(got)  # a kernel of JAX's reads the memory
        assert not got.size or copied.unsafe_buffer_pointer() != got.unsafe_buffer_pointer()
        assert np.asarray(copied).tobytes() == expected.tobytes(), key
    c = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    direct = _jax_import.to_jax(jax, c, device)
    public = jax.dlpack.from_dlpack(c)
    assert direct.unsafe_buffer_pointer() == public.unsafe_buffer_pointer() == c.data.ptr
    assert (direct.shape, direct.dtype, direct.committed, direct.sharding) == (
        public.shape,
        public.dtype,
        public.committed,
        public.sharding,
    )


def test_load_to_jax_device_object_and_torch_device(tmp_path):
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    a = random_array(by_name("bfloat16"), (16, 16))
    path = tmp_path / "x.safetensors"
    arrayio.save(path, a)
    device = jax.devices("gpu")[0]
    as_jax = arrayio.load(path, device=device)
    assert isinstance(as_jax, jax.Array) and as_jax.devices() == {device}
    as_torch = arrayio.load(path, device=torch.device("cuda:0"))
    assert as_torch.is_cuda and as_torch.dtype == torch.bfloat16
    assert np.asarray(as_jax).tobytes() == a.tobytes()


def test_read_into_device_memory_in_place(tmp_path):
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    a = random_array(by_name("float32"), (256, 33))
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"x": a})
    out = cupy.zeros(a.shape, dtype=a.dtype)
    pointer = out.data.ptr
    assert arrayio.read_into(path, out, key="x") is out
    assert out.data.ptr == pointer and cupy.asnumpy(out).tobytes() == a.tobytes()
    t = torch.zeros(a.shape, dtype=torch.float32, device="cuda")
    arrayio.read_into(path, t, key="x")
    assert t.cpu().numpy().tobytes() == a.tobytes()


@pytest.mark.parametrize("tool", [None, "staged(threads=4,chunk_size=1048576)", "kvikio"])
def test_a_read_into_memory_a_queued_kernel_still_writes_gets_the_files_bytes(tmp_path, tool):
    # The caller's stream still holds a long kernel, then a fill of the output: the tools
    # write from streams of their own, so without waiting for the caller's stream the fill
    # lands after the file's bytes. Torch and CuPy outputs, on their current streams.
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    if tool == "kvikio":
        pytest.importorskip("kvikio")
    a = random_array(by_name("uint8"), (16 << 20,))
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"x": a})
    out = torch.empty(a.shape, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(1 << 30)  # about half a second of the GPU's clock
    out.fill_(7)
    arrayio.read_into(path, out, key="x", tool=tool)
    assert out.cpu().numpy().tobytes() == a.tobytes()
    # CuPy: a kernel that takes a while, on CuPy's current stream, then the fill.
    c = cupy.empty(a.shape, dtype=cupy.uint8)
    busy = cupy.ones((4096, 4096), dtype=cupy.float32)
    for _ in range(20):
        busy = busy @ busy / 4096
    c.fill(7)
    arrayio.read_into(path, c, key="x", tool=tool)
    assert cupy.asnumpy(c).tobytes() == a.tobytes()


@pytest.mark.parametrize("source", GPU_FRAMEWORKS, ids=lambda f: f.id)
def test_large_array_through_small_staging_buffers(tmp_path, source, monkeypatch):
    # 48 MiB through 1 MiB staging buffers: dozens of chunks each way, checksums verified.
    a = random_array(by_name("float16"), (3 << 20, 8))
    path = tmp_path / "big.safetensors"
    with arrayio.config.set(staging_bytes=1 << 20):
        arrayio.save(path, {"x": source.from_numpy(a)})
        back = arrayio.load(path, like=source.name, device="cuda")["x"]
        rows = arrayio.open(path).read(
            "x", index=slice(1000, 5000), like=source.name, device="cuda"
        )
        # A tensor-parallel rank's columns: the rows whole, then sliced on the GPU (runs of
        # 8 bytes), and a run per row, each into its place on the GPU.
        columns = arrayio.open(path).read(
            "x", index=(slice(1000, 5000), slice(2, 6)), like=source.name, device="cuda"
        )
        from arrayio.api import _reader

        monkeypatch.setattr(_reader, "MIN_RUN_BYTES", 1)
        runs = arrayio.open(path).read(
            "x", index=(slice(1000, 5000), slice(2, 6)), like=source.name, device="cuda"
        )
    assert source.to_bytes(back) == a.tobytes()
    assert source.to_bytes(rows) == a[1000:5000].tobytes()
    assert source.to_bytes(columns) == np.ascontiguousarray(a[1000:5000, 2:6]).tobytes()
    assert source.to_bytes(runs) == np.ascontiguousarray(a[1000:5000, 2:6]).tobytes()


def test_corruption_is_caught_on_gpu_loads(tmp_path):
    a = random_array(by_name("float32"), (1024,))
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"x": a})
    damage_array(path, "x", 100)
    with pytest.raises(arrayio.ChecksumError):
        arrayio.load(path, like="cupy", device="cuda")


@pytest.mark.parametrize(
    "tool",
    [
        "naive",
        "staged(threads=4,chunk_size=1048576)",
        "staged(threads=2,chunk_size=1048576,direct=True)",
    ],
)
def test_gpu_tools_through_the_public_api(tmp_path, tool):
    cupy = pytest.importorskip("cupy")
    a = random_array(by_name("float32"), (3 << 20,))  # 12 MiB: above the small-transfer bypass
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"x": cupy.asarray(a)}, tool=tool)
    assert arrayio.open(path)["x"].crc32c is not None
    back = arrayio.load(path, like="cupy", device="cuda", tool=tool)["x"]
    assert cupy.asnumpy(back).tobytes() == a.tobytes()


@pytest.mark.parametrize(
    "tool",
    [
        "staged(threads=4,chunk_size=1048576)",
        "staged(threads=1,chunk_size=4194304,direct=True)",
        "staged(threads=3,chunk_size=65536,direct=True)",
    ],
)
def test_a_gpu_save_of_many_arrays_through_gathered_writes(tmp_path, tool):
    # The staged tool writes a batch's neighbours as one range, its chunks cut across the
    # arrays: every byte and every array's checksum must be its own, at any alignment.
    cupy = pytest.importorskip("cupy")
    sizes = [(3 << 20) + 2, 1 << 20, (1 << 20) + 5, (2 << 20) - 3, 5 << 20, 4096, 7, 1 << 20]
    tree = {f"a{i}": random_array(by_name("uint8"), (n,), seed=i) for i, n in enumerate(sizes)}
    path = tmp_path / "g.safetensors"
    arrayio.save(path, {k: cupy.asarray(v) for k, v in tree.items()}, tool=tool)
    back = arrayio.load(path)  # host reads, checksums verified
    for key, expected in tree.items():
        assert back[key].tobytes() == expected.tobytes(), key
    for key in ("a4", "a2"):  # checksummed on the GPU (5 MiB), on the host (1 MiB)
        offset, _ = damage_array(path, key, 12345, 0x01)
        with pytest.raises(arrayio.ChecksumError, match=f"'{key}'"):
            arrayio.load(path)
        flip_byte(path, offset, 0x01)  # mended for the next key


@pytest.mark.parametrize(
    "tool",
    [
        None,
        "kvikio",
        "staged(threads=4,chunk_size=1048576)",
        "staged(threads=2,chunk_size=1048576,direct=True)",
    ],
)
def test_batched_jax_loads_hold_every_byte_through_each_tool(tmp_path, tool):
    # A load to JAX on the GPU reads its arrays as one batch into CuPy memory, then wraps
    # each (from_dlpack): every byte must be there, whatever the tool, and a damaged array
    # must fail the load.
    jax = pytest.importorskip("jax")
    if tool == "kvikio":
        from arrayio.tools.kvikio import KvikioTool

        if not KvikioTool.availability():
            pytest.skip(KvikioTool.availability().reason)
    tree = {
        f"w{i}": random_array(by_name(dtype), ((1 << 19) + 4096 * i,), seed=i)
        for i, dtype in enumerate(["bfloat16", "float32"] * 6)
    }  # 1 to 2 MiB each
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree)
    back = arrayio.load(path, like="jax", device="cuda", tool=tool)
    for key, expected in tree.items():
        assert isinstance(back[key], jax.Array)
        assert np.asarray(back[key]).tobytes() == expected.tobytes(), key
    damage_array(path, "w7", 999, 0x10)
    with pytest.raises(arrayio.ChecksumError, match="'w7'"):
        arrayio.load(path, like="jax", device="cuda", tool=tool)


def test_kvikio_reads_and_writes_with_checksums_computed_on_the_gpu(tmp_path):
    cupy = pytest.importorskip("cupy")
    from arrayio.tools.kvikio import KvikioTool

    if not KvikioTool.availability():
        pytest.skip(KvikioTool.availability().reason)
    assert KvikioTool().mode in ("gds", "compat")
    a = random_array(by_name("float32"), (3 << 20,))
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"x": cupy.asarray(a)}, tool="kvikio")
    assert arrayio.open(path)["x"].crc32c is not None
    assert arrayio.load(path)["x"].tobytes() == a.tobytes()  # host CRC agrees with the GPU's
    back = arrayio.load(path, like="cupy", device="cuda", tool="kvikio")["x"]
    assert cupy.asnumpy(back).tobytes() == a.tobytes()
    damage_array(path, "x", 5 << 20, 0x01)
    with pytest.raises(arrayio.ChecksumError):
        arrayio.load(path, like="cupy", device="cuda", tool="kvikio")
    with pytest.raises(arrayio.ChecksumError):
        arrayio.load(path, like="torch", device="cuda")


def test_kvikio_refuses_checksums_when_the_gpu_cannot_compute_them(tmp_path, monkeypatch):
    cupy = pytest.importorskip("cupy")
    from arrayio.integrity import _device_checksum
    from arrayio.tools.kvikio import KvikioTool

    if not KvikioTool.availability():
        pytest.skip(KvikioTool.availability().reason)
    a = random_array(by_name("float32"), (3 << 20,))
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"x": a})
    monkeypatch.setattr(_device_checksum, "_unavailable", "pretend: no NVRTC")
    back = arrayio.load(path, like="cupy", device="cuda", tool="kvikio", verify=False)["x"]
    assert cupy.asnumpy(back).tobytes() == a.tobytes()
    with pytest.raises(arrayio.ToolUnavailableError, match="verify=False"):
        arrayio.load(path, like="cupy", device="cuda", tool="kvikio")
    # The staged tool checksums on the host instead, and still catches nothing wrong here.
    back = arrayio.load(path, like="cupy", device="cuda", tool="staged")["x"]
    assert cupy.asnumpy(back).tobytes() == a.tobytes()


@pytest.mark.parametrize("like", ["torch", "cupy", "jax"])
def test_small_neighbours_reach_the_gpu_whole_beside_a_large_batch(tmp_path, like):
    # Small arrays that are neighbours in the file are read as one run and scattered to
    # their device buffers with one copy (scatter_from_host); a large array beside them
    # takes the batch. Every byte of every array must arrive, and a damaged small array
    # must fail the load by name.
    pytest.importorskip(like)
    rng = np.random.default_rng(41)
    tree = {
        f"b{i:03d}": random_array(
            by_name(["bfloat16", "float32", "int8"][i % 3]), (int(rng.integers(1, 16384)),), seed=i
        )
        for i in range(300)
    }
    tree["big"] = random_array(by_name("float32"), (3 << 20,), seed=999)  # 12 MiB
    path = tmp_path / "m.safetensors"
    arrayio.save(path, tree)
    back = arrayio.load(path, like=like, device="cuda")
    framework = next(f for f in GPU_FRAMEWORKS if f.id.startswith(like))
    for key, expected in tree.items():
        _assert_same(framework, back[key], expected)
    damage_array(path, "b123", 1, 0x01)
    with pytest.raises(arrayio.ChecksumError, match="'b123'"):
        arrayio.load(path, like=like, device="cuda")


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_scatter_from_host_fills_each_device_buffer_from_its_place_in_the_span(kind, pinned):
    # From pageable memory one copy of the span and a copy on the device each; from pinned
    # memory a copy each, queued without waiting.
    from arrayio.arrays._buffers import (
        CupyDeviceBuffer,
        TorchDeviceBuffer,
        scatter_from_host,
        synchronize_device,
    )
    from arrayio.arrays._cuda import alloc_pinned

    xp = pytest.importorskip(kind)
    span = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    if pinned:
        host = alloc_pinned(span.nbytes)
        host[:] = span
        span = host
    places = [(0, 4096), (4096, 1), (9000, 70000), (200000, 12345), (1048000, 576)]

    def empty(n):
        if kind == "torch":
            return TorchDeviceBuffer(xp.zeros(n, dtype=xp.uint8, device="cuda"))
        return CupyDeviceBuffer(xp.zeros(n, dtype=xp.uint8))

    buffers = [empty(n) for _, n in places]
    synchronize_device(buffers[0])  # the zeros written (the copies run on streams of their own)
    scatter_from_host(
        span, [(start, b) for (start, _), b in zip(places, buffers, strict=True)], pinned=pinned
    )
    for (start, n), b in zip(places, buffers, strict=True):
        got = b.tensor.cpu().numpy() if kind == "torch" else b.array.get()
        assert got.tobytes() == span[start : start + n].tobytes(), (start, n)


@pytest.mark.parametrize("writer", ["arrayio", "savez", "savez_compressed"])
def test_npz_archives_to_and_from_the_gpu(tmp_path, gpu_xp: Framework, writer):
    """An .npz saved from device arrays holds their values; stored and compressed members
    load into device memory."""
    arrays = {
        "w": random_array(by_name("float32"), (64, 33), seed=1),
        "i": random_array(by_name("int16"), (5,), seed=2),
    }
    path = tmp_path / "x.npz"
    if writer == "arrayio":
        arrayio.save(path, {k: gpu_xp.from_numpy(v) for k, v in arrays.items()})
    else:
        getattr(np, writer)(path, **arrays)
    with np.load(path) as archive:
        for key, expected in arrays.items():
            np.testing.assert_array_equal(archive[key], expected)
    for target in GPU_FRAMEWORKS:
        if target.usable() is not None:
            continue
        loaded = arrayio.load(path, like=target.name, device=target.device)
        for key, expected in arrays.items():
            _assert_same(target, loaded[key], expected)


def test_a_damaged_header_is_caught_on_gpu_loads(tmp_path, gpu_xp: Framework):
    path = tmp_path / "h.safetensors"
    arrayio.save(path, {"w": gpu_xp.from_numpy(np.arange(1 << 20, dtype=np.float32))})
    blob = bytearray(path.read_bytes())
    blob[blob.index(b'"shape":[') + 9] ^= 0x01  # one bit of the shape
    path.write_bytes(blob)
    with pytest.raises(arrayio.ChecksumError, match="header"):
        arrayio.load(path, device="cuda")


def test_sharded_loads_and_saves_place_arrays_on_the_gpu(tmp_path):
    # One GPU: a sharding (or a ShapeDtypeStruct that carries one) puts each array on it, from
    # one file or a checkpoint in several; a jax.Array on the GPU saves and reads back.
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(4)
    state = {
        "w": rng.standard_normal((64, 12)).astype(np.float32),
        "b": rng.standard_normal(16).astype(np.float32),
    }
    arrayio.save(tmp_path / "one.safetensors", state)
    arrayio.save(tmp_path / "sharded", state, max_shard_size=1024)
    rows = NamedSharding(Mesh(np.array([gpu]), ("data",)), PartitionSpec("data"))
    for source in ("one.safetensors", "sharded"):
        loaded = arrayio.load(tmp_path / source, sharding=SingleDeviceSharding(gpu))
        structured = arrayio.load(
            tmp_path / source,
            structure={
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in state.items()
            },
        )
        for key, expected in state.items():
            for got in (loaded[key], structured[key]):
                assert got.devices() == {gpu}
                np.testing.assert_array_equal(np.asarray(got), expected)
    on_gpu = jax.device_put(state["w"], rows)
    arrayio.save(tmp_path / "from_gpu.safetensors", {"w": on_gpu})
    np.testing.assert_array_equal(arrayio.load(tmp_path / "from_gpu.safetensors")["w"], state["w"])


def test_a_jax_process_loads_onto_the_gpu_without_importing_cupy(tmp_path):
    # Device memory from the driver, handed to JAX by DLPack; checksums checked on the GPU by
    # the driver's launcher (NVRTC), a damaged array caught; the memory JAX gives back pooled
    # and reused by the next load of the same sizes, which holds its own values. CuPy's
    # import costs more than a warm load of a gigabyte.
    pytest.importorskip("jax")
    from arrayio.tools.kvikio import KvikioTool

    if not KvikioTool.availability():  # a tool that cannot checksum on the host
        pytest.skip(KvikioTool.availability().reason)
    for name, base in (("a", 0), ("b", 100)):
        tree = {f"w{i}": np.full((1 << 18) + i, base + i, np.float32) for i in range(8)}
        arrayio.save(tmp_path / f"{name}.safetensors", tree)
    damaged = tmp_path / "d.safetensors"
    arrayio.save(damaged, {"w": np.arange(1 << 20, dtype=np.float32)})
    damage_array(damaged, "w", 4096, 0x10)
    script = f"""
import gc, sys
import jax, numpy as np
import arrayio
from arrayio.arrays import _driver_buffers
from arrayio.integrity import _device_checksum

def load(name, base):
    path = f"{tmp_path}/{{name}}.safetensors"
    back = arrayio.load(path, like="jax", device="cuda", tool="kvikio")
    for i in range(8):
        got = back[f"w{{i}}"]
        assert isinstance(got, jax.Array) and got.devices() == {{jax.devices("gpu")[0]}}
        assert np.asarray(got).tolist() == [float(base + i)] * ((1 << 18) + i), (name, i)
        assert float(jax.numpy.min(got)) == float(jax.numpy.max(got)) == base + i  # JAX reads
    return back

first = load("a", 0)
print("launcher", _device_checksum._chosen.name)
pointers = {{x.unsafe_buffer_pointer() for x in first.values()}}
del first
gc.collect()
pooled = _driver_buffers._pool._bytes.get(0, 0)
assert pooled >= 8 << 20, pooled
second = load("b", 100)
assert {{x.unsafe_buffer_pointer() for x in second.values()}} == pointers, "not reused"
try:
    arrayio.load({str(damaged)!r}, like="jax", device="cuda", tool="kvikio")
    raise SystemExit("damage not caught")
except arrayio.ChecksumError:
    pass
assert "cupy" not in sys.modules, "CuPy was imported"
print("ok")
"""
    import subprocess
    import sys

    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "launcher driver" in result.stdout and "ok" in result.stdout


def test_a_sharded_save_and_load_over_every_gpu_of_one_process(tmp_path):
    # On a machine of several GPUs: each GPU's rows saved from it and read back onto it, the
    # pieces of all the GPUs moving at once (one batch each), then resharded along the
    # columns; every element compared on the host.
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"{len(gpus)} GPU: this test needs several")
    rows = NamedSharding(Mesh(np.array(gpus), ("data",)), P("data"))
    columns = NamedSharding(Mesh(np.array(gpus), ("model",)), P(None, "model"))
    values = {
        f"w{i}": np.random.default_rng(i).standard_normal((len(gpus) * 512, 1024), np.float32)
        for i in range(3)
    }
    tree = {k: jax.device_put(v, rows) for k, v in values.items()}
    path = tmp_path / "sharded.safetensors"
    arrayio.save(path, tree)
    for sharding in (rows, columns):
        out = arrayio.load(path, sharding=sharding)
        for k, v in values.items():
            assert out[k].sharding == sharding, k
            assert {s.device for s in out[k].addressable_shards} == set(gpus), k
            assert np.asarray(out[k]).tobytes() == v.tobytes(), k


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [False, True])
def test_many_small_files_are_read_into_gpu_buffers_in_bundles(tmp_path, direct):
    # A Zarr array's chunk files into device memory: past one per thread, the staged tool
    # reads them a bundle per task (packed into its pinned buffers, copied as the next are
    # read), with and without O_DIRECT; ranges of one file at odd offsets too (a shard's
    # inner chunks). Every buffer gets its bytes; a short file is named.
    cupy = pytest.importorskip("cupy")
    from arrayio.arrays._buffers import CupyDeviceBuffer
    from arrayio.dispatch import batches
    from arrayio.errors import TruncatedFileError
    from arrayio.tools.staged import StagedTool

    rng = np.random.default_rng(5)
    sizes = [int(n) for n in rng.integers(1, 300_000, 40)] + [batches.BUNDLE_BYTES + 5]
    paths, contents = [], []
    for i, n in enumerate(sizes):
        content = rng.integers(0, 256, n + 777, dtype=np.uint8)
        (tmp_path / f"c{i}").write_bytes(content.tobytes())
        paths.append(str(tmp_path / f"c{i}"))
        contents.append(content)
    offsets = [0 if i % 3 else 777 - i for i in range(len(sizes))]  # some at odd offsets

    class Counted(StagedTool):
        def __init__(self, **params):
            super().__init__(**params)
            self.bundles: list[int] = []

        def pread_each_device(self, requests):
            self.bundles.append(len(requests))
            return super().pread_each_device(requests)

    tool = Counted(threads=2, chunk_size=1 << 20, direct=direct)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        buffers = [CupyDeviceBuffer(cupy.zeros(n, dtype=cupy.uint8)) for n in sizes]
        cupy.cuda.Device().synchronize()
        requests = [(fd, at, b) for fd, at, b in zip(fds, offsets, buffers, strict=True)]
        batches.read_files(tool, requests, paths, lambda i: None)
        for content, at, n, buffer in zip(contents, offsets, sizes, buffers, strict=True):
            assert buffer.array.get().tobytes() == content[at : at + n].tobytes()
        # (a bundle of one file is a plain read)
        assert len(tool.bundles) > 1 and len(sizes) // 2 < sum(tool.bundles) <= len(sizes) - 1
        short = [(fds[0], offsets[0] + 800, buffers[0])] + requests[1:]
        with pytest.raises(TruncatedFileError, match=r"c0: file ends"):
            batches.read_files(tool, short, paths, lambda i: None)
    finally:
        for fd in fds:
            os.close(fd)
        tool.close()
