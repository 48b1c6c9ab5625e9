"""Probe 36 (2026-11-21): is a save right after torch.save slower, and why?

In runs 16 to 21, the torch front door's 8 GiB saves ran at 0.76 of the run's write ceiling
(mean of 4) when torch.save came right before, 0.93 after another O_DIRECT writer, 1.0 as
the first of a phase; the ceiling itself after torch.save ran at 1.0 (2 samples). Pairs,
shuffled in each round: an untimed predecessor (torch.save, the ceiling's raw write, or
nothing but a pause), then a timed target (arrayio.save of the torch tensors, of CuPy
views of them, or the ceiling's write). Every file fsynced, the predecessor's file kept
until the target is done (as in a round). For each timed sample, /proc/diskstats of the
file's disk: busy fraction, mean requests in flight, mean write size. The dispatcher is
tuned for the save first (writes only), as the checkpoint harness does."""
import json, os, random, sys, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
from benchmarks import _ceiling_tools
import arrayio
from arrayio._buffers import aligned_empty

out, gib, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
d = "/tmp/probe36"; os.makedirs(d, exist_ok=True)
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
views = {k: cupy.from_dlpack(v) for k, v in state.items()}
nbytes = sum(v.numel() * v.element_size() for v in state.values())
host = aligned_empty(-(-nbytes // (1 << 20)) * (1 << 20))
host[:] = np.random.default_rng(0).integers(0, 256, host.nbytes, dtype=np.uint8)
ceiling_tool = _ceiling_tools.make("direct", 4, 64 << 20)

st = os.stat(d)
devno = f"{os.major(st.st_dev)} {os.minor(st.st_dev)}"


def diskstats():
    for line in open("/proc/diskstats"):
        f = line.split()
        if f"{f[0]} {f[1]}" == devno:
            return f[2], [int(x) for x in f[3:14]]
    return None, None


def ceiling(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        ceiling_tool.write(fd, host, 0); os.fsync(fd)
    finally:
        os.close(fd)


def save(tree):
    def go(path):
        arrayio.save(path, tree); h.fsync_tree(path)
    return go


before = {"torch.save": lambda p: (torch.save(state, p), h.fsync_tree(p)),
          "ceiling": ceiling, "pause-5s": lambda p: time.sleep(5)}
after = {"arrayio(torch)": save(state), "arrayio(cupy)": save(views), "ceiling": ceiling}
pairs = [("torch.save", "arrayio(torch)"), ("torch.save", "arrayio(cupy)"),
         ("torch.save", "ceiling"), ("ceiling", "arrayio(torch)"),
         ("ceiling", "ceiling"), ("pause-5s", "arrayio(torch)"),
         ("torch.save", "pause-5s+arrayio(torch)")]
res = {"argv": sys.argv, "bytes": nbytes, "disk": None, "samples": []}
t = time.perf_counter()
tuned = arrayio.tune(d, device="cuda", sizes=(), directions=("write",), arrays=state)
res["tune_s"] = round(time.perf_counter() - t, 1)
res["tuned"] = {e.key: e.chosen for e in tuned.explanations}
print("tuned", res["tune_s"], res["tuned"], flush=True)
rng = random.Random(36)
for r in range(reps + 1):
    order = list(pairs); rng.shuffle(order)
    for first, second in order:
        p1, p2 = f"{d}/a.bin", f"{d}/b.safetensors"
        h.remove(p1); h.remove(p2); h.fsync_tree(d)
        before[first](p1)
        if second.startswith("pause-5s+"):
            time.sleep(5)
        name, s0 = diskstats()
        t = time.perf_counter(); after[second.split("+")[-1]](p2); s = time.perf_counter() - t
        _, s1 = diskstats()
        row = {"round": r, "before": first, "target": second, "s": round(s, 3),
               "GBps": round(nbytes / s / 1e9, 3)}
        if s0:
            dd = [b - a for a, b in zip(s0, s1)]
            res["disk"] = name
            row.update(busy=round(dd[9] / 1000 / s, 3), inflight=round(dd[10] / 1000 / s, 2),
                       write_MiB=round(dd[6] * 512 / max(1, dd[4]) / 2**20, 2),
                       writes=dd[4])
        res["samples"].append(row)
        print(row, flush=True)
        json.dump(res, open(out, "w"), indent=1)
        h.remove(p1); h.remove(p2)
summary = {}
for first, second in pairs:
    v = sorted(x["GBps"] for x in res["samples"] if x["before"] == first
               and x["target"] == second)
    summary[f"{first} -> {second}"] = {"median": v[len(v) // 2], "samples": v}
res["summary"] = summary
json.dump(res, open(out, "w"), indent=1)
for k, v in summary.items():
    print(f"{k:40s} {v['median']:.3f}  {v['samples']}")
h.remove(d)
