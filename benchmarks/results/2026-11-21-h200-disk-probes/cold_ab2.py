"""Is fastsafetensors' cold-load edge its reader or its 16-shard layout?"""
import concurrent.futures, json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, cupyx, numpy as np
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from fastsafetensors import fastsafe_open

out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
device = "cuda"
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), device)
nbytes = sum(t.numel() * t.element_size() for t in state.values())
h.settle()
d = tempfile.mkdtemp(prefix="coldab2-", dir="/tmp")
arr = os.path.join(d, "a.safetensors"); arrayio.save(arr, state)
fst = ck.fastsafetensors_peer(state, device)
fst_path = os.path.join(d, "fst"); fst.save(fst_path); h.fsync_tree(fst_path)
shards = h.files_under(fst_path)
MiB = 1 << 20; CH = 16 * MiB
dev = cupy.empty(os.path.getsize(arr) + CH, dtype=cupy.uint8)
pinned = []
for _ in range(32):
    raw = cupyx.empty_pinned((CH + 4096,), dtype=np.uint8)
    s = -raw.ctypes.data % 4096; pinned.append(raw[s:s + CH])
streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(16)]
pool = concurrent.futures.ThreadPoolExecutor(16)

def segments(path, base, rr):
    """(fd path, file offset, device offset, length) per worker."""
    size = os.path.getsize(path) // 4096 * 4096
    chunks = [(o, min(CH, size - o)) for o in range(0, size, CH)]
    if rr:
        return [[(path, o, base + o, n) for o, n in chunks[k::16]] for k in range(16)]
    per = -(-len(chunks) // 16)
    return [[(path, o, base + o, n) for o, n in chunks[k * per:(k + 1) * per]] for k in range(16)]

def work(k, items, double):
    fds = {}
    with cupy.cuda.Device(0):
        st = streams[k]; ev = [None, None]
        for j, (p, o, do, n) in enumerate(items):
            fd = fds.get(p) or fds.setdefault(p, os.open(p, os.O_RDONLY | os.O_DIRECT))
            b = pinned[2 * k + (j % 2 if double else 0)]
            if ev[j % 2 if double else 0] is not None: ev[j % 2 if double else 0].synchronize()
            got = os.preadv(fd, [memoryview(b)[:n]], o)
            dev[do:do + got].set(b[:got], stream=st); ev[j % 2 if double else 0] = st.record()
            if not double: st.synchronize()
        st.synchronize()
    for fd in fds.values(): os.close(fd)

def py(rr, on_shards=False, double=True):
    def go():
        if on_shards:
            base = 0; per = []
            for p in shards:
                per.append(segments(p, base, False)[0] + sum(segments(p, base, False)[1:], [])); base += os.path.getsize(p) // 4096 * 4096 + 4096
            parts = per
        else:
            parts = segments(arr, 0, rr)
        list(pool.map(lambda a: work(*a, double), enumerate(parts)))
    return go

def fst_on(files, block=16 << 30):
    def go():
        with fastsafe_open(files, framework="pt", device="cuda:0", nogds=True, max_copy_block_size=block) as f:
            o = {k: f.get_tensor(k) for k in f.keys()}
        h.settle(); return o
    return go

variants = {
    "fst_shards": (fst_on(shards), fst_path),
    "fst_on_arrayio_file": (fst_on([arr]), arr),
    "fst_on_arrayio_file_64M_blocks": (fst_on([arr], 64 * MiB), arr),
    "py_rr_double": (py(True), arr),
    "py_contig_double": (py(False), arr),
    "py_contig_single": (py(False, double=False), arr),
    "py_shards_double": (py(False, on_shards=True), fst_path),
    "aio_s16x16": (lambda: arrayio.load(arr, like="torch", device=device, tool="staged(threads=16,chunk_size=16777216,direct=True)"), arr),
}
res = {"bytes": nbytes, "rounds": {}}
names = list(variants)
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
        fn, path = variants[name]
        h.evict(path, True)
        t = time.perf_counter(); o = fn(); h.settle(); s = time.perf_counter() - t
        del o
        res["rounds"].setdefault(name, []).append(round(nbytes / s / 1e9, 3))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
    json.dump(res, open(out, "w"), indent=1)
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
print(json.dumps(res["median"], indent=1)); json.dump(res, open(out, "w"), indent=1)
h.remove(d)
