"""Is the first cold read of a freshly written file slower than the next ones? Each writer
writes its file, then it is read cold three times (evicted before each): the raw ceiling's
reader (into pageable and into pinned host memory), arrayio.load and fastsafetensors."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupyx, numpy as np
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
os.makedirs(out, exist_ok=True)
MiB = 1 << 20
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="p17-", dir="/tmp")
arrayio.tune(d, device="cuda", sizes=[nbytes])
n = nbytes // (64 * MiB) * 64 * MiB
host = aligned_empty(n); host[:] = 9
pinned = cupyx.empty_pinned((n,), dtype=np.uint8)
wt = tools.make("direct", threads=1, task_size=64 * MiB)
rt = tools.make("direct", threads=8, task_size=16 * MiB)
fst = ck.fastsafetensors_peer(state, "cuda")

def raw_pair(buf):
    p = os.path.join(d, "raw.bin")
    def write():
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); wt.write(fd, host, 0); os.fsync(fd); os.close(fd)
    def read():
        fd = os.open(p, os.O_RDONLY); rt.read(fd, buf, 0); os.close(fd)
    return write, read, p, n

def aio_pair():
    p = os.path.join(d, "a.safetensors")
    return (lambda: arrayio.save(p, state)), (lambda: (arrayio.load(p, like="torch", device="cuda"), h.settle())), p, nbytes

def fst_pair():
    p = os.path.join(d, "fst")
    def write():
        h.remove(p); fst.save(p); h.fsync_tree(p)
    return write, (lambda: fst.load(p)), p, nbytes

pairs = {"raw_pageable": raw_pair(host), "raw_pinned": raw_pair(pinned), "arrayio": aio_pair(), "fastsafetensors": fst_pair()}
res = {k: [] for k in pairs}
names = list(pairs)
for r in range(rounds):
    for k in names[r % len(names):] + names[:r % len(names)]:
        write, read, path, nb = pairs[k]
        write()
        reads = []
        for _ in range(3):
            h.evict(path, True)
            t = time.perf_counter(); o = read(); s = time.perf_counter() - t; del o
            reads.append(round(nb / s / 1e9, 3))
        res[k].append(reads)
    print(r, {k: v[-1] for k, v in res.items()}, flush=True)
summary = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in res.items()}
json.dump({"reads_GBps": res, "median_by_read": summary}, open(os.path.join(out, "probe17.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
h.remove(d)
