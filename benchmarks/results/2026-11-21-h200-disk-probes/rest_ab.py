"""Is a cold read right after a large write slower than one after a rest?"""
import json, os, sys, tempfile, time
sys.path.insert(0, os.getcwd())
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty
out = sys.argv[1]
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="rest-", dir="/tmp"); arr = os.path.join(d, "a.safetensors"); raw = os.path.join(d, "raw.bin")
host = aligned_empty(1 << 30); host[:] = 5
wt = tools.make("direct", threads=1, task_size=64 << 20); rt = tools.make("direct", threads=16, task_size=16 << 20)
res = {}
def rec(k, v): res.setdefault(k, []).append(round(v, 2))
for i in range(8):
    rest = 3.0 if i % 2 else 0.0
    tag = f"rest{rest:g}"
    # arrayio: save, evict, (rest), cold load
    h.remove(arr); t = time.perf_counter(); arrayio.save(arr, state); rec(f"aio_save", nbytes / (time.perf_counter() - t) / 1e9)
    h.evict(arr, True); time.sleep(rest)
    t = time.perf_counter(); o = arrayio.load(arr, like="torch", device="cuda"); h.settle(); rec(f"aio_cold_{tag}", nbytes / (time.perf_counter() - t) / 1e9); del o
    # raw: write, evict, (rest), read
    fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); wt.write(fd, host, 0); os.fsync(fd); os.close(fd)
    h.evict(raw, True); time.sleep(rest)
    fd = os.open(raw, os.O_RDONLY); t = time.perf_counter(); rt.read(fd, host, 0); rec(f"raw_cold_{tag}", (1 << 30) / (time.perf_counter() - t) / 1e9); os.close(fd)
    # and a second cold read of the same file, no write in between
    h.evict(raw, True); fd = os.open(raw, os.O_RDONLY); t = time.perf_counter(); rt.read(fd, host, 0); rec(f"raw_cold_again_{tag}", (1 << 30) / (time.perf_counter() - t) / 1e9); os.close(fd)
    print(i, {k: v[-1] for k, v in res.items()}, flush=True)
json.dump(res, open(out, "w"), indent=1); print(json.dumps(res)); h.remove(d)
