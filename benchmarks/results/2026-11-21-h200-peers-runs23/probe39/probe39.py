"""Probe 39 (2026-11-21): does reserving a save's blocks first slow it on the H200 VM?

Probe 38: in save phases (files kept until the phase ends), arrayio.save with the staged tool
forced ran at 0.87 of a raw O_DIRECT writer into a new file (medians of 11: 4 x 64 MiB 2.05,
1 x 64 MiB 2.04, raw 1 x 64 MiB 2.36 GB/s). The raw writer kept the disk busy 0.99 of the
time with 16 requests of 3.99 MiB in flight; the 4 x 64 MiB save 0.97 with 21 of 3.8 MiB
(its blocks reserved first, so its writers overlap), the 1 x 64 MiB save 0.92 with 15 (one
worker checksums each chunk between its writes). Here, in the same phases: saves with and
without the reservation (4, 2 and 1 workers of 64 MiB), and the raw writer with 1 and 4
threads into new files (ext4 runs 4 unreserved writers one at a time). Plus discard
counters: the file system is mounted with ``discard``."""
import json, os, random, sys, threading, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
from benchmarks import _ceiling_tools
import arrayio
import arrayio.tools.staged as staged_mod
import arrayio.dispatch.dispatcher as disp_mod
from arrayio._buffers import aligned_empty

out, gib, budget = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
t_start = time.time()
d = "/tmp/probe39"; h.remove(d); os.makedirs(d, exist_ok=True)
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
nbytes = sum(v.numel() * v.element_size() for v in state.values())
host = aligned_empty(-(-nbytes // (1 << 20)) * (1 << 20))
host[:] = np.random.default_rng(0).integers(0, 256, host.nbytes, dtype=np.uint8)
ceil_tool = _ceiling_tools.make("direct", 1, 64 << 20)
ceil4_tool = _ceiling_tools.make("direct", 4, 64 << 20)
A4 = "staged(chunk_size=67108864,direct=True,threads=4)"
A2 = "staged(chunk_size=67108864,direct=True,threads=2)"
A1 = "staged(chunk_size=67108864,direct=True,threads=1)"

st = os.stat(d)
devno = f"{os.major(st.st_dev)} {os.minor(st.st_dev)}"
vfs = os.statvfs(d)
free_gb = vfs.f_bavail * vfs.f_frsize / 1e9


def diskstats():
    for line in open("/proc/diskstats"):
        f = line.split()
        if f"{f[0]} {f[1]}" == devno:
            return [int(x) for x in f[3:]]
    return None


def meminfo():
    got = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":")
        if k in ("MemFree", "Cached", "Dirty", "Writeback", "MemAvailable"):
            got[k] = int(v.split()[0]) >> 20  # GiB
    return got


# Timeline hooks (this probe only).
events = []
lock = threading.Lock()
real_direct = staged_mod._pwrite_direct
real_prealloc = disp_mod.preallocate
real_fsync = os.fsync


def timed_direct(fd, view, off):
    t0 = time.perf_counter(); real_direct(fd, view, off)
    with lock:
        events.append(("w", t0, time.perf_counter(), view.nbytes))


RESERVE = [True]


def timed_prealloc(fd, off, n):
    if not RESERVE[0]:
        return False
    t0 = time.perf_counter(); r = real_prealloc(fd, off, n)
    with lock:
        events.append(("prealloc", t0, time.perf_counter(), n))
    return r


def timed_fsync(fd):
    t0 = time.perf_counter(); real_fsync(fd)
    with lock:
        events.append(("fsync", t0, time.perf_counter(), 0))


staged_mod._pwrite_direct = timed_direct
disp_mod.preallocate = timed_prealloc
os.fsync = timed_fsync


def ceiling(tool):
    def go(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            tool.write(fd, host, 0); os.fsync(fd)
        finally:
            os.close(fd)
    return go


def save(tool, reserve):
    def go(path):
        RESERVE[0] = reserve
        try:
            arrayio.save(path, state, tool=tool); h.fsync_tree(path)
        finally:
            RESERVE[0] = True
    return go


writers = {"res4x64": (save(A4, True), "r4.safetensors"),
           "unres4x64": (save(A4, False), "u4.safetensors"),
           "unres2x64": (save(A2, False), "u2.safetensors"),
           "unres1x64": (save(A1, False), "u1.safetensors"),
           "ceil1x64": (ceiling(ceil_tool), "c1.bin"), "ceil4x64": (ceiling(ceil4_tool), "c4.bin")}
res = {"argv": sys.argv, "bytes": nbytes, "free_GB_at_start": round(free_gb, 1),
       "commit": open(".devrun/commit.txt").read().strip(), "samples": []}
print("free GB", free_gb, "bytes", nbytes, flush=True)
# one untimed, checked save of each forced arm first (CUDA contexts, pinned buffers)
for tool in (A4, A2, A1):
    p = f"{d}/warm.safetensors"; arrayio.save(p, state, tool=tool)
    h.remove(p)
rng = random.Random(38)
phase = 0
per_phase = 35.0
while time.time() - t_start + per_phase < budget:
    for name in list(os.listdir(d)):
        h.remove(f"{d}/{name}")
    h.fsync_tree(d)
    order = list(writers); rng.shuffle(order)
    t_phase = time.time()
    fd = os.open(f"{d}/lead-in.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    ceil_tool.write(fd, host[: 2 << 30], 0); real_fsync(fd); os.close(fd)
    for pos, name in enumerate(order):
        fn, fname = writers[name]
        path = f"{d}/{fname or f'new{phase}.bin'}"
        m0 = meminfo(); s0 = diskstats()
        with lock:
            events.clear()
        t0 = time.perf_counter(); fn(path); t1 = time.perf_counter()
        s1 = diskstats()
        with lock:
            ev = list(events)
        sec = t1 - t0
        row = {"phase": phase, "pos": pos, "name": name, "before": order[:pos], "s": round(sec, 3),
               "GBps": round(nbytes / sec / 1e9, 3), "mem_GiB": m0}
        if s0 and s1:
            dd = [b - a for a, b in zip(s0, s1)]
            row.update(busy=round(dd[9] / 1000 / sec, 3), inflight=round(dd[10] / 1000 / sec, 2),
                       writes=dd[4], write_MiB=round(dd[6] * 512 / max(1, dd[4]) / 2**20, 2))
            if len(dd) >= 15:
                row.update(discards=dd[11], discard_GB=round(dd[13] * 512 / 1e9, 2),
                           discard_ms=dd[14])
        ws = [e for e in ev if e[0] == "w"]
        if ws:
            first = min(e[1] for e in ws); last = max(e[2] for e in ws)
            row.update(to_first_write_ms=round((first - t0) * 1e3, 1),
                       after_last_write_ms=round((t1 - last) * 1e3, 1),
                       span_GBps=round(sum(e[3] for e in ws) / (last - first) / 1e9, 3),
                       direct_bytes=sum(e[3] for e in ws))
        row["prealloc_ms"] = [round((e[2] - e[1]) * 1e3, 1) for e in ev if e[0] == "prealloc"]
        row["fsync_ms"] = [round((e[2] - e[1]) * 1e3, 1) for e in ev if e[0] == "fsync"]
        res["samples"].append(row)
        print({k: v for k, v in row.items() if k != "before"}, flush=True)
        json.dump(res, open(out, "w"), indent=1)
    per_phase = max(per_phase, time.time() - t_phase + 5)
    phase += 1
summary = {}
for name in writers:
    v = sorted(x["GBps"] for x in res["samples"] if x["name"] == name)
    early = sorted(x["GBps"] for x in res["samples"] if x["name"] == name and x["pos"] == 0)
    summary[name] = {"median": v[len(v) // 2] if v else None, "samples": v, "first": early}
res["summary"] = summary
json.dump(res, open(out, "w"), indent=1)
for k, v in summary.items():
    print(f"{k:12s} {v['median']}  all {v['samples']}")
h.remove(d)
