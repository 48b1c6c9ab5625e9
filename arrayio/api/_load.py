"""Loading: :func:`open` (lazy), :func:`load` (a whole file or some of its arrays) and
:func:`read_into` (into the caller's buffer), all through :class:`~arrayio.Reader`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ._reader import Reader

__all__ = ["load", "open", "read_into"]

PathLike = str | os.PathLike[str]


def open(path: PathLike, *, verify: bool | None = None, tool: Any = None) -> Reader:
    """Open a file lazily: its keys, dtypes, shapes and metadata, without reading data.

    Parameters
    ----------
    path
        An arrayio or safetensors container, or a ``.npy`` file (told apart by content).
    verify
        Check each whole array's CRC-32C as it is read (default: ``config`` setting, on).
    tool
        Force a transfer tool for this reader's reads (see :func:`save`).

    Returns
    -------
    Reader
        Use it as a context manager; ``reader.read(key, index=slice(1000, 2000))`` reads only
        those rows.

    Raises
    ------
    FormatError
        (and subclasses) for a damaged or hostile file, before any data is allocated.
    FileNotFoundError
        If ``path`` does not exist.
    """
    return Reader(path, verify=verify, tool=tool)


def load(
    path: PathLike,
    *,
    like: Any = None,
    device: Any = None,
    keys: str | Sequence[str] | None = None,
    structure: Any = None,
    verify: bool | None = None,
    tool: Any = None,
    progress: bool | None = None,
) -> Any:
    """Load what :func:`save` wrote (or any safetensors / ``.npy`` file).

    Parameters
    ----------
    path
        The file.
    like
        The framework of the result: ``"numpy"``, ``"jax"``, ``"cupy"``, ``"torch"``, or an
        example array (whose device is also used when ``device`` is not given). Default: NumPy,
        or CuPy when ``device`` is a GPU, or the framework of a ``device`` object.
    device
        ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``jax.Device``, a ``torch.device``... Default:
        the CPU.
    keys
        Load only these arrays: the key of one array returns that array; a list returns a
        flat ``dict`` from key to array. A key naming a subtree (``"params"``) selects every
        array below it (alone, it also returns a flat ``dict``).
    structure
        An example pytree (arrays, ``jax.ShapeDtypeStruct`` or anything in their place) to
        rebuild, for custom JAX pytree classes that arrayio cannot rebuild on its own.
    verify
        Check CRC-32C checksums (default: on; ``ARRAYIO_VERIFY_CHECKSUMS=0`` turns it off).
    tool
        Force a transfer tool (see :func:`save`).
    progress
        Show a progress bar for long loads (see :func:`save`).

    Returns
    -------
    The saved structure with arrays of the requested framework on the requested device.

    Raises
    ------
    KeyNotFoundError, ChecksumError, FormatError, UnsupportedDtypeError, DeviceError
    """
    with Reader(path, verify=verify, tool=tool) as reader:
        return reader.load(
            keys=keys, like=like, device=device, structure=structure, progress=progress
        )


def read_into(
    path: PathLike,
    out: Any,
    *,
    key: str | None = None,
    verify: bool | None = None,
    tool: Any = None,
) -> Any:
    """Fill ``out``, an array the caller allocated (NumPy, CuPy or torch), in place.

    No second full-size buffer is allocated: bytes go from the file into ``out`` (through
    bounded pinned staging buffers for GPU memory).

    Parameters
    ----------
    path
        The file.
    out
        A contiguous, writable array of the stored dtype and shape.
    key
        Which array; may be omitted when the file holds one.
    verify
        Check the array's CRC-32C (default: on).
    tool
        Force a transfer tool (see :func:`save`).

    Returns
    -------
    ``out``

    Raises
    ------
    MismatchError
        If ``out``'s dtype or shape differ from the stored array's.
    UnsupportedObjectError
        For a JAX array (immutable) or a non-contiguous ``out``.
    """
    with Reader(path, verify=verify, tool=tool) as reader:
        return reader.read_into(out, key)
