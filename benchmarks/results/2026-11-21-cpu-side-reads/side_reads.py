import concurrent.futures, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import numpy as np
from safetensors.numpy import save_file
import arrayio
from arrayio.dispatch import dispatcher as dispatch
from benchmarks._pagecache import evict
rng = np.random.default_rng(0)
t = {}
for i in range(24):
    t[f"layers.{i:02d}.w"] = rng.standard_normal((512, 1024), dtype=np.float32)  # 2 MiB
    t[f"layers.{i:02d}.b"] = rng.standard_normal(1024, dtype=np.float32)          # 4 KiB
    t[f"layers.{i:02d}.norm"] = rng.standard_normal(2048, dtype=np.float32)       # 8 KiB
d = tempfile.mkdtemp(dir="/work/tmp" if os.path.isdir("/work/tmp") else None)
p = os.path.join(d, "hf.safetensors"); save_file(t, p)
class Inline(concurrent.futures.Executor):
    def submit(self, fn, *a, **k):
        f = concurrent.futures.Future(); f.set_result(fn(*a, **k)); return f
real = dispatch.Dispatcher._side_executor
def once(side):
    dispatch.Dispatcher._side_executor = real if side else (lambda self: Inline())
    evict(p)
    s = time.perf_counter(); arrayio.load(p); return time.perf_counter() - s
for v in (1, 0): once(v)
r = {1: [], 0: []}
for i in range(10):
    for v in ((1, 0) if i % 2 else (0, 1)):
        r[v].append(once(v))
print("side ms", [round(x*1e3,1) for x in r[1]]); print("serial ms", [round(x*1e3,1) for x in r[0]])
print("median side/serial ms", round(statistics.median(r[1])*1e3,1), round(statistics.median(r[0])*1e3,1))
