"""Probe 27 (2026-11-21): the JAX front door's per-array wrapping, and the collector over
whole loads.  Part 1: 702 CuPy arrays of the 8 GiB checkpoint's shapes, wrapped into JAX
arrays (zero-copy) 7 times by each variant: public jax.dlpack.from_dlpack, arrayio's direct
import (arrayio._jax_import.to_jax), the private call with the stream fetched once (what
from_dlpack does, batched); best and median ms, bytes and zero-copy checked.
Part 2: warm 8 GiB loads (one forced read tool), shuffled per round: like torch, cupy, jax
(direct import), jax with the public from_dlpack, jax with the collector not paused; between
rounds 300k long-lived objects are added to the heap (as the other peers of the checkpoint
harness do), so that full collections fall due.  GcMeter around each load."""
import json, os, random, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, jax, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio import _jax_import, config

out, gib = sys.argv[1], float(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
res = {"argv": sys.argv, "jax": jax.__version__, "cupy": cupy.__version__}
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
import ml_dtypes
npd = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
flats = [cupy.empty(int(np.prod(s)) * np.dtype(npd[d]).itemsize, dtype=cupy.uint8) for _, s, d in entries]
views = [f.view(npd[d]).reshape(s) for f, (_, s, d) in zip(flats, entries)]
for i, f in enumerate(flats):
    f[:8] = i % 251
cupy.cuda.runtime.deviceSynchronize()
dev = jax.devices()[0]
from jax._src.lib import _jax


def private_stream_once(vs):
    stream = dev.get_stream_for_external_ready_events()
    return [_jax.dlpack_managed_tensor_to_buffer(v.__dlpack__(stream=stream), dev, stream, None, 2) for v in vs]


variants = {
    "from_dlpack": lambda vs: [jax.dlpack.from_dlpack(v) for v in vs],
    "arrayio_direct": lambda vs: [_jax_import.to_jax(jax, v, dev) for v in vs],
    "private_stream_once": private_stream_once,
}
res["wrap_ms"] = {}
for name, fn in variants.items():
    try:
        times = []
        for _ in range(7):
            _jax_import.reset()
            t = time.perf_counter(); arrs = fn(views); jax.block_until_ready(arrs); times.append(time.perf_counter() - t)
        first = [np.asarray(jax.lax.bitcast_convert_type(a.ravel()[:1], np.uint16 if a.dtype.itemsize == 2 else np.uint32)).view(np.uint8)[0] for a in arrs]
        ok = all(int(b) == i % 251 for i, b in enumerate(first))
        zero_copy = all(a.unsafe_buffer_pointer() == v.data.ptr for a, v in zip(arrs, views))
        res["wrap_ms"][name] = {"best": round(min(times) * 1e3, 2), "median": round(statistics.median(times) * 1e3, 2),
                                "bytes_ok": ok, "zero_copy": zero_copy, "state": _jax_import._state,
                                "committed": arrs[0].committed}
    except Exception as e:  # noqa: BLE001
        res["wrap_ms"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    print(name, res["wrap_ms"][name], flush=True)
del arrs, views, flats
state = ck.make_state(entries, "cuda"); nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="probe27-", dir="/tmp"); path = f"{d}/a.safetensors"
arrayio.save(path, state, tool="staged(chunk_size=33554432,direct=True,threads=8)")
del state
TOOL = "kvikio(task_size=4194304,threads=16)"
kinds = ["torch", "cupy", "jax", "jax-public", "jax-nopause"]
res["loads"] = []
heap = []
rng = random.Random(27)
for r in range(rounds + 1):
    order = kinds[:]
    rng.shuffle(order)
    for kind in order:
        like = kind.split("-")[0]
        h.warm(path)
        _jax_import.reset()
        if kind == "jax-public":
            _jax_import._state = "public"
        with config.set(gc_pause=kind != "jax-nopause"), h.GcMeter() as g:
            t = time.perf_counter(); o = arrayio.load(path, like=like, device="cuda", tool=TOOL)
            h.settle(jax_tree=o if like == "jax" else None); s = time.perf_counter() - t
        del o
        if r:
            res["loads"].append({"round": r, "kind": kind, "GBps": round(nbytes / s / 1e9, 2), **g.report()})
            print(res["loads"][-1], flush=True)
    heap.append([(i, str(i)) for i in range(300_000)])  # long-lived objects, as other peers leave
res["median_GBps"] = {k: statistics.median(x["GBps"] for x in res["loads"] if x["kind"] == k) for k in kinds}
res["full_collections"] = {k: sum(x["full"] for x in res["loads"] if x["kind"] == k) for k in kinds}
print(json.dumps(res["median_GBps"]), json.dumps(res["full_collections"]), flush=True)
json.dump(res, open(out, "w"), indent=1)
h.remove(d)
