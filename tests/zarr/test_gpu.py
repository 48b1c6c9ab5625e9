"""NVMeStore and ``read`` with GPU memory: chunks land in CuPy memory under
``zarr.config.enable_gpu()``, many at once and in several pieces each; GPU buffers are
written; JAX and torch get the device memory zarr filled, without a copy. Run on the GPU
machine (``pytest -m gpu``); skipped cleanly elsewhere."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest  # noqa: E402
from zarr.storage import LocalStore  # noqa: E402

from arrayio.arrays import _frameworks  # noqa: E402
from arrayio.zarr import NVMeStore, read  # noqa: E402
from arrayio.zarr._kernels import DeviceSpan, address  # noqa: E402

pytestmark = pytest.mark.gpu
FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"
HAS_FUSED = hasattr(zarr.core.codec_pipeline, "FusedCodecPipeline")


@pytest.fixture
def cupy():
    return pytest.importorskip("cupy")


@pytest.fixture
def gpu_prototype(cupy):
    from zarr.core.buffer import gpu

    return gpu.buffer_prototype


def payload(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("pipeline", ["batched", "fused", "arrayio"])
def test_arrays_written_on_the_cpu_read_into_the_gpu(tmp_path, cupy, codec, pipeline):
    if pipeline == "fused" and not HAS_FUSED:
        pytest.skip(f"zarr {zarr.__version__} has no FusedCodecPipeline (zarr >= 3.4)")
    data = np.random.default_rng(0).normal(size=(300, 200)).astype(np.float32)
    z = zarr.create_array(
        LocalStore(tmp_path),
        shape=data.shape,
        chunks=(64, 64),
        dtype=data.dtype,
        compressors=None if codec == "none" else zarr.codecs.ZstdCodec(),
    )
    z[...] = data
    paths = {"fused": FUSED, "arrayio": "arrayio.zarr.CodecPipeline"}
    config = {"codec_pipeline.path": paths[pipeline]} if pipeline in paths else {}
    with zarr.config.enable_gpu(), zarr.config.set(config):
        array = zarr.open_array(NVMeStore(tmp_path, read_only=True), mode="r")
        got = array[...]
        part = array[17:250, 3]
    assert isinstance(got, cupy.ndarray) and isinstance(part, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    np.testing.assert_array_equal(cupy.asnumpy(part), data[17:250, 3])


@pytest.mark.parametrize("rows", [64, 300])
def test_whole_row_chunks_are_read_into_gpu_memory_in_place(tmp_path, cupy, monkeypatch, rows):
    # Chunks of 64 full rows land on contiguous rows of the GPU output: read there by the
    # dispatcher (device buffers), no staging; the array's last, cut chunk is staged.

    data = np.random.default_rng(3).normal(size=(rows, 512)).astype(np.float32)
    z = zarr.create_array(
        LocalStore(tmp_path), shape=data.shape, chunks=(64, 512), dtype="f4", compressors=None
    )
    z[...] = data
    made = _in_place(monkeypatch)
    got = _read_whole(NVMeStore(tmp_path, read_only=True))
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    whole = rows // 64
    assert made[0] == [True] * whole + [False] * (len(made[0]) - whole)


def test_the_pipeline_decodes_a_read_in_one_gpu_batch(tmp_path, cupy, monkeypatch):
    # Every zstd chunk of the selection goes to nvCOMP in one call, with zarr's defaults.

    data = np.random.default_rng(2).normal(size=(256, 256)).astype(np.float32)
    z = zarr.create_array(LocalStore(tmp_path), shape=data.shape, chunks=(32, 32), dtype="f4")
    z[...] = data
    batches = _submitted(monkeypatch)
    got = _read_whole(LocalStore(tmp_path, read_only=True))
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    assert [len(arrays) for arrays, _ in batches] == [64]


def _in_place(monkeypatch) -> list:
    """Per read, whether each request of the pipeline's file reads landed in the output."""
    from arrayio.zarr import _pipeline

    made = []
    real = _pipeline._read_files

    def spying(files, places, staging=None):
        result = real(files, places, staging)
        made.append(result[2])
        return result

    monkeypatch.setattr(_pipeline, "_read_files", spying)
    return made


def _read_whole(store):
    """The array in ``store`` read whole into GPU memory through arrayio's pipeline."""
    with (
        zarr.config.enable_gpu(),
        zarr.config.set({"codec_pipeline.path": "arrayio.zarr.CodecPipeline"}),
    ):
        return zarr.open_array(store, mode="r")[...]


def _submitted(monkeypatch, host_share: float = 0.0) -> list:
    """The (chunks, destinations) of every batch the pipeline hands nvCOMP's worker, with
    ``host_share`` of each batch's chunks decoded on the host instead (none by default)."""
    from arrayio.zarr import _gpu_worker

    _placed(monkeypatch, host_share)
    made = []
    real = _gpu_worker.DeviceWorker.submit

    def spying(device_id, kind, arrays, zstd, destinations=None):
        made.append((arrays, destinations))
        return real(device_id, kind, arrays, zstd, destinations)

    monkeypatch.setattr(_gpu_worker.DeviceWorker, "submit", spying)
    return made


def _reads_whole_and_part(cupy, root, data, part) -> None:
    """The array at ``root``, read whole and at ``part`` into GPU memory through arrayio's
    pipeline, holds ``data``."""
    with (
        zarr.config.enable_gpu(),
        zarr.config.set({"codec_pipeline.path": "arrayio.zarr.CodecPipeline"}),
    ):
        array = zarr.open_array(NVMeStore(root, read_only=True), mode="r")
        got = array[...]
        got_part = array[part]
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    np.testing.assert_array_equal(cupy.asnumpy(got_part), data[part])


def _placed(monkeypatch, host_share: float) -> None:
    """Every batch shares ``host_share`` of its chunks with the host, whatever was learned."""
    from arrayio.zarr import _decode_placement

    def fixed(device_id, chunk_bytes, chunks):
        context = _decode_placement.context_of(device_id, chunk_bytes, chunks)
        return _decode_placement.Placement(round(host_share * chunks), context, "forced")

    monkeypatch.setattr(_decode_placement, "placement", fixed)


@pytest.mark.parametrize("host_share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("rows", [256, 300])
def test_zstd_chunks_decoded_on_the_host_and_by_nvcomp_read_exactly(
    tmp_path, cupy, monkeypatch, host_share, crc, rows
):
    # Whatever share the host decodes, every chunk lands in its place: whole row chunks in
    # the output's own memory, the cut last chunk and a slab's cut chunks placed after.
    data = np.random.default_rng(6).normal(size=(rows, 256)).astype(np.float32)
    compressors = [zarr.codecs.ZstdCodec(level=3)]
    if crc:
        compressors.append(zarr.codecs.Crc32cCodec())
    z = zarr.create_array(
        LocalStore(tmp_path),
        shape=data.shape,
        chunks=(32, 256),
        dtype="f4",
        compressors=compressors,
    )
    z[...] = data
    given = _submitted(monkeypatch, host_share)
    _reads_whole_and_part(cupy, tmp_path, data, (slice(45, 270), slice(7, 200)))
    chunks = -(-rows // 32)
    expected_gpu = chunks - round(host_share * chunks)
    assert (len(given[0][0]) if given else 0) == expected_gpu


def test_a_damaged_chunk_decoded_on_the_host_raises(tmp_path, cupy, monkeypatch):
    from arrayio.errors import ArrayioError

    data = np.random.default_rng(7).normal(size=(256, 256)).astype(np.float32)
    z = zarr.create_array(
        LocalStore(tmp_path),
        shape=data.shape,
        chunks=(32, 256),
        dtype="f4",
        compressors=[zarr.codecs.ZstdCodec(level=3, checksum=True)],
    )
    z[...] = data
    chunk = tmp_path / "c" / "7" / "0"
    damaged = bytearray(chunk.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    chunk.write_bytes(bytes(damaged))
    _placed(monkeypatch, 1.0)
    with (
        zarr.config.enable_gpu(),
        zarr.config.set({"codec_pipeline.path": "arrayio.zarr.CodecPipeline"}),
    ):
        with pytest.raises(ArrayioError):
            zarr.open_array(NVMeStore(tmp_path, read_only=True), mode="r")[...]


def test_the_first_read_of_a_context_is_shared_then_placed_by_rate(tmp_path, cupy, monkeypatch):
    from arrayio.zarr import _decode_placement, _gpu_worker

    monkeypatch.setattr(_decode_placement, "_learned", {})
    data = np.random.default_rng(8).normal(size=(512, 256)).astype(np.float32)
    z = zarr.create_array(LocalStore(tmp_path), shape=data.shape, chunks=(32, 256), dtype="f4")
    z[...] = data
    sizes = []
    real = _gpu_worker.DeviceWorker.submit

    def spying(device_id, kind, arrays, zstd, destinations=None):
        sizes.append(len(arrays))
        return real(device_id, kind, arrays, zstd, destinations)

    monkeypatch.setattr(_gpu_worker.DeviceWorker, "submit", spying)
    with (
        zarr.config.enable_gpu(),
        zarr.config.set({"codec_pipeline.path": "arrayio.zarr.CodecPipeline"}),
    ):
        array = zarr.open_array(NVMeStore(tmp_path, read_only=True), mode="r")
        for _ in range(3):
            np.testing.assert_array_equal(cupy.asnumpy(array[...]), data)
    assert sizes[0] == 8  # 16 chunks, half of them on the host, measured
    [line] = _decode_placement.report()
    assert "batches of about 2^4" in line and "3 batches" in line


@pytest.mark.parametrize("rows", [256, 300])
def test_zstd_row_chunks_are_decoded_into_their_place_in_the_output(
    tmp_path, cupy, monkeypatch, rows
):
    # Chunks of 32 full rows: nvCOMP decodes each into its rows of the CuPy output (no
    # placement copy); the cut last chunk of 300 rows is decoded apart and copied.

    data = np.random.default_rng(4).normal(size=(rows, 256)).astype(np.float32)
    z = zarr.create_array(LocalStore(tmp_path), shape=data.shape, chunks=(32, 256), dtype="f4")
    z[...] = data
    given = _submitted(monkeypatch)
    got = _read_whole(LocalStore(tmp_path, read_only=True))
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    [(_, places)] = given
    whole = rows // 32
    assert [p is not None for p in places] == [True] * whole + [False] * (len(places) - whole)
    assert address(places[0]) == got.data.ptr  # the output's own memory
    # places and chunks are spans, not a CuPy view each
    assert all(type(p) is DeviceSpan for p in places[:whole])
    assert all(type(chunk) is DeviceSpan for chunks, _ in given for chunk in chunks)


def test_sharded_zstd_arrays_read_into_the_gpu_in_one_batch(tmp_path, cupy, monkeypatch):
    # 4 shards of 64 inner zstd chunks each: one nvCOMP batch of every inner chunk read.
    data = np.random.default_rng(5).normal(size=(256, 256)).astype(np.float32)
    z = zarr.create_array(
        LocalStore(tmp_path), shape=data.shape, chunks=(16, 16), shards=(128, 128), dtype="f4"
    )
    z[...] = data
    batches = _submitted(monkeypatch)
    _reads_whole_and_part(cupy, tmp_path, data, (slice(10, 200), slice(30, 250)))
    assert len(batches[0][0]) == 256


def test_gpu_buffers_written_read_by_local_store(tmp_path, cupy):
    data = cupy.arange(100_000, dtype=cupy.int32).reshape(250, 400)
    with zarr.config.enable_gpu():
        z = zarr.create_array(NVMeStore(tmp_path), shape=data.shape, chunks=(100, 128), dtype="i4")
        z[...] = data
    got = zarr.open_array(LocalStore(tmp_path, read_only=True), mode="r")[...]
    np.testing.assert_array_equal(got, cupy.asnumpy(data))


def test_large_values_read_and_written_on_the_gpu(tmp_path, cupy, gpu_prototype):
    store = NVMeStore(tmp_path)
    size = (16 << 20) + 12345  # many of any tool's chunks, the last one short
    data = payload(size, 1)
    (tmp_path / "big").write_bytes(data)
    got = store.get_sync("big", prototype=gpu_prototype)
    assert isinstance(got.as_array_like(), cupy.ndarray)
    assert got.to_bytes() == data
    value = gpu_prototype.buffer.from_bytes(data[::-1])
    store.set_sync("back", value)
    assert (tmp_path / "back").read_bytes() == data[::-1]


def test_many_threads_read_into_the_gpu_at_once(tmp_path, cupy, gpu_prototype):
    store = NVMeStore(tmp_path)
    sizes = [1, 4097, 300_000, 1 << 20, (3 << 20) + 5, (8 << 20) + 777]
    values = {f"c/{i}": payload(sizes[i % len(sizes)], i) for i in range(36)}
    for key, value in values.items():
        (tmp_path / key).parent.mkdir(exist_ok=True)
        (tmp_path / key).write_bytes(value)
    keys = list(values) * 3
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(lambda k: store.get_sync(k, prototype=gpu_prototype), keys))
    assert [g.to_bytes() for g in got] == [values[k] for k in keys]

    async def batch():
        return await store.get_partial_values(gpu_prototype, [(k, None) for k in keys])

    assert [g.to_bytes() for g in asyncio.run(batch())] == [values[k] for k in keys]


@pytest.mark.parametrize("failure", ["ToolUnavailableError", "RuntimeError"])
def test_a_tool_that_fails_midway_leaves_no_bytes_of_its_own(
    tmp_path, cupy, gpu_prototype, monkeypatch, failure, fresh
):
    # The first arm the dispatcher tries for the store's batches scribbles on the device
    # memory, then fails (as a failing KvikIO read may): the batch moves again with the next
    # arm, and every value comes back whole. A fresh dispatcher: the process-wide one keeps
    # the tool instances it made, and would hand this run the Broken of the previous one.
    from arrayio import tools
    from arrayio.dispatch import dispatcher as dispatcher_module
    from arrayio.dispatch.arm import Arm
    from arrayio.errors import ToolUnavailableError
    from arrayio.tools import Capabilities, Tool

    calls = []

    class Broken(Tool):
        name = "broken"
        capabilities = Capabilities(frozenset({"host", "cuda"}), checksums=False)

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            calls.append(buffer.nbytes)
            buffer.cuda_array[:] = 0xA5  # scribbles, then fails
            if failure == "RuntimeError":
                raise RuntimeError("broken: a KvikIO error in the middle of a read")
            raise ToolUnavailableError("broken: injected")

        pwrite = pread

    monkeypatch.setattr(tools, "_REGISTRY", dict(tools._REGISTRY))
    tools.register("broken", Broken)
    real = dispatcher_module.candidate_arms

    def broken_first(context):
        arms = real(context)
        return [Arm.of("broken"), *arms] if context.memory == "cuda" else arms

    monkeypatch.setattr(dispatcher_module, "candidate_arms", broken_first)
    values = {f"w/{i}": payload((2 << 20) + i, i) for i in range(24)}
    for key, value in values.items():
        (tmp_path / key).parent.mkdir(exist_ok=True)
        (tmp_path / key).write_bytes(value)
    store = NVMeStore(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda k: store.get_sync(k, prototype=gpu_prototype), values))
    assert [g.to_bytes() for g in got] == list(values.values())
    assert calls  # tried


@pytest.mark.parametrize(
    "request_",
    [
        None,
        RangeByteRequest(5, 3_000_000),
        OffsetByteRequest(4095),
        SuffixByteRequest(10_001),
        RangeByteRequest(9_000_000, 9_000_010),
    ],
    ids=repr,
)
def test_byte_ranges_into_the_gpu(tmp_path, cupy, gpu_prototype, request_):
    data = payload(3 << 20, 2)
    (tmp_path / "k").write_bytes(data)
    ours = NVMeStore(tmp_path).get_sync("k", prototype=gpu_prototype, byte_range=request_)
    theirs = LocalStore(tmp_path).get_sync("k", byte_range=request_)
    assert isinstance(ours.as_array_like(), cupy.ndarray)
    assert ours.to_bytes() == theirs.to_bytes()


@pytest.fixture
def stored(tmp_path):
    data = np.random.default_rng(3).normal(size=(230, 110)).astype(np.float32)
    z = zarr.create_array(
        NVMeStore(tmp_path),
        shape=data.shape,
        chunks=(50, 40),
        dtype=data.dtype,
        compressors=zarr.codecs.ZstdCodec(),
    )
    z[...] = data
    return tmp_path, data


def _spy_allocations(monkeypatch) -> list:
    made = []
    real = _frameworks.allocate
    monkeypatch.setattr(
        _frameworks, "allocate", lambda *a, **k: (made.append(real(*a, **k)), made[-1])[1]
    )
    return made


def test_jax_gets_the_device_memory_zarr_filled(stored, monkeypatch, cupy):
    jax = pytest.importorskip("jax")
    root, data = stored
    made = _spy_allocations(monkeypatch)
    got = read(root, (slice(10, 200), Ellipsis), like="jax", device="cuda")
    assert isinstance(got, jax.Array)
    assert next(iter(got.devices())).platform in ("gpu", "cuda")
    np.testing.assert_array_equal(np.asarray(got), data[10:200])
    assert got.unsafe_buffer_pointer() == made[-1].data.data_ptr  # zero-copy


def test_torch_and_cupy_on_the_gpu(stored, monkeypatch, cupy):
    root, data = stored
    got = read(root, device="cuda:0")
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    torch = pytest.importorskip("torch")
    made = _spy_allocations(monkeypatch)
    tensor = read(root, (7, slice(None)), like="torch", device="cuda")
    assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda"
    np.testing.assert_array_equal(tensor.cpu().numpy(), data[7])
    assert tensor.data_ptr() == made[-1].data.tensor.data_ptr()


def test_sharded_arrays_stored_as_is_are_read_into_the_gpu_a_run_per_shard(
    tmp_path, cupy, monkeypatch
):
    # 4 shards of 16 inner chunks of whole rows, uncompressed: each shard's inner chunks are
    # read into GPU memory as one request, straight into their rows of the output.

    data = np.random.default_rng(6).normal(size=(256, 128)).astype(np.float32)
    z = zarr.create_array(
        LocalStore(tmp_path),
        shape=data.shape,
        chunks=(4, 128),
        shards=(64, 128),
        dtype="f4",
        compressors=None,
    )
    z[...] = data
    made = _in_place(monkeypatch)
    got = _read_whole(LocalStore(tmp_path, read_only=True))
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    assert made[-1] == [True] * 4


def test_a_read_larger_than_a_gpu_batch_is_decoded_in_batches(tmp_path, cupy, monkeypatch):
    # zstd chunks bound for the GPU go to nvCOMP in batches of at most GPU_BATCH_BYTES of
    # decoded bytes (here a quarter of the array): 4 batches of 16 chunks, the values exact.
    from arrayio.zarr import _pipeline

    data = np.random.default_rng(8).normal(size=(256, 256)).astype(np.float32)
    z = zarr.create_array(LocalStore(tmp_path), shape=data.shape, chunks=(32, 32), dtype="f4")
    z[...] = data
    monkeypatch.setattr(_pipeline, "GPU_BATCH_BYTES", data.nbytes // 4)
    batches = _submitted(monkeypatch)
    got = _read_whole(LocalStore(tmp_path, read_only=True))
    np.testing.assert_array_equal(cupy.asnumpy(got), data)
    assert [len(arrays) for arrays, _ in batches] == [16, 16, 16, 16]
