"""Cold 1 GiB checkpoint into the GPU: KvikIO compat with O_DIRECT reads vs fastsafetensors vs arrayio."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, kvikio, kvikio.defaults
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
out = sys.argv[1]; rounds = int(sys.argv[2])
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="kvab-", dir="/tmp"); arr = os.path.join(d, "a.safetensors"); arrayio.save(arr, state)
fst = ck.fastsafetensors_peer(state, "cuda"); fst_path = os.path.join(d, "fst"); fst.save(fst_path); h.fsync_tree(fst_path)
size = os.path.getsize(arr); dev = cupy.empty(size, dtype=cupy.uint8)
print("kvikio", kvikio.__version__, "compat preferred", kvikio.defaults.is_compat_mode_preferred(), flush=True)
def kv(threads, task, direct, bounce=None):
    def go():
        kvikio.defaults.set("num_threads", threads); kvikio.defaults.set("task_size", task)
        kvikio.defaults.set("auto_direct_io_read", direct)
        if bounce: kvikio.defaults.set("bounce_buffer_size", bounce)
        f = kvikio.CuFile(arr, "r")
        try:
            n = f.pread(dev, size, 0, task).get()
        finally:
            f.close()
        cupy.cuda.Device().synchronize(); return n
    return go
M = 1 << 20
variants = {
    "fst_shards": (lambda: fst.load(fst_path), fst_path),
    "aio_s16x16": (lambda: arrayio.load(arr, like="torch", device="cuda", tool="staged(threads=16,chunk_size=16777216,direct=True)"), arr),
    "kv_buffered_16x4M": (kv(16, 4 * M, False, 4 * M), arr),
    "kv_direct_16x4M": (kv(16, 4 * M, True, 4 * M), arr),
    "kv_direct_16x16M": (kv(16, 16 * M, True, 16 * M), arr),
    "kv_direct_32x8M": (kv(32, 8 * M, True, 8 * M), arr),
}
res = {"bytes": nbytes, "rounds": {}}
names = list(variants)
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
        fn, path = variants[name]
        h.evict(path, True)
        try:
            t = time.perf_counter(); o = fn(); h.settle(); s = time.perf_counter() - t; del o
            res["rounds"].setdefault(name, []).append(round(nbytes / s / 1e9, 3))
        except Exception as e:
            res.setdefault("errors", {})[name] = repr(e)
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
print(json.dumps(res["median"], indent=1), res.get("errors")); json.dump(res, open(out, "w"), indent=1); h.remove(d)
