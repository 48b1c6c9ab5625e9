"""Does a larger O_DIRECT request per thread (one pread of 64-128 MiB) beat 16 MiB ones on
the H200 VM's disk, raw and through arrayio's staged tool? fastsafetensors' shard reads
issue one large read per file."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import numpy as np
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
os.makedirs(out, exist_ok=True)
MiB = 1 << 20
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="p12-", dir="/tmp")
arr = os.path.join(d, "a.safetensors"); arrayio.save(arr, state)
size = os.path.getsize(arr) // 4096 * 4096
host = aligned_empty(size)
fst = ck.fastsafetensors_peer(state, "cuda"); fst_path = os.path.join(d, "fst"); fst.save(fst_path); h.fsync_tree(fst_path)

def raw(threads, task):
    t = tools.make("direct", threads=threads, task_size=task)
    def go():
        fd = os.open(arr, os.O_RDONLY)
        try:
            t.read(fd, host, 0)
        finally:
            os.close(fd)
    return go, arr

def aio(spec):
    def go():
        o = arrayio.load(arr, like="torch", device="cuda", tool=spec); h.settle(); return o
    return go, arr

def fst_load():
    o = fst.load(fst_path); h.settle(); return o

variants = {
    "raw_16x16M": raw(16, 16 * MiB), "raw_16x64M": raw(16, 64 * MiB), "raw_8x128M": raw(8, 128 * MiB),
    "raw_4x64M": raw(4, 64 * MiB), "raw_32x32M": raw(32, 32 * MiB), "raw_16x32M": raw(16, 32 * MiB),
    "aio_s16x16M": aio("staged(threads=16,chunk_size=16777216,direct=True)"),
    "aio_s16x64M": aio("staged(threads=16,chunk_size=67108864,direct=True)"),
    "aio_s8x64M": aio("staged(threads=8,chunk_size=67108864,direct=True)"),
    "aio_s16x32M": aio("staged(threads=16,chunk_size=33554432,direct=True)"),
    "fst_shards": (fst_load, fst_path),
}
res = {"bytes": nbytes, "rounds": {}}
names = list(variants)
for name in names:  # untimed once: pinned buffers, thread pools
    variants[name][0]()
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    if r % 2:
        order = order[::-1]
    for name in order:
        fn, path = variants[name]
        h.evict(path, True)
        t = time.perf_counter(); o = fn(); s = time.perf_counter() - t
        del o
        res["rounds"].setdefault(name, []).append(round((size if name.startswith("raw") else nbytes) / s / 1e9, 3))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
    json.dump(res, open(os.path.join(out, "probe12.json"), "w"), indent=1)
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
json.dump(res, open(os.path.join(out, "probe12.json"), "w"), indent=1)
print(json.dumps(res["median"], indent=1))
h.remove(d)
