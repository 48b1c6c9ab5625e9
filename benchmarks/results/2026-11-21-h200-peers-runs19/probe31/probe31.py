"""Probe 31 (2026-11-21): where an 8 GiB checkpoint save loses against the raw write
ceiling (runs 18 and 19: arrayio's saves at 0.85 and 0.81 of it).  Interleaved, each to a
fresh file, fsync included: the ceiling's host O_DIRECT write (1 and 4 threads x 64 MiB),
the staged tool writing one 8 GiB device buffer (4 x 64 MiB, O_DIRECT, no tensor
boundaries), and arrayio.save of the 702-tensor state through that same tool."""
import json, os, random, sys, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio import tools
from arrayio._buffers import CupyDeviceBuffer, aligned_empty

out, gib, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
nbytes = sum(t.numel() * t.element_size() for t in state.values())
n = -(-nbytes // (1 << 20)) * (1 << 20)
host = aligned_empty(n)
block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
for start in range(0, n, block.nbytes):
    host[start:start + block.nbytes] = block[: min(block.nbytes, n - start)]
big = cupy.asarray(host)
TOOL = "staged(chunk_size=67108864,direct=True,threads=4)"
d = "/tmp/probe31"; os.makedirs(d, exist_ok=True)
path = f"{d}/f.bin"
t1 = tools.make("direct", threads=1, task_size=64 << 20)
t4 = tools.make("direct", threads=4, task_size=64 << 20)
st = tools.make("staged", threads=4, chunk_size=64 << 20, direct=True)


def raw(tool, buf):
    def go():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            tool.write(fd, buf, 0); os.fsync(fd)
        finally:
            os.close(fd)
    return go


kinds = {"ceiling-1x64": raw(t1, host), "ceiling-4x64": raw(t4, host),
         "staged-one-buffer": raw(st, CupyDeviceBuffer(big)),
         "arrayio-save": lambda: (arrayio.save(path, state, tool=TOOL), h.fsync_tree(path))}
res = {"argv": sys.argv, "bytes": {"state": nbytes, "host": n}, "samples": []}
rng = random.Random(31)
for r in range(reps):
    order = list(kinds); rng.shuffle(order)
    for k in order:
        h.remove(path); h.fsync_tree(d)
        t = time.perf_counter(); kinds[k](); s = time.perf_counter() - t
        size = nbytes if k == "arrayio-save" else n
        res["samples"].append({"round": r, "kind": k, "s": round(s, 3), "GBps": round(size / s / 1e9, 3)})
        print(res["samples"][-1], flush=True)
        json.dump(res, open(out, "w"), indent=1)
h.remove(d)
