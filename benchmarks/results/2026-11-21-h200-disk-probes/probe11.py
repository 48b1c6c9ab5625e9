"""Cold loads without tune and after tune: which arm, which estimates, under rotating disk
conditions (after a write, after a read, after a pause)."""
import json, os, shutil, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import numpy as np
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty
from arrayio.dispatch import dispatcher as dispatch
from benchmarks._pagecache import evict
from benchmarks.peers import checkpoint as ck, _harness as h

out = sys.argv[1]; os.makedirs(out, exist_ok=True)
MiB = 1 << 20
res = {}
d = tempfile.mkdtemp(prefix="p11-", dir="/tmp")
host = aligned_empty(1 << 30); host[:] = 7
data = os.path.join(d, "data.bin"); other = os.path.join(d, "other.bin")
with open(data, "wb") as f:
    f.write(host); f.flush(); os.fsync(f.fileno())
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
arr = os.path.join(d, "a.safetensors"); arrayio.save(arr, state)
wt = tools.make("direct", threads=4, task_size=64 * MiB)
rt = tools.make("direct", threads=16, task_size=16 * MiB)

def before(cond):
    if cond == "after_write":
        fdw = os.open(other, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); wt.write(fdw, host, 0); os.fsync(fdw); os.close(fdw)
    elif cond == "after_read":
        evict(data, True); fdr = os.open(data, os.O_RDONLY); rt.read(fdr, host, 0); os.close(fdr)
    elif cond == "after_pause":
        time.sleep(3)

def load_once(cond, tag):
    before(cond); evict(arr, True)
    t = time.perf_counter(); o = arrayio.load(arr, like="torch", device="cuda"); h.settle(); s = time.perf_counter() - t
    del o
    last = _big[-1] if _big else (None, None)
    res.setdefault(tag, []).append({"cond": cond, "GBps": round(nbytes / s / 1e9, 3),
                                    "arm": last[1], "context": last[0]})
    print(tag, res[tag][-1], flush=True)

def raw_once(cond, tag):
    before(cond); evict(data, True)
    fdr = os.open(data, os.O_RDONLY); t = time.perf_counter(); rt.read(fdr, host, 0); s = time.perf_counter() - t; os.close(fdr)
    res.setdefault(tag, []).append({"cond": cond, "GBps": round((1 << 30) / s / 1e9, 3)})

_big = []
_orig_batch = dispatch.Dispatcher._batch
def _batch(self, direction, fd, batch, *a, **k):
    r = _orig_batch(self, direction, fd, batch, *a, **k)
    if sum(b.nbytes for _, b in batch) > (256 << 20):
        _big.append((self.last[0].key(), self.last[1].label))
    return r
dispatch.Dispatcher._batch = _batch

conds = ("after_write", "after_read", "after_pause")
for phase in ("untuned", "tuned"):
    if phase == "tuned":
        dispatch.reset()
        shutil.rmtree(os.environ["ARRAYIO_CACHE_DIR"], ignore_errors=True)
        t = time.perf_counter()
        rep = arrayio.tune(d, device="cuda", sizes=[nbytes])
        res["tune_seconds"] = round(time.perf_counter() - t, 1)
        res["tuned"] = {e.key: e.chosen for e in rep.explanations}
        print("tuned", res["tuned"], flush=True)
    for r in range(6 if phase == "untuned" else 4):
        for cond in conds[r % 3:] + conds[:r % 3]:
            load_once(cond, f"{phase}_aio")
            if phase == "tuned":
                raw_once(cond, "raw")
    res[f"{phase}_explain"] = [e.as_dict() for e in arrayio.explain().explanations if "/cold/" in e.key] if hasattr(arrayio.explain(), "explanations") else str(arrayio.explain())
    print(json.dumps(res[f"{phase}_explain"])[:3000], flush=True)
    json.dump(res, open(os.path.join(out, "probe11.json"), "w"), indent=1)
summary = {}
for tag in ("untuned_aio", "tuned_aio", "raw"):
    for cond in conds:
        v = [x["GBps"] for x in res.get(tag, []) if x["cond"] == cond]
        if v: summary[f"{tag}_{cond}"] = statistics.median(v)
res["summary"] = summary
json.dump(res, open(os.path.join(out, "probe11.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
shutil.rmtree(d, ignore_errors=True)
