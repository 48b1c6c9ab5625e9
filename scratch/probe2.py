import os, sys, subprocess
sys.path.insert(0, os.getcwd())
d = "/tmp/probe"; os.makedirs(d, exist_ok=True)
from benchmarks import first_calls as fc
if not os.path.exists(f"{d}/model.safetensors"):
    fc.write_files(fc.make_state(fc.layout(int(1.5 * (1 << 30)), 2048, 32000)), d)
for name in ("model.safetensors", "model-arrayio.safetensors"):
    for _ in range(2):
        with open(f"{d}/{name}", "rb") as f:
            while f.read(64 << 20): pass
CODE = r'''
import time, os, sys, cProfile, pstats, io, tempfile
like, path, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.environ["ARRAYIO_CACHE_DIR"] = tempfile.mkdtemp()
if like == "torch":
    import torch; torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    sync = lambda out: torch.cuda.synchronize()
else:
    import jax, numpy as np; jax.block_until_ready(jax.device_put(np.zeros(1, np.float32), jax.devices()[0]))
    sync = lambda out: jax.block_until_ready(list(out.values()))
import arrayio
size = os.path.getsize(path)
out = None
for c in range(1, calls + 1):
    out = None
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    out = arrayio.load(path, like=like, device="cuda"); sync(out)
    pr.disable(); s = time.perf_counter() - t
    print(f"== {like} call {c}: {s*1e3:.1f} ms {size/s/1e9:.2f} GB/s")
    if c in (1, 2):
        st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(14); print(st.getvalue()[-3500:])
'''
for like, name, calls in (("torch", "model.safetensors", 3), ("jax", "model-arrayio.safetensors", 3)):
    r = subprocess.run([sys.executable, "-c", CODE, like, f"{d}/{name}", str(calls)], capture_output=True, text=True)
    print(r.stdout[-9000:], r.stderr[-2000:])
