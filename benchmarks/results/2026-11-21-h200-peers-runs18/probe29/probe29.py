"""Probe 29 (2026-11-21): does a full page cache slow warm 8 GiB loads?  In checkpoint run 18
every warm load ran ~25% slower than in a quiet process (probe 28): raw KvikIO 245 against
190 ms, arrayio 291 against 229.  The harness keeps every peer's 8.66 GB file on disk and in
the cache (host 128 GiB), so each warm() must reclaim.  Here: warm loads (arrayio like torch,
raw KvikIO peer) with the cache first filled by a sparse 110 GB filler ("pressure"), and
with the filler evicted ("free"); /proc/meminfo's Cached and MemFree recorded."""
import json, os, random, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio

out, gib, rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
def mem():
    m = dict(l.split(":") for l in open("/proc/meminfo"))
    return {k: round(int(m[k].split()[0]) / 2**20, 1) for k in ("MemFree", "Cached", "MemAvailable")}
res = {"argv": sys.argv, "mem_start": mem()}
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="probe29-", dir="/tmp")
paths = {"arrayio": f"{d}/a.safetensors", "kvikio": f"{d}/k.bin"}
arrayio.save(paths["arrayio"], state, tool="staged(chunk_size=33554432,direct=True,threads=8)")
kv = ck.kvikio_peer(state); kv.save(paths["kvikio"])
filler = f"{d}/filler.bin"
with open(filler, "wb") as f:
    f.truncate(110 << 30)
TOOL = "kvikio(task_size=4194304,threads=16)"
kinds = {"arrayio-torch": lambda: arrayio.load(paths["arrayio"], like="torch", device="cuda", tool=TOOL),
         "kvikio-peer": lambda: kv.load(paths["kvikio"])}
res["loads"] = []
rng = random.Random(29)
for cond in ("pressure", "free", "pressure", "free"):
    t = time.perf_counter()
    if cond == "pressure":
        h.warm(filler, threads=16)
    else:
        h.evict(filler, False)
    res.setdefault("prepare_s", []).append(round(time.perf_counter() - t, 1))
    res.setdefault("mem_" + cond, []).append(mem())
    print(cond, mem(), flush=True)
    for r in range(rounds):
        order = list(kinds); rng.shuffle(order)
        for kind in order:
            h.warm(paths["kvikio" if kind == "kvikio-peer" else "arrayio"])
            t = time.perf_counter(); o = kinds[kind](); h.settle(); s = time.perf_counter() - t
            del o
            res["loads"].append({"cond": cond, "kind": kind, "s": round(s, 4), "GBps": round(nbytes / s / 1e9, 2)})
            print(res["loads"][-1], flush=True)
res["median_GBps"] = {f"{c}/{k}": statistics.median(x["GBps"] for x in res["loads"] if x["kind"] == k and x["cond"] == c)
                      for c in ("pressure", "free") for k in kinds}
print(json.dumps(res["median_GBps"]), flush=True)
json.dump(res, open(out, "w"), indent=1)
h.remove(d)
