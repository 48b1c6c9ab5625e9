"""Zarr v3 arrays on local NVMe, read into CPU or GPU memory through arrayio.

:class:`NVMeStore` is a zarr-python 3 store with :class:`zarr.storage.LocalStore`'s layout
whose reads land in the memory zarr asks for (GPU memory under
``zarr.config.enable_gpu()``) through arrayio's dispatcher, many chunks at once; its writes
are atomic. :func:`read` returns a Zarr array (or a part of it) as a NumPy, JAX, CuPy or
torch array, filled in place with no extra copy. :class:`ZstdCodec` is zarr's ``zstd``
codec with a GPU path (nvCOMP) for chunks in GPU memory; importing this package registers
it, and ``zarr.config.set({"codecs.zstd": "arrayio.zarr.codecs.ZstdCodec"})`` selects it.
:class:`CodecPipeline` reads the chunks of a selection as one batch (files read through the
dispatcher, zstd decoded in one call, on the GPU by nvCOMP); importing this package
registers it, and ``zarr.config.set({"codec_pipeline.path": "arrayio.zarr.CodecPipeline"})``
selects it.

This subpackage is the optional extra ``zarr`` (``pip install 'arrayio[zarr]'``);
``import arrayio`` never imports it.
"""

from __future__ import annotations

try:
    import zarr
except ImportError as error:
    raise ImportError(
        "arrayio.zarr requires the optional zarr-python >= 3.1 dependency: "
        "pip install 'arrayio[zarr]'"
    ) from error

if int(zarr.__version__.split(".")[0]) < 3 or zarr.__version__.startswith("3.0."):
    raise ImportError(
        f"arrayio.zarr requires zarr-python >= 3.1, found {zarr.__version__}: "
        "pip install 'arrayio[zarr]'"
    )

from ._keys import InvalidKeyError
from ._pipeline import CodecPipeline, register
from ._read import read
from ._store import NVMeStore
from .codecs import ZstdCodec

register()  # selectable as codec_pipeline.path "arrayio.zarr.CodecPipeline"

__all__ = ["CodecPipeline", "InvalidKeyError", "NVMeStore", "ZstdCodec", "read"]
