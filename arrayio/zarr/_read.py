"""Zarr arrays as the framework's arrays: zarr fills memory that the framework owns.

A store or directory is opened with :class:`~arrayio.zarr.CodecPipeline`, which reads the
selection's chunks as one batch.

The result is allocated by :func:`arrayio.arrays._frameworks.allocate` in the requested framework
and device, viewed as a NumPy array (host) or a CuPy array (GPU, through the CUDA array
interface) and handed to zarr as the ``out`` of the read, so the chunks are decoded straight
into it; ``finish()`` then gives the framework's array over the same memory (DLPack for
JAX, zero-copy on the CPU and on CUDA). JAX and torch users never handle CuPy themselves,
although zarr's GPU buffers need it installed.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import zarr
from zarr.core.buffer import cpu

from ..arrays import _dtypes, _frameworks
from ._store import NVMeStore

__all__ = ["read"]

PIPELINE = "arrayio.zarr.CodecPipeline"


def _open(source: Any, path: str | None) -> zarr.Array:
    if isinstance(source, zarr.Array):
        if path is not None:
            raise ValueError(
                "path= names an array inside a store or directory, not inside a zarr.Array"
            )
        return source
    if isinstance(source, str | os.PathLike):
        source = NVMeStore(source, read_only=True)
    if isinstance(source, zarr.abc.store.Store):
        # Opened here, so read with arrayio's pipeline (whole-batch reads; what it does not
        # handle goes to zarr's); a zarr.Array keeps the pipeline it was opened with.
        with zarr.config.set({"codec_pipeline.path": PIPELINE}):
            return zarr.open_array(store=source, path=path or "", mode="r")
    raise TypeError(
        f"read() takes a zarr.Array, a zarr store or a directory, got {type(source).__name__}"
    )


def read(
    source: Any,
    selection: Any = Ellipsis,
    *,
    like: Any = None,
    device: Any = None,
    path: str | None = None,
) -> Any:
    """Read a Zarr array, or a region of it, as a NumPy, JAX, CuPy or torch array.

    Parameters
    ----------
    source
        A ``zarr.Array``, a zarr store, or the directory of a store (opened read-only with
        :class:`NVMeStore`).
    selection
        A basic selection (integers, slices, ``...``), as for ``array[selection]``.
    like
        ``"numpy"``, ``"jax"``, ``"cupy"``, ``"torch"``, or an example array. By default
        NumPy on the CPU and CuPy on a GPU.
    device
        ``"cpu"``, ``"cuda"``, ``"cuda:N"``, or a framework's device object (a
        ``jax.Device``, a ``torch.device``).
    path
        The array's path inside the store or directory (``""``: the root).

    Returns
    -------
    array
        Of the requested framework, on the requested device. On the CPU and on CUDA the
        memory zarr filled is the memory returned: JAX imports it through DLPack without a
        copy (host buffers are allocated 4096-byte aligned, as JAX needs).

    Raises
    ------
    UnsupportedDtypeError
        For a dtype arrayio or the target framework cannot hold (strings; float64 in JAX
        without ``jax_enable_x64``...).
    DeviceError, FrameworkNotAvailableError
        As :func:`arrayio.load`.
    TypeError
        For a ``source`` that is not an array, a store or a path.

    Examples
    --------
    >>> x = arrayio.zarr.read("data.zarr", like="jax", device="cuda")
    >>> rows = arrayio.zarr.read(z, (slice(0, 1000), ...), like="torch")
    """
    request = _frameworks.parse_target(like, device)
    # zarr's GPU buffers are CuPy arrays, whatever framework the result is in: a machine
    # with a GPU and JAX or torch but no CuPy is told so before anything is opened.
    if request.placement.is_cuda:
        cupy = _frameworks.require("cupy", "reading Zarr into GPU memory")
    array = _open(source, path)
    stored = np.dtype(array.dtype)
    if not stored.isnative and not request.placement.is_cuda:
        # Zarr v2 arrays may be big-endian ('>f8'): zarr swaps the bytes as it copies the
        # chunks into ``out``, so the result is the same values in native order, as zarr v3
        # gives for its big-endian ``bytes`` codec. (CuPy has no big-endian dtypes: on the GPU
        # these are refused below.)
        stored = stored.newbyteorder("=")
    dtype = _dtypes.dtype_of(stored, where=f"{array.name or 'array'}: ")
    # The shape a basic selection gives, without reading anything: index a zero-stride view.
    shape = np.broadcast_to(np.empty((), dtype=np.bool_), array.shape)[selection].shape
    target = _frameworks.allocate(request, dtype, shape)
    np_dtype = _dtypes.numpy_dtype(dtype)
    if not request.placement.is_cuda:
        out = target.data.view(np_dtype).reshape(shape)
        array.get_basic_selection(selection, out=cpu.NDBuffer(out), prototype=cpu.buffer_prototype)
        return target.finish()

    from zarr.core.buffer import gpu

    with cupy.cuda.Device(request.placement.index), zarr.config.enable_gpu():
        flat = cupy.asarray(target.data.cuda_array).reshape(-1).view(cupy.uint8)
        out = flat.view(np_dtype).reshape(shape)
        array.get_basic_selection(selection, out=gpu.NDBuffer(out), prototype=gpu.buffer_prototype)
        # zarr scattered the chunks with CuPy from its own threads, on their streams; the
        # framework that takes the memory may read it on yet another.
        cupy.cuda.Device().synchronize()
    return target.finish()
