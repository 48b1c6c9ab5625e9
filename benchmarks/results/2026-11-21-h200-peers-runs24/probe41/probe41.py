"""Probe 41: where an 8 GiB warm load to the GPU spends the time that raw KvikIO does not.

Run from the repository root: python3 .devrun/probe41.py OUT.json GIB
Every figure is a warm load (file read twice through the page cache first, as the benchmark
does), arrayio forced to the arm the checkpoint run tuned for warm reads (KvikIO, 16 threads,
4 MiB tasks) through the policy only, so that small arrays still take the naive bypass.
"""
import cProfile, io, json, os, pstats, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio.dispatch import dispatcher as dmod, batches
from arrayio import _reader, _transfer, _frameworks
from arrayio.tools import kvikio as kmod

out_path, gib = sys.argv[1], float(sys.argv[2])
ents = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(ents, "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values())
d = tempfile.mkdtemp(prefix="p41-", dir="/tmp")
apath = os.path.join(d, "a.safetensors"); kpath = os.path.join(d, "k.bin")
arrayio.save(apath, state)
kpeer = ck.kvikio_peer(state)
kpeer.save(kpath)
h.settle()
ARM = dmod.parse_arm("kvikio(task_size=4194304,threads=16)")
disp = dmod.get()
orig_run = disp.policy.run
def forced_run(context, n, operation, *, force=None):
    if force is None and context.direction == "read" and n >= dmod.SMALL_TRANSFER:
        force = ARM
    return orig_run(context, n, operation, force=force)
disp.policy.run = forced_run

res = {"gib": gib, "bytes": nbytes, "tensors": len(state), "samples": {}, "phases": {}}

def aio_load(**kw):
    o = arrayio.load(apath, like="torch", device="cuda", **kw); h.settle(); return o

def timed(name, fn, path, n=5):
    xs = []
    for _ in range(n):
        h.warm(path)
        t = time.perf_counter(); o = fn(); s = time.perf_counter() - t
        del o
        xs.append(s)
    res["samples"][name] = xs
    print(f"{name:28s} median {statistics.median(xs)*1e3:7.1f} ms  {nbytes/statistics.median(xs)/1e9:6.2f} GB/s  {[round(x*1e3,1) for x in xs]}", flush=True)

# warm the code paths
for _ in range(2):
    h.warm(apath); aio_load(); h.warm(kpath); kpeer.load(kpath)
print("last arm", disp.last_batch, flush=True)

for rep in range(2):
    timed(f"kvikio raw #{rep}", lambda: kpeer.load(kpath), kpath)
    timed(f"arrayio #{rep}", aio_load, apath)
    timed(f"arrayio verify=False #{rep}", lambda: aio_load(verify=False), apath)
old = batches.BATCH_WINDOW
batches.BATCH_WINDOW = 1024
timed("arrayio window 1024", aio_load, apath)
batches.BATCH_WINDOW = old

# phases, by wrapping (adds a little)
acc = {}
def wrap(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            e = acc.setdefault(label, [0.0, 0]); e[0] += time.perf_counter() - t; e[1] += 1
    setattr(owner, name, w)
    return f
saved = [(o, n, wrap(o, n, l)) for o, n, l in [
    (_reader.Reader, "__init__", "open+header"),
    (_reader.Reader, "_allocate_batch", "allocate"),
    (_reader.Reader, "_read_batch", "read_batch(incl finish)"),
    (_reader._transfer, "read_many", "read_many"),
    (dmod.Dispatcher, "_read_run", "small runs"),
    (dmod.Dispatcher, "_one", "single transfers"),
    (dmod.Dispatcher, "_batch", "batch"),
    (batches, "submit_windowed", "submit_windowed"),
    (batches, "_merged", "merge crcs (gpu wait)"),
    (kmod.KvikioTool, "_open", "kvikio _open"),
    (kmod._Future, "get", "kvikio future get"),
]]
phases = []
for _ in range(3):
    acc.clear(); h.warm(apath)
    t = time.perf_counter(); o = aio_load(); s = time.perf_counter() - t; del o
    phases.append({"total": s, **{k: v[0] for k, v in acc.items()}, "counts": {k: v[1] for k, v in acc.items()}})
    print("phases", round(s * 1e3, 1), {k: (round(v[0] * 1e3, 1), v[1]) for k, v in acc.items()}, flush=True)
res["phases"] = phases
for o, n, f in saved:
    setattr(o, n, f)

# cost of a KvikIO file open as arrayio's tool does it, 702 times
import kvikio
fd = os.open(apath, os.O_RDONLY)
t = time.perf_counter()
for _ in range(len(state)):
    kvikio.CuFile(os.readlink(f"/proc/self/fd/{fd}"), "r").close()
res["open_702_s"] = time.perf_counter() - t
os.close(fd)
print("702 CuFile opens", round(res["open_702_s"] * 1e3, 1), "ms", flush=True)

# allocation alone
import torch
t = time.perf_counter()
bufs = [torch.empty(v.numel() * v.element_size(), dtype=torch.uint8, device="cuda") for v in state.values()]
torch.cuda.synchronize(); res["torch_alloc_s"] = time.perf_counter() - t; del bufs
print("torch allocs", round(res["torch_alloc_s"] * 1e3, 1), "ms", flush=True)

pr = cProfile.Profile(); h.warm(apath)
pr.enable(); o = aio_load(); pr.disable(); del o
st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(30)
res["profile"] = st.getvalue()
print(st.getvalue()[-6000:])
json.dump(res, open(out_path, "w"), indent=1)
h.remove(d)
