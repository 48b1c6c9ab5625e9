"""The measuring process of :mod:`benchmarks.sharded`, started by it with ``--devices`` JAX
devices already configured (``XLA_FLAGS``): it builds the sharded pytree, runs the rounds
and prints one ``RESULT {json}`` line. Not meant to be run by hand.

``python -m benchmarks._sharded_child SPEC_JSON``
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import arrayio
from benchmarks.peers import _harness as h

COLUMNS = 4096
MATRICES = 8
OPTIONAL_PEERS = ("orbax", "tensorstore")

# The ceilings each round samples beside the peers, one setting each (the question is the
# disk's rate for plain writes, not the best of several tools'): plain threaded pwrite of
# the checkpoint's bytes into a new file in the checkpoints' directory, then fsync...
WRITE_CEILING = ("posix", 4, 64 * h.MiB)
# ...and that file read back from the page cache by buffered threads.
READ_CEILING = ("posix", 16, 16 * h.MiB)
CEILINGS = ("write_fsync", "warm_read")


@dataclass
class Peer:
    """A checkpointer under test: ``save()`` writes the tree under ``path``,
    ``restore(sharding)`` returns it as jax.Arrays with that sharding."""

    path: str
    save: Callable[[], Any]
    restore: Callable[[NamedSharding], dict[str, Any]]


# ------------------------------------------------------------------ the pytree


def meshes(devices: list[Any]) -> tuple[NamedSharding, NamedSharding]:
    """Rows over every device, and the other mesh a restore reshards onto: devices / 2 x 2,
    sharded along both axes."""
    rows = NamedSharding(Mesh(np.array(devices).reshape(-1), ("data",)), P("data"))
    mesh2 = Mesh(np.array(devices).reshape(-1, 2), ("data", "model"))
    return rows, NamedSharding(mesh2, P("data", "model"))


def build_tree(gib: float, sharding: NamedSharding, devices: int) -> dict[str, Any]:
    """``MATRICES`` float32 matrices of ``gib`` GiB in all, each sharded along its rows. The
    rows are a multiple of 2 x devices, so that both meshes split them evenly."""
    rows = int(gib * (1 << 30)) // (4 * COLUMNS * MATRICES)
    rows -= rows % (2 * devices)
    if rows == 0:
        need = 2 * devices * 4 * COLUMNS * MATRICES / (1 << 30)
        raise SystemExit(f"--gib {gib} is too small for {devices} devices: at least {need:g}")
    rng = np.random.default_rng(0)
    tree = {
        f"layer{i}": jax.device_put(rng.standard_normal((rows, COLUMNS), np.float32), sharding)
        for i in range(MATRICES)
    }
    jax.block_until_ready(tree)
    return tree


def abstract(tree: dict[str, Any], sharding: NamedSharding) -> dict[str, Any]:
    return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for k, x in tree.items()}


def check(tree: dict[str, Any], out: dict[str, Any], sharding: NamedSharding) -> None:
    """Raise unless ``out`` is ``tree`` with ``sharding``: the first row of each quarter of
    every array compared, each quarter coming from other shards and other files."""
    assert set(out) == set(tree), sorted(out)
    for k, x in out.items():
        assert x.sharding == sharding, k
        step = max(1, x.shape[0] // 4)
        assert np.array_equal(np.asarray(x[::step]), np.asarray(tree[k][::step])), k


# ------------------------------------------------------------------ the peers


def arrayio_peer(tree: dict[str, Any], scratch: str) -> Peer:
    path = os.path.join(scratch, "arrayio.safetensors")
    return Peer(
        path,
        lambda: arrayio.save(path, tree),
        lambda sharding: arrayio.load(path, structure=abstract(tree, sharding)),
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
    process writes its addressable shards (one replica of each), and a restore reads each
    device's region (its shard, or on the other mesh the part of the chunks it needs) and
    assembles them with ``jax.make_array_from_single_device_arrays``. Every write and read
    of the tree is issued before any is waited on."""
    import tensorstore

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


def make_peers(tree: dict[str, Any], scratch: str) -> tuple[dict[str, Peer], dict[str, str]]:
    """arrayio, and each optional peer that imports here; those that do not, with why."""
    peers = {"arrayio": arrayio_peer(tree, scratch)}
    unavailable = {}
    makers = {"orbax": orbax_peer, "tensorstore": tensorstore_peer}
    for name in OPTIONAL_PEERS:
        try:
            peers[name] = makers[name](tree, scratch)
        except Exception as error:  # noqa: BLE001 - any failure to import means "not here"
            unavailable[name] = f"{type(error).__name__}: {error}"
    return peers, unavailable


# ------------------------------------------------------------------ measuring


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_with_peak_memory(run: Callable[[], Any]) -> tuple[float, int]:
    """Seconds ``run`` took, and the most the resident set grew above where it started,
    sampled every 2 ms."""
    base, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes() - base)
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    start = time.perf_counter()
    try:
        run()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        thread.join()
    return seconds, max(peak[0], resident_bytes() - base)


def timed_restore(peer: Peer, sharding: NamedSharding) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    out = peer.restore(sharding)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def measure_peer(
    peer: Peer, tree: dict[str, Any], rows: NamedSharding, other: NamedSharding
) -> dict[str, Any]:
    """One round of a peer: a durable save (its files and directories fsynced, as the write
    ceiling's file is, inside the timing), a restore onto the save's sharding, one onto the
    other mesh; both restores checked."""
    h.remove(peer.path)

    def durable_save() -> None:
        peer.save()
        h.fsync_tree(peer.path)

    save_s, peak = timed_with_peak_memory(durable_save)
    restore_s, out = timed_restore(peer, rows)
    check(tree, out, rows)
    del out
    reshard_s, out = timed_restore(peer, other)
    check(tree, out, other)
    return {
        "save_s": save_s,
        "restore_s": restore_s,
        "reshard_s": reshard_s,
        "save_peak_extra_bytes": peak,
    }


def disk_ceilings(scratch: str, nbytes: int) -> h.DiskCeilings:
    """The write and page-cache read ceilings on a file of ``nbytes`` in ``scratch``, each
    with its one setting (its samples up front are the warm-up)."""
    ceilings = h.DiskCeilings(
        scratch,
        nbytes,
        drop=False,
        prefer={"write_fsync": [WRITE_CEILING], "warm_read": [READ_CEILING]},
        limits=CEILINGS,
    )
    ceilings.search()
    return ceilings


def sample_ceilings(ceilings: h.DiskCeilings) -> dict[str, float]:
    """One sample of each ceiling that has a working setting: seconds for its bytes."""
    seconds = {}
    for name in CEILINGS:
        limit = ceilings.limits[name]
        before = len(limit.samples)
        ceilings.sample(name)
        if len(limit.samples) > before:
            seconds[f"{name}_s"] = limit.samples[-1]
    return seconds


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in ("arrayio", "jax", "jaxlib", "numpy", "orbax-checkpoint", "tensorstore"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(spec: dict[str, Any]) -> dict[str, Any]:
    devices = jax.devices()
    assert len(devices) == spec["devices"], devices
    rows, other = meshes(devices)
    tree = build_tree(spec["gib"], rows, len(devices))
    nbytes = sum(x.nbytes for x in tree.values())
    scratch = spec["dir"]
    peers, unavailable = make_peers(tree, scratch)
    ceilings = disk_ceilings(scratch, nbytes)
    measured: list[dict[str, Any]] = []
    ceiling_rows: list[dict[str, Any]] = []
    orders = []
    layout = None
    shuffle = random.Random(spec["seed"]).shuffle
    try:
        # The first round is untimed (imports, caches, first compilations); the ceilings,
        # warmed up by their samples up front, join from the second.
        for repetition in range(spec["repeats"] + 1):
            order = list(peers) + (["ceilings"] if repetition else [])
            shuffle(order)
            orders.append(order)
            for name in order:
                if name == "ceilings":
                    ceiling_rows.append({"repetition": repetition, **sample_ceilings(ceilings)})
                    print(json.dumps(ceiling_rows[-1]), flush=True)
                    continue
                row = measure_peer(peers[name], tree, rows, other)
                if name == "orbax" and layout is None:
                    layout = orbax_layout(peers[name].path)
                if repetition:
                    measured.append({"peer": name, "repetition": repetition, **row})
                    print(json.dumps(measured[-1]), flush=True)
    finally:
        for peer in peers.values():
            h.remove(peer.path)
        ceiling_report = ceilings.report()
        ceilings.close()
    return {
        "rows": measured,
        "ceiling_rows": ceiling_rows,
        "ceilings": ceiling_report,
        "orders": orders,
        "peers_unavailable": unavailable,
        "orbax_layout": layout,
        "nbytes": nbytes,
        "shard_bytes": nbytes // len(tree) // len(devices),
        "array_bytes": nbytes // len(tree),
        "arrays": len(tree),
        "devices": len(devices),
        "platform": devices[0].platform,
        "versions": versions(),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
