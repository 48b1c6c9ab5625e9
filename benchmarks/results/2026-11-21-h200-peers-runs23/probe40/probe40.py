"""Probe 40 (2026-11-21): do the save's pinned staging buffers (4 KiB pages) make its
O_DIRECT writes slower than the raw writer's (a NumPy buffer NumPy backs with transparent
huge pages, THP being ``madvise`` on the H200 VM)?

Probes 38 and 39: in save phases with torch.save among the writers, arrayio.save (staged,
4 x 64 MiB, forced) ran at 0.87 of a raw O_DIRECT writer into a new file; in phases of
O_DIRECT writers alone, at 0.97. The disk was as busy during a save (0.97) as during the raw
write (0.99), but a save's requests averaged 3.5 to 3.85 MiB against the raw writer's 3.9 to
4.0: a 4 KiB-paged buffer gives the block layer a segment per page.

Phases as in probe 38 (files kept until the phase ends, a 2 GiB lead-in), shuffled:
  save       arrayio.save, staged 4 x 64 MiB O_DIRECT, its pinned buffers from CuPy
  save-thp   the same, its buffers NumPy memory on huge pages, registered with CUDA
  raw        host O_DIRECT 1 x 64 MiB from the NumPy buffer (huge pages)
  raw-4k     the same from a copy on 4 KiB pages (MADV_NOHUGEPAGE)
  torch.save (fsync included)
"""
import json, os, random, sys, threading, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
from benchmarks import _ceiling_tools
import arrayio
import arrayio.tools.staged as staged_mod
import arrayio.dispatch.dispatcher as disp_mod
import mmap
from arrayio.tools.staged import StagedTool
from arrayio._buffers import aligned_empty

out, gib, budget = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
t_start = time.time()
d = "/tmp/probe40"; h.remove(d); os.makedirs(d, exist_ok=True)
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
nbytes = sum(v.numel() * v.element_size() for v in state.values())
host = aligned_empty(-(-nbytes // (1 << 20)) * (1 << 20))
host[:] = np.random.default_rng(0).integers(0, 256, host.nbytes, dtype=np.uint8)
ceil_tool = _ceiling_tools.make("direct", 1, 64 << 20)
A4 = "staged(chunk_size=67108864,direct=True,threads=4)"


def anon_huge():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1]) >> 10  # MiB
    return None


huge_before = anon_huge()
small_map = mmap.mmap(-1, host.nbytes)
small_map.madvise(mmap.MADV_NOHUGEPAGE)
host4k = np.frombuffer(small_map, dtype=np.uint8)
host4k[:] = host
huge_after = anon_huge()
THP = [False]
_orig_slots = StagedTool._slots


def thp_slots(self, device_index):
    if not THP[0]:
        return _orig_slots(self, device_index)

    def make():
        size = self.chunk_size + 2 * 4096
        pair = []
        for _ in range(2):
            raw = np.empty(size + (4 << 20), np.uint8)  # NumPy madvises huge pages here
            start = -raw.ctypes.data % (2 << 20)
            buf = raw[start : start + size]
            buf.fill(0)
            cupy.cuda.runtime.hostRegister(buf.ctypes.data, buf.nbytes, 0)
            pair.append(buf)
        return pair[0], pair[1]
    return self._pinned.lend(("thp", device_index), make)


StagedTool._slots = thp_slots

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


def ceiling(buffer):
    def go(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            ceil_tool.write(fd, buffer, 0); os.fsync(fd)
        finally:
            os.close(fd)
    return go


def save(tool, thp):
    def go(path):
        THP[0] = thp
        try:
            arrayio.save(path, state, tool=tool); h.fsync_tree(path)
        finally:
            THP[0] = False
    return go


writers = {"save": (save(A4, False), "s.safetensors"),
           "save-thp": (save(A4, True), "h.safetensors"),
           "raw": (ceiling(host), "r.bin"), "raw-4k": (ceiling(host4k), "r4k.bin"),
           "torch.save": (lambda p: (torch.save(state, p), h.fsync_tree(p)), "t.pt")}
res = {"argv": sys.argv, "bytes": nbytes, "free_GB_at_start": round(free_gb, 1),
       "anon_huge_MiB": {"before_4k_copy": huge_before, "after": huge_after},
       "commit": open(".devrun/commit.txt").read().strip(), "samples": []}
print("free GB", free_gb, "bytes", nbytes, "AnonHugePages MiB", huge_before, huge_after,
      flush=True)
# one untimed, checked save of each forced arm first (CUDA contexts, pinned buffers)
for thp in (False, True):
    p = f"{d}/warm.safetensors"; save(A4, thp)(p)
    got = arrayio.load(p, device="cuda")
    assert all(torch.equal(torch.from_dlpack(got[k]), v) for k, v in state.items()), thp
    del got
    h.remove(p)
rng = random.Random(38)
phase = 0
per_phase = 40.0
while time.time() - t_start + per_phase < budget:
    for name in list(os.listdir(d)):
        h.remove(f"{d}/{name}")
    h.fsync_tree(d)
    order = list(writers); rng.shuffle(order)
    t_phase = time.time()
    fd = os.open(f"{d}/lead-in.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    ceil_tool.write(fd, host[: 2 << 30], 0); real_fsync(fd); os.close(fd)
    res.setdefault("anon_huge_MiB_per_phase", []).append(anon_huge())
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
