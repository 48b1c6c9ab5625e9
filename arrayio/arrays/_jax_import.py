"""Hand a load's CuPy device arrays to JAX, zero-copy, at a fraction of ``from_dlpack``'s cost.

``jax.dlpack.from_dlpack`` takes tens of microseconds an array: for a checkpoint of hundreds
of arrays, a tenth of a warm load (docs/design/loads.md). Most of it is work a load does not
need: looking up the backend and the device's stream for each
array, having CuPy record an event and make that stream wait on it, then re-wrapping the
result through ``jnp.asarray``. A load's bytes are final before they are handed over (its
transfers have returned: see :func:`arrayio.dispatch.batches.read_batch`), so no stream
needs to wait, and the dtype is already one JAX keeps as it is (checked at allocation).

:func:`to_jax` calls the conversion under ``from_dlpack`` directly, as ``from_dlpack`` does.
It is private to jaxlib: its first result is checked (the same memory, shape and dtype),
and any failure, then or later, sends this and every later array through the public
``jax.dlpack.from_dlpack``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_KDLCUDA = 2  # DLPack's device type of CUDA memory
_direct: Callable[[Any, Any], Any] | None = None
_state = "untried"  # "untried", "direct" (checked once) or "public"


def to_jax(jax: Any, array: Any, device: Any) -> Any:
    """``array`` (a CuPy array or a :class:`~arrayio.arrays._driver_buffers.DLPackExport`, on
    ``device``'s GPU, its bytes final) as a JAX array, zero-copy."""
    global _state
    if _state != "public" and array.size:  # an empty array has no memory to compare
        try:
            result = _convert(jax, array, device)
        except Exception:  # noqa: BLE001 - a jaxlib whose private call differs: the public one
            _state = "public"
        else:
            if _state == "direct":
                return result
            if _same_array(result, array):
                _state = "direct"
                return result
            _state = "public"
    return jax.dlpack.from_dlpack(array)


def imports_in_place() -> bool:
    """Whether arrays are known to be taken over where they lie (the direct import, checked
    on a first array): only then may an array be made before its bytes are final, since the
    public ``from_dlpack`` may copy."""
    return _state == "direct"


def _convert(jax: Any, array: Any, device: Any) -> Any:
    global _direct
    if _direct is None:
        from jax._src.lib import _jax, jaxlib_extension_version  # private: checked on use

        if jaxlib_extension_version < 467:  # before it took the device type
            raise RuntimeError("jaxlib too old for the direct import")
        convert = _jax.dlpack_managed_tensor_to_buffer

        def direct(x: Any, dev: Any) -> Any:
            # stream -1 and None: no event to record or wait on, the bytes are final
            return convert(x.__dlpack__(stream=-1), dev, None, None, _KDLCUDA)

        _direct = direct
    result = _direct(array, device)
    if not isinstance(result, jax.Array):
        raise TypeError(f"the direct import gave a {type(result).__name__}")
    return result


def _same_array(result: Any, array: Any) -> bool:
    pointer = array.pointer if hasattr(array, "pointer") else array.data.ptr
    return (
        tuple(result.shape) == tuple(array.shape)
        and result.dtype == array.dtype
        and result.unsafe_buffer_pointer() == pointer
    )


def reset() -> None:
    """Try the direct import again on the next array (tests)."""
    global _direct, _state
    _direct, _state = None, "untried"
