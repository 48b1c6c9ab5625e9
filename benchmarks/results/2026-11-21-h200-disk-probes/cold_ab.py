"""Alternating cold loads of one 1 GiB checkpoint: fastsafetensors vs arrayio arms vs raw O_DIRECT."""
import json, os, sys, tempfile, time
sys.path.insert(0, os.getcwd())
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty

out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
device = "cuda"
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), device)
nbytes = sum(t.numel() * t.element_size() for t in state.values())
h.settle()
d = tempfile.mkdtemp(prefix="coldab-", dir="/tmp")
arr = os.path.join(d, "a.safetensors")
arrayio.save(arr, state)
fst = ck.fastsafetensors_peer(state, device)
fst_path = os.path.join(d, "fst"); fst.save(fst_path); h.fsync_tree(fst_path)
res = {"bytes": nbytes, "rounds": {}}
t0 = time.time()
res["tuned"] = {e.key: e.chosen for e in arrayio.tune(d, device=device, sizes=[nbytes]).explanations}
res["tune_s"] = time.time() - t0
print("tuned", res["tuned"], flush=True)
host = aligned_empty(os.path.getsize(arr) // 4096 * 4096)
raw = {k: tools.make("direct", threads=k, task_size=16 << 20) for k in (4, 16)}
def raw_read(k):
    fd = os.open(arr, os.O_RDONLY); raw[k].read(fd, host, 0); os.close(fd)
S = lambda th, ch: f"staged(threads={th},chunk_size={ch << 20},direct=True)"
def aio(tool=None, verify=None):
    return lambda: arrayio.load(arr, like="torch", device=device, tool=tool, verify=verify)
variants = {
    "fst": lambda: fst.load(fst_path),
    "aio": aio(),
    "aio_noverify": aio(verify=False),
    "s4x16": aio(S(4, 16)), "s8x16": aio(S(8, 16)), "s16x16": aio(S(16, 16)),
    "s16x8": aio(S(16, 8)), "s8x32": aio(S(8, 32)), "s16x16_noverify": aio(S(16, 16), False),
    "raw_direct16x16_host": lambda: raw_read(16), "raw_direct4x16_host": lambda: raw_read(4),
}
paths = {k: (fst_path if k == "fst" else arr) for k in variants}
names = list(variants)
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
        h.evict(paths[name], True)
        t = time.perf_counter(); o = variants[name](); h.settle(); s = time.perf_counter() - t
        del o
        res["rounds"].setdefault(name, []).append(round(nbytes / s / 1e9, 3))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
    json.dump(res, open(out, "w"), indent=1)
import statistics
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
print(json.dumps(res["median"], indent=1)); json.dump(res, open(out, "w"), indent=1)
h.remove(d)
