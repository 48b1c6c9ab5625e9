"""Probe 35 (2026-11-21): would writing a checkpoint's contiguous tensors as one stream of
64 MiB chunks ("gathered": several tensors copied into one pinned buffer, one O_DIRECT write
per chunk) bring a save to the raw write ceiling's pattern and rate?  A prototype of that
writer (1 and 4 workers, each with two pinned buffers and its own stream, the next chunk's
copies overlapping the previous chunk's write), against the host O_DIRECT writes (1 and 4 x
64 MiB), the staged tool writing the same bytes from one device buffer, and arrayio.save
(staged 4 x 64 MiB forced). Interleaved, shuffled, each to a fresh file reserved first
where said, fsync included; round 0 untimed."""
import json, os, random, sys, threading, time
sys.path.insert(0, os.getcwd())
import cupy, cupyx, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
from benchmarks import _ceiling_tools
import arrayio
from arrayio import tools
from arrayio._buffers import CupyDeviceBuffer, aligned_empty
from arrayio.tools._io import preallocate

out, gib, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); h.settle()
order = sorted(state, key=lambda k: -state[k].numel() * state[k].element_size())
pieces, offset = [], 0
for k in order:
    v = cupy.asarray(state[k].view(torch.uint8).reshape(-1))
    pieces.append((offset, v)); offset += v.nbytes
nbytes = offset
assert nbytes % 4096 == 0
big = cupy.empty(nbytes, dtype=cupy.uint8)
for o, v in pieces:
    big[o:o + v.nbytes] = v
host = aligned_empty(nbytes); big.get(out=host)
cupy.cuda.Device().synchronize()
d = "/tmp/probe35"; os.makedirs(d, exist_ok=True)
path = f"{d}/f.bin"
CHUNK = 64 << 20
slots = {}


def pinned_pair(k):
    if k not in slots:
        slots[k] = [cupyx.empty_pinned((CHUNK,), dtype=np.uint8) for _ in range(2)]
    return slots[k]


def gathered(threads):
    starts = [o for o, _ in pieces]
    def go():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        try:
            preallocate(fd, 0, nbytes)
            chunks = list(range(0, nbytes, CHUNK))
            def worker(k):
                pair = pinned_pair(k); stream = cupy.cuda.Stream(non_blocking=True)
                pending = None
                import bisect
                for j, a in enumerate(chunks[k::threads]):
                    b = min(a + CHUNK, nbytes); slot = pair[j % 2]
                    i = bisect.bisect_right(starts, a) - 1
                    while i < len(pieces) and pieces[i][0] < b:
                        o, v = pieces[i]
                        lo, hi = max(a, o), min(b, o + v.nbytes)
                        v[lo - o:hi - o].get(stream=stream, out=slot[lo - a:hi - a])
                        i += 1
                    ev = stream.record()
                    if pending is not None:
                        pslot, pa, pb, pev = pending; pev.synchronize()
                        os.pwritev(dfd, [memoryview(pslot[:pb - pa])], pa)
                    pending = (slot, a, b, ev)
                if pending is not None:
                    pslot, pa, pb, pev = pending; pev.synchronize()
                    os.pwritev(dfd, [memoryview(pslot[:pb - pa])], pa)
            ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
            [t.start() for t in ts]; [t.join() for t in ts]
            os.fsync(fd)
        finally:
            os.close(dfd); os.close(fd)
    return go


def raw(kind, threads):
    tool = _ceiling_tools.make(kind, threads, CHUNK)
    def go():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            tool.write(fd, host, 0); os.fsync(fd)
        finally:
            os.close(fd)
    return go


staged = tools.make("staged", threads=4, chunk_size=CHUNK, direct=True)
def one_buffer():
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        preallocate(fd, 0, nbytes); staged.write(fd, CupyDeviceBuffer(big), 0); os.fsync(fd)
    finally:
        os.close(fd)


TOOL = "staged(chunk_size=67108864,direct=True,threads=4)"
kinds = {"host-1x64": raw("direct", 1), "host-4x64": raw("direct", 4),
         "host-4x64+fallocate": raw("direct+fallocate", 4),
         "gathered-1x64": gathered(1), "gathered-4x64": gathered(4),
         "staged-one-buffer-4x64": one_buffer,
         "save-4x64-forced": lambda: (arrayio.save(path, state, tool=TOOL), h.fsync_tree(path))}
# the gathered writer's bytes must be the file's
h.remove(path); kinds["gathered-4x64"]()
back = np.fromfile(path, dtype=np.uint8); assert np.array_equal(back, host), "gathered bytes differ"
del back
res = {"argv": sys.argv, "bytes": nbytes, "samples": []}
rng = random.Random(35)
for r in range(reps + 1):
    ks = list(kinds); rng.shuffle(ks)
    for k in ks:
        h.remove(path); h.fsync_tree(d)
        t = time.perf_counter(); kinds[k](); s = time.perf_counter() - t
        res["samples"].append({"round": r, "kind": k, "s": round(s, 3), "GBps": round(nbytes / s / 1e9, 3)})
        print(res["samples"][-1], flush=True)
        json.dump(res, open(out, "w"), indent=1)
med = {}
for k in kinds:
    v = sorted(x["GBps"] for x in res["samples"] if x["kind"] == k and x["round"] > 0)
    med[k] = v[len(v) // 2]
res["medians_GBps"] = med
json.dump(res, open(out, "w"), indent=1)
for k, v in med.items():
    print(f"{k:24s} {v:.3f} GB/s")
h.remove(d)
