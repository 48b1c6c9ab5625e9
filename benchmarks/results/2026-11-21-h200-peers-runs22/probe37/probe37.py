"""Probe 37 (2026-11-21): do writes that are not aligned to 4 MiB in the file run slower?

Probe 36: the torch front door's 8 GiB saves ran at 0.88 of the raw ceiling's writes in the
same rounds, whatever came before; the disk was as busy (0.97 against 0.99) and held more
requests in flight (21 to 30 against 16), so each request took longer. The ceiling writes
64 MiB tasks from file offset 0; a save's chunks are cut from its data start (8 + the
header, rounded to 4 KiB), so every request of a save straddles 4 MiB boundaries. Here the
ceiling's host writer (O_DIRECT, 4 x 64 MiB) and the staged tool (one 8 GiB device buffer,
4 x 64 MiB, reserved first as a save does) each write at offset 0, at the save's data start,
and at 1 MiB; and arrayio.save with the staged tool forced. Shuffled rounds, fresh files,
fsync included; /proc/diskstats per sample."""
import json, os, random, sys, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
from benchmarks import _ceiling_tools
import arrayio
from arrayio import tools
from arrayio._buffers import CupyDeviceBuffer, aligned_empty
from arrayio.tools._io import preallocate

out, gib, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
d = "/tmp/probe37"; os.makedirs(d, exist_ok=True)
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
nbytes = sum(v.numel() * v.element_size() for v in state.values())
nbytes = -(-nbytes // (1 << 20)) * (1 << 20)
host = aligned_empty(nbytes)
host[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
big = cupy.asarray(host)
cupy.cuda.Device().synchronize()
TOOL = "staged(chunk_size=67108864,direct=True,threads=4)"
path = f"{d}/f.bin"
arrayio.save(path, state, tool=TOOL)
with open(path, "rb") as f:
    start = 8 + int.from_bytes(f.read(8), "little")
data_start = -(-start // 4096) * 4096
h.remove(path)
print("data start", start, "->", data_start, "mod 4 MiB", data_start % (4 << 20), flush=True)
host_tool = _ceiling_tools.make("direct", 4, 64 << 20)
staged = tools.make("staged", threads=4, chunk_size=64 << 20, direct=True)
st = os.stat(d)
devno = f"{os.major(st.st_dev)} {os.minor(st.st_dev)}"


def diskstats():
    for line in open("/proc/diskstats"):
        f = line.split()
        if f"{f[0]} {f[1]}" == devno:
            return [int(x) for x in f[3:14]]
    return None


def host_at(offset):
    def go():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            host_tool.write(fd, host, offset); os.fsync(fd)
        finally:
            os.close(fd)
    return go


def staged_at(offset):
    def go():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            preallocate(fd, offset, nbytes)
            staged.write(fd, CupyDeviceBuffer(big), offset); os.fsync(fd)
        finally:
            os.close(fd)
    return go


kinds = {"host@0": host_at(0), f"host@{data_start}": host_at(data_start),
         "host@1MiB": host_at(1 << 20),
         "staged@0": staged_at(0), f"staged@{data_start}": staged_at(data_start),
         "staged@1MiB": staged_at(1 << 20),
         "save(staged forced)": lambda: (arrayio.save(path, state, tool=TOOL),
                                         h.fsync_tree(path))}
res = {"argv": sys.argv, "bytes": nbytes, "data_start": data_start, "samples": []}
rng = random.Random(37)
for r in range(reps + 1):
    ks = list(kinds); rng.shuffle(ks)
    for k in ks:
        h.remove(path); h.fsync_tree(d)
        s0 = diskstats()
        t = time.perf_counter(); kinds[k](); s = time.perf_counter() - t
        s1 = diskstats()
        row = {"round": r, "kind": k, "s": round(s, 3), "GBps": round(nbytes / s / 1e9, 3)}
        if s0:
            dd = [b - a for a, b in zip(s0, s1)]
            row.update(busy=round(dd[9] / 1000 / s, 3), inflight=round(dd[10] / 1000 / s, 2),
                       write_MiB=round(dd[6] * 512 / max(1, dd[4]) / 2**20, 2), writes=dd[4],
                       ms_per_write=round(dd[7] / max(1, dd[4]), 1))
        res["samples"].append(row)
        print(row, flush=True)
        json.dump(res, open(out, "w"), indent=1)
med = {}
for k in kinds:
    v = sorted(x["GBps"] for x in res["samples"] if x["kind"] == k and x["round"] > 0)
    med[k] = {"median": v[len(v) // 2], "samples": v}
res["medians_GBps"] = med
json.dump(res, open(out, "w"), indent=1)
for k, v in med.items():
    print(f"{k:24s} {v['median']:.3f}  {v['samples']}")
h.remove(d)
