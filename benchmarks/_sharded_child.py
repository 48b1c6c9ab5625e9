"""The measuring process of :mod:`benchmarks.sharded`, started by it with its JAX devices
already configured (``XLA_FLAGS`` for CPU host devices; on GPUs, every GPU, or with
``processes`` above 1 one GPU per process, joined by ``jax.distributed``): it builds the
sharded pytree, runs the rounds and prints one ``RESULT {json}`` line (process 0 alone).
Not meant to be run by hand.

``python -m benchmarks._sharded_child SPEC_JSON``
"""

from __future__ import annotations

import abc
import importlib.metadata
import inspect
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import arrayio
from benchmarks import _pagecache
from benchmarks.peers import _harness as h

COLUMNS = 4096
MATRICES = 8
OPTIONAL_PEERS = ("orbax", "tensorstore")

# The ceilings each round samples beside the peers, one setting each (the question is the
# disk's rate for plain writes and reads, not the best of several tools'): plain threaded
# pwrite of the checkpoint's bytes into a new file in the checkpoints' directory, then
# fsync...
WRITE_CEILING = ("posix", 4, 64 * h.MiB)
# ...that file read back from the page cache by buffered threads...
READ_CEILING = ("posix", 16, 16 * h.MiB)
# ...and read after eviction with O_DIRECT (``cold``)...
COLD_CEILING = ("direct", 16, 16 * h.MiB)
# ...and by buffered threads (``cold``): the disk's rate for a read that leaves the file in
# the page cache, as arrayio's reads of a file its process reads again do.
COLD_BUFFERED_CEILING = ("posix", 16, 16 * h.MiB)
# On GPUs, pinned host memory copied to every device at once (of each process), at most
# this much per device: the host-to-device links' limit on a restore from the page cache.
DEVICE_COPY_BYTES = 1 << 30
# Host memory copied by as many threads as the page-cache ceiling reads with, at most this
# much per process: the memory's own rate, which a read from the page cache into GPUs pays
# once more than a read into host memory (the staging buffer is written, then read again).
MEMORY_COPY_BYTES = 1 << 30


@dataclass
class Peer:
    """A checkpointer under test: ``save()`` writes the tree under ``path``,
    ``restore(sharding)`` returns it as jax.Arrays with that sharding."""

    path: str
    save: Callable[[], Any] | None  # None: it restores another peer's checkpoint
    restore: Callable[[NamedSharding], dict[str, Any]]
    # Paths a cold restore evicts (the checkpoint's files).
    files: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ processes


def start_processes(spec: dict[str, Any]) -> None:
    """Join ``jax.distributed`` where the run has several processes: on GPUs, process ``r``
    drives GPU ``r`` alone."""
    if spec["processes"] == 1:
        return
    placement = {"local_device_ids": [spec["rank"]]} if spec["platform"] == "gpu" else {}
    jax.distributed.initialize(
        f"localhost:{spec['port']}",
        num_processes=spec["processes"],
        process_id=spec["rank"],
        **placement,
    )


def sync(name: str) -> None:
    """Every process meets here (nothing to do in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def leader() -> bool:
    return jax.process_index() == 0


# ------------------------------------------------------------------ the pytree


def meshes(devices: list[Any]) -> tuple[NamedSharding, NamedSharding]:
    """Rows over every device, and the other mesh a restore reshards onto: devices / 2 x 2,
    sharded along both axes (1 x 1 for one device, where it is the same placement)."""
    rows = NamedSharding(Mesh(np.array(devices).reshape(-1), ("data",)), P("data"))
    mesh2 = Mesh(np.array(devices).reshape(-1, 2 if len(devices) > 1 else 1), ("data", "model"))
    return rows, NamedSharding(mesh2, P("data", "model"))


def build_tree(gib: float, sharding: NamedSharding, devices: int) -> dict[str, Any]:
    """``MATRICES`` float32 matrices of ``gib`` GiB in all, normally distributed, made on
    their devices and each sharded along its rows. The rows are a multiple of 2 x devices,
    so that both meshes split them evenly."""
    rows = int(gib * (1 << 30)) // (4 * COLUMNS * MATRICES)
    rows -= rows % (2 * devices)
    if rows == 0:
        need = 2 * devices * 4 * COLUMNS * MATRICES / (1 << 30)
        raise SystemExit(f"--gib {gib} is too small for {devices} devices: at least {need:g}")
    make = jax.jit(
        lambda key: jax.random.normal(key, (rows, COLUMNS), jnp.float32), out_shardings=sharding
    )
    tree = {f"layer{i}": make(jax.random.key(i)) for i in range(MATRICES)}
    jax.block_until_ready(tree)
    return tree


def abstract(tree: dict[str, Any], sharding: NamedSharding) -> dict[str, Any]:
    return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for k, x in tree.items()}


def check(tree: dict[str, Any], out: dict[str, Any], sharding: NamedSharding) -> None:
    """Raise unless ``out`` is ``tree`` with ``sharding``: every element compared, on the
    devices (across processes too), whatever the two shardings."""
    assert set(out) == set(tree), sorted(out)
    for k, x in out.items():
        assert x.sharding == sharding, k
        if x.sharding.device_set != tree[k].sharding.device_set:  # fewer devices: move it
            x = jax.device_put(x, tree[k].sharding)
        replicated = NamedSharding(tree[k].sharding.mesh, P())
        assert bool(jax.jit(jnp.array_equal, out_shardings=replicated)(tree[k], x)), k


# ------------------------------------------------------------------ the peers


def arrayio_peer(tree: dict[str, Any], scratch: str, restore_tool: str | None = None) -> Peer:
    """arrayio's save and restore; with ``restore_tool``, restores only, of arrayio's
    checkpoint, naming that tool."""
    path = os.path.join(scratch, "arrayio.safetensors")
    return Peer(
        path,
        None if restore_tool else lambda: arrayio.save(path, tree),
        lambda sharding: arrayio.load(path, structure=abstract(tree, sharding), tool=restore_tool),
    )


def orbax_peer(tree: dict[str, Any], scratch: str) -> Peer:
    """orbax's ``StandardCheckpointer`` with its default layout (see :func:`orbax_layout`)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    path = os.path.join(scratch, "orbax")

    def save() -> None:
        checkpointer.save(path, tree, force=True)
        checkpointer.wait_until_finished()

    return Peer(path, save, lambda sharding: checkpointer.restore(path, abstract(tree, sharding)))


def orbax_layout(path: str) -> dict[str, Any]:
    """Which layout orbax wrote at ``path`` and whether it is its default: OCDBT, where
    orbax writes a ``manifest.ocdbt``, is a layout of its own only where it is not."""
    import orbax.checkpoint as ocp

    try:
        parameters = inspect.signature(ocp.StandardCheckpointHandler.__init__).parameters
        default = parameters["use_ocdbt"].default
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        default = f"unknown: {type(error).__name__}: {error}"
    wrote_ocdbt = os.path.exists(os.path.join(path, "manifest.ocdbt"))
    return {"ocdbt": wrote_ocdbt, "use_ocdbt_default": default}


def tensorstore_context() -> Any:
    """As :mod:`benchmarks.zarr_read` configures tensorstore: copy threads for every core,
    at least 4 file threads, and no chunk cache (each restore reads the files)."""
    import tensorstore

    cores = len(os.sched_getaffinity(0))
    return tensorstore.Context(
        {
            "data_copy_concurrency": {"limit": cores},
            "file_io_concurrency": {"limit": max(4, cores)},
            "cache_pool": {"total_bytes_limit": 0},
        }
    )


def zarr3_metadata(x: Any) -> dict[str, Any]:
    """One chunk per shard, stored raw (the ``bytes`` codec alone: no compression)."""
    return {
        "shape": list(x.shape),
        "data_type": str(np.dtype(x.dtype)),
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": list(x.sharding.shard_shape(x.shape))},
        },
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }


def tensorstore_peer(tree: dict[str, Any], scratch: str) -> Peer:
    """tensorstore's ``zarr3`` driver over its ``file`` kvstore, one array per leaf: each
    shard written (one replica of each), and a restore reads each device's region (its
    shard, or on the other mesh the part of the chunks it needs) and assembles them with
    ``jax.make_array_from_single_device_arrays``. Every write and read of the tree is
    issued before any is waited on. One process only: the arrays' creation is not
    coordinated between processes."""
    import tensorstore

    if jax.process_count() > 1:
        raise RuntimeError("the tensorstore peer runs in one process only")
    root = os.path.join(scratch, "tensorstore")
    context = tensorstore_context()

    def spec(name: str) -> dict[str, Any]:
        return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(root, name)}}

    def save() -> None:
        pending = []
        for name, x in tree.items():
            store = tensorstore.open(
                {**spec(name), "metadata": zarr3_metadata(x)},
                create=True,
                delete_existing=True,
                context=context,
            ).result()
            pending += [
                store[shard.index].write(np.asarray(shard.data))
                for shard in x.addressable_shards
                if shard.replica_id == 0
            ]
        for write in pending:
            write.result()

    def restore(sharding: NamedSharding) -> dict[str, Any]:
        reads = {}
        for name, x in tree.items():
            store = tensorstore.open(spec(name), open=True, read=True, context=context).result()
            regions = sharding.addressable_devices_indices_map(x.shape)
            reads[name] = {device: store[region].read() for device, region in regions.items()}
        return {
            name: jax.make_array_from_single_device_arrays(
                tree[name].shape,
                sharding,
                [jax.device_put(read.result(), device) for device, read in per_device.items()],
            )
            for name, per_device in reads.items()
        }

    return Peer(root, save, restore)


def make_peers(
    tree: dict[str, Any], scratch: str, wanted: list[str] | None, restore_tool: str | None = None
) -> tuple[dict[str, Peer], dict[str, str]]:
    """arrayio, its restores naming ``restore_tool`` where given (``arrayio+TOOL``: restores
    only, of arrayio's checkpoint), and each optional peer of ``wanted`` (all where None)
    that imports and runs here; those that do not, with why."""
    peers = {"arrayio": arrayio_peer(tree, scratch)}
    if restore_tool:
        peers[f"arrayio+{restore_tool}"] = arrayio_peer(tree, scratch, restore_tool)
    unavailable = {}
    makers = {"orbax": orbax_peer, "tensorstore": tensorstore_peer}
    for name in OPTIONAL_PEERS:
        if wanted is not None and name not in wanted:
            continue
        try:
            peers[name] = makers[name](tree, scratch)
        except Exception as error:  # noqa: BLE001 - any failure to import means "not here"
            unavailable[name] = f"{type(error).__name__}: {error}"
    return peers, unavailable


# ------------------------------------------------------------------ measuring


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(run: Callable[[], Any], name: str) -> tuple[float, Any]:
    """Seconds from every process's start of ``run`` to the last one's end (its arrays
    ready), and what it returned here."""
    sync(f"{name}:start")
    activated = _pagecache.page_activations()
    start = time.perf_counter()
    out = run()
    jax.block_until_ready(out)
    own = time.perf_counter() - start
    sync(f"{name}:end")
    seconds = time.perf_counter() - start
    moved = None if activated is None else (_pagecache.page_activations() or activated) - activated
    DETAILS[name] = {"each_process_seconds": gather_seconds(own), "pgactivate": moved}
    return seconds, out


# What the last ``timed`` of each name saw besides its seconds: each process's own seconds
# (its start to its own arrays ready, without waiting for the others: where one process
# lags, the spread shows it), and the pages the kernel moved to its active list meanwhile,
# on the whole machine (see benchmarks._pagecache.page_activations).
DETAILS: dict[str, dict[str, Any]] = {}


def details(quantity: str, name: str) -> dict[str, Any]:
    """:data:`DETAILS` of the timing ``name``, as a row's fields of ``quantity``."""
    return {f"{quantity}_{field}": value for field, value in DETAILS[name].items()}


def gather_seconds(own: float) -> list[float]:
    """``own`` of every process, in process order (after the timing)."""
    if jax.process_count() == 1:
        return [own]
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.array([own], np.float64))
    return [float(x) for x in np.asarray(gathered).reshape(-1)]


def timed_with_peak_memory(run: Callable[[], Any], name: str) -> tuple[float, int]:
    """Seconds ``run`` took (as :func:`timed`), and the most this process's resident set
    grew above where it started, sampled every 2 ms."""
    base, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes() - base)
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        seconds, _ = timed(run, name)
    finally:
        done.set()
        thread.join()
    return seconds, max(peak[0], resident_bytes() - base)


def warm_checkpoint(path: str) -> None:
    """The checkpoint's files read through the page cache twice (by process 0 while the
    others wait), as the ceilings' file is: after a cold restore, the next read of a page
    moves it to the kernel's active list, a cost the page-cache ceiling does not pay
    (``docs/design/measurement.md``, "Warm loads follow two passes")."""
    if leader():
        h.warm(path)
    sync(f"warmed:{path}")


def every_process_text(text: str, scratch: str) -> list[str]:
    """``text`` of every process, in process order, on process 0 (a file each in
    ``scratch``, read and removed by process 0); one process: ``[text]``."""
    if jax.process_count() == 1:
        return [text]
    path = os.path.join(scratch, f"process-text-{jax.process_index()}.txt")
    with open(path, "w") as f:
        f.write(text)
    sync("process-text:written")
    texts = []
    if leader():
        for rank in range(jax.process_count()):
            path = os.path.join(scratch, f"process-text-{rank}.txt")
            with open(path) as f:
                texts.append(f.read())
            os.remove(path)
    sync("process-text:read")
    return texts


def evict_checkpoint(path: str) -> None:
    """The checkpoint's files out of the page cache (and every cache, where this is root):
    done by process 0 while the others wait."""
    if leader():
        h.evict(path, drop=True)
    sync(f"evicted:{path}")


def measure_peer(
    name: str,
    peer: Peer,
    tree: dict[str, Any],
    shardings: dict[str, NamedSharding],
    cold: bool,
) -> dict[str, Any]:
    """One round of a peer: a durable save (its files and directories fsynced, as the write
    ceiling's file is, inside the timing); with ``cold`` a restore onto the save's sharding
    after the files were evicted, then the files read twice (:func:`warm_checkpoint`); then
    one restore onto every sharding of ``shardings`` from the page cache (``restore``, the
    save's own, first). Every restore is checked."""
    row: dict[str, Any] = {}
    save = peer.save
    if save is not None:  # else it restores the checkpoint another peer just saved
        if leader():
            h.remove(peer.path)
        sync(f"{name}:removed")

        def durable_save() -> None:
            save()
            sync(f"{name}:saved")
            if leader():
                h.fsync_tree(peer.path)

        save_s, peak = timed_with_peak_memory(durable_save, f"{name}:save")
        row.update(save_s=save_s, save_peak_extra_bytes=peak)
        row.update(details("save", f"{name}:save"))
    if cold:
        evict_checkpoint(peer.path)
        seconds, out = timed(lambda: peer.restore(shardings["restore"]), f"{name}:cold")
        check(tree, out, shardings["restore"])
        del out
        row["cold_restore_s"] = seconds
        row.update(details("cold_restore", f"{name}:cold"))
        warm_checkpoint(peer.path)
    for quantity, sharding in shardings.items():
        seconds, out = timed(lambda s=sharding: peer.restore(s), f"{name}:{quantity}")
        check(tree, out, sharding)
        del out
        row[f"{quantity}_s"] = seconds
        row.update(details(quantity, f"{name}:{quantity}"))
    return row


def ceiling_names(cold: bool) -> tuple[str, ...]:
    cold_names = ("cold_read", "cold_buffered_read") if cold else ()
    return ("write_fsync", "warm_read", *cold_names)


class ExtraCeiling(abc.ABC):
    """A ceiling sampled beside the disk's: :meth:`_prepare` untimed, then ``ready()``
    (where the processes meet), then :meth:`_move` timed. ``bytes`` are every process's."""

    setting = ""

    def __init__(self, nbytes: int) -> None:
        self.bytes = nbytes * jax.process_count()
        self.samples: list[float] = []

    def _prepare(self) -> None:  # noqa: B027 - optional hook
        """Untimed, before each sample."""

    @abc.abstractmethod
    def _move(self) -> None:
        """This process's timed work."""

    def sample(self, ready: Callable[[], None] | None = None) -> float:
        self._prepare()
        if ready is not None:
            ready()
        start = time.perf_counter()
        self._move()
        seconds = time.perf_counter() - start
        self.samples.append(seconds)
        return seconds

    def report(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "setting": self.setting, "interleaved_seconds": self.samples}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what it holds, after every process's last sample (the run's end)."""


class DeviceCopyCeiling(ExtraCeiling):
    """Pinned host memory copied to each of this process's GPUs at once (torch, a stream
    per device, every copy queued before any is waited on): ``nbytes`` per device."""

    def __init__(self, devices: list[Any], nbytes: int) -> None:
        import torch

        super().__init__(nbytes * len(devices))
        self.torch = torch
        self.indices = [d.local_hardware_id for d in devices]
        self.hosts = [torch.ones(nbytes, dtype=torch.uint8, pin_memory=True) for _ in devices]
        self.targets = [torch.empty(nbytes, dtype=torch.uint8, device=i) for i in self.indices]
        self.streams = [torch.cuda.Stream(device=i) for i in self.indices]
        gpus = len(devices) * jax.process_count()
        self.setting = f"torch pinned copy_ of {nbytes} bytes to each of {gpus} GPUs"
        self._prepare()
        self._move()  # the warm-up

    def _prepare(self) -> None:
        for i in self.indices:
            self.torch.cuda.synchronize(i)

    def _move(self) -> None:
        for host, target, stream in zip(self.hosts, self.targets, self.streams, strict=True):
            with self.torch.cuda.stream(stream):
                target.copy_(host, non_blocking=True)
        for stream in self.streams:
            stream.synchronize()

    def close(self) -> None:
        self.hosts, self.targets, self.streams = [], [], []
        self.torch.cuda.empty_cache()


class MemoryCopyCeiling(ExtraCeiling):
    """``nbytes`` of host memory copied into another buffer by ``threads`` threads at once
    (NumPy's copy releases the interpreter's lock), each its own slice."""

    def __init__(self, nbytes: int, threads: int) -> None:
        import concurrent.futures

        super().__init__(nbytes)
        self.source = np.ones(nbytes, dtype=np.uint8)
        self.target = np.zeros(nbytes, dtype=np.uint8)
        step = -(-nbytes // threads)
        self.slices = [slice(start, start + step) for start in range(0, nbytes, step)]
        self.pool = concurrent.futures.ThreadPoolExecutor(len(self.slices))
        self.setting = (
            f"numpy copyto of {nbytes} bytes by {len(self.slices)} threads "
            f"in each of {jax.process_count()} processes"
        )
        self._move()  # the warm-up (faults every page in)

    def _copy(self, part: slice) -> None:
        np.copyto(self.target[part], self.source[part])

    def _move(self) -> None:
        list(self.pool.map(self._copy, self.slices))

    def close(self) -> None:
        self.pool.shutdown()
        self.source = self.target = np.empty(0, dtype=np.uint8)


class SharedFileWriteCeiling(ExtraCeiling):
    """The write ceiling's setting with every process writing its share into one file, at
    its own offset, then fsyncing it: the shape of a multi-process save, which writes one
    checkpoint file, where ``write_fsync`` gives each process a file of its own."""

    def __init__(self, directory: str, host: np.ndarray) -> None:
        from benchmarks import _ceiling_tools

        super().__init__(host.nbytes)
        self.path = os.path.join(directory, "ceiling-shared.bin")
        self.host = host  # this process's share: the disk ceilings' buffer
        self.tool = _ceiling_tools.make(*WRITE_CEILING)
        self.setting = f"{self.tool.label}, every process its share of one file, then fsync"

    def _prepare(self) -> None:
        if jax.process_index() == 0:  # a new file each time, made before anyone writes
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))

    def _move(self) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            self.tool.write(fd, self.host, jax.process_index() * self.host.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.tool.close()
        if jax.process_index() == 0:
            h.remove(self.path)


def memory_copy_ceiling(ceiling_bytes: int) -> MemoryCopyCeiling:
    """The host memory's copy rate, a share of ``ceiling_bytes`` per process (at most
    ``MEMORY_COPY_BYTES``), by the page-cache ceiling's threads."""
    share = min(MEMORY_COPY_BYTES, ceiling_bytes // jax.process_count())
    return MemoryCopyCeiling(max(share, 1 << 20), threads=READ_CEILING[1])


def device_copy_ceiling(ceiling_bytes: int) -> DeviceCopyCeiling | None:
    """On GPUs with torch: the host-to-device ceiling, a share of ``ceiling_bytes`` per
    device (at most ``DEVICE_COPY_BYTES``)."""
    devices = jax.local_devices()
    if devices[0].platform != "gpu":
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    share = min(DEVICE_COPY_BYTES, ceiling_bytes // jax.device_count())
    return DeviceCopyCeiling(devices, max(share, 1 << 20))


def disk_ceilings(scratch: str, nbytes: int, cold: bool) -> h.DiskCeilings:
    """The write, page-cache read (and with ``cold`` the disk's read) ceilings, each with its
    one setting (its samples up front are the warm-up): on a file of ``nbytes`` in
    ``scratch``, or with several processes, each process on a file of its share of them,
    in a folder of its own, all sampled at once (:func:`sample_ceilings`)."""
    processes, rank = jax.process_count(), jax.process_index()
    if processes > 1:
        scratch = os.path.join(scratch, f"ceiling-{rank}")
        os.makedirs(scratch, exist_ok=True)
    ceilings = h.DiskCeilings(
        scratch,
        -(-nbytes // processes),
        drop=True,
        prefer={
            "write_fsync": [WRITE_CEILING],
            "warm_read": [READ_CEILING],
            "cold_read": [COLD_CEILING],
            "cold_buffered_read": [COLD_BUFFERED_CEILING],
        },
        limits=ceiling_names(cold),
    )
    ceilings.SAMPLES = 1  # one setting each: the search's samples are only the warm-up
    ceilings.search()
    return ceilings


# The ceilings sampled beside the disk's, by name.
Extras = dict[str, ExtraCeiling]


def sample_ceilings(ceilings: h.DiskCeilings, extras: Extras, repetition: int) -> dict[str, float]:
    """One sample of each ceiling that has a working setting: seconds for its bytes. With
    several processes, every process samples its file at once (they meet after preparing
    it, so that no process's eviction or warming overlaps another's timing), and the
    slowest process's seconds are the ceiling's, for all the processes' bytes."""
    seconds: dict[str, float] = {}
    for name in ceilings.limits:
        limit = ceilings.limits[name]
        tag = f"ceiling:{name}:{repetition}"
        if limit.tool is None:
            sync(f"{tag}:ready")  # no setting works here: meet the others all the same
        else:
            before = len(limit.samples)
            ceilings.sample(name, ready=lambda tag=tag: sync(f"{tag}:ready"))
            if len(limit.samples) > before:
                seconds[f"{name}_s"] = limit.samples[-1]
        sync(f"{tag}:end")
    for name, extra in extras.items():
        tag = f"ceiling:{name}:{repetition}"
        seconds[f"{name}_s"] = extra.sample(lambda tag=tag: sync(f"{tag}:ready"))
        sync(f"{tag}:end")
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    names = [f"{name}_s" for name in ceilings.limits]
    names += [f"{name}_s" for name in extras]
    mine = np.array([seconds.get(name, np.nan) for name in names], dtype=np.float64)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(names))
    slowest = every.max(axis=0)
    return {name: float(v) for name, v in zip(names, slowest, strict=True) if np.isfinite(v)}


def ceilings_report(ceilings: h.DiskCeilings, extras: Extras) -> dict[str, Any]:
    """The ceilings' report (process 0's search and samples); its ``bytes`` are every
    process's, which the rounds' seconds are for (the extra ceilings', under their own
    names, are theirs)."""
    report = ceilings.report()
    report.update({name: extra.report() for name, extra in extras.items()})
    processes = jax.process_count()
    if processes > 1:
        report["bytes_per_process"] = report["bytes"]
        report["bytes"] = report["bytes"] * processes
        report["sampled"] = (
            f"{processes} processes at once, each its own file of bytes_per_process; a "
            "round's seconds are the slowest process's"
        )
    return report


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    names = ("arrayio", "jax", "jaxlib", "numpy", "orbax-checkpoint", "tensorstore", "torch")
    for name in (*names, "fastsafetensors", "instanttensor"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def restore_shardings(
    devices: list[Any], rows: NamedSharding, other: NamedSharding, scaling: bool
) -> dict[str, NamedSharding]:
    """What each round restores onto: the save's sharding, the other mesh, and with
    ``scaling`` rows over the first 1, 2, 4... devices (fewer than all; one process)."""
    shardings = {"restore": rows, "reshard": other}
    n = 1
    while scaling and n < len(devices):
        mesh = Mesh(np.array(devices[:n]), ("data",))
        shardings[f"restore_n{n}"] = NamedSharding(mesh, P("data"))
        n *= 2
    return shardings


def main(spec: dict[str, Any]) -> dict[str, Any] | None:
    start_processes(spec)
    devices = jax.devices()
    assert len(devices) == spec["devices"], devices
    rows, other = meshes(devices)
    shardings = restore_shardings(devices, rows, other, spec["scaling"] and spec["processes"] == 1)
    tree = build_tree(spec["gib"], rows, len(devices))
    nbytes = sum(x.nbytes for x in tree.values())
    scratch = spec["dir"]
    peers, unavailable = make_peers(tree, scratch, spec["peers"], spec.get("restore_tool"))
    tp = None
    if spec["hf_gib"]:
        from benchmarks import _tp_load

        tp = _tp_load.TensorParallel(spec, devices, timed=timed, sync=sync, evict=evict_checkpoint)
        unavailable.update(tp.unavailable)
    cold = spec["cold"]
    ceiling_gib = spec.get("ceiling_gib")
    ceiling_bytes = int(ceiling_gib * (1 << 30)) if ceiling_gib else nbytes
    ceilings = disk_ceilings(scratch, ceiling_bytes, cold)
    extras: Extras = {"memory_copy": memory_copy_ceiling(ceiling_bytes)}
    if jax.process_count() > 1:
        extras["write_fsync_shared"] = SharedFileWriteCeiling(scratch, ceilings.host)
    device_copy = device_copy_ceiling(ceiling_bytes)
    if device_copy is not None:
        extras["host_to_device"] = device_copy
    about = {
        "peers_unavailable": unavailable,
        "nbytes": nbytes,
        "shard_bytes": nbytes // len(tree) // len(devices),
        "array_bytes": nbytes // len(tree),
        "arrays": len(tree),
        "devices": len(devices),
        "processes": jax.process_count(),
        "device_kinds": sorted({d.device_kind for d in devices}),
        "platform": devices[0].platform,
        "cold": cold,
        "scaling": sorted(q for q in shardings if q.startswith("restore_n")),
        "tensor_parallel": tp.describe() if tp else None,
        "versions": versions(),
        # The ceilings' size and settings (their whole report comes at the end).
        "ceilings": ceilings_report(ceilings, extras),
    }
    if leader():  # what the rows are of, for a report of the rounds so far
        print("ABOUT " + json.dumps(about), flush=True)
    measured: list[dict[str, Any]] = []
    ceiling_rows: list[dict[str, Any]] = []
    orders = []
    layout = None
    shuffle = random.Random(spec["seed"]).shuffle
    try:
        # The first round is untimed (imports, caches, first compilations) and reads only
        # from the page cache; the ceilings, warmed up by their samples up front, join from
        # the second.
        for repetition in range(spec["repeats"] + 1):
            order = [name for name, peer in peers.items() if peer.save is not None]
            order += (list(tp.peers) if tp else []) + (["ceilings"] if repetition else [])
            shuffle(order)
            # A peer that restores arrayio's checkpoint comes right after arrayio's save, in
            # the same state of the page cache.
            at = order.index("arrayio") + 1
            order[at:at] = [name for name, peer in peers.items() if peer.save is None]
            orders.append(order)
            for name in order:
                if name == "ceilings":
                    row = {
                        "repetition": repetition,
                        **sample_ceilings(ceilings, extras, repetition),
                    }
                    ceiling_rows.append(row)
                    if leader():
                        print(json.dumps(row), flush=True)
                    continue
                if name in peers:
                    peer_cold = cold and repetition > 0
                    row = measure_peer(name, peers[name], tree, shardings, peer_cold)
                    if name == "orbax" and layout is None and leader():
                        layout = orbax_layout(peers[name].path)
                else:
                    assert tp is not None
                    row = tp.measure(name, cold and repetition > 0)
                if repetition:
                    measured.append({"peer": name, "repetition": repetition, **row})
                    if leader():
                        print(json.dumps(measured[-1]), flush=True)
    finally:
        sync("done")
        if leader():
            for peer in peers.values():
                h.remove(peer.path)
            if tp is not None:
                tp.remove()
        ceiling_report = ceilings_report(ceilings, extras)
        ceilings.close()
        for extra in extras.values():
            extra.close()
    dispatchers = every_process_text(str(arrayio.explain()), scratch)
    if not leader():
        return None
    return {
        **about,
        # Which tools process 0's dispatcher chose, and what it measured of each; every
        # process's in ``dispatchers`` (each process learns on its own).
        "dispatcher": dispatchers[0],
        "dispatchers": dispatchers,
        "rows": measured,
        "ceiling_rows": ceiling_rows,
        "ceilings": ceiling_report,
        "orders": orders,
        "orbax_layout": layout,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)
