"""Cold 1 GiB checkpoint loads with the small arrays read beside the batch (side threads)
against one after another before it (the previous behaviour), alternating, after tune."""
import concurrent.futures, json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import arrayio
from arrayio.dispatch import dispatcher as dispatch
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
os.makedirs(out, exist_ok=True)
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="p13-", dir="/tmp")
arr = os.path.join(d, "a.safetensors"); arrayio.save(arr, state)
arrayio.tune(d, device="cuda", sizes=[nbytes])

class Inline(concurrent.futures.Executor):
    def submit(self, fn, *a, **k):
        f = concurrent.futures.Future()
        try:
            f.set_result(fn(*a, **k))
        except BaseException as e:
            f.set_exception(e)
        return f

real = dispatch.Dispatcher._side_executor
def variant(side):
    dispatch.Dispatcher._side_executor = real if side else (lambda self: Inline())
    h.evict(arr, True)
    t = time.perf_counter(); o = arrayio.load(arr, like="torch", device="cuda"); h.settle(); s = time.perf_counter() - t
    del o
    return round(nbytes / s / 1e9, 3)
for v in (True, False):
    variant(v)
res = {"side": [], "serial": []}
for r in range(rounds):
    for v in ((True, False) if r % 2 == 0 else (False, True)):
        res["side" if v else "serial"].append(variant(v))
    print(r, {k: x[-1] for k, x in res.items()}, flush=True)
res["median"] = {k: statistics.median(v) for k, v in res.items()}
res["paired_side_over_serial"] = statistics.median(a / b for a, b in zip(res["side"], res["serial"]))
json.dump(res, open(os.path.join(out, "probe13.json"), "w"), indent=1)
print(json.dumps({k: res[k] for k in ("median", "paired_side_over_serial")}))
h.remove(d)
