"""Probe 30 (2026-11-21): is the checkpoint harness's warm load slower than a quiet
process's (probe 28: raw KvikIO 245 against 190 ms for 8 GiB) because the harness's
``warm()`` reads a file into the page cache only once after the cold phase dropped every
cache?  The timed load is then the second access of every page, which moves it to the
active LRU list.  Conditions, each after ``echo 3 > drop_caches``: ``once`` (one ``warm``
pass, the harness today) and ``twice`` (two passes).  Loads: the harness's raw KvikIO peer,
arrayio like torch through the tuned tool, and the warm ceiling's host read (posix, 16
threads x 16 MiB).  /proc/vmstat deltas across each timed load."""
import json, os, random, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty

out, gib, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
res = {"argv": sys.argv, "uname": os.uname().release}
for name in ("/sys/kernel/mm/lru_gen/enabled", "/sys/kernel/mm/transparent_hugepage/enabled"):
    try:
        res[name] = open(name).read().strip()
    except OSError as e:
        res[name] = repr(e)
print(res, flush=True)
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="probe30-", dir="/tmp")
paths = {"arrayio": f"{d}/a.safetensors", "kvikio": f"{d}/k.bin"}
arrayio.save(paths["arrayio"], state, tool="staged(chunk_size=33554432,direct=True,threads=8)")
kv = ck.kvikio_peer(state); kv.save(paths["kvikio"])
TOOL = "kvikio(task_size=4194304,threads=16)"
host = aligned_empty(-(-os.path.getsize(paths["arrayio"]) // (1 << 20)) * (1 << 20))
host[:] = 1
posix = tools.make("posix", threads=16, task_size=16 << 20)


def ceiling_read():
    fd = os.open(paths["arrayio"], os.O_RDONLY)
    try:
        posix.read(fd, host[: os.path.getsize(paths["arrayio"])], 0)
    finally:
        os.close(fd)


loads = {
    "kvikio-peer": ("kvikio", lambda: kv.load(paths["kvikio"])),
    "arrayio-torch": ("arrayio", lambda: arrayio.load(paths["arrayio"], like="torch", device="cuda", tool=TOOL)),
    "ceiling-host": ("arrayio", ceiling_read),
}
KEYS = ("pgactivate", "pgdeactivate", "pgrefill", "workingset_activate_file", "pgscan_kswapd",
        "pgsteal_kswapd", "thp_fault_alloc", "pgfault", "pgmajfault")


def vmstat():
    out = {}
    for line in open("/proc/vmstat"):
        k, v = line.split()
        out[k] = int(v)
    return out


res["loads"] = []
rng = random.Random(30)
for r in range(reps + 1):
    jobs = [(c, l) for c in ("once", "twice") for l in loads]
    rng.shuffle(jobs)
    for cond, load in jobs:
        which, fn = loads[load]
        h.evict(paths[which], True)
        for _ in range(1 if cond == "once" else 2):
            h.warm(paths[which])
        before = vmstat()
        t = time.perf_counter(); o = fn(); h.settle(); s = time.perf_counter() - t
        after = vmstat()
        del o
        if r:
            row = {"round": r, "cond": cond, "load": load, "ms": round(1e3 * s, 1),
                   "GBps": round(nbytes / s / 1e9, 2),
                   **{k: after.get(k, 0) - before.get(k, 0) for k in KEYS}}
            res["loads"].append(row)
            print(row, flush=True)
res["median_GBps"] = {f"{l}/{c}": statistics.median(x["GBps"] for x in res["loads"] if x["load"] == l and x["cond"] == c)
                      for l in loads for c in ("once", "twice")}
print(json.dumps(res["median_GBps"], indent=1), flush=True)
json.dump(res, open(out, "w"), indent=1)
h.remove(d)
