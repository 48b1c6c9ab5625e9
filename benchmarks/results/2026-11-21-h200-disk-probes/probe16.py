"""Small reads beside the batch, on a file where they lie between the large tensors: the 1 GiB
checkpoint written by safetensors' own save_file (sorted by dtype, then name), cold loads
alternating with the side threads and without them (one after another before the batch)."""
import concurrent.futures, json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
from safetensors.torch import save_file
import arrayio
from arrayio.dispatch import dispatcher as dispatch
from arrayio.formats import safetensors as st
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
os.makedirs(out, exist_ok=True)
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="p16-", dir="/tmp")
p = os.path.join(d, "hf.safetensors"); save_file(state, p); h.fsync_tree(p)
arrayio.tune(d, device="cuda", sizes=[nbytes], directions=("read",), caches=("cold",))

class Inline(concurrent.futures.Executor):
    def submit(self, fn, *a, **k):
        f = concurrent.futures.Future(); f.set_result(fn(*a, **k)); return f

real = dispatch.Dispatcher._side_executor
def once(side):
    dispatch.Dispatcher._side_executor = real if side else (lambda self: Inline())
    h.evict(p, True)
    t = time.perf_counter(); o = arrayio.load(p, like="torch", device="cuda"); h.settle(); s = time.perf_counter() - t
    del o
    return round(nbytes / s / 1e9, 3)
for v in (True, False):
    once(v)
res = {"side": [], "serial": []}
for r in range(rounds):
    for v in ((True, False) if r % 2 == 0 else (False, True)):
        res["side" if v else "serial"].append(once(v))
    print(r, {k: x[-1] for k, x in res.items()}, flush=True)
res["median"] = {k: statistics.median(v) for k, v in res.items()}
res["paired_side_over_serial"] = statistics.median(a / b for a, b in zip(res["side"], res["serial"]))
json.dump(res, open(os.path.join(out, "probe16.json"), "w"), indent=1)
print(json.dumps({k: res[k] for k in ("median", "paired_side_over_serial")}))
h.remove(d)
