"""Probe 25: why arrayio.load(like='jax') is slower warm than like='torch'/'cupy' at 8 GiB
(run 16: 18.8 against 30.7 GB/s). Same file, same forced tool, warm, rotating order; then
the per-array costs of each front door's finish, and a profile of one warm load of each."""
import cProfile, io, json, os, pstats, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, jax, numpy as np, torch
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio

out = sys.argv[1]; gib = float(sys.argv[2]); rounds = int(sys.argv[3])
TOOL = "kvikio(task_size=4194304,threads=16)"
state = ck.make_state(ck.layout(int(gib * (1 << 30)), 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="probe25-", dir="/tmp")
path = os.path.join(d, "a.safetensors"); arrayio.save(path, state)
res = {"bytes": nbytes, "tensors": len(state), "rounds": {}}
def load(like):
    o = arrayio.load(path, like=like, device="cuda", tool=TOOL)
    h.settle(jax_tree=o if like == "jax" else None); return o
def load_nosettle_jax():
    o = arrayio.load(path, like="jax", device="cuda", tool=TOOL); torch.cuda.synchronize(); return o
variants = {"torch": lambda: load("torch"), "cupy": lambda: load("cupy"), "jax": lambda: load("jax"),
            "jax_no_block": load_nosettle_jax}
for fn in variants.values(): fn()
names = list(variants)
for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
        h.warm(path)
        t = time.perf_counter(); o = variants[name](); s = time.perf_counter() - t; del o
        res["rounds"].setdefault(name, []).append(round(nbytes / s / 1e9, 2))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
res["median_GBps"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
# per-array costs
shapes = [(tuple(t.shape), t.dtype) for t in state.values()]
import ml_dtypes
npd = {torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32}
def tm(fn, n=3):
    best = []
    for _ in range(n):
        t = time.perf_counter(); x = fn(); torch.cuda.synchronize(); best.append(time.perf_counter() - t)
    return round(min(best) * 1e3, 2), x
costs = {}
costs["cupy_empty_ms"], flats = tm(lambda: [cupy.empty((int(np.prod(s)) * (2 if dt == torch.bfloat16 else 4),), dtype=cupy.uint8) for s, dt in shapes])
views = [f.view(npd[dt]).reshape(s) for f, (s, dt) in zip(flats, shapes)]
costs["jax_from_dlpack_cupy_ms"], arrs = tm(lambda: [jax.dlpack.from_dlpack(v) for v in views])
costs["jax_block_until_ready_ms"], _ = tm(lambda: jax.block_until_ready(arrs))
tens = [torch.empty(s, dtype=dt, device="cuda") for s, dt in shapes]
costs["jax_from_dlpack_torch_ms"], _ = tm(lambda: [jax.dlpack.from_dlpack(t) for t in tens])
costs["torch_empty_ms"], _ = tm(lambda: [torch.empty(s, dtype=dt, device="cuda") for s, dt in shapes])
costs["jax_from_dlpack_cupy_fresh_ms"], _ = tm(lambda: [jax.dlpack.from_dlpack(f.view(npd[dt]).reshape(s)) for f, (s, dt) in zip(flats, shapes)])
res["costs_702"] = costs; print(costs, flush=True)
prof = {}
for name in ("torch", "jax"):
    h.warm(path); p = cProfile.Profile(); p.enable(); o = variants[name](); p.disable(); del o
    s = io.StringIO(); pstats.Stats(p, stream=s).sort_stats("cumulative").print_stats(28); prof[name] = s.getvalue()
    s2 = io.StringIO(); pstats.Stats(p, stream=s2).sort_stats("tottime").print_stats(15); prof[name + "_tottime"] = s2.getvalue()
res["profiles"] = prof
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res["median_GBps"]))
print(prof["jax_tottime"][:4000])
h.remove(d)
