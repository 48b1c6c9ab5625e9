"""Checkpoint save and load against every peer, beside the disk's limits, in one run.

``python -m benchmarks.peers.checkpoint --out DIR [--gib 1,8] [--repeats 3] [--goal-repeats N]
[--drop-caches] [--dir SCRATCH] [--deadline EPOCH] [--no-tune] [--smoke]
[--replot DIR/checkpoint.json]``

The checkpoint is a transformer-like state dict on the GPU: a 256 MiB bfloat16 embedding,
then layers of float32 attention weights (16 MiB) with 4 KiB bfloat16 biases and 8 KiB
float32 norm scales, and bfloat16 MLP weights (32 MiB), as many layers as the size asks
(``--gib``); every size has the same tensor shapes, only more layers.

Peers, each saving from and loading to the GPU: ``torch.save``/``torch.load(map_location)``;
safetensors ``save_file``/``load_file(device)``; NumPy ``savez``/``load`` then a copy to the
GPU (``cupy.asarray``; bfloat16 as its bits, NumPy has no bfloat16); orbax
``StandardCheckpointer`` on a JAX pytree; raw KvikIO (one ``CuFile``, every tensor written
and read at its offset in parallel, 16 threads, no header); fastsafetensors
(``ParallelSaver``, 16 shards, and ``fastsafe_open``, no GDS); and arrayio's public API
with torch tensors (``arrayio``), a JAX pytree (``arrayio-jax``) and CuPy arrays
(``arrayio-cupy``).

Every save is followed by an fsync of what it wrote, inside the timed region. A cold load
starts after the files' pages were evicted (``posix_fadvise``; ``--drop-caches`` also drops
the whole page cache); a warm one right after the files were read into the page cache
twice (from run 19 on; once before, see :func:`~benchmarks.peers._harness.warm`). A
load is timed until its arrays are on the GPU and the device is synchronized. Each size
searches the disk's ceilings' settings on a file of the checkpoint's size up front (see
:class:`~benchmarks.peers._harness.DiskCeilings`), then samples the chosen settings in every
round, between the peers; arrayio is judged against those samples (the disk's write rate
drifts over a run), and the cold read's sample reads arrayio's own file, right before or
right after arrayio's cold load, alternately. A round runs in three
phases (:func:`~benchmarks.peers._harness.measure_round`): every peer's save, then every
cold load, then every warm load, each phase in its own shuffled order (a new shuffle each
run, ``--seed`` to repeat one) with the ceiling's sample among them. An untimed write
leads the save phase and an untimed cold read the cold phase, so that every timed save
follows a write and every timed cold read follows a cold read. An untimed,
checked round of every peer comes first, on a checkpoint of ``--warmup-gib`` (default: the
first size): imports and CUDA contexts. A warm-up smaller than the first size also searches
the ceilings' settings on its own file, so that the first size, like every later one, tries
only the two best of each. arrayio moves a checkpoint's tensors as one batch, learned in
a context of its own (total size and typical tensor), so before each size's rounds
(untimed, and unless ``--no-tune``) ``arrayio.tune(arrays=state)`` teaches the dispatcher
that checkpoint's saves and its cold and warm loads into GPU memory, as a user would once
per machine. Each size's first sample of every peer is checked too. A round holds every
peer's checkpoint on the disk at once, or, where they would not fit, runs its phases over
groups of peers that do (the ceilings' samples with the first group).

Each size's JSON also records, per peer, quantity and round, the time Python's garbage
collector ran inside the timed sample and its full collections (``gc_in_samples``): in a
process that holds every framework a full collection costs 120 to 230 ms on the H200 VM.

With ``--deadline``, a peer whose next measurement would not fit is skipped for that round
(torch, safetensors and arrayio's front doors, the targets' terms, keep their time first);
the JSON says how many samples each peer has. ``--goal-repeats N`` (more than
``--repeats``) adds rounds of the targets' terms alone, with the ceilings' samples: a
single 8 GiB save on the H200 VM spreads by 10 to 20% from sample to sample, so their
medians need more samples than the other peers' figures. Those rounds only get the time
the other peers' ``--repeats`` rounds leave (see :func:`plan_round`; in run 23, before that
rule, they took the time of numpy's and orbax's rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.peers import _harness as h

ARRAYIO = ("arrayio", "arrayio-jax", "arrayio-cupy")
# The goals' terms: measured first when time is short, and in every round of --goal-repeats.
CORE = (*ARRAYIO, "torch", "safetensors")

# The goals for arrayio: (name, arrayio's quantity, against what, goal).
GOALS = (
    ("cold_load_vs_disk_ceiling", "cold_load", "ceiling:cold_read", 0.9),
    ("warm_load_vs_torch", "warm_load", "torch", 10.0),
    ("warm_load_vs_safetensors", "warm_load", "safetensors", 3.0),
    ("save_vs_torch", "save", "torch", 2.0),
    ("save_vs_write_ceiling", "save", "ceiling:write_fsync", 0.9),
)
QUANTITIES = h.QUANTITIES
# The figures are medians of at least 3 repetitions: a goal is judged on no fewer.
MIN_ROUNDS = 3
CEILING_OF = {"save": "write_fsync", "cold_load": "cold_read", "warm_load": "warm_read"}


# ------------------------------------------------------------------ the model


def layout(total_bytes: int, d_model: int, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Names, shapes and dtypes of a transformer-like state dict of about ``total_bytes``."""
    size = {"float32": 4, "bfloat16": 2}

    def nbytes(entries: list[tuple[str, tuple[int, ...], str]]) -> int:
        return sum(int(np.prod(shape)) * size[dtype] for _, shape, dtype in entries)

    def layer(i: int) -> list[tuple[str, tuple[int, ...], str]]:
        p, d = f"layers.{i}.", d_model
        out = [(p + "attn_norm.scale", (d,), "float32")]
        for w in "qkvo":
            out += [
                (p + f"attn.{w}.weight", (d, d), "float32"),
                (p + f"attn.{w}.bias", (d,), "bfloat16"),
            ]
        out += [
            (p + "mlp_norm.scale", (d,), "float32"),
            (p + "mlp.gate.weight", (4 * d, d), "bfloat16"),
            (p + "mlp.up.weight", (4 * d, d), "bfloat16"),
            (p + "mlp.down.weight", (d, 4 * d), "bfloat16"),
            (p + "mlp.down.bias", (d,), "bfloat16"),
        ]
        return out

    head = [("embed.weight", (vocab, d_model), "bfloat16")]
    tail = [("final_norm.scale", (d_model,), "float32")]
    layers = max(1, round((total_bytes - nbytes(head) - nbytes(tail)) / nbytes(layer(0))))
    return head + [e for i in range(layers) for e in layer(i)] + tail


def make_state(entries: list[tuple[str, tuple[int, ...], str]], device: str) -> dict[str, Any]:
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.randn(shape, dtype=getattr(torch, dtype), device=device, generator=generator)
        for name, shape, dtype in entries
    }


# ------------------------------------------------------------------ the peers


def torch_peer(state: dict[str, Any], device: str) -> h.Peer:
    import torch

    def load(path: str) -> Any:
        out = torch.load(path, map_location=device, weights_only=True)
        h.settle()
        return out

    return h.Peer(
        "torch",
        lambda path: torch.save(state, path),
        load,
        h.check_flat(state, lambda out, k, _: out[k]),
        ".pt",
    )


def safetensors_peer(state: dict[str, Any], device: str) -> h.Peer:
    from safetensors.torch import load_file, save_file

    target = "cuda:0" if device.startswith("cuda") else "cpu"

    def load(path: str) -> Any:
        out = load_file(path, device=target)
        h.settle()
        return out

    return h.Peer(
        "safetensors",
        lambda path: save_file(state, path),
        load,
        h.check_flat(state, lambda out, k, _: out[k]),
        ".safetensors",
    )


def numpy_peer(state: dict[str, Any], device: str) -> h.Peer:
    import torch

    to_device: Callable[[np.ndarray], Any] = lambda a: a  # noqa: E731
    if device.startswith("cuda"):
        import cupy

        to_device = cupy.asarray

    def save(path: str) -> None:
        arrays = {}
        for key, tensor in state.items():
            host = tensor.detach().cpu()
            if host.dtype == torch.bfloat16:
                host = host.view(torch.int16)  # NumPy has no bfloat16: store its bits
            arrays[key] = host.numpy()
        np.savez(path, **arrays)

    def load(path: str) -> Any:
        with np.load(path) as npz:
            out = {key: to_device(npz[key]) for key in npz.files}
        h.settle()
        return out

    def get(out: Any, key: str, expected: Any) -> Any:
        got = h.as_torch(out[key])
        return got.view(torch.bfloat16) if expected.dtype == torch.bfloat16 else got

    return h.Peer(
        "numpy",
        save,
        load,
        h.check_flat(state, get),
        ".npz",
        "savez, then load and cupy.asarray per array; bfloat16 stored as int16 bits",
    )


def orbax_peer(state: dict[str, Any], jax_tree: Any) -> h.Peer:
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), jax_tree
    )

    def save(path: str) -> None:
        checkpointer.save(os.path.abspath(path), jax_tree, force=True)
        checkpointer.wait_until_finished()

    def load(path: str) -> Any:
        out = checkpointer.restore(os.path.abspath(path), abstract)
        h.settle(jax_tree=out)
        return out

    return h.Peer(
        "orbax",
        save,
        load,
        h.check_flat(state, lambda out, k, _: h.flatten(out)[k]),
        "",
        "StandardCheckpointer on a JAX pytree (the torch tensors through DLPack)",
        checkpointer.close,
    )


def kvikio_peer(state: dict[str, Any]) -> h.Peer:
    import cupy
    import kvikio
    import kvikio.defaults
    import torch

    def configure() -> None:
        # Process-wide settings (arrayio's KvikIO tool changes them too): set before each use.
        for name, value in (("num_threads", 16), ("task_size", 4 << 20)):
            if kvikio.defaults.get(name) != value:
                kvikio.defaults.set(name, value)

    views, offsets, end = {}, {}, 0
    for key, tensor in state.items():
        views[key] = cupy.from_dlpack(tensor.reshape(-1).view(torch.uint8))
        offsets[key] = end
        end += -(-views[key].nbytes // 4096) * 4096

    def save(path: str) -> None:
        configure()
        f = kvikio.CuFile(path, "w")
        try:
            for future in [f.pwrite(views[k], file_offset=offsets[k]) for k in views]:
                future.get()
        finally:
            f.close()

    def load(path: str) -> Any:
        configure()
        out = {key: cupy.empty(view.nbytes, dtype=cupy.uint8) for key, view in views.items()}
        f = kvikio.CuFile(path, "r")
        try:
            for future in [f.pread(out[k], file_offset=offsets[k]) for k in out]:
                future.get()
        finally:
            f.close()
        h.settle()
        return out

    def get(out: Any, key: str, expected: Any) -> Any:
        return h.as_torch(out[key]).view(expected.dtype).reshape(expected.shape)

    return h.Peer(
        "kvikio",
        save,
        load,
        h.check_flat(state, get),
        ".bin",
        "raw CuFile pwrite/pread of every tensor at its offset, 16 threads, no header; "
        "load buffers allocated (CuPy pool) inside the timed region",
    )


def fastsafetensors_peer(state: dict[str, Any], device: str) -> h.Peer:
    from fastsafetensors import ParallelSaver, fastsafe_open

    shards = min(16, len(state))
    saver = ParallelSaver(num_shards=shards)
    target = "cuda:0" if device.startswith("cuda") else "cpu"

    def save(path: str) -> None:
        os.makedirs(path)
        saver.save(state, os.path.join(path, "model"))

    def load(path: str) -> Any:
        with fastsafe_open(h.files_under(path), framework="pt", device=target, nogds=True) as f:
            out = {key: f.get_tensor(key) for key in f.keys()}
        h.settle()
        return out

    return h.Peer(
        "fastsafetensors",
        save,
        load,
        h.check_flat(state, lambda out, k, _: out[k]),
        "",
        f"ParallelSaver ({shards} shards), fastsafe_open(nogds=True)",
    )


def arrayio_peer(
    name: str, tree: Any, state: dict[str, Any], like: str, device: str, nested: bool
) -> h.Peer:
    import arrayio

    def load(path: str) -> Any:
        out = arrayio.load(path, like=like, device=device)
        h.settle(jax_tree=out if like == "jax" else None)
        return out

    def get(out: Any, key: str, _: Any) -> Any:
        return (h.flatten(out) if nested else out)[key]

    return h.Peer(
        name,
        lambda path: arrayio.save(path, tree),
        load,
        h.check_flat(state, get),
        ".safetensors",
        f"arrayio.save / arrayio.load(like={like!r}, device={device!r})",
    )


def make_peers(state: dict[str, Any], device: str) -> tuple[list[h.Peer], dict[str, str]]:
    """Every peer that can run here, and why the others cannot."""
    cuda = device.startswith("cuda")
    peers: list[h.Peer] = []
    unavailable: dict[str, str] = {}

    def add(name: str, build: Callable[[], h.Peer], needs_cuda: bool = False) -> None:
        if needs_cuda and not cuda:
            unavailable[name] = "needs a CUDA device"
            return
        try:
            peers.append(build())
        except Exception as error:  # noqa: BLE001 - a peer missing here is reported
            unavailable[name] = f"{type(error).__name__}: {error}"

    jax_tree: list[Any] = []

    def jax_state() -> Any:
        if not jax_tree:
            jax_tree.append(h.nest({k: h.torch_to_jax(v) for k, v in state.items()}))
        return jax_tree[0]

    add("arrayio", lambda: arrayio_peer("arrayio", state, state, "torch", device, False))
    add("torch", lambda: torch_peer(state, device))
    add("safetensors", lambda: safetensors_peer(state, device))
    add("arrayio-jax", lambda: arrayio_peer("arrayio-jax", jax_state(), state, "jax", device, True))

    def cupy_tree() -> Any:
        import cupy

        return {k: cupy.from_dlpack(v) for k, v in state.items()}

    add(
        "arrayio-cupy",
        lambda: arrayio_peer("arrayio-cupy", cupy_tree(), state, "cupy", device, False),
        needs_cuda=True,
    )
    add("kvikio", lambda: kvikio_peer(state), needs_cuda=True)
    add("fastsafetensors", lambda: fastsafetensors_peer(state, device))
    add("numpy", lambda: numpy_peer(state, device))
    add("orbax", lambda: orbax_peer(state, jax_state()))
    return peers, unavailable


# ------------------------------------------------------------------ measuring


def summarize(
    nbytes: int,
    ceilings: h.DiskCeilings,
    samples: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Per peer: GB/s (median), the fraction of the ceiling (of the medians, and round by
    round beside the ceiling's sample of the same round), ratios to torch and safetensors."""
    speeds = {
        name: {q: h.rate(nbytes, h.median(s[q])) for q in QUANTITIES} for name, s in samples.items()
    }
    out: dict[str, dict[str, Any]] = {}
    for name, s in samples.items():
        row: dict[str, Any] = {f"{q}_GBps": speeds[name][q] for q in QUANTITIES}
        row["samples"] = len(s["rounds"])
        row["seconds"] = {q: s[q] for q in QUANTITIES}
        row["fraction_of_ceiling"] = {
            q: h.ratio(speeds[name][q], ceilings.limit(CEILING_OF[q])) for q in QUANTITIES
        }
        paired = {}
        for q in QUANTITIES:
            ceiling_s = ceilings.limits[CEILING_OF[q]].samples
            fractions = [
                (nbytes / seconds) / (ceilings.nbytes / ceiling_s[r])
                for r, seconds in zip(s["rounds"], s[q], strict=True)
                if r < len(ceiling_s)
            ]
            paired[q] = h.median(fractions)
        row["paired_fraction_of_ceiling"] = paired
        for reference in ("torch", "safetensors"):
            if reference in speeds:
                row[f"vs_{reference}"] = {
                    q: h.ratio(speeds[name][q], speeds[reference][q]) for q in QUANTITIES
                }
        out[name] = row
    return out


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals for each arrayio front door, with their numbers.

    ``met`` is None (not judged) where a ratio is missing, or where either side has fewer
    than :data:`MIN_ROUNDS` rounds (``rounds``: the fewer of the two). A ceiling is its
    ``GBps``: in reports since the ceiling's samples in the rounds were the judged value,
    their median (``judged_on``); in earlier ones, the higher of that and the search's
    best."""
    out: dict[str, Any] = {}
    peers, ceilings = result["peers"], result["ceilings"]
    for who in ARRAYIO:
        if not peers.get(who, {}).get("samples"):
            continue
        mine: dict[str, Any] = {}
        for goal_name, quantity, against, goal in GOALS:
            value = peers[who][f"{quantity}_GBps"]
            rounds = peers[who]["samples"]
            if against.startswith("ceiling:"):
                reference = ceilings[against.split(":")[1]]["GBps"]
            else:
                reference = peers.get(against, {}).get(f"{quantity}_GBps")
                rounds = min(rounds, peers.get(against, {}).get("samples", 0))
            r = h.ratio(value, reference)
            mine[goal_name] = {
                "GBps": value,
                "reference": against,
                "reference_GBps": reference,
                "ratio": r,
                "goal": goal,
                "rounds": rounds,
                "met": None if r is None or rounds < MIN_ROUNDS else r >= goal,
            }
            if against.startswith("ceiling:"):
                # Also beside the search's best (reports before the rounds' ceiling was the
                # judged one had only the higher of the two as GBps) and round by round.
                name = against.split(":")[1]
                search = ceilings[name].get("search_GBps") or max(
                    ceilings[name].get("upfront_GBps", {}).values(), default=None
                )
                mine[goal_name]["reference_interleaved_GBps"] = ceilings[name]["interleaved_GBps"]
                mine[goal_name]["reference_search_GBps"] = search
                mine[goal_name]["ratio_vs_search"] = h.ratio(value, search)
                mine[goal_name]["paired_ratio"] = peers[who]["paired_fraction_of_ceiling"][quantity]
        out[who] = mine
    return out


def warm_up(
    args: argparse.Namespace,
    gib: float,
    per_byte: dict[str, float],
    report: dict[str, Any],
    search: bool = False,
) -> dict[str, list[tuple[str, int, int]]] | None:
    """An untimed, checked round of every peer on a checkpoint of ``gib``: imports, CUDA
    contexts, and the arrayio dispatcher's first explorations (the tensor shapes, and so
    the dispatcher's contexts, are those of every size).

    With ``search``, it also searches the disk ceilings' settings on a file of its size and
    returns the two best of each, so that the first measured size tries only those, as a
    later size does after an earlier one (an 8 GiB search of every setting took 164 s).
    """
    entries = layout(int(gib * (1 << 30)), args.d_model, args.vocab)
    state = make_state(entries, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    h.settle()
    directory = tempfile.mkdtemp(prefix="arrayio-peers-warmup-", dir=args.dir)
    peers, _ = make_peers(state, args.device)
    paths = {p.name: os.path.join(directory, f"{p.name}{p.suffix}") for p in peers}
    seconds: dict[str, Any] = {}
    ceilings = h.DiskCeilings(directory, nbytes, drop=args.drop_caches) if search else None
    try:
        if ceilings is not None:
            try:
                report["warmup_ceiling_search_seconds"], _ = h.timed(ceilings.search)
                report["warmup_ceilings"] = ceilings.report()
            finally:
                ceilings.close()  # its file is not needed during the round
        for index, group in enumerate(
            h.groups_on_disk(peers, directory, lambda _: int(nbytes * 1.1))
        ):
            got = h.measure_round(
                group,
                paths,
                args.drop_caches,
                verify={p.name for p in group},
                seed=f"warm-up/{index}",
            )
            for name, took in got.took.items():
                seconds[name] = took
                per_byte[name] = took / nbytes
            for name, error in got.errors.items():  # reported; the peer is tried again
                seconds[name] = error
                print(f"  warm-up {name}: {error}", flush=True)
    finally:
        for peer in peers:
            if peer.close is not None:
                peer.close()
        h.remove(directory)
    report["warmup"] = {"gib": gib, "bytes": nbytes, "seconds": seconds}
    return ceilings.best_settings() if ceilings is not None else None


def rounds_of(args: argparse.Namespace) -> int:
    """Rounds of the targets' terms: ``--repeats``, or ``--goal-repeats`` if more."""
    return max(args.repeats, args.goal_repeats or 0)


def plan_round(
    peers: list[h.Peer],
    round_index: int,
    repeats: int,
    expected: dict[str, float],
    ceiling_round: float,
    allows: Callable[[float], bool],
) -> tuple[list[h.Peer], list[str]]:
    """The peers of round ``round_index`` that fit in the time left, and those skipped for
    time. ``expected`` holds each peer's last measured seconds, ``ceiling_round`` the
    seconds the ceilings' samples took in the last round, and ``allows(seconds)`` says
    whether that much time is left.

    First the goals' terms (:data:`CORE`), then the other peers as long as the goals' terms'
    later rounds up to ``repeats`` still fit after them. Rounds past ``repeats`` (those of
    ``--goal-repeats``) hold the goals' terms alone, each if it fits: they add samples, but
    never at the cost of another peer's ``repeats`` rounds.
    """
    core_round = ceiling_round + sum(expected.get(n, 0.0) for n in CORE)
    later = max(0, repeats - round_index - 1)
    chosen: list[h.Peer] = []
    skipped: list[str] = []
    planned = ceiling_round
    for peer in sorted(peers, key=lambda p: p.name not in CORE):  # stable: core peers first
        core = peer.name in CORE
        if round_index >= repeats and not core:
            continue
        need = expected.get(peer.name, 0.0) * 1.2 + 2.0
        if not allows(planned + need + (0.0 if core else core_round * later)):
            skipped.append(peer.name)
            continue
        chosen.append(peer)
        planned += need
    return chosen, skipped


def run_size(
    args: argparse.Namespace,
    gib: float,
    deadline: h.Deadline,
    per_byte: dict[str, float],
    prefer: dict[str, Any] | None,
    report: dict[str, Any],
    out_json: str,
) -> dict[str, Any]:
    """Measure one checkpoint size; return the ceilings' best settings for the next size.

    ``per_byte`` holds each peer's last measurement time per byte (to predict the next one
    against the deadline), carried from size to size.
    """
    started = time.time()
    entries = layout(int(gib * (1 << 30)), args.d_model, args.vocab)
    state = make_state(entries, args.device)
    sizes = [t.numel() * t.element_size() for t in state.values()]
    nbytes = sum(sizes)
    h.settle()
    directory = tempfile.mkdtemp(prefix="arrayio-peers-", dir=args.dir)
    ceilings = h.DiskCeilings(directory, nbytes, drop=args.drop_caches, prefer=prefer)
    result: dict[str, Any] = {
        "gib": gib,
        "bytes": nbytes,
        "tensors": len(state),
        "d_model": args.d_model,
        "layers": sum(1 for name, _, _ in entries if name.endswith("attn.q.weight")),
        "smallest_bytes": min(sizes),
        "largest_bytes": max(sizes),
        "dtype_bytes": {
            d: sum(
                t.numel() * t.element_size() for t in state.values() if str(t.dtype) == f"torch.{d}"
            )
            for d in ("bfloat16", "float32")
        },
    }
    report["sizes"].append(result)
    peers, unavailable = make_peers(state, args.device)
    report["peers_unavailable"] = unavailable
    samples = {p.name: {"rounds": [], **{q: [] for q in QUANTITIES}} for p in peers}
    errors: dict[str, str] = {}
    skipped: dict[str, int] = {}
    paths = {p.name: os.path.join(directory, f"{p.name}{p.suffix}") for p in peers}

    def expected_disk(peer: h.Peer) -> int:
        return result.get("disk_bytes", {}).get(peer.name, int(nbytes * 1.1))

    try:
        if args.tune and any(p.name.startswith("arrayio") for p in peers):
            import arrayio

            result["tune_seconds"], tuned = h.timed(
                lambda: arrayio.tune(directory, device=args.device, sizes=(), arrays=state)
            )
            result["tuned"] = {e.key: e.chosen for e in tuned.explanations}
            print(
                f"  {gib:g} GiB tuned in {result['tune_seconds']:.1f} s: {result['tuned']}",
                flush=True,
            )
        result["ceiling_search_seconds"], _ = h.timed(ceilings.search)
        if args.device.startswith("cuda") and "pinned_host_to_device_GBps" not in report:
            ceilings.measure_pinned_h2d()
            report["pinned_host_to_device_GBps"] = ceilings.pinned_h2d_GBps
        ceiling_round = 0.0
        for round_index in range(rounds_of(args)):
            chosen, left_out = plan_round(
                [p for p in peers if p.name not in errors],
                round_index,
                args.repeats,
                {p.name: per_byte.get(p.name, 0.0) * nbytes for p in peers},
                ceiling_round,
                deadline.allows,
            )
            for name in left_out:
                skipped[name] = skipped.get(name, 0) + 1
            start = time.perf_counter()
            for index, group in enumerate(
                h.groups_on_disk(chosen, directory, expected_disk, reserve=ceilings.lead_in_bytes)
            ):
                got = h.measure_round(
                    group,
                    paths,
                    args.drop_caches,
                    verify={p.name for p in group if not samples[p.name]["rounds"]},
                    seed=f"{report['seed']}/{gib}/{round_index}/{index}",
                    ceilings=ceilings if index == 0 else None,
                    lead_in=ceilings.lead_in,
                    cold_ceiling_reads="arrayio",
                    ceiling_first=round_index % 2 == 0,
                )
                result.setdefault("orders", []).append(
                    {"round": round_index, "group": index, **got.orders}
                )
                for name, error in got.errors.items():
                    errors[name] = error
                    print(f"  {name}: {error}", flush=True)
                for name, seconds in got.seconds.items():
                    per_byte[name] = got.took[name] / nbytes
                    samples[name]["rounds"].append(round_index)
                    for q in QUANTITIES:
                        samples[name][q].append(seconds[q])
                        result.setdefault("gc_in_samples", {}).setdefault(
                            name, {k: [] for k in QUANTITIES}
                        )[q].append(got.gc[name][q])
                    result.setdefault("disk_bytes", {})[name] = got.disk[name]
                    print(
                        f"  {gib:g} GiB round {round_index + 1} {name:16s} "
                        + "  ".join(f"{q} {nbytes / seconds[q] / h.GB:6.2f}" for q in QUANTITIES)
                        + " GB/s",
                        flush=True,
                    )
            ceiling_round = max(
                0.0,
                time.perf_counter()
                - start
                - sum(per_byte.get(p.name, 0.0) * nbytes for p in chosen),
            )
            result["ceilings"] = ceilings.report()
            result["peers"] = summarize(
                nbytes, ceilings, {n: s for n, s in samples.items() if s["rounds"]}
            )
            h.write_json(report, out_json)
        for peer in peers:
            row = result["peers"].setdefault(peer.name, {"samples": 0})
            row["note"] = peer.note
            if peer.name in errors:
                row["error"] = errors[peer.name]
            if skipped.get(peer.name):
                row["rounds_skipped_for_time"] = skipped[peer.name]
        result["targets"] = targets(result)
        result["seconds"] = time.time() - started
        h.write_json(report, out_json)
        print_size(result)
        return ceilings.best_settings()
    finally:
        ceilings.close()
        for peer in peers:
            if peer.close is not None:
                peer.close()
        h.remove(directory)


def print_size(result: dict[str, Any]) -> None:
    c = result["ceilings"]

    def both(name: str) -> str:  # the judged ceiling (the rounds'), then the search's best
        return (
            f"{c[name]['GBps'] or float('nan'):.2f} "
            f"(search {c[name].get('search_GBps') or float('nan'):.2f})"
        )

    print(
        f"\n{result['gib']:g} GiB ({result['bytes'] / 1e9:.2f} GB, {result['tensors']} tensors)"
        f" ceilings in the rounds: write+fsync {both('write_fsync')}, cold read "
        f"{both('cold_read')}, warm read {both('warm_read')} GB/s",
        flush=True,
    )
    for name, row in result["peers"].items():
        if not row.get("samples"):
            print(f"  {name:16s} {row.get('error') or 'not measured'}")
            continue
        cells = []
        for q in QUANTITIES:
            frac = row["fraction_of_ceiling"][q]
            frac = float("nan") if frac is None else frac
            cells.append(f"{q} {row[f'{q}_GBps']:6.2f} ({frac:.2f} of ceiling)")
        print(f"  {name:16s} " + "  ".join(cells), flush=True)
    for who, goals in result.get("targets", {}).items():
        for goal_name, t in goals.items():
            search = (
                f" [{t['ratio_vs_search']:.2f} of the search's best]"
                if t.get("ratio_vs_search") is not None
                else ""
            )
            print(
                f"  target {who} {goal_name}: {goal_ratio_text(t['ratio'], t['goal'])} "
                f"(goal {t['goal']:g}) "
                f"{verdict(t)}{search}",
                flush=True,
            )


def goal_ratio_text(ratio: float | None, goal: float) -> str:
    """A ratio beside its goal: two decimals, or three where two would round it onto the
    goal (0.8963 against 0.9 reads 0.896, not 0.90 beside "not met")."""
    if ratio is None:
        return "n/a"
    text = f"{ratio:.2f}"
    if (float(text) >= goal) != (ratio >= goal):
        text = f"{ratio:.3f}"
    return text


def verdict(target: dict[str, Any]) -> str:
    """How a target of :func:`targets` reads: met, NOT met, or why it was not judged."""
    if target["met"] is not None:
        return "met" if target["met"] else "NOT met"
    rounds = target.get("rounds", MIN_ROUNDS)
    return (
        f"not judged: {rounds} round{'s' * (rounds != 1)}, fewer than {MIN_ROUNDS}"
        if rounds < MIN_ROUNDS
        else "not judged: no ratio"
    )


# ------------------------------------------------------------------ plot


def measured_peers(size: dict[str, Any]) -> tuple[int, int]:
    """How many peers a size measured, then how many samples in all (the tie-break)."""
    rows = [row for row in size.get("peers", {}).values() if row.get("samples")]
    return len(rows), sum(row["samples"] for row in rows)


def most_complete_sizes(paths: list[str]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each size once, from the report (of ``paths``) that measured the most peers at that
    size, then the most samples, later ones winning ties: a run cut short by its time budget
    measures fewer.
    Returns (path, report, size) sorted by size."""
    chosen: dict[float, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for size in report["sizes"]:
            held = chosen.get(size["gib"])
            if held is None or measured_peers(size) >= measured_peers(held[2]):
                chosen[size["gib"]] = (path, report, size)
    return [chosen[gib] for gib in sorted(chosen)]


def replot_merged(paths: list[str], png: str) -> None:
    """One plot of several runs' reports, each size from the most complete run."""
    picked = most_complete_sizes(paths)
    report = dict(picked[-1][1], sizes=[size for _, _, size in picked])
    dates = sorted({r["date"][:10] for _, r, _ in picked})
    report["date"] = ", ".join(dates)
    h.try_plot(plot, report, png)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    sizes = [s for s in report["sizes"] if s.get("peers")]
    where = "GPU" if report["device"].startswith("cuda") else report["device"]
    titles = {
        "save": f"save from {where} (fsync incl.)",
        "cold_load": f"cold load to {where}",
        "warm_load": f"warm load to {where}",
    }
    fig, grid = plt.subplots(len(sizes), 3, figsize=(16, 0.5 + 3.6 * len(sizes)), squeeze=False)
    for row, size in zip(grid, sizes, strict=True):
        names = [n for n, r in size["peers"].items() if r.get("samples")]
        for ax, q in zip(row, QUANTITIES, strict=True):
            values = [size["peers"][n][f"{q}_GBps"] for n in names]
            colors = ["tab:orange" if n.startswith("arrayio") else "tab:blue" for n in names]
            ax.barh(names, values, color=colors)
            for y, value in enumerate(values):
                ax.annotate(
                    f"{value:.2f}",
                    (value, y),
                    fontsize=7,
                    va="center",
                    xytext=(2, 0),
                    textcoords="offset points",
                )
            ceiling = size["ceilings"][CEILING_OF[q]]["GBps"]
            if ceiling:
                ax.axvline(ceiling, color="black", linestyle="--", linewidth=1)
                ax.annotate(
                    f"ceiling {ceiling:.2f}", (ceiling, len(names) - 0.5), fontsize=7, ha="right"
                )
            ax.invert_yaxis()
            ax.set_xlabel("GB/s")
            ax.set_title(f"{size['gib']:g} GiB: {titles[q]}", fontsize=9)
    machine = report["machine"]["summary"]
    fig.suptitle(
        f"Checkpoint, arrayio vs peers, {report['date'][:10]}, {machine}; medians; "
        "dashed: disk/page-cache ceiling measured in the same run",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    h.common_arguments(parser)
    parser.add_argument("--gib", default="1,8", help="checkpoint sizes, GiB, comma-separated")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="wall-clock time (seconds since the epoch) to finish by",
    )
    parser.add_argument(
        "--no-tune",
        dest="tune",
        action="store_false",
        help="let arrayio learn during the measured rounds instead",
    )
    parser.add_argument("--plot-out", help="with --replot A.json,B.json: the merged plot")
    parser.add_argument(
        "--seed",
        default=None,
        help="the phases' shuffle (default: a new one each run, in the JSON)",
    )
    parser.add_argument(
        "--goal-repeats",
        type=int,
        default=None,
        help="rounds of the targets' terms (arrayio's front doors, torch, "
        "safetensors) and the ceilings, if more than --repeats",
    )
    parser.add_argument(
        "--warmup-gib",
        type=float,
        default=None,
        help="size of the untimed warm-up round's checkpoint (default: the first size)",
    )
    args = parser.parse_args(argv)
    if args.goal_repeats is not None and args.goal_repeats < args.repeats:
        parser.error("--goal-repeats must be at least --repeats")
    if args.replot and "," in args.replot:
        replot_merged(args.replot.split(","), args.plot_out or "checkpoint-merged.png")
        return None
    if args.replot:
        h.replot(plot, args.replot)
        return None
    if args.smoke:
        args.device, args.d_model, args.vocab, args.repeats = "cpu", 128, 1024, 1
        args.gib, args.goal_repeats = "0.004", None
    if not args.out:
        parser.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "checkpoint.json")
    import torch  # noqa: F401 - the state lives in torch tensors

    report = h.header("peers-checkpoint", "benchmarks.peers.checkpoint", argv)
    # Each run shuffles its phases differently: with one fixed seed, the same peer opened
    # the same phases in every run (arrayio's save, 3 rounds of 5 at 1 GiB).
    report.update(
        device=args.device,
        repeats=rounds_of(args),
        peer_repeats=args.repeats,
        smoke=args.smoke,
        drop_caches=args.drop_caches,
        warm_passes=h.WARM_PASSES,
        sizes=[],
        peers_unavailable={},
        seed=args.seed or secrets.token_hex(4),
    )
    report["machine"] = h.machine()
    deadline = h.Deadline(args.deadline)
    per_byte: dict[str, float] = {}
    sizes = [float(g) for g in args.gib.split(",")]
    warmup_gib = args.warmup_gib or sizes[0]
    prefer = warm_up(args, warmup_gib, per_byte, report, search=warmup_gib < sizes[0])
    for gib in sizes:
        if not deadline.allows(10.0):
            report["sizes"].append({"gib": gib, "skipped": "time budget"})
            continue
        prefer = run_size(args, gib, deadline, per_byte, prefer, report, out_json)
        report["machine"]["versions"] = h.versions()
        h.write_json(report, out_json)
    try:
        import arrayio

        report["arrayio_dispatcher"] = arrayio.explain().as_dict()
    except Exception as error:  # noqa: BLE001 - informative only
        report["arrayio_dispatcher"] = repr(error)
    h.write_json(report, out_json)
    h.try_plot(plot, report, os.path.join(args.out, "checkpoint.png"))
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
