"""Probe 26: does the JAX (and CuPy) front door's warm load slow down in a process that
holds every framework's memory pools, as in checkpoint run 16 (JAX 24.3, 18.8, 16.0 GB/s
round after round, against 33-35 alone)?  8 GiB, the harness's state and peers' loads,
forced tools, warm, shuffled rounds; per load: wall time, Python GC time and collections
during it, CuPy pool / torch / JAX / device memory before it, host MemAvailable.
Phases: A GC on (4 rounds), B GC disabled during each timed load (4), C GC on again (2);
then a cycle check of each front door on the GPU."""
import gc, json, os, random, shutil, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, jax, numpy as np, torch
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio

out, gib, rounds_a, rounds_b, rounds_c = sys.argv[1], float(sys.argv[2]), *map(int, sys.argv[3:6])
READ = "kvikio(task_size=4194304,threads=16)"
WRITE = "staged(chunk_size=33554432,direct=True,threads=8)"
t0 = time.time()
res = {"argv": sys.argv, "read_tool": READ, "write_tool": WRITE, "loads": [], "log": []}
def log(*a):
    line = f"+{time.time() - t0:6.1f}s " + " ".join(str(x) for x in a)
    print(line, flush=True); res["log"].append(line)
    json.dump(res, open(out, "w"), indent=1)

state = ck.make_state(ck.layout(int(gib * (1 << 30)), 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
jax_tree = h.nest({k: h.torch_to_jax(v) for k, v in state.items()})
res.update(bytes=nbytes, tensors=len(state))
d = tempfile.mkdtemp(prefix="probe26-", dir="/tmp")
log("state", nbytes, len(state), "disk free GB", shutil.disk_usage(d).free / 1e9)
paths = {"arrayio": f"{d}/arrayio.safetensors", "arrayio-jax": f"{d}/jax.safetensors",
         "torch": f"{d}/torch.pt", "orbax": f"{d}/orbax"}
orbax = ck.orbax_peer(state, jax_tree)
torch_peer = ck.torch_peer(state, "cuda")
saves = {"arrayio": lambda p: arrayio.save(p, state, tool=WRITE),
         "arrayio-jax": lambda p: arrayio.save(p, jax_tree, tool=WRITE),
         "torch": torch_peer.save, "orbax": orbax.save}
for name, fn in saves.items():
    s, _ = h.timed(lambda: (fn(paths[name]), h.fsync_tree(paths[name])))
    log("saved", name, round(nbytes / s / 1e9, 2), "GB/s")

def aio(like, file):
    def load():
        o = arrayio.load(paths[file], like=like, device="cuda", tool=READ)
        h.settle(jax_tree=o if like == "jax" else None); return o
    return load, file
loads = {"arrayio": aio("torch", "arrayio"), "arrayio-jax": aio("jax", "arrayio-jax"),
         "jax-on-torch-file": aio("jax", "arrayio"), "arrayio-cupy": aio("cupy", "arrayio"),
         "torch": (lambda: torch_peer.load(paths["torch"]), "torch"),
         "orbax": (lambda: orbax.load(paths["orbax"]), "orbax")}

gc_log = {"t": 0.0, "n": [0, 0, 0], "start": None}
def gc_cb(phase, info):
    if phase == "start": gc_log["start"] = time.perf_counter()
    elif gc_log["start"] is not None:
        gc_log["t"] += time.perf_counter() - gc_log["start"]; gc_log["n"][info["generation"]] += 1
gc.callbacks.append(gc_cb)
pool = cupy.get_default_memory_pool()
def meminfo():
    free, total = cupy.cuda.runtime.memGetInfo()
    st = jax.devices()[0].memory_stats() or {}
    avail = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemAvailable"))
    return {"dev_free_GB": round(free / 1e9, 1), "cupy_used_GB": round(pool.used_bytes() / 1e9, 1),
            "cupy_total_GB": round(pool.total_bytes() / 1e9, 1),
            "torch_reserved_GB": round(torch.cuda.memory_reserved() / 1e9, 1),
            "jax_in_use_GB": round(st.get("bytes_in_use", 0) / 1e9, 1),
            "jax_live": len(jax.live_arrays()), "host_avail_GB": round(avail / 1e6, 1),
            "gc_counts": gc.get_count()}

rng = random.Random(26)
for name, (fn, _) in loads.items():  # untimed first call of each
    h.warm(paths[loads[name][1]]); o = fn(); del o
log("first calls done", meminfo())
for phase, n, gc_off in (("A", rounds_a, False), ("B", rounds_b, True), ("C", rounds_c, False)):
    for r in range(n):
        order = list(loads); rng.shuffle(order)
        for name in order:
            fn, file = loads[name]
            h.warm(paths[file]); before = meminfo()
            gc_log.update(t=0.0, n=[0, 0, 0], start=None)
            if gc_off: gc.disable()
            t = time.perf_counter(); o = fn(); s = time.perf_counter() - t
            if gc_off: gc.enable()
            after_cupy = round(pool.used_bytes() / 1e9, 1)
            del o
            rec = {"phase": phase, "round": r, "name": name, "GBps": round(nbytes / s / 1e9, 2),
                   "seconds": round(s, 4), "gc_ms": round(gc_log["t"] * 1e3, 1),
                   "gc_collections": list(gc_log["n"]), "before": before,
                   "cupy_used_after_GB": after_cupy}
            res["loads"].append(rec)
        log(phase, r, {x["name"]: (x["GBps"], x["gc_ms"]) for x in res["loads"][-len(order):]})
summary = {}
for phase in "ABC":
    for name in loads:
        v = [x["GBps"] for x in res["loads"] if x["phase"] == phase and x["name"] == name]
        if v: summary.setdefault(phase, {})[name] = round(statistics.median(v), 2)
res["median_GBps"] = summary
log("medians", json.dumps(summary))
cyc = {}
for name in ("arrayio", "arrayio-jax", "arrayio-cupy"):
    fn, file = loads[name]; h.warm(paths[file])
    gc.collect(); gc.disable(); u0 = pool.used_bytes()
    o = fn(); u1 = pool.used_bytes(); del o; h.settle(); u2 = pool.used_bytes()
    n = gc.collect(); u3 = pool.used_bytes(); gc.enable()
    cyc[name] = {"unreachable": n, "cupy_used_GB": [round(u / 1e9, 2) for u in (u0, u1, u2, u3)]}
res["cycles"] = cyc
log("cycles", json.dumps(cyc), meminfo())
h.remove(d)
