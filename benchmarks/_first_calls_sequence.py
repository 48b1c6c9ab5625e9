"""One peer's sequence of load calls, in a process of its own: what :mod:`benchmarks.first_calls`
runs once per peer, pattern, repetition and cache state.

``python -m benchmarks._first_calls_sequence SPEC.json`` imports the peer, makes its framework's
device context, then makes ``calls`` calls, each prepared (page cache dropped or warmed) as
the pattern says, timed until the arrays are in device memory and the device synchronized.
Every call's result is checked for its keys, shapes, dtypes and device; the first call's
also for the bytes of a few tensors (CRC-32), so that no peer is timed returning less than
the file. On the CPU each call's clock stops only once one byte of every page of its arrays
has been read (:func:`touch_pages`): a loader that maps the file has then read it too. The
result is written to ``SPEC["result"]`` after every call, so that a process
that dies keeps what it measured.

The peers are listed in :data:`PEERS`; this module imports none of them until a sequence
asks for one.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.peers import _harness as h

PATTERNS = ("warm", "cold_start", "cold_every")


@dataclasses.dataclass(frozen=True)
class PeerInfo:
    """A loader under test: which of the two files it reads (``"safetensors"``, written by
    ``safetensors.torch.save_file``, or ``"arrayio"``, by ``arrayio.save``), the framework
    whose device context is made before call 1, the modules it needs, the devices it can
    load to, and the distribution whose version the report records."""

    name: str
    reads: str
    framework: str
    modules: tuple[str, ...]
    devices: tuple[str, ...]
    distribution: str
    note: str
    learns: bool = False  # keeps a dispatch table in ARRAYIO_CACHE_DIR


# The stand-in for warm reads into GPU memory (arrayio.dispatch.candidates), as ARRAYIO_TOOL
# names it.
STAND_IN = "staged(threads=8,chunk_size=4194304)"

PEERS = {
    p.name: p
    for p in (
        PeerInfo(
            "safetensors",
            "safetensors",
            "torch",
            ("safetensors", "torch"),
            ("cpu", "cuda"),
            "safetensors",
            "safetensors.torch.load_file(path, device=...)",
        ),
        PeerInfo(
            "safetensors-numpy",
            "safetensors",
            "numpy",
            ("safetensors", "ml_dtypes"),
            ("cpu",),
            "safetensors",
            "safetensors.numpy.load_file(path) (ml_dtypes imported for bfloat16)",
        ),
        PeerInfo(
            "fastsafetensors",
            "safetensors",
            "torch",
            ("fastsafetensors", "torch"),
            ("cpu", "cuda"),
            "fastsafetensors",
            "fastsafe_open([path], framework='pt', device=..., nogds=True), "
            "get_tensor of every key",
        ),
        PeerInfo(
            "runai-streamer",
            "safetensors",
            "torch",
            ("runai_model_streamer", "torch"),
            ("cpu", "cuda"),
            "runai-model-streamer",
            "SafetensorsStreamer().stream_file(path), each tensor .to(device) as it arrives "
            "(.clone() on the CPU: the streamer reuses its buffers)",
        ),
        PeerInfo(
            "instanttensor",
            "safetensors",
            "torch",
            ("instanttensor", "torch"),
            ("cuda",),
            "instanttensor",
            "instanttensor.safe_open(path, framework='pt', device=...), every tensor of "
            ".tensors(); its default backends (io_uring, then AIO, both direct I/O)",
        ),
        PeerInfo(
            "instanttensor-buffered",
            "safetensors",
            "torch",
            ("instanttensor", "torch"),
            ("cuda",),
            "instanttensor",
            "as instanttensor, with backend=BackendPolicy.BUFFERED (page-cache reads)",
        ),
        PeerInfo(
            "arrayio-torch",
            "arrayio",
            "torch",
            ("arrayio", "torch"),
            ("cpu", "cuda"),
            "arrayio",
            "arrayio.load(path, like='torch', device=...)",
            learns=True,
        ),
        PeerInfo(
            "arrayio-torch-stfile",
            "safetensors",
            "torch",
            ("arrayio", "torch"),
            ("cpu", "cuda"),
            "arrayio",
            "arrayio.load(path, like='torch', device=...) of the file safetensors wrote "
            "(no checksums in it)",
            learns=True,
        ),
        PeerInfo(
            "arrayio-jax",
            "arrayio",
            "jax",
            ("arrayio", "jax"),
            ("cpu", "cuda"),
            "arrayio",
            "arrayio.load(path, like='jax', device=...)",
            learns=True,
        ),
        PeerInfo(
            "arrayio-cupy",
            "arrayio",
            "cupy",
            ("arrayio", "cupy"),
            ("cuda",),
            "arrayio",
            "arrayio.load(path, like='cupy', device='cuda')",
            learns=True,
        ),
        PeerInfo(
            "arrayio-numpy",
            "arrayio",
            "numpy",
            ("arrayio",),
            ("cpu",),
            "arrayio",
            "arrayio.load(path, like='numpy')",
            learns=True,
        ),
        PeerInfo(
            "arrayio-torch-pagecache",
            "arrayio",
            "torch",
            ("arrayio", "torch"),
            ("cuda",),
            "arrayio",
            "arrayio.load(path, like='torch', device='cuda') with ARRAYIO_TOOL=pagecache: "
            "the GPU copying straight out of the page cache (its pages registered with "
            "CUDA), no choosing; a tool the dispatcher does not offer yet",
        ),
        PeerInfo(
            "arrayio-numpy-posix",
            "arrayio",
            "numpy",
            ("arrayio",),
            ("cpu",),
            "arrayio",
            "arrayio.load(path, like='numpy') with ARRAYIO_TOOL=posix: one fixed tool "
            "(threaded pread at its defaults), no choosing; the choice the dispatcher must "
            "never lose to",
        ),
        PeerInfo(
            "arrayio-torch-kvikio",
            "arrayio",
            "torch",
            ("arrayio", "torch"),
            ("cuda",),
            "arrayio",
            "arrayio.load(path, like='torch', device='cuda') with ARRAYIO_TOOL=kvikio: "
            "KvikIO for every transfer (its set-up in the process's first call), no "
            "choosing; the GPU's fixed choice for page-cache reads",
        ),
        PeerInfo(
            "arrayio-torch-stand-in",
            "arrayio",
            "torch",
            ("arrayio", "torch"),
            ("cuda",),
            "arrayio",
            "arrayio.load(path, like='torch', device='cuda') with ARRAYIO_TOOL="
            f"{STAND_IN}: the staged pipeline that stands in for KvikIO until it is set up, "
            "for every transfer",
        ),
        PeerInfo(
            "arrayio-torch-no-setup-wait",
            "arrayio",
            "torch",
            ("arrayio", "torch"),
            ("cuda",),
            "arrayio",
            "arrayio.load(path, like='torch', device='cuda') with the dispatcher's "
            "Policy.setup_wait 0: a page-cache load runs the stand-in beside a tool's set-up "
            "in progress instead of waiting for it",
        ),
        PeerInfo(
            "arrayio-torch-no-second-pass",
            "arrayio",
            "torch",
            ("arrayio", "torch"),
            ("cuda",),
            "arrayio",
            "arrayio.load(path, like='torch', device='cuda') with ARRAYIO_SECOND_PASS=0: a "
            "cold load's pages left inactive, as the kernel leaves them (what the second "
            "pass saves the next load)",
        ),
        PeerInfo(
            "arrayio-torch-no-verify",
            "arrayio",
            "torch",
            ("arrayio", "torch"),
            ("cpu", "cuda"),
            "arrayio",
            "arrayio.load(path, like='torch', device=...) with ARRAYIO_VERIFY_CHECKSUMS=0: "
            "arrayio's file, its checksums not verified (what verifying them costs)",
        ),
        PeerInfo(
            "arrayio-jax-no-second-pass",
            "arrayio",
            "jax",
            ("arrayio", "jax"),
            ("cuda",),
            "arrayio",
            "arrayio.load(path, like='jax', device='cuda') with ARRAYIO_SECOND_PASS=0",
        ),
        PeerInfo(
            "arrayio-numpy-no-second-pass",
            "arrayio",
            "numpy",
            ("arrayio",),
            ("cpu",),
            "arrayio",
            "arrayio.load(path, like='numpy') with ARRAYIO_SECOND_PASS=0",
        ),
    )
}


# ------------------------------------------------------------------ the loaders


def _torch_device(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def _safetensors(device: str) -> Callable[[str], Any]:
    from safetensors.torch import load_file

    target = _torch_device(device)
    return lambda path: load_file(path, device=target)


def _safetensors_numpy(device: str) -> Callable[[str], Any]:
    import ml_dtypes  # noqa: F401 - registers the bfloat16 dtype that safetensors.numpy asks for
    from safetensors.numpy import load_file

    return load_file


def _fastsafetensors(device: str) -> Callable[[str], Any]:
    from fastsafetensors import fastsafe_open

    target = _torch_device(device)

    def load(path: str) -> Any:
        with fastsafe_open([path], framework="pt", device=target, nogds=True) as f:
            return {key: f.get_tensor(key).to(target) for key in f.keys()}

    return load


def _runai_streamer(device: str) -> Callable[[str], Any]:
    from runai_model_streamer import SafetensorsStreamer

    target = _torch_device(device)

    def load(path: str) -> Any:
        out = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path)
            for name, tensor in streamer.get_tensors():
                out[name] = tensor.to(target) if target != "cpu" else tensor.clone()
        return out

    return load


def _instanttensor(device: str, buffered: bool) -> Callable[[str], Any]:
    from instanttensor import BackendPolicy, safe_open

    target = _torch_device(device)
    options = {"backend": BackendPolicy.BUFFERED} if buffered else {}

    def load(path: str) -> Any:
        with safe_open(path, framework="pt", device=target, **options) as f:
            return dict(f.tensors())

    return load


def _arrayio(like: str, device: str) -> Callable[[str], Any]:
    import arrayio

    return lambda path: arrayio.load(path, like=like, device=device)


def _arrayio_fixed(tool: str, like: str, device: str) -> Callable[[str], Any]:
    """arrayio with every transfer forced to ``tool``, as ``ARRAYIO_TOOL`` does. arrayio reads
    its environment when imported, which the peer's set-up has done: setting the variable
    now would force nothing."""
    import arrayio

    arrayio.config.set(tool=tool)
    return _arrayio(like, device)


def _arrayio_without_verifying(like: str, device: str) -> Callable[[str], Any]:
    """arrayio with no checksum verified (see :func:`_arrayio_fixed` on why through the
    settings)."""
    import arrayio

    arrayio.config.set(verify_checksums=False)
    return _arrayio(like, device)


def _arrayio_without_setup_wait(like: str, device: str) -> Callable[[str], Any]:
    """arrayio whose page-cache loads never wait for a tool's set-up in progress (they run
    the stand-in beside it, as before ``Policy.setup_wait``)."""
    from arrayio.dispatch import dispatcher

    dispatcher.get().policy.setup_wait = 0.0
    return _arrayio(like, device)


def _arrayio_without_second_pass(like: str, device: str) -> Callable[[str], Any]:
    """arrayio with no second pass over its cold reads (see :func:`_arrayio_fixed` on why
    through the settings)."""
    import arrayio

    arrayio.config.set(second_pass=False)
    return _arrayio(like, device)


LOADERS: dict[str, Callable[[str], Callable[[str], Any]]] = {
    "safetensors": _safetensors,
    "safetensors-numpy": _safetensors_numpy,
    "fastsafetensors": _fastsafetensors,
    "runai-streamer": _runai_streamer,
    "instanttensor": lambda device: _instanttensor(device, buffered=False),
    "instanttensor-buffered": lambda device: _instanttensor(device, buffered=True),
    "arrayio-torch": lambda device: _arrayio("torch", device),
    "arrayio-torch-stfile": lambda device: _arrayio("torch", device),
    "arrayio-jax": lambda device: _arrayio("jax", device),
    "arrayio-cupy": lambda device: _arrayio("cupy", device),
    "arrayio-numpy": lambda device: _arrayio("numpy", device),
    "arrayio-numpy-posix": lambda device: _arrayio_fixed("posix", "numpy", device),
    "arrayio-torch-pagecache": lambda device: _arrayio_fixed("pagecache", "torch", device),
    "arrayio-torch-kvikio": lambda device: _arrayio_fixed("kvikio", "torch", device),
    "arrayio-torch-stand-in": lambda device: _arrayio_fixed(STAND_IN, "torch", device),
    "arrayio-torch-no-setup-wait": lambda device: _arrayio_without_setup_wait("torch", device),
    "arrayio-torch-no-second-pass": lambda device: _arrayio_without_second_pass("torch", device),
    "arrayio-torch-no-verify": lambda device: _arrayio_without_verifying("torch", device),
    "arrayio-jax-no-second-pass": lambda device: _arrayio_without_second_pass("jax", device),
    "arrayio-numpy-no-second-pass": lambda device: _arrayio_without_second_pass("numpy", device),
}


def ready_device(framework: str, device: str) -> None:
    """Make ``framework``'s context on ``device`` before call 1, so that no peer's first call
    pays for the CUDA context its framework would make for any loader."""
    cuda = device.startswith("cuda")
    if framework == "torch":
        import torch

        if cuda:
            torch.empty(1, device=_torch_device(device))
            torch.cuda.synchronize()
    elif framework == "jax":
        import jax

        where = jax.devices()[0] if cuda else jax.devices("cpu")[0]
        jax.block_until_ready(jax.device_put(np.zeros(1, np.float32), where))
    elif framework == "cupy":
        import cupy

        cupy.zeros(1)
        cupy.cuda.runtime.deviceSynchronize()


# ------------------------------------------------------------------ the checks


def _library(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def host_bytes(x: Any) -> np.ndarray:
    """The bytes of ``x`` (torch, JAX, CuPy or NumPy, on any device) as a flat uint8 array in
    host memory."""
    library = _library(x)
    if library == "torch":
        return x.detach().cpu().contiguous().reshape(-1).view(_torch_uint8()).numpy()
    if library == "cupy":
        x = x.get()
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


def crc32(x: Any) -> int:
    return zlib.crc32(host_bytes(x))


def dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def device_kind(x: Any) -> str:
    """``"cuda"`` or ``"cpu"``: where ``x``'s bytes are."""
    library = _library(x)
    if library == "torch":
        return str(x.device.type)
    if library == "cupy":
        return "cuda"
    if library in ("jax", "jaxlib"):
        platform = next(iter(x.devices())).platform
        return "cuda" if platform in ("gpu", "cuda", "rocm") else platform
    return "cpu"


PAGE = 4096


def touch_pages(out: Any) -> int:
    """Read one byte of every page of every array of ``out`` (host memory); return their
    sum. A loader that maps the file (safetensors.torch on the CPU) returns before it has
    read a byte: this makes every peer's call end with its bytes in memory, at the cost of
    a strided read for those that copied them already."""
    total = 0
    for x in h.flatten(out).values():
        flat = host_bytes(x)
        if flat.size:
            total += int(flat[::PAGE].sum(dtype=np.uint64))
    return total


def check_structure(out: Any, expected: dict[str, Any], device: str) -> None:
    """Raise unless ``out`` holds every tensor of ``expected`` with its shape and dtype, on
    ``device``."""
    if not isinstance(out, dict):
        raise AssertionError(f"got a {type(out).__name__}, expected a dict of arrays")
    out = h.flatten(out)
    tensors = expected["tensors"]
    if set(out) != set(tensors):
        missing, extra = sorted(set(tensors) - set(out)), sorted(set(out) - set(tensors))
        raise AssertionError(f"keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
    want = "cuda" if device.startswith("cuda") else "cpu"
    for key, (shape, dtype) in tensors.items():
        x = out[key]
        if tuple(x.shape) != tuple(shape) or dtype_name(x) != dtype:
            raise AssertionError(
                f"{key}: got {dtype_name(x)}{tuple(x.shape)}, expected {dtype}{tuple(shape)}"
            )
        if device_kind(x) != want:
            raise AssertionError(f"{key}: in {device_kind(x)} memory, expected {want}")


def check_content(out: Any, expected: dict[str, Any]) -> None:
    """Raise unless the sampled tensors of ``expected`` have the CRC-32 of the file's."""
    out = h.flatten(out)
    for key, want in expected["crc32"].items():
        got = crc32(out[key])
        if got != want:
            raise AssertionError(f"{key}: CRC-32 {got:#010x}, expected {want:#010x}")


# ------------------------------------------------------------------ the sequence


def versions(peer: PeerInfo) -> dict[str, str]:
    """The versions of the peer's distribution and of the frameworks this process imported."""
    out = {}
    try:
        out[peer.distribution] = importlib.metadata.version(peer.distribution)
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get(peer.distribution.replace("-", "_"))
        out[peer.distribution] = str(getattr(module, "__version__", "unknown"))
    for name in ("numpy", "torch", "jax", "cupy", "kvikio"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "unknown"))
    return out


def prepare(pattern: str, call: int, path: str, drop: bool) -> str | None:
    """Put ``path`` in the page-cache state ``pattern`` asks for before call ``call`` (from
    0); return what was done: ``"warmed"``, ``"evicted"`` (the file's pages),
    ``"dropped"`` (the whole page cache too), or None."""
    if pattern == "warm" and call == 0:
        h.warm(path)
        return "warmed"
    if (pattern == "cold_start" and call == 0) or pattern == "cold_every":
        return "dropped" if h.evict(path, drop) else "evicted"
    return None


def set_up(peer: PeerInfo, device: str) -> tuple[Callable[[str], Any], dict[str, float]]:
    """Import ``peer`` (and its framework: a user has it imported already) and make its
    framework's device context; return its load function and the seconds of both steps."""
    start = time.perf_counter()
    for module in peer.modules:
        importlib.import_module(module)
    load = LOADERS[peer.name](device)
    imported = time.perf_counter()
    ready_device(peer.framework, device)
    return load, {"import": imported - start, "device": time.perf_counter() - imported}


def _forced_tool(peer: PeerInfo) -> str | None:
    """The tool arrayio's settings force on every transfer of an arrayio peer, or None."""
    if not peer.name.startswith("arrayio"):
        return None
    import arrayio

    return arrayio.config.get().tool


def _second_pass(peer: PeerInfo) -> bool | None:
    """Whether an arrayio peer's cold reads get the dispatcher's second pass; None for
    others."""
    if not peer.name.startswith("arrayio"):
        return None
    import arrayio

    return bool(arrayio.config.get().second_pass)


def _driver_pool(peer: PeerInfo, device: str) -> Any:
    """For arrayio into JAX on a GPU, the pool of device memory JAX gives back: each call
    records how many of its outputs it reused and how many the driver allocated anew."""
    if not (peer.name.startswith("arrayio") and peer.framework == "jax"):
        return None
    if not device.startswith("cuda"):
        return None
    from arrayio.arrays import _driver_buffers

    return _driver_buffers._pool


def background(peer: PeerInfo) -> dict[str, Any] | None:
    """For an arrayio peer, what its dispatcher does in the background at this moment: the
    arms whose tools are being set up, and whether a second pass is reading (a call that
    starts beside them shares the machine with them). None for other peers."""
    if not peer.name.startswith("arrayio"):
        return None
    from arrayio.dispatch import dispatcher

    current = dispatcher.current()  # (none before call 1: making one here would time less)
    if current is None:
        return {"setting_up": [], "second_pass": False}
    return {
        "setting_up": [arm.label for arm in current.policy.setting_up()],
        "second_pass": not current.second_pass.wait(0),
    }


def set_ups_since(start: float) -> list[dict[str, Any]]:
    """The set-ups arrayio's dispatcher ran in the background in this process (see
    ``Policy.set_ups``), each one's ``began`` in seconds after ``start`` (call 1's start)."""
    from arrayio.dispatch import dispatcher

    current = dispatcher.current()
    if current is None:
        return []
    return [dict(record, began=record["began"] - start) for record in current.policy.set_ups()]


def stages_of_last_load() -> dict[str, Any] | None:
    """Where arrayio's last load in this process spent its time (its stages' seconds, as
    ``arrayio.explain()`` shows them)."""
    from arrayio.runtime import _stages

    return _stages.last()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the sequence ``spec`` describes; the result is also written to ``spec["result"]``
    after every call. An exception ends the sequence: the result says at which stage."""
    peer = PEERS[spec["peer"]]
    cache_dir = os.environ.get("ARRAYIO_CACHE_DIR")
    result: dict[str, Any] = {
        "seconds": [],
        "gc": [],
        "page_cache": [],
        "check": None,
        "error": None,
        "failed_at": None,
        "cache_files_at_start": (
            sorted(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else []
        ),
    }
    stage = "setup"
    try:
        load, result["setup_seconds"] = set_up(peer, spec["device"])
        result["versions"] = versions(peer)
        result["forced_tool"] = _forced_tool(peer)
        result["second_pass"] = _second_pass(peer)
        h.write_json(result, spec["result"])
        pool = _driver_pool(peer, spec["device"])
        first_began: float | None = None
        for call in range(spec["calls"]):
            stage = f"call {call + 1}"
            page_cache = prepare(spec["pattern"], call, spec["path"], spec["drop_caches"])
            before = pool.counts() if pool is not None else None
            busy = background(peer)
            with h.GcMeter() as collector:
                began = time.perf_counter()
                first_began = began if first_began is None else first_began
                out = load(spec["path"])
                h.settle(jax_tree=out if peer.framework == "jax" else None)
                if not spec["device"].startswith("cuda"):
                    touch_pages(out)
                seconds = time.perf_counter() - began
            if pool is not None and before is not None:
                after = pool.counts()
                result.setdefault("pool", []).append({k: after[k] - before[k] for k in after})
            stage = f"check of call {call + 1}"
            check_structure(out, spec["expected"], spec["device"])
            budget = spec.get("call_budget")
            spent = sum(result["seconds"]) + seconds
            cut = budget is not None and call + 1 < spec["calls"] and spent >= budget
            # One call's bytes are checked: --check-call's, or the last made if cut before.
            last = call + 1 == spec["calls"]
            if result["check"] is None and (call + 1 >= spec.get("check_call", 1) or cut or last):
                check_content(out, spec["expected"])
                result["check"] = "passed"
                result["checked_call"] = call + 1
            del out
            result["seconds"].append(seconds)
            result["gc"].append(collector.report())
            result["page_cache"].append(page_cache)
            if busy is not None:
                result.setdefault("background", []).append(busy)
                result.setdefault("stages", []).append(stages_of_last_load())
                result.setdefault("began", []).append(began - first_began)
            h.write_json(result, spec["result"])
            if cut:
                result["cut_after"] = call + 1  # a slow loader: its later calls not made
                h.write_json(result, spec["result"])
                break
            if spec.get("gap"):
                time.sleep(spec["gap"])  # the program's own work between its loads
        if peer.name.startswith("arrayio"):
            # Which tool each context's calls ran on (after the calls, out of their timing).
            stage = "the dispatcher's report"
            import arrayio

            result["dispatcher"] = str(arrayio.explain())
            if first_began is not None:
                result["set_ups"] = set_ups_since(first_began)
            h.write_json(result, spec["result"])
    except Exception as error:  # noqa: BLE001 - the parent reports it beside the others
        result["error"] = f"{type(error).__name__}: {error}"
        result["failed_at"] = stage
        result["traceback"] = traceback.format_exc(limit=8)
        if stage.startswith("check"):
            result["check"] = result["error"]
        h.write_json(result, spec["result"])
    return result


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        spec = json.load(f)
    run(spec)


if __name__ == "__main__":
    main()
