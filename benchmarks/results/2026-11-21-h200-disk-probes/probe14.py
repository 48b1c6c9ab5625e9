"""Does the GIL's switch interval (5 ms by default) slow arrayio's cold loads? 16 worker
threads each need the GIL back after every read. Alternating cold loads, after tune, beside
fastsafetensors and the raw ceiling reader."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
os.makedirs(out, exist_ok=True)
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="p14-", dir="/tmp")
arr = os.path.join(d, "a.safetensors"); arrayio.save(arr, state)
fst = ck.fastsafetensors_peer(state, "cuda"); fst_path = os.path.join(d, "fst"); fst.save(fst_path); h.fsync_tree(fst_path)
arrayio.tune(d, device="cuda", sizes=[nbytes])
size = os.path.getsize(arr) // 4096 * 4096
host = aligned_empty(size)
import cupyx, numpy as np
pinned = cupyx.empty_pinned((size,), dtype=np.uint8)
raw8 = tools.make("direct", threads=8, task_size=16 << 20)
raw16 = tools.make("direct", threads=16, task_size=16 << 20)

def aio(interval):
    def go():
        old = sys.getswitchinterval(); sys.setswitchinterval(interval)
        try:
            o = arrayio.load(arr, like="torch", device="cuda"); h.settle(); return o
        finally:
            sys.setswitchinterval(old)
    return go, arr, nbytes

def raw(tool, buf):
    def go():
        fd = os.open(arr, os.O_RDONLY)
        try:
            tool.read(fd, buf, 0)
        finally:
            os.close(fd)
    return go, arr, size

variants = {"aio_5ms": aio(0.005), "aio_0.2ms": aio(0.0002), "aio_1ms": aio(0.001),
            "fst": ((lambda: fst.load(fst_path)), fst_path, nbytes),
            "raw8_pageable": raw(raw8, host), "raw8_pinned": raw(raw8, pinned),
            "raw16_pinned": raw(raw16, pinned)}
names = list(variants)
for n in names:
    variants[n][0]()
res = {"rounds": {}}
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    if r % 2:
        order = order[::-1]
    for n in order:
        fn, path, nb = variants[n]
        h.evict(path, True)
        t = time.perf_counter(); o = fn(); s = time.perf_counter() - t; del o
        res["rounds"].setdefault(n, []).append(round(nb / s / 1e9, 3))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
json.dump(res, open(os.path.join(out, "probe14.json"), "w"), indent=1)
print(json.dumps(res["median"], indent=1))
h.remove(d)
