"""Probe 34 (2026-11-21): probe 33 with finer marks inside the save (what runs in its last
0.12 s, when the disk writes about 1.7 MB one small request at a time), with and without the
reservation. Probe 33: where an 8 GiB checkpoint save spends the ~0.3 s it loses against
the raw host write (probe 32: 2.18 against 2.32-2.46 GB/s). A thread samples the disk's
written sectors (/sys/block/<disk>/stat) every 2 ms across a host O_DIRECT write (4 x 64 MiB,
reserved first) and across arrayio.save (staged 4 x 64 MiB), and marks the save's steps:
the batch of data writes, each fsync, the rename."""
import json, os, random, sys, threading, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
from benchmarks import _ceiling_tools
import arrayio
from arrayio import _transfer, _atomic
from arrayio.dispatch import dispatcher as dmod

out, gib, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
disk = sys.argv[4] if len(sys.argv) > 4 else "vda"
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
nbytes = sum(t.numel() * t.element_size() for t in state.values())
n = -(-nbytes // (1 << 20)) * (1 << 20)
from arrayio._buffers import aligned_empty
host = aligned_empty(n)
host[:] = 7
d = "/tmp/probe34"; os.makedirs(d, exist_ok=True)
path = f"{d}/f.bin"
marks = []
T0 = [0.0]


def mark(what):
    marks.append((round(time.perf_counter() - T0[0], 4), what))


def wrap(obj, name):
    real = getattr(obj, name)
    def f(*a, **k):
        mark(f"{name} start")
        try:
            return real(*a, **k)
        finally:
            mark(f"{name} end")
    setattr(obj, name, f)


wrap(_transfer, "write_many"); wrap(os, "fsync"); wrap(os, "replace")
wrap(dmod, "preallocate"); wrap(dmod.Dispatcher, "_batch")
from arrayio.dispatch import batches as bmod
from arrayio import _device_checksum as dc
from arrayio.tools import _io
wrap(bmod, "submit_windowed"); wrap(bmod, "flush_range"); wrap(dc.DeviceChecksums, "results")
wrap(dmod.Dispatcher, "_write_run"); wrap(dmod.Dispatcher, "_one"); wrap(dmod.Dispatcher, "_maybe_save")
wrap(dmod, "flush_range"); wrap(os, "fdatasync")
real_fallocate = _io._fallocate


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True); self.stop = False; self.trace = []
    def run(self):
        while not self.stop:
            f = open(f"/sys/block/{disk}/stat").read().split()
            self.trace.append((time.perf_counter() - T0[0], int(f[6]) * 512, int(f[8])))
            time.sleep(0.002)


def host_write():
    tool = _ceiling_tools.make("direct+fallocate", 4, 64 << 20)
    def go():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            tool.write(fd, host, 0); mark("data end"); os.fsync(fd)
        finally:
            os.close(fd)
    return go


TOOL = "staged(chunk_size=67108864,direct=True,threads=4)"
def save(reserve):
    def go():
        _io._fallocate = real_fallocate if reserve else (lambda: None)
        try:
            arrayio.save(path, state, tool=TOOL); h.fsync_tree(path)
        finally:
            _io._fallocate = real_fallocate
    return go


kinds = {"host-4x64+fallocate": host_write(), "save-4x64+fallocate": save(True),
         "save-4x64": save(False)}
res = {"argv": sys.argv, "bytes": {"state": nbytes, "host": n}, "samples": []}
rng = random.Random(34)
for r in range(reps + 1):
    order = list(kinds); rng.shuffle(order)
    for k in order:
        h.remove(path); h.fsync_tree(d); time.sleep(0.2)
        marks.clear(); s = Sampler(); T0[0] = time.perf_counter(); s.start()
        time.sleep(0.05)
        T0[0] = time.perf_counter(); kinds[k](); e = time.perf_counter() - T0[0]
        time.sleep(0.05); s.stop = True; s.join()
        base = s.trace[0][1]
        tr = [(round(t, 4), b - base, q) for t, b, q in s.trace]
        first = next((t for t, b, _ in tr if b > 0), None)
        total = tr[-1][1]
        last = next((t for t, b, _ in tr if b >= total), None)
        size = nbytes if k.startswith("save") else n
        res["samples"].append({"round": r, "kind": k, "s": round(e, 4),
                               "GBps": round(size / e / 1e9, 3), "first_byte_s": first,
                               "last_byte_s": last, "disk_bytes": total, "marks": list(marks),
                               "trace": tr})
        print({x: res["samples"][-1][x] for x in ("round", "kind", "s", "GBps", "first_byte_s",
                                                   "last_byte_s")}, flush=True)
        counts = {}
        for t, what in marks:
            counts[what] = counts.get(what, 0) + 1
        print("   ", counts)
        print("   ", [m for m in marks if "_one" not in m[1] and "_write_run" not in m[1]][-24:], flush=True)
json.dump(res, open(out, "w"))
h.remove(d)
