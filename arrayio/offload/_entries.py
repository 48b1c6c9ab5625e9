"""What the offloader keeps per array: the caller's :class:`Handle` and the entry behind it.

An entry's array is *resident* (the offloader holds it) or *spilled* (only its file holds
it); a resident entry is *clean* when its file is complete too, *dirty* otherwise.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

from ..arrays import _dtypes
from ..arrays._frameworks import Request, framework_of, placement_of
from ..errors import UnsupportedObjectError

if TYPE_CHECKING:
    from ._offloader import Offloader

__all__ = ["Entry", "Handle", "describe"]


class Handle:
    """A reference to an array given to :meth:`Offloader.put`.

    Dropping the last reference to a handle frees its array and file, as
    :meth:`Offloader.free` does.

    Attributes
    ----------
    nbytes : int
    shape : tuple of int
    dtype : str
        The arrayio dtype name (``"float32"``, ``"bfloat16"``...).
    framework : str
        ``"numpy"``, ``"jax"``, ``"torch"`` or ``"cupy"``.
    """

    __slots__ = ("__weakref__", "_offloader", "dtype", "framework", "id", "nbytes", "shape")

    def __init__(self, offloader: Offloader, entry: Entry) -> None:
        self._offloader = weakref.ref(offloader)
        self.id = entry.id
        self.nbytes = entry.nbytes
        self.shape = entry.shape
        self.dtype = entry.dtype.name
        self.framework = entry.framework

    def __del__(self) -> None:
        offloader = self._offloader()
        if offloader is not None:
            offloader._release(self.id)

    def __repr__(self) -> str:
        return (
            f"<arrayio.offload.Handle #{self.id} {self.framework} {self.dtype}{list(self.shape)}>"
        )


@dataclasses.dataclass(eq=False, repr=False)
class Entry:
    """One array's state in the offloader; every field is read and written under its lock."""

    id: int
    nbytes: int
    dtype: _dtypes.DType
    shape: tuple[int, ...]
    framework: str
    request: Request
    hint: str | None
    file: str
    array: Any = None
    ready: Any = None  # a CUDA event the writer waits for before reading the array
    on_disk: bool = False
    writing: bool = False
    reading: bool = False
    evict: bool = False  # drop the array once its write is complete
    freed: bool = False
    crc: int | None = None
    host: Any = None  # the spilled copy in the host tier (a HostCopy or JaxHostCopy), or None
    read_error: BaseException | None = None
    from_read: bool = False  # the array was read back (torch: record_stream on get)
    arrived: Any = None  # the event of a queued copy back, which the user's stream waits for
    prefetched: bool = False  # read back by prefetch() and not used by get() since
    waiters: int = 0  # get() calls waiting for this array: it must not be dropped meanwhile
    tier: str | None = None  # "disk": spilled to its file even where the host tier has room
    # A JAX array put uncommitted (placed by default, not by the caller): read back
    # uncommitted too, or every jitted function it reaches compiles again for it.
    uncommitted: bool = False

    @property
    def clean(self) -> bool:
        return self.on_disk and not self.writing

    @property
    def in_file(self) -> bool:
        """Whether the spilled copy is the entry's file (not the host tier)."""
        return self.on_disk and self.host is None


def describe(array: Any) -> tuple[Any, Request, _dtypes.DType, tuple[int, ...]]:
    """What :meth:`Offloader.put` records of an array.

    Returns
    -------
    array
        ``array`` itself if a framework arrayio knows owns it; a DLPack producer becomes a
        NumPy or CuPy array.
    request
        The framework and device a read back returns it in.
    dtype, shape

    Raises
    ------
    UnsupportedObjectError
        For an object that is no array, or a JAX array on more than one device.
    UnsupportedDtypeError
        For a dtype arrayio does not store.
    """
    array = _as_known_array(array)
    framework = framework_of(array)
    dtype = _dtypes.dtype_of(array.dtype)
    shape = tuple(int(n) for n in array.shape)
    placement = placement_of(array)
    jax_device = None
    if framework == "jax":
        devices = array.devices()
        if len(devices) != 1:
            raise UnsupportedObjectError(
                f"the offloader takes arrays on one device; this JAX array spans {len(devices)}"
            )
        jax_device = next(iter(devices)) if placement.is_cuda else None
    return array, Request(framework, placement, jax_device), dtype, shape  # type: ignore[arg-type]


def _as_known_array(x: Any) -> Any:
    if framework_of(x) is not None:
        return x
    if hasattr(x, "__dlpack__"):
        if placement_of(x).is_cuda:
            import cupy

            return cupy.from_dlpack(x)
        import numpy as np

        return np.from_dlpack(x)
    raise UnsupportedObjectError(f"cannot offload an object of type {type(x).__name__}")
