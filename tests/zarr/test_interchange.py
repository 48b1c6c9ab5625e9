"""Arrays written through one codec pipeline read back bit-exact through every other: zarr's
own (``BatchedCodecPipeline``), arrayio's (``arrayio.zarr.CodecPipeline``) and zarrs-python's
(``zarrs.ZarrsCodecPipeline``, a Rust implementation of the codecs), over arrayio's store and
zarr's, for plain and sharded arrays; and into and out of GPU memory (marked ``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from zarr.codecs import Crc32cCodec, ZstdCodec  # noqa: E402
from zarr.storage import LocalStore  # noqa: E402

from arrayio.zarr import NVMeStore  # noqa: E402

PIPELINES = {
    "zarr": "zarr.core.codec_pipeline.BatchedCodecPipeline",
    "arrayio": "arrayio.zarr.CodecPipeline",
    "zarrs": "zarrs.ZarrsCodecPipeline",
}
LAYOUTS = {
    "zstd": {"chunks": (16, 24), "compressors": [ZstdCodec(level=3)]},
    "uncompressed+crc32c": {"chunks": (16, 24), "compressors": [Crc32cCodec()]},
    "sharded zstd": {"chunks": (8, 12), "shards": (32, 48), "compressors": [ZstdCodec(level=1)]},
}


def _pipeline(name: str) -> dict[str, str]:
    if name == "zarrs":
        pytest.importorskip("zarrs")
    return {"codec_pipeline.path": PIPELINES[name]}


def _data(dtype: str) -> np.ndarray:
    # Values of every bit pattern, NaNs and signed zeros among them for floats: compared as
    # bytes, since NaN != NaN.
    raw = np.random.default_rng(11).integers(0, 256, 70 * 90 * np.dtype(dtype).itemsize)
    return raw.astype(np.uint8).view(dtype).reshape(70, 90)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "int16", "uint8"])
@pytest.mark.parametrize(
    ("writer", "reader"), [(w, r) for w in PIPELINES for r in PIPELINES if w != r]
)
def test_what_one_pipeline_writes_every_other_reads_bit_exact(
    tmp_path, writer, reader, layout, dtype
):
    data = _data(dtype)
    with zarr.config.set(_pipeline(writer)):
        array = zarr.create_array(
            NVMeStore(tmp_path / "a.zarr"), shape=data.shape, dtype=dtype, **LAYOUTS[layout]
        )
        array[:] = data
        array[3:9, 40:47] = data[:6, :7]  # a partial write into chunks already there
    expected = data.copy()
    expected[3:9, 40:47] = data[:6, :7]
    with zarr.config.set(_pipeline(reader)):
        for store in (NVMeStore(tmp_path / "a.zarr"), LocalStore(tmp_path / "a.zarr")):
            back = zarr.open_array(store, mode="r")
            assert back[:].tobytes() == expected.tobytes()
            assert back[5:61, 7:80].tobytes() == expected[5:61, 7:80].tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_what_zarrs_writes_reads_into_the_gpu_bit_exact(tmp_path, layout):
    cupy = pytest.importorskip("cupy")
    data = _data("float32")
    with zarr.config.set(_pipeline("zarrs")):
        array = zarr.create_array(
            LocalStore(tmp_path / "a.zarr"), shape=data.shape, dtype="float32", **LAYOUTS[layout]
        )
        array[:] = data
    with zarr.config.enable_gpu(), zarr.config.set(_pipeline("arrayio")):
        back = zarr.open_array(NVMeStore(tmp_path / "a.zarr", read_only=True), mode="r")[:]
    assert isinstance(back, cupy.ndarray)
    assert cupy.asnumpy(back).tobytes() == data.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("reader", ["zarr", "zarrs"])
def test_what_the_gpu_writes_every_pipeline_reads_bit_exact(tmp_path, reader):
    cupy = pytest.importorskip("cupy")
    data = _data("float32")
    with zarr.config.enable_gpu(), zarr.config.set(_pipeline("arrayio")):
        array = zarr.create_array(
            NVMeStore(tmp_path / "a.zarr"),
            shape=data.shape,
            dtype="float32",
            chunks=(16, 24),
            compressors=None,
        )
        array[:] = cupy.asarray(data)
    with zarr.config.set(_pipeline(reader)):
        back = zarr.open_array(LocalStore(tmp_path / "a.zarr"), mode="r")[:]
    assert back.tobytes() == data.tobytes()
