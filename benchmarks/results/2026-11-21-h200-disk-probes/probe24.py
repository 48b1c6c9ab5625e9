"""Probe 24: where a cold 1 GiB checkpoint load loses to a plain reader of the same file.

Every variant reads arrayio's own file, dropped from the page cache first, in rotating order:
- load / load_noverify: arrayio.load, forced staged 16 x 16 MiB O_DIRECT;
- readmany: the dispatcher's batch into preallocated tensors (no header, no allocation);
- py_whole: the whole file in aligned 16 MiB chunks, round robin to 16 workers, one device buffer;
- py_tensors: arrayio's request pattern (each tensor cut in 16 MiB chunks from its own start,
  read as aligned spans) on the same 16 workers, into the preallocated tensors;
- load_8x64 / load_16x64: arrayio.load with 64 MiB chunks.
"""
import concurrent.futures, json, os, statistics, sys, tempfile, threading, time
sys.path.insert(0, os.getcwd())
import cupy, cupyx, numpy as np, torch
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio import _transfer
from arrayio._frameworks import writable_view

out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
MiB = 1 << 20; CH = 16 * MiB; B = 4096
arm = lambda t, c: f"staged(threads={t},chunk_size={c * MiB},direct=True)"
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
keys = list(state)
nbytes = sum(t.numel() * t.element_size() for t in state.values())
h.settle()
d = tempfile.mkdtemp(prefix="probe24-", dir="/tmp")
path = os.path.join(d, "a.safetensors"); arrayio.save(path, state)
with arrayio.open(path) as reader:
    starts = [reader._entry(k).start for k in keys]
pre = {k: torch.empty_like(v) for k, v in state.items()}
requests = [(s, writable_view(pre[k])[2]) for k, s in zip(keys, starts)]
dev = cupy.empty(os.path.getsize(path) + CH, dtype=cupy.uint8)
local = threading.local()
pool = concurrent.futures.ThreadPoolExecutor(16)


def slots():
    if not hasattr(local, "pair"):
        pair = []
        for _ in range(2):
            raw = cupyx.empty_pinned((CH + 3 * B,), dtype=np.uint8)
            s = -raw.ctypes.data % B; pair.append(raw[s:s + CH + 2 * B])
        local.pair, local.stream, local.ev = pair, cupy.cuda.Stream(non_blocking=True), [None, None]
    return local


def run(items):
    """items: (fd, aligned file offset, span, skip, length, device uint8 view) in worker order."""
    L = slots(); j = 0
    with cupy.cuda.Device(0):
        for fd, off, span, skip, length, target in items:
            if L.ev[j % 2] is not None: L.ev[j % 2].synchronize()
            b = L.pair[j % 2]
            got = 0
            while got < span:
                n = os.preadv(fd, [memoryview(b)[got:span]], off + got)
                got += n
                if n == 0 or got % B: break
            target.set(b[skip:skip + length], stream=L.stream); L.ev[j % 2] = L.stream.record(); j += 1
        L.stream.synchronize()


def py_whole():
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.path.getsize(path)
    chunks = [(fd, o, min(CH, -(-(size - o) // B) * B), 0, min(CH, size - o), dev[o:o + min(CH, size - o)])
              for o in range(0, size, CH)]
    list(pool.map(run, [chunks[k::16] for k in range(16)])); os.close(fd)


def py_tensors():
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    chunks = []
    for k, s in zip(keys, starts):
        flat = cupy.asarray(pre[k]).reshape(-1).view(cupy.uint8) if pre[k].dtype != torch.bfloat16 else \
            cupy.asarray(pre[k].view(torch.int16)).reshape(-1).view(cupy.uint8)
        n = flat.nbytes
        for c in range(0, n, CH):
            length = min(CH, n - c); pos = s + c; al = pos - pos % B; skip = pos - al
            chunks.append((fd, al, -(-(skip + length) // B) * B, skip, length, flat[c:c + length]))
    list(pool.map(run, [chunks[k::16] for k in range(16)])); os.close(fd)


def readmany():
    fd = os.open(path, os.O_RDONLY)
    _transfer.read_many(fd, requests, path=path, with_checksum=False, tool=arm(16, 16))
    os.close(fd)


variants = {
    "load": lambda: arrayio.load(path, like="torch", device="cuda", tool=arm(16, 16)),
    "load_noverify": lambda: arrayio.load(path, like="torch", device="cuda", tool=arm(16, 16), verify=False),
    "readmany": readmany,
    "py_whole": py_whole,
    "py_tensors": py_tensors,
    "load_8x64": lambda: arrayio.load(path, like="torch", device="cuda", tool=arm(8, 64)),
    "load_16x64": lambda: arrayio.load(path, like="torch", device="cuda", tool=arm(16, 64)),
}
for fn in variants.values():  # warm every code path once (allocations, pinned buffers)
    fn(); h.settle()
res = {"bytes": nbytes, "tensors": len(keys), "rounds": {}}
names = list(variants)
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
        h.evict(path, True)
        t = time.perf_counter(); o = variants[name](); torch.cuda.synchronize(); s = time.perf_counter() - t
        del o
        res["rounds"].setdefault(name, []).append(round(nbytes / s / 1e9, 3))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
    json.dump(res, open(out, "w"), indent=1)
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
print(json.dumps(res["median"], indent=1)); json.dump(res, open(out, "w"), indent=1)
# correctness of the hand readers
py_tensors(); torch.cuda.synchronize()
print("py_tensors exact:", all(torch.equal(pre[k], state[k]) for k in keys))
h.remove(d)
