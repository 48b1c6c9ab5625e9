"""A Hugging Face checkpoint in several files, loaded with a tensor-parallel slice per device:
the part of :mod:`benchmarks.sharded` that ``--hf-gib`` adds, run in its measuring process.

The checkpoint is a bfloat16 decoder-like state dict (:func:`benchmarks.first_calls.layout`)
written as transformers writes one: ``safetensors.torch.save_file`` into ``--hf-files``
files of about equal size, beside their ``model.safetensors.index.json``. The slice rule is
Megatron's column-parallel one, applied to every matrix: a 2-d tensor whose rows divide
evenly is split along its rows over the devices (device ``r`` of ``n`` holds rows
``r/n`` to ``(r+1)/n``); every other tensor is whole on every device. Peers, each timed
from every process's start to the last one's end:

* ``arrayio-tp``: ``arrayio.load(directory, sharding=...)`` with a ``NamedSharding`` per
  key: global ``jax.Array``s, each device's rows read onto it;
* ``fastsafetensors-tp`` (one process per GPU): ``SafeTensorsFileLoader`` over
  ``torch.distributed``, each rank reading a share of the files, then ``get_sharded(key, 0)``
  for split tensors and ``get_tensor`` for the others, its own distributed mode;
* ``instanttensor-tp`` (one process per GPU): ``safe_open(files, process_group=WORLD,
  copy=False)``, InstantTensor's distributed mode (the ranks share the reads over NCCL and
  every rank receives every tensor), each rank keeping a copy of its slice.

Each round loads once after the files were evicted (``tp_cold``, with ``cold``) and once
with them in the page cache (``tp_warm``); every load is checked against the files as
``safetensors`` reads them, for a split and a whole tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.peers import _harness as h

TORCH_PEERS = ("fastsafetensors-tp", "instanttensor-tp")


def write_checkpoint(directory: str, gib: float, files: int) -> None:
    """The state dict as ``files`` safetensors files and their index, made durable."""
    import torch
    from safetensors.torch import save_file

    from benchmarks import first_calls

    entries = first_calls.layout(int(gib * (1 << 30)), 4096 if gib >= 4 else 1024, 32000)
    if gib < 0.05:  # smoke sizes: a narrower model, so that there is more than one layer
        entries = first_calls.layout(int(gib * (1 << 30)), 256, 1024)
    total = sum(2 * int(np.prod(shape)) for _, shape in entries)
    os.makedirs(directory, exist_ok=True)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    filled = 0
    for name, shape in entries:
        if filled >= total * len(groups) / files and len(groups) < files:
            groups.append([])
        groups[-1].append((name, shape))
        filled += 2 * int(np.prod(shape))
    weight_map = {}
    rng = np.random.default_rng(0)
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        state = {}
        for name, shape in group:
            # Random bits with the exponent's top bit cleared: no infinities or NaNs.
            bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16) & 0xBFFF
            state[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
            weight_map[name] = file
        save_file(state, os.path.join(directory, file))
        h.fsync_tree(os.path.join(directory, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    h.fsync_tree(directory)


class TensorParallel:
    """The checkpoint (written by process 0), its peers, and one round of each."""

    def __init__(
        self,
        spec: dict[str, Any],
        devices: list[Any],
        *,
        timed: Callable[[Callable[[], Any], str], tuple[float, Any]],
        sync: Callable[[str], None],
        evict: Callable[[str], None],
    ) -> None:
        """``timed``, ``sync`` and ``evict`` are the measuring process's: time a load from
        every process's start to the last one's end, meet, and push a path out of the page
        cache (process 0, the others waiting)."""
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.directory = os.path.join(spec["dir"], "hf")
        self.timed, self.sync, self._evict = timed, sync, evict
        self.rank, self.processes = jax.process_index(), jax.process_count()
        if self.rank == 0:
            write_checkpoint(self.directory, spec["hf_gib"], spec["hf_files"])
        sync("hf:written")
        with open(os.path.join(self.directory, "model.safetensors.index.json")) as f:
            index = json.load(f)
        self.bytes = index["metadata"]["total_size"]
        self.file_of = {k: os.path.join(self.directory, v) for k, v in index["weight_map"].items()}
        self.files = sorted(set(self.file_of.values()))
        self.shapes = self._shapes(index)
        self.world = len(devices)
        self.split = {k for k, s in self.shapes.items() if len(s) == 2 and s[0] % self.world == 0}
        mesh = Mesh(np.array(devices), ("data",))
        self.shardings = {
            k: NamedSharding(mesh, P("data") if k in self.split else P()) for k in self.shapes
        }
        self.peers: dict[str, Callable[[], dict[str, Any]]] = {"arrayio-tp": self._arrayio}
        self.unavailable: dict[str, str] = {}
        self._start_torch(spec)

    def _shapes(self, index: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        import arrayio

        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(index["weight_map"].values())):
            with arrayio.open(os.path.join(self.directory, file)) as reader:
                shapes.update({k: tuple(reader[k].shape) for k in reader.keys()})
        return {k: shapes[k] for k in index["weight_map"]}

    def _start_torch(self, spec: dict[str, Any]) -> None:
        """``torch.distributed`` for the torch peers: one process per GPU only."""
        why = None
        if spec["platform"] != "gpu" or self.processes == 1:
            why = "runs with one process per GPU only (--processes)"
        else:
            try:
                import torch
                import torch.distributed as dist

                torch.cuda.set_device(self.rank)
                dist.init_process_group(
                    "nccl",
                    init_method=f"tcp://localhost:{spec['port'] + 1}",
                    rank=self.rank,
                    world_size=self.processes,
                )
            except Exception as error:  # noqa: BLE001 - no torch peers then, and why
                why = f"{type(error).__name__}: {error}"
        makers = {"fastsafetensors-tp": self._fastsafetensors, "instanttensor-tp": self._instant}
        for name in TORCH_PEERS:
            if why is not None:
                self.unavailable[name] = why
                continue
            try:
                __import__(name.split("-")[0])
                self.peers[name] = makers[name]
            except Exception as error:  # noqa: BLE001 - not installed here
                self.unavailable[name] = f"{type(error).__name__}: {error}"

    def rows_of(self, key: str) -> tuple[int, int]:
        """The rows of ``key`` that this process's device holds."""
        rows = self.shapes[key][0]
        if key not in self.split:
            return 0, rows
        step = rows // self.world
        return self.rank * step, (self.rank + 1) * step

    # ------------------------------------------------------------------ peers

    def _arrayio(self) -> dict[str, Any]:
        import arrayio

        loaded: dict[str, Any] = arrayio.load(self.directory, sharding=self.shardings.get)
        return loaded

    def _fastsafetensors(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from fastsafetensors import SafeTensorsFileLoader

        loader = SafeTensorsFileLoader(dist.group.WORLD, device=f"cuda:{self.rank}", nogds=True)
        try:
            shares = {r: self.files[r :: self.processes] for r in range(self.processes)}
            loader.add_filenames(shares)
            buffers = loader.copy_files_to_device()
            try:
                out = {
                    k: buffers.get_sharded(k, 0) if k in self.split else buffers.get_tensor(k)
                    for k in self.shapes
                }
            finally:
                buffers.close()
        finally:
            loader.close()
        torch.cuda.synchronize()
        return out

    def _instant(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from instanttensor import safe_open

        out = {}
        with safe_open(
            list(self.files),
            framework="pt",
            device=self.rank,
            process_group=dist.group.WORLD,
            copy=False,
        ) as f:
            for name, tensor in f.tensors():
                start, stop = self.rows_of(name)
                out[name] = tensor[start:stop].clone() if name in self.split else tensor.clone()
        torch.cuda.synchronize()
        return out

    # ------------------------------------------------------------------ rounds

    def _part(self, key: str, value: Any) -> tuple[int, np.ndarray]:
        """The first row and the raw 16-bit words of this process's part of a loaded
        tensor (for a global ``jax.Array``, its first addressable piece, whose sharding
        is checked too)."""
        import torch

        if hasattr(value, "addressable_shards"):
            assert value.sharding == self.shardings[key], key
            shard = value.addressable_shards[0]
            start = shard.index[0].indices(self.shapes[key][0])[0] if shard.index else 0
            return start, np.asarray(shard.data).view(np.uint16)
        return self.rows_of(key)[0], value.detach().cpu().view(torch.int16).numpy().view(np.uint16)

    def check(self, loaded: dict[str, Any]) -> None:
        """Raise unless ``loaded`` has every key, and this process's rows of the largest
        split tensor and of one whole tensor are the files' bytes, as ``safetensors``
        reads them."""
        import torch
        from safetensors import safe_open

        assert set(loaded) == set(self.shapes), sorted(set(self.shapes) ^ set(loaded))
        whole = [k for k in self.shapes if k not in self.split][:1]
        split = sorted(self.split, key=lambda k: -int(np.prod(self.shapes[k])))[:1]
        for key in split + whole:
            start, got = self._part(key, loaded[key])
            with safe_open(self.file_of[key], "pt") as f:
                rows = f.get_slice(key)[start : start + len(got)]
                expected = rows.view(torch.int16).numpy().view(np.uint16)
            assert got.shape == expected.shape and np.array_equal(got, expected), key

    def evict(self) -> None:
        self._evict(self.directory)

    def warm(self) -> None:
        if self.rank == 0:
            for file in self.files:
                h.warm(file)
        self.sync("hf:warm")

    def measure(self, name: str, cold: bool) -> dict[str, Any]:
        """One round of ``name``: a load after eviction (with ``cold``), then one from the
        page cache, each checked."""
        row: dict[str, Any] = {}
        for state in ("cold", "warm") if cold else ("warm",):
            self.evict() if state == "cold" else self.warm()
            seconds, loaded = self.timed(self.peers[name], f"{name}:{state}")
            self.check(loaded)
            del loaded
            row[f"tp_{state}_s"] = seconds
        return row

    def describe(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "files": len(self.files),
            "tensors": len(self.shapes),
            "split_tensors": len(self.split),
            "split_bytes": sum(2 * int(np.prod(self.shapes[k])) for k in self.split),
            "devices": self.world,
            "written_by": "safetensors.torch.save_file, with model.safetensors.index.json",
        }

    def remove(self) -> None:
        h.remove(self.directory)
