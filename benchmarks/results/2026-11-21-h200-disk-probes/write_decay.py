"""How does the VM's write rate decay with back-to-back 1 GiB writes, and recover with pauses?"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
from arrayio import tools
from arrayio._buffers import aligned_empty
GiB = 1 << 30
d = sys.argv[1]; out = sys.argv[2]; os.makedirs(d, exist_ok=True)
host = aligned_empty(GiB); host[:] = 3
tool = tools.make("direct", threads=4, task_size=64 << 20)
path = os.path.join(d, "w.bin"); res = {}
def w():
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter(); tool.write(fd, host, 0); os.fsync(fd); s = time.perf_counter() - t
    os.close(fd); return round(GiB / s / 1e9, 2)
res["back_to_back"] = [w() for _ in range(24)]; print(res, flush=True)
for pause in (1, 3, 8):
    got = []
    for _ in range(4):
        time.sleep(pause); got.append(w())
    res[f"pause_{pause}s"] = got; print(pause, got, flush=True)
res["back_to_back_again"] = [w() for _ in range(6)]
print(res, flush=True); json.dump(res, open(out, "w"))
os.unlink(path)
