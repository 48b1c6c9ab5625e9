"""arrayio.zarr.codecs.ZstdCodec: plain zstd frames, decoded and encoded on the GPU by nvCOMP
for GPU buffers and on the host by numcodecs otherwise.

The host tests run everywhere; the ``gpu`` ones need CuPy and nvCOMP and check the GPU path
against numcodecs (libzstd) bit for bit, both ways.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
import types
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

zarr = pytest.importorskip("zarr")
numcodecs = pytest.importorskip("numcodecs")

from numcodecs import Zstd  # noqa: E402
from zarr.codecs import ZstdCodec as ZarrZstdCodec  # noqa: E402
from zarr.core.array_spec import ArrayConfig, ArraySpec  # noqa: E402
from zarr.core.buffer import default_buffer_prototype  # noqa: E402
from zarr.core.dtype import get_data_type_from_native_dtype  # noqa: E402

from arrayio.errors import ChecksumError, FormatError, FrameworkNotAvailableError  # noqa: E402
from arrayio.zarr import _gpu_worker  # noqa: E402
from arrayio.zarr import codecs as codecs_module  # noqa: E402
from arrayio.zarr._frames import scan_frames  # noqa: E402
from arrayio.zarr.codecs import ZstdCodec  # noqa: E402

OURS = "arrayio.zarr.codecs.ZstdCodec"
DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]

# --------------------------------------------------------------------------- helpers

_M = (1 << 64) - 1
_P1, _P2, _P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P4, _P5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc: int, value: int) -> int:
    return (_rotl((acc + value * _P2) & _M, 31) * _P1) & _M


def xxh64(data: bytes) -> int:
    """XXH64 with seed 0, straight from the specification (slow: small inputs only)."""
    n, p = len(data), 0
    word = lambda at, size: int.from_bytes(data[at : at + size], "little")  # noqa: E731
    if n >= 32:
        v = [(_P1 + _P2) & _M, _P2, 0, (-_P1) & _M]
        while p <= n - 32:
            v = [_round(v[k], word(p + 8 * k, 8)) for k in range(4)]
            p += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M
        for lane in v:
            h = ((h ^ _round(0, lane)) * _P1 + _P4) & _M
    else:
        h = _P5
    h = (h + n) & _M
    while p + 8 <= n:
        h = (_rotl(h ^ _round(0, word(p, 8)), 27) * _P1 + _P4) & _M
        p += 8
    if p + 4 <= n:
        h = (_rotl(h ^ (word(p, 4) * _P1 & _M), 23) * _P2 + _P3) & _M
        p += 4
    while p < n:
        h = (_rotl(h ^ (data[p] * _P5 & _M), 11) * _P1) & _M
        p += 1
    h ^= h >> 33
    h = h * _P2 & _M
    h ^= h >> 29
    h = h * _P3 & _M
    return h ^ (h >> 32)


def sample_bytes(size: int, seed: int = 0) -> bytes:
    """Half noise, half runs: compressible like real data, with every block type."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, size // 2, dtype=np.uint8)
    runs = np.repeat(rng.integers(0, 4, size, dtype=np.uint8), 16)[: size - size // 2]
    return noise.tobytes() + runs.tobytes()


def spec(nbytes: int = 1, prototype=None) -> ArraySpec:
    return ArraySpec(
        shape=(max(nbytes, 1),),
        dtype=get_data_type_from_native_dtype(np.uint8),
        fill_value=0,
        config=ArrayConfig.from_dict({}),
        prototype=prototype or default_buffer_prototype(),
    )


def host_buffer(data: bytes):
    return default_buffer_prototype().buffer.from_bytes(data)


def random_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype)
    count = int(np.prod(shape)) * np_dtype.itemsize
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    # Mostly small integers: compressible, and NaN payloads included for floats.
    raw = rng.integers(0, 4, count, dtype=np.uint8)
    raw[rng.random(count) < 0.1] = rng.integers(0, 256, dtype=np.uint8)
    return raw.view(np_dtype).reshape(shape)


def write(store, data: np.ndarray, chunks, compressor) -> zarr.Array:
    array = zarr.create_array(
        store=store,
        shape=data.shape,
        chunks=chunks,
        dtype=data.dtype,
        compressors=[compressor],
        fill_value=0,
    )
    array[...] = data
    return array


def same_bytes(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


@st.composite
def shapes_and_chunks(draw):
    shape = tuple(draw(st.lists(st.integers(0, 12), min_size=1, max_size=3)))
    chunks = tuple(draw(st.integers(1, max(side, 1) + 1)) for side in shape)
    return shape, chunks


# --------------------------------------------------------------------------- XXH64, frames


def test_the_xxh64_reference_matches_libzstd_checksums():
    assert xxh64(b"") == 0xEF46DB3751D8E999
    for size in (0, 1, 3, 4, 7, 8, 31, 32, 33, 100, 1000):
        data = sample_bytes(size, seed=size)
        frame = Zstd(level=3, checksum=True).encode(data)
        assert int.from_bytes(frame[-4:], "little") == xxh64(data) & 0xFFFFFFFF, size


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 300_000), level=st.sampled_from([-5, 0, 1, 3, 9]), checksum=st.booleans()
)
def test_scan_reads_numcodecs_frames(size, level, checksum):
    frame = Zstd(level=level, checksum=checksum).encode(sample_bytes(size, seed=size))
    [found] = scan_frames(frame)
    assert (found.start, found.end, found.content_size, found.checksum, found.dictionary_id) == (
        0,
        len(frame),
        size,
        checksum,
        0,
    )


def test_scan_walks_several_frames_and_skips_skippable_ones():
    one, two = Zstd().encode(b"a" * 1000), Zstd(checksum=True).encode(sample_bytes(5000))
    skippable = (0x184D2A53).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"xyz"
    frames = scan_frames(one + skippable + two)
    assert [(f.start, f.end, f.content_size) for f in frames] == [
        (0, len(one), 1000),
        (len(one) + 11, len(one) + 11 + len(two), 5000),
    ]


def test_scan_reads_a_frame_without_content_size():
    # Hand-made: no single-segment flag, no content size, a window descriptor, one raw block.
    frame = (0xFD2FB528).to_bytes(4, "little") + bytes([0x00, 0x00])
    frame += ((5 << 3) | 1).to_bytes(3, "little") + b"hello"
    [found] = scan_frames(frame)
    assert found.content_size is None and found.end == len(frame)
    assert ZstdCodec()._decode_sync(host_buffer(frame), spec()).to_bytes() == b"hello"


def _damaged_frames() -> dict[str, bytes]:
    frame = Zstd(level=3).encode(sample_bytes(300_000))
    fcs_at = 5  # numcodecs frames: single segment, 4-byte content size after the descriptor
    assert frame[4] >> 6 == 2 and frame[4] & 0x20
    huge = bytearray(frame)
    huge[fcs_at : fcs_at + 4] = (2**32 - 1).to_bytes(4, "little")
    reserved_bit = bytearray(frame)
    reserved_bit[4] |= 0x08
    reserved_block = bytearray(frame)
    reserved_block[fcs_at + 4] |= 0x06
    return {
        "empty": b"",
        "garbage": b"this is not zstd at all",
        "magic": b"\x00" + frame[1:],
        "truncated": frame[: len(frame) // 2],
        "header only": frame[:7],
        "trailing byte": frame + b"\x00",
        "huge content size": bytes(huge),
        "reserved bit": bytes(reserved_bit),
        "reserved block type": bytes(reserved_block),
    }


@pytest.mark.parametrize("name", list(_damaged_frames()))
def test_damaged_frames_raise_format_error(name):
    damaged = _damaged_frames()[name]
    with pytest.raises(FormatError):
        scan_frames(damaged)
    with pytest.raises(FormatError):
        ZstdCodec()._decode_sync(host_buffer(damaged), spec())


def test_every_truncation_of_a_small_frame_is_an_error():
    frame = Zstd(checksum=True).encode(sample_bytes(2000))
    for cut in range(len(frame)):
        with pytest.raises(FormatError):
            ZstdCodec()._decode_sync(host_buffer(frame[:cut]), spec())


def test_empty_frames_decode_and_their_checksums_are_checked():
    # libzstd writes these, but its one-shot decoder (hence numcodecs) refuses them.
    for checksum in (False, True):
        frame = Zstd(checksum=checksum).encode(b"")
        assert ZstdCodec()._decode_sync(host_buffer(frame), spec()).to_bytes() == b""
    damaged = bytearray(Zstd(checksum=True).encode(b""))
    damaged[-1] ^= 1
    with pytest.raises(ChecksumError):
        ZstdCodec()._decode_sync(host_buffer(bytes(damaged)), spec())


def test_a_wrong_content_checksum_raises_checksum_error():
    frame = bytearray(Zstd(checksum=True).encode(sample_bytes(10_000)))
    frame[-1] ^= 0xFF
    with pytest.raises(ChecksumError, match="checksum"):
        ZstdCodec()._decode_sync(host_buffer(bytes(frame)), spec())


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(("level", "checksum"), [(0, False), (3, True), (-7, False), (22, True)])
def test_config_is_zarrs_own(level, checksum):
    ours = ZstdCodec(level=level, checksum=checksum)
    theirs = ZarrZstdCodec(level=level, checksum=checksum)
    assert (
        ours.to_dict()
        == theirs.to_dict()
        == {"name": "zstd", "configuration": {"level": level, "checksum": checksum}}
    )
    assert ZstdCodec.from_dict(json.loads(json.dumps(ours.to_dict()))) == ours
    assert isinstance(ours, ZarrZstdCodec)


def test_bad_configs_are_refused_as_zarr_does():
    with pytest.raises(ValueError):
        ZstdCodec(level=23)
    with pytest.raises(TypeError):
        ZstdCodec(checksum="yes")  # type: ignore[arg-type]


def test_selected_through_zarr_config():
    from zarr.registry import get_codec_class

    assert get_codec_class("zstd") is ZarrZstdCodec  # zarr's stays the default
    with zarr.config.set({"codecs.zstd": OURS}):
        assert get_codec_class("zstd") is ZstdCodec
        store = zarr.storage.MemoryStore()
        write(
            store,
            np.arange(100, dtype="i4"),
            (30,),
            {"name": "zstd", "configuration": {"level": 1, "checksum": False}},
        )
        opened = zarr.open_array(store, mode="r")
        assert type(opened.compressors[0]) is ZstdCodec
        assert same_bytes(opened[:], np.arange(100, dtype="i4"))
    assert type(zarr.open_array(store, mode="r").compressors[0]) is ZarrZstdCodec


# --------------------------------------------------------------------------- zarr arrays


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=shapes_and_chunks(),
    dtype=st.sampled_from(DTYPES),
    level=st.integers(-3, 5),
    checksum=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_zarr_round_trip_and_cross_reads(case, dtype, level, checksum, seed):
    shape, chunks = case
    data = random_array(dtype, shape, seed)
    ours, theirs = (
        ZstdCodec(level=level, checksum=checksum),
        ZarrZstdCodec(level=level, checksum=checksum),
    )
    written_by_us, written_by_zarr = zarr.storage.MemoryStore(), zarr.storage.MemoryStore()
    assert same_bytes(write(written_by_us, data, chunks, ours)[...], data)
    write(written_by_zarr, data, chunks, theirs)
    # The same chunk files, byte for byte: host chunks go through the same libzstd call.
    assert {k: v.to_bytes() for k, v in written_by_us._store_dict.items()} == {
        k: v.to_bytes() for k, v in written_by_zarr._store_dict.items()
    }
    assert same_bytes(zarr.open_array(written_by_us, mode="r")[...], data)  # plain zarr
    with zarr.config.set({"codecs.zstd": OURS}):
        opened = zarr.open_array(written_by_zarr, mode="r")
        assert type(opened.compressors[0]) is ZstdCodec
        assert same_bytes(opened[...], data)


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_batches_of_chunks_with_missing_ones(batch_size):
    data = random_array("float32", (50, 40), seed=1)
    store = zarr.storage.MemoryStore()
    with zarr.config.set({"codec_pipeline.batch_size": batch_size}):
        array = zarr.create_array(
            store=store,
            shape=data.shape,
            chunks=(7, 9),
            dtype=data.dtype,
            compressors=[ZstdCodec()],
            fill_value=0,
        )
        array[10:30, 5:25] = data[10:30, 5:25]  # most chunks are never written
        expected = np.zeros_like(data)
        expected[10:30, 5:25] = data[10:30, 5:25]
        assert same_bytes(array[...], expected)


def test_batch_decode_keeps_missing_chunks_in_place():
    frames = [Zstd().encode(sample_bytes(n, seed=n)) for n in (10, 1000, 0, 70_000)]
    batch = [
        (host_buffer(frames[0]), spec()),
        (None, spec()),
        (host_buffer(frames[1]), spec()),
        (host_buffer(frames[2]), spec()),
        (None, spec()),
        (host_buffer(frames[3]), spec()),
    ]
    decoded = asyncio.run(ZstdCodec().decode(batch))
    assert [None if d is None else d.to_bytes() for d in decoded] == [
        sample_bytes(10, seed=10),
        None,
        sample_bytes(1000, seed=1000),
        b"",
        None,
        sample_bytes(70_000, seed=70_000),
    ]
    encoded = asyncio.run(ZstdCodec().encode([(None, spec()), (host_buffer(b"abc"), spec())]))
    assert encoded[0] is None and Zstd().decode(encoded[1].to_bytes()) == b"abc"


def test_sharded_arrays_use_it_for_inner_chunks():
    data = random_array("int16", (64, 64), seed=2)
    store = zarr.storage.MemoryStore()
    array = zarr.create_array(
        store=store,
        shape=data.shape,
        chunks=(8, 8),
        shards=(32, 32),
        dtype=data.dtype,
        compressors=[ZstdCodec(checksum=True)],
    )
    array[...] = data
    with zarr.config.set({"codecs.zstd": OURS}):
        assert same_bytes(zarr.open_array(store, mode="r")[...], data)


def test_a_damaged_chunk_fails_the_read():
    store = zarr.storage.MemoryStore()
    array = write(store, random_array("uint32", (100,), seed=3), (25,), ZstdCodec())
    key = "c/1"
    store._store_dict[key] = host_buffer(b"\x00" + store._store_dict[key].to_bytes()[1:])
    with pytest.raises(FormatError, match="magic number"):
        array[...]


def test_host_use_imports_neither_cupy_nor_nvcomp(tmp_path):
    def modules_after(code: str) -> dict[str, bool]:
        script = textwrap.dedent(code) + textwrap.dedent("""
            import json, sys
            print(json.dumps({m: m in sys.modules for m in ("cupy", "nvidia.nvcomp")}))
            """)
        result = subprocess.run(
            [sys.executable, "-W", "error", "-c", script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    baseline = modules_after("import zarr, zarr.storage")
    used = modules_after("""
        import numpy as np, zarr, zarr.storage
        from arrayio.zarr.codecs import ZstdCodec
        with zarr.config.set({"codecs.zstd": "arrayio.zarr.codecs.ZstdCodec"}):
            a = zarr.create_array(store=zarr.storage.MemoryStore(), shape=(100,), chunks=(10,),
                                  dtype="f8", compressors=[ZstdCodec(checksum=True)])
            a[:] = np.arange(100.0)
            assert (a[:] == np.arange(100.0)).all()
        """)
    assert used == baseline and not used["nvidia.nvcomp"]


def test_the_fused_synchronous_pipeline_uses_it_too():
    if not hasattr(zarr.core.codec_pipeline, "FusedCodecPipeline"):
        pytest.skip(f"zarr {zarr.__version__} has no FusedCodecPipeline")
    data = random_array("float64", (40, 30), seed=4)
    with zarr.config.set({"codec_pipeline.path": "zarr.core.codec_pipeline.FusedCodecPipeline"}):
        store = zarr.storage.MemoryStore()
        assert same_bytes(write(store, data, (16, 16), ZstdCodec(checksum=True))[...], data)


class FakeDeviceArray:
    """Host bytes posing as a CuPy array on a numbered device, for the worker's plumbing."""

    def __init__(self, data, device_id: int) -> None:
        self.data = np.frombuffer(bytes(data), dtype=np.uint8)
        self.device = types.SimpleNamespace(id=device_id)

    def get(self) -> np.ndarray:
        return self.data


class FakeGpu:
    """Stands in for nvCOMP: codes each batch on the host, slowly, and records its size."""

    batches: ClassVar[list[int]] = []

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id

    def _each(self, chunks, code):
        FakeGpu.batches.append(len(chunks))
        time.sleep(0.02)  # long enough for other requests to queue up behind this batch
        out = []
        for chunk in chunks:
            try:
                out.append(FakeDeviceArray(code(chunk.get()), self.device_id))
            except Exception as error:  # noqa: BLE001 - as the real one, per chunk
                out.append(error)
        return out

    def decode(self, chunks, host_decode, destinations=None):
        return self._each(chunks, host_decode)

    def encode(self, chunks, checksum, host_encode):
        return self._each(chunks, host_encode)


@pytest.fixture
def fake_device(monkeypatch):
    """A device number whose buffers go through the GPU worker, with FakeGpu as nvCOMP."""
    device_id = 1000 + len(_gpu_worker.DeviceWorker._workers)
    on_device: set[int] = set()
    real = codecs_module._device_array

    def device_array(buffer):
        if id(buffer) in on_device:
            return FakeDeviceArray(buffer.as_numpy_array(), device_id)
        return real(buffer)

    monkeypatch.setattr(codecs_module, "_device_array", device_array)
    monkeypatch.setattr(_gpu_worker, "NvcompZstd", FakeGpu)
    FakeGpu.batches.clear()

    def buffer(data: bytes):
        made = host_buffer(data)
        on_device.add(id(made))
        return made

    return buffer


def test_the_device_worker_coalesces_concurrent_requests(fake_device):
    datas = [sample_bytes(n, seed=n) for n in range(1000, 1032)]
    frames = [fake_device(Zstd().encode(d)) for d in datas]

    async def one_chunk_per_call():
        return await asyncio.gather(*(ZstdCodec().decode([(f, spec())]) for f in frames))

    decoded = asyncio.run(one_chunk_per_call())
    assert [d[0].to_bytes() for d in decoded] == datas
    assert sum(FakeGpu.batches) == 32 and len(FakeGpu.batches) < 32, FakeGpu.batches
    mixed = [(frames[0], spec()), (None, spec()), (host_buffer(Zstd().encode(b"host")), spec())]
    assert [
        None if d is None else d.to_bytes() for d in asyncio.run(ZstdCodec().decode(mixed))
    ] == [datas[0], None, b"host"]
    encoded = ZstdCodec(checksum=True)._encode_sync(fake_device(b"xyz" * 100), spec())
    assert Zstd().decode(encoded.to_bytes()) == b"xyz" * 100


def test_a_failing_chunk_fails_only_its_own_call(fake_device):
    good = [fake_device(Zstd().encode(sample_bytes(500, seed=k))) for k in range(8)]
    bad = fake_device(b"\x00" * 40)

    async def calls():
        return await asyncio.gather(
            *(ZstdCodec().decode([(f, spec())]) for f in [*good, bad]), return_exceptions=True
        )

    results = asyncio.run(calls())
    assert [r[0].to_bytes() for r in results[:8]] == [sample_bytes(500, seed=k) for k in range(8)]
    assert isinstance(results[8], FormatError)
    with pytest.raises(FormatError, match="magic number"):
        ZstdCodec()._decode_sync(bad, spec())


def test_a_device_that_cannot_start_fails_its_callers(fake_device, monkeypatch):
    class BrokenGpu:
        def __init__(self, device_id: int) -> None:
            raise ImportError("No module named 'nvidia.nvcomp'")

    monkeypatch.setattr(_gpu_worker, "NvcompZstd", BrokenGpu)
    with pytest.raises(FrameworkNotAvailableError, match="nvidia-nvcomp-cu13"):
        ZstdCodec()._decode_sync(fake_device(Zstd().encode(b"abc")), spec())


# --------------------------------------------------------------------------- GPU


def _gpu_modules():
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("nvidia.nvcomp")
    from zarr.core.buffer import gpu

    return cupy, gpu


def _device_buffer(cupy, gpu, data: bytes):
    return gpu.Buffer.from_array_like(cupy.asarray(np.frombuffer(data, dtype=np.uint8)))


@pytest.fixture
def host_path_forbidden(monkeypatch):
    """Fail any chunk the GPU path would hand to the host, to prove it stayed on the GPU."""

    def refuse(*args, **kwargs):
        raise AssertionError("chunk went to the host path")

    for module in (codecs_module, _gpu_worker):
        monkeypatch.setattr(module, "decode_on_host", refuse)
        monkeypatch.setattr(module, "encode_on_host", refuse)


GPU_SIZES = [1, 7, 100, 4096, 65_536, 131_073, 1 << 20, (4 << 20) + 3, 16 << 20, 40 << 20]


@pytest.mark.gpu
@pytest.mark.parametrize("checksum", [False, True])
def test_gpu_decodes_numcodecs_frames_bit_exact(checksum, host_path_forbidden):
    cupy, gpu = _gpu_modules()
    datas = [sample_bytes(n, seed=n) for n in GPU_SIZES]
    levels = [-3, 0, 1, 3, 9, 3, 3, 1, 3, 3]
    frames = [
        Zstd(level=level, checksum=checksum).encode(d)
        for d, level in zip(datas, levels, strict=True)
    ]
    prototype = gpu.buffer_prototype
    batch = [
        (_device_buffer(cupy, gpu, f), spec(len(d), prototype))
        for f, d in zip(frames, datas, strict=True)
    ]
    decoded = asyncio.run(ZstdCodec().decode(batch))
    for d, out in zip(datas, decoded, strict=True):
        assert isinstance(out, gpu.Buffer)
        assert out.to_bytes() == d


@pytest.mark.gpu
@pytest.mark.parametrize("refused", [False, True])
def test_gpu_batches_go_to_nvcomps_c_function_or_else_its_python_codec(
    refused, host_path_forbidden, monkeypatch
):
    # nvCOMP's C function takes each batch whole; where it refuses one, nvCOMP's Python
    # codec decodes it, exactly as well.
    from arrayio.zarr import _nvcomp_batched

    cupy, gpu = _gpu_modules()
    real = _nvcomp_batched.BatchedZstd.decompress
    batches = []

    def spy(self, source_ptrs, *args, **kwargs):
        batches.append(len(source_ptrs))
        if refused:
            raise RuntimeError("nvCOMP refused the batch: status 10")
        return real(self, source_ptrs, *args, **kwargs)

    monkeypatch.setattr(_nvcomp_batched.BatchedZstd, "decompress", spy)
    datas = [sample_bytes(n, seed=n) for n in GPU_SIZES]
    prototype = gpu.buffer_prototype
    batch = [
        (_device_buffer(cupy, gpu, Zstd(level=3).encode(d)), spec(len(d), prototype)) for d in datas
    ]
    decoded = asyncio.run(ZstdCodec().decode(batch))
    assert [out.to_bytes() for out in decoded] == datas
    assert sum(batches) == len(datas)


@pytest.mark.gpu
@pytest.mark.parametrize("checksum", [False, True])
def test_numcodecs_decodes_gpu_frames_bit_exact(checksum, host_path_forbidden):
    cupy, gpu = _gpu_modules()
    datas = [sample_bytes(n, seed=n) for n in GPU_SIZES]
    batch = [(_device_buffer(cupy, gpu, d), spec(len(d), gpu.buffer_prototype)) for d in datas]
    encoded = asyncio.run(ZstdCodec(checksum=checksum).encode(batch))
    for d, out in zip(datas, encoded, strict=True):
        assert isinstance(out, gpu.Buffer)
        frame = out.to_bytes()
        [found] = scan_frames(frame)
        assert (found.content_size, found.checksum, found.end) == (len(d), checksum, len(frame))
        assert Zstd().decode(frame) == d  # libzstd verifies the checksum when there is one
        if checksum and len(d) <= 1 << 16:
            assert int.from_bytes(frame[-4:], "little") == xxh64(d) & 0xFFFFFFFF


@pytest.mark.gpu
def test_gpu_checksums_agree_with_the_reference_for_every_tail_length(host_path_forbidden):
    cupy, gpu = _gpu_modules()
    datas = [sample_bytes(n, seed=n) for n in range(1, 100)]
    batch = [(_device_buffer(cupy, gpu, d), spec(len(d), gpu.buffer_prototype)) for d in datas]
    encoded = asyncio.run(ZstdCodec(checksum=True).encode(batch))
    for d, out in zip(datas, encoded, strict=True):
        assert int.from_bytes(out.to_bytes()[-4:], "little") == xxh64(d) & 0xFFFFFFFF, len(d)
    # And the GPU verifies them when it decodes its own frames.
    decoded = asyncio.run(
        ZstdCodec().decode([(out, spec(1, gpu.buffer_prototype)) for out in encoded])
    )
    assert [out.to_bytes() for out in decoded] == datas


@pytest.mark.gpu
def test_gpu_batches_with_missing_empty_and_unusual_chunks():
    cupy, gpu = _gpu_modules()
    skippable = (0x184D2A50).to_bytes(4, "little") + (2).to_bytes(4, "little") + b"zz"
    no_size = (
        (0xFD2FB528).to_bytes(4, "little")
        + bytes([0x00, 0x00])
        + ((5 << 3) | 1).to_bytes(3, "little")
        + b"hello"
    )
    cases = [
        (Zstd().encode(b"x" * 5000), b"x" * 5000),
        (None, None),
        (Zstd().encode(b""), b""),  # content size 0
        (Zstd().encode(b"ab") + Zstd().encode(b"cd"), b"abcd"),  # two frames
        (skippable + Zstd().encode(b"ef"), b"ef"),
        (no_size, b"hello"),
        (Zstd(checksum=True).encode(sample_bytes(300_000)), sample_bytes(300_000)),
    ]
    prototype = gpu.buffer_prototype
    batch = [
        (None if f is None else _device_buffer(cupy, gpu, f), spec(1, prototype)) for f, _ in cases
    ]
    decoded = asyncio.run(ZstdCodec().decode(batch))
    assert [None if d is None else d.to_bytes() for d in decoded] == [e for _, e in cases]
    encoded = asyncio.run(
        ZstdCodec(checksum=True).encode(
            [(_device_buffer(cupy, gpu, b""), spec(1, prototype)), (None, spec(1, prototype))]
        )
    )
    empty = encoded[0].to_bytes()  # libzstd writes it, but numcodecs cannot read it back
    assert [(f.content_size, f.checksum) for f in scan_frames(empty)] == [(0, True)]
    assert ZstdCodec()._decode_sync(host_buffer(empty), spec()).to_bytes() == b""
    assert encoded[1] is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in _damaged_frames() if n != "empty"])
def test_gpu_damaged_frames_raise_format_error(name):
    cupy, gpu = _gpu_modules()
    good = Zstd().encode(sample_bytes(1000))
    batch = [
        (_device_buffer(cupy, gpu, good), spec(1, gpu.buffer_prototype)),
        (_device_buffer(cupy, gpu, _damaged_frames()[name]), spec(1, gpu.buffer_prototype)),
    ]
    with pytest.raises(FormatError):
        asyncio.run(ZstdCodec().decode(batch))


@pytest.mark.gpu
def test_gpu_wrong_content_checksum_raises_checksum_error():
    cupy, gpu = _gpu_modules()
    frame = bytearray(Zstd(checksum=True).encode(sample_bytes(200_000)))
    frame[-2] ^= 0x10  # the stored checksum, so the payload itself stays decodable
    batch = [(_device_buffer(cupy, gpu, bytes(frame)), spec(1, gpu.buffer_prototype))]
    with pytest.raises(ChecksumError, match="checksum"):
        asyncio.run(ZstdCodec().decode(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [1, 64])
@pytest.mark.parametrize("checksum", [False, True])
def test_zarr_arrays_round_trip_in_gpu_memory(tmp_path, batch_size, checksum):
    cupy, gpu = _gpu_modules()
    data = random_array("float32", (300, 200), seed=5)
    config = {"codecs.zstd": OURS, "codec_pipeline.batch_size": batch_size}
    store = zarr.storage.LocalStore(tmp_path / "a.zarr")
    with zarr.config.enable_gpu(), zarr.config.set(config):
        array = zarr.create_array(
            store=store,
            shape=data.shape,
            chunks=(64, 50),
            dtype=data.dtype,
            compressors=[ZstdCodec(checksum=checksum)],
        )
        array[...] = cupy.asarray(data)
        array[:64, :50] = 0  # an all-fill chunk, which zarr does not store
        back = zarr.open_array(store, mode="r")[...]
        assert isinstance(back, cupy.ndarray)
    expected = data.copy()
    expected[:64, :50] = 0
    assert same_bytes(cupy.asnumpy(back), expected)
    # Plain zarr on the CPU reads what the GPU wrote.
    assert same_bytes(zarr.open_array(store, mode="r")[...], expected)
