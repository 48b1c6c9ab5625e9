"""Where does a save lose against the raw write ceiling? 1 GiB writes + fsync, in rotating
order: raw O_DIRECT from host memory (new file, or O_TRUNC of the same file as the ceiling
does), arrayio's staged tool from the GPU alone, and whole arrayio.save calls (tuned choice
and forced arms)."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty, CupyDeviceBuffer
from arrayio.dispatch import dispatcher as dispatch
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
os.makedirs(out, exist_ok=True)
MiB = 1 << 20
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="p15-", dir="/tmp")
arrayio.tune(d, device="cuda", sizes=[nbytes], directions=("write",))
n = nbytes // 4096 * 4096
host = aligned_empty(n); host[:] = 3
dev = cupy.full(n, 3, dtype=cupy.uint8)
forcing = dispatch.Dispatcher(None)

def raw(threads, trunc):
    t = tools.make("direct", threads=threads, task_size=64 * MiB)
    p = os.path.join(d, f"raw{threads}{trunc}.bin")
    def go():
        if not trunc and os.path.exists(p):
            os.unlink(p)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            t.write(fd, host, 0); os.fsync(fd)
        finally:
            os.close(fd)
    return go

def staged(threads):
    arm = dispatch.Arm.of("staged", threads=threads, chunk_size=64 * MiB, direct=True)
    p = os.path.join(d, f"st{threads}.bin")
    def go():
        if os.path.exists(p):
            os.unlink(p)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            forcing.write(fd, CupyDeviceBuffer(dev), 0, with_checksum=True, tool=arm); os.fsync(fd)
        finally:
            os.close(fd)
    return go

def save(tool):
    p = os.path.join(d, f"save{tool}.safetensors")
    def go():
        if os.path.exists(p):
            os.unlink(p)
        arrayio.save(p, state, tool=tool)
    return go

variants = {"raw1_new": raw(1, False), "raw1_trunc": raw(1, True), "raw4_new": raw(4, False),
            "staged1_gpu": staged(1), "staged2_gpu": staged(2), "staged4_gpu": staged(4),
            "save_tuned": save(None),
            "save_s1x64": save("staged(threads=1,chunk_size=67108864,direct=True)"),
            "save_s2x64": save("staged(threads=2,chunk_size=67108864,direct=True)"),
            "save_s4x64": save("staged(threads=4,chunk_size=67108864,direct=True)")}
names = list(variants)
for k in names:
    variants[k]()
res = {"rounds": {}, "tuned": [e.as_dict()["chosen"] for e in arrayio.explain().explanations if e.key.startswith("write/cuda/2^3")]}
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    if r % 2:
        order = order[::-1]
    for k in order:
        t = time.perf_counter(); variants[k](); s = time.perf_counter() - t
        res["rounds"].setdefault(k, []).append(round((nbytes if k.startswith("save") else n) / s / 1e9, 3))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
json.dump(res, open(os.path.join(out, "probe15.json"), "w"), indent=1)
print(res["tuned"]); print(json.dumps(res["median"], indent=1))
h.remove(d)
