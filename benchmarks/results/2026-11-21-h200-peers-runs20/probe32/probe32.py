"""Probe 32 (2026-11-21): does reserving a file's blocks first (fallocate) let parallel
O_DIRECT writers overlap on the H200 VM's ext4 disk, as on the development VM, and what
does it do to an 8 GiB checkpoint save?  Interleaved, shuffled per round, each to a fresh
file, fsync included: host O_DIRECT writes of one 8 GiB buffer (1 x 64 MiB, 4 x 64 MiB,
and reserved first: 4 x 64, 8 x 64, 16 x 16 MiB), and arrayio.save of the 702-tensor state
through the staged tool (4 x 64 MiB without and with the reservation; 8 x 64 and
16 x 16 MiB with it). Each sample also records the mean number of write requests in flight
at the disk (write ticks / elapsed, /sys/block/<disk>/stat)."""
import json, os, random, sys, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
from benchmarks import _ceiling_tools
import arrayio
from arrayio.tools import _io

out, gib, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
disk = sys.argv[4] if len(sys.argv) > 4 else "vda"
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
nbytes = sum(t.numel() * t.element_size() for t in state.values())
n = -(-nbytes // (1 << 20)) * (1 << 20)
from arrayio._buffers import aligned_empty
host = aligned_empty(n)
block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
for start in range(0, n, block.nbytes):
    host[start:start + block.nbytes] = block[: min(block.nbytes, n - start)]
d = "/tmp/probe32"; os.makedirs(d, exist_ok=True)
path = f"{d}/f.bin"
real_fallocate = _io._fallocate


def stat():
    f = open(f"/sys/block/{disk}/stat").read().split()
    return int(f[4]), int(f[7])  # write requests, write ticks (ms)


def raw(kind, threads, task):
    tool = _ceiling_tools.make(kind, threads, task)
    def go():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            tool.write(fd, host, 0); os.fsync(fd)
        finally:
            os.close(fd)
    return go


def save(tool, reserve):
    def go():
        _io._fallocate = real_fallocate if reserve else (lambda: None)
        try:
            arrayio.save(path, state, tool=tool); h.fsync_tree(path)
        finally:
            _io._fallocate = real_fallocate
    return go


S = "staged(chunk_size={},direct=True,threads={})"
kinds = {"host-1x64": raw("direct", 1, 64 << 20), "host-4x64": raw("direct", 4, 64 << 20),
         "host-4x64+fallocate": raw("direct+fallocate", 4, 64 << 20),
         "host-8x64+fallocate": raw("direct+fallocate", 8, 64 << 20),
         "host-16x16+fallocate": raw("direct+fallocate", 16, 16 << 20),
         "save-4x64": save(S.format(64 << 20, 4), False),
         "save-4x64+fallocate": save(S.format(64 << 20, 4), True),
         "save-8x64+fallocate": save(S.format(64 << 20, 8), True),
         "save-16x16+fallocate": save(S.format(16 << 20, 16), True)}
res = {"argv": sys.argv, "bytes": {"state": nbytes, "host": n}, "samples": []}
rng = random.Random(32)
for r in range(reps + 1):  # round 0: untimed first device writes of the process
    order = list(kinds); rng.shuffle(order)
    for k in order:
        h.remove(path); h.fsync_tree(d)
        a = stat(); t = time.perf_counter(); kinds[k](); s = time.perf_counter() - t; b = stat()
        size = nbytes if k.startswith("save") else n
        res["samples"].append({"round": r, "kind": k, "s": round(s, 3),
                               "GBps": round(size / s / 1e9, 3),
                               "in_flight": round((b[1] - a[1]) / (s * 1000), 2),
                               "requests": b[0] - a[0]})
        print(res["samples"][-1], flush=True)
        json.dump(res, open(out, "w"), indent=1)
med = {}
for k in kinds:
    v = sorted(x["GBps"] for x in res["samples"] if x["kind"] == k and x["round"] > 0)
    q = sorted(x["in_flight"] for x in res["samples"] if x["kind"] == k and x["round"] > 0)
    med[k] = (v[len(v) // 2], q[len(q) // 2])
res["medians_GBps_in_flight"] = med
json.dump(res, open(out, "w"), indent=1)
for k, v in med.items():
    print(f"{k:24s} {v[0]:.3f} GB/s  in flight {v[1]:.1f}")
h.remove(d)
