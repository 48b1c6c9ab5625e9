"""Probe 23: which arm writes the checkpoint's batch fastest? (probe 22's script, other variants)
Probe 22: does a save lose to the raw write ceiling because a checkpoint's writes are cut at its
tensors (16 and 32 MiB) while the ceiling writes 64 MiB requests? 1 GiB checkpoint, writes
+ fsync of a new file each, in rotating order:
- raw_whole_64M_x4: O_DIRECT from host memory, 64 MiB requests, 4 threads (the ceiling);
- raw_tensors_x4 / raw_tensors_x8: the same bytes, one request per tensor of arrayio's file
  (256 MiB ones cut at 64 MiB), 4 or 8 threads;
- staged_whole_gpu: arrayio's staged tool (4 x 64 MiB, O_DIRECT), one 1 GiB GPU buffer;
- save_tuned, save_staged32x8: whole arrayio.save calls (tuned arm; 8 x 32 MiB forced)."""
import concurrent.futures, json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np
import arrayio
from arrayio import tools
from arrayio._buffers import aligned_empty, CupyDeviceBuffer
from arrayio._reader import Reader
from arrayio.dispatch import dispatcher as dispatch
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
MiB = 1 << 20
state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="p22-", dir="/tmp")
t0 = time.perf_counter()
arrayio.tune(d, device="cuda", sizes=[nbytes], directions=("write",))
tune_s = time.perf_counter() - t0
layout_file = os.path.join(d, "layout.safetensors"); arrayio.save(layout_file, state)
with Reader(layout_file) as r:
    infos = sorted((r[k].file_offset, r[k].nbytes) for k in r.keys())
start = infos[0][0]; end = max(o + n for o, n in infos)
pieces = []
for o, n in infos:
    if o % 4096 or n % 4096:
        continue
    for s in range(o, o + n, 64 * MiB):
        pieces.append((s, min(64 * MiB, o + n - s)))
covered = sum(n for _, n in pieces)
span = -(-end // 4096) * 4096
host = aligned_empty(span); host[:] = 5
dev = cupy.full(nbytes // 4096 * 4096, 5, dtype=cupy.uint8)
forcing = dispatch.Dispatcher(None)

def new(p):
    if os.path.exists(p):
        os.unlink(p)
    return os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)

def raw_whole():
    t = tools.make("direct", threads=4, task_size=64 * MiB)
    p = os.path.join(d, "whole.bin")
    def go():
        fd = new(p)
        try:
            t.write(fd, host[:nbytes // 4096 * 4096], 0); os.fsync(fd)
        finally:
            os.close(fd)
    return go

def raw_tensors(threads):
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    p = os.path.join(d, f"tensors{threads}.bin")
    def go():
        fd = new(p); dfd = os.open(p, os.O_WRONLY | os.O_DIRECT)
        try:
            def one(piece):
                s, n = piece; mv = memoryview(host)[s:s + n]; done = 0
                while done < n:
                    done += os.pwritev(dfd, [mv[done:]], s + done)
            list(pool.map(one, pieces)); os.fsync(fd)
        finally:
            os.close(dfd); os.close(fd)
    return go

def staged_whole():
    arm = dispatch.Arm.of("staged", threads=4, chunk_size=64 * MiB, direct=True)
    p = os.path.join(d, "staged.bin")
    def go():
        fd = new(p)
        try:
            forcing.write(fd, CupyDeviceBuffer(dev), 0, with_checksum=True, tool=arm); os.fsync(fd)
        finally:
            os.close(fd)
    return go

def save(tool):
    p = os.path.join(d, f"save{tool}.safetensors")
    def go():
        if os.path.exists(p):
            os.unlink(p)
        arrayio.save(p, state, tool=tool)
    return go

variants = {"raw_whole_64M_x4": raw_whole(), "save_tuned": save(None)}
for threads, chunk in ((4, 32), (8, 32), (8, 64), (16, 16), (16, 32)):
    variants[f"save_staged{chunk}x{threads}"] = save(
        f"staged(threads={threads},chunk_size={chunk * MiB},direct=True)")
variants["save_kvikio16"] = save("kvikio(threads=16,task_size=4194304)")
res = {"bytes": nbytes, "tune_s": tune_s, "pieces": len(pieces), "piece_bytes": covered,
       "piece_sizes_MiB": sorted({n // MiB for _, n in pieces}), "rounds": {}}
names = list(variants)
for name in names:  # one untimed pass of each: lead-in and imports
    variants[name]()
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
        t = time.perf_counter(); variants[name](); s = time.perf_counter() - t
        n = covered if name.startswith("raw_tensors") else nbytes
        res["rounds"].setdefault(name, []).append(round(n / s / 1e9, 3))
    print(r, {k: v[-1] for k, v in res["rounds"].items()}, flush=True)
    json.dump(res, open(out, "w"), indent=1)
res["median"] = {k: statistics.median(v) for k, v in res["rounds"].items()}
res["explain"] = str(arrayio.explain())[-3000:]
print(json.dumps(res["median"], indent=1)); json.dump(res, open(out, "w"), indent=1)
h.remove(d)
