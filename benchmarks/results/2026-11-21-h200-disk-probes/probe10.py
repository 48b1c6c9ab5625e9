"""Three probes in one call:
A. warm 16 MiB into the GPU: where does the dispatcher lose ~0.15 ms a call against the same
   KvikIO arm forced? (orders, pieces, profiles)
B. writes: does fallocate (or overwriting) speed up a 1 GiB O_DIRECT write + fsync?
C. cold reads: after a write vs after a read vs after a pause, raw and arrayio.load.
"""
import cProfile, io, json, os, pstats, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import numpy as np
try:
    import cupy
except ImportError:
    cupy = None
import arrayio
from arrayio import tools, _device_checksum
from arrayio._buffers import CupyDeviceBuffer, aligned_empty
from arrayio.dispatch import dispatcher as dispatch
from arrayio.dispatch.context import cache_state, storage_of
from benchmarks._pagecache import evict

out = sys.argv[1]; parts = sys.argv[2] if len(sys.argv) > 2 else "ABC"
os.makedirs(out, exist_ok=True)
res = {}
d = tempfile.mkdtemp(prefix="p10-", dir="/tmp")
MiB = 1 << 20
host = aligned_empty(1 << 30)
host[:] = np.random.default_rng(0).integers(0, 256, 1 << 30, dtype=np.uint8)
data = os.path.join(d, "data.bin")
with open(data, "wb") as f:
    f.write(host); f.flush(); os.fsync(f.fileno())


def dump():
    json.dump(res, open(os.path.join(out, "probe10.json"), "w"), indent=1)


if "A" in parts:
    N = 16 * MiB
    dev = cupy.empty(1 << 30, dtype=cupy.uint8)
    warmer = tools.make("posix", threads=16, task_size=16 * MiB)
    fd0 = os.open(data, os.O_RDONLY); warmer.read(fd0, host[:256 * MiB], 0); os.close(fd0)
    kv = dispatch.Arm.of("kvikio", threads=16, task_size=4 * MiB)
    st = dispatch.Arm.of("staged", threads=16, chunk_size=16 * MiB, direct=True)
    forcing = dispatch.Dispatcher(None)
    disp = dispatch.Dispatcher(None)
    fd = os.open(data, os.O_RDONLY)
    buf = lambda: CupyDeviceBuffer(dev[:N])
    for i in range(80):
        disp.read(fd, buf(), 0, with_checksum=True)
        ctx, arm = disp.last
        if disp.policy.explain(ctx).phase == "exploiting":
            break
    res["A_learned"] = {"calls": i + 1, "arm": disp.last[1].label}
    print("A learned", res["A_learned"], flush=True)
    kvtool = forcing.policy.tool(kv)

    runners = {
        "F": lambda fd: forcing.read(fd, buf(), 0, with_checksum=True, tool=kv),
        "D": lambda fd: disp.read(fd, buf(), 0, with_checksum=True),
        "Fnc": lambda fd: forcing.read(fd, buf(), 0, with_checksum=False, tool=kv),
        "T": lambda fd: (kvtool.read(fd, buf(), 0), _device_checksum.checksum_anywhere(buf())),
        "R": lambda fd: kvtool.read(fd, buf(), 0),
        "S": lambda fd: forcing.read(fd, buf(), 0, with_checksum=True, tool=st),
    }

    def sample(name, newfd=True):
        f = os.open(data, os.O_RDONLY) if newfd else fd
        try:
            t = time.perf_counter()
            for _ in range(4):
                runners[name](f)
            return (time.perf_counter() - t) / 4 * 1e3
        finally:
            if newfd:
                os.close(f)

    for order in ("FD", "DF", "SFSD", "SDSF", "FDTR", "DFncRT"):
        names = []
        # split order into runner names (Fnc is the only multi-letter one)
        i = 0
        while i < len(order):
            if order.startswith("Fnc", i):
                names.append("Fnc"); i += 3
            else:
                names.append(order[i]); i += 1
        ms = {n: [] for n in names}
        for _ in range(20):
            for n in names:
                ms[n].append(sample(n))
        res.setdefault("A_orders", {})[order] = {n: round(statistics.median(v), 4) for n, v in ms.items()}
        print("A", order, res["A_orders"][order], flush=True)
    # same fd kept open (no open per sample)
    ms = {"F": [], "D": []}
    for _ in range(20):
        for n in ms:
            ms[n].append(sample(n, newfd=False))
    res["A_samefd"] = {n: round(statistics.median(v), 4) for n, v in ms.items()}
    print("A samefd", res["A_samefd"], flush=True)

    def per_call(fn, k=200):
        t = time.perf_counter()
        for _ in range(k):
            fn()
        return round((time.perf_counter() - t) / k * 1e6, 2)
    b = buf()
    res["A_pieces_us"] = {
        "context": per_call(lambda: disp.context("read", fd, 0, N, "cuda", True)),
        "cache_state": per_call(lambda: cache_state(fd, 0, N)),
        "storage_of": per_call(lambda: storage_of(fd)),
        "checksum_anywhere": per_call(lambda: _device_checksum.checksum_anywhere(b)),
        "open_close": per_call(lambda: os.close(os.open(data, os.O_RDONLY))),
        "raw_kvikio_read": per_call(lambda: kvtool.read(fd, b, 0), 50),
        "forced_read": per_call(lambda: forcing.read(fd, b, 0, with_checksum=True, tool=kv), 50),
        "dispatcher_read": per_call(lambda: disp.read(fd, b, 0, with_checksum=True), 50),
    }
    print("A pieces", res["A_pieces_us"], flush=True)
    for name in ("F", "D"):
        pr = cProfile.Profile(); pr.enable()
        for _ in range(100):
            runners[name](fd)
        pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        open(os.path.join(out, f"profile_{name}.txt"), "w").write(s.getvalue())
    res["A_explain"] = disp.policy.explain(disp.last[0]).as_dict()
    os.close(fd); forcing.close(); disp.close()
    del dev; cupy.get_default_memory_pool().free_all_blocks()
    dump()

if "B" in parts:
    wpath = os.path.join(d, "w.bin")
    variants = {}
    for threads, task in ((1, 64 * MiB), (4, 64 * MiB)):
        tool = tools.make("direct", threads=threads, task_size=task)
        for mode in ("new", "fallocate", "overwrite"):
            variants[f"{mode}_{threads}x{task >> 20}M"] = (tool, mode)
    samples = {k: [] for k in variants}
    names = list(variants)
    for r in range(4):
        for name in names[r % len(names):] + names[:r % len(names)]:
            tool, mode = variants[name]
            if mode == "overwrite" and not os.path.exists(wpath):
                open(wpath, "wb").close()
            if mode == "overwrite":  # make sure the blocks exist first (untimed)
                if os.path.getsize(wpath) < (1 << 30):
                    fdw = os.open(wpath, os.O_WRONLY); tool.write(fdw, host, 0); os.fsync(fdw); os.close(fdw)
                flags = os.O_WRONLY
            else:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            if mode != "overwrite" and os.path.exists(wpath):
                os.unlink(wpath)
            t = time.perf_counter()
            fdw = os.open(wpath, flags | os.O_CREAT, 0o644)
            if mode == "fallocate":
                os.posix_fallocate(fdw, 0, 1 << 30)
            tool.write(fdw, host, 0); os.fsync(fdw); os.close(fdw)
            samples[name].append(round((1 << 30) / (time.perf_counter() - t) / 1e9, 3))
        print("B", r, {k: v[-1] for k, v in samples.items()}, flush=True)
    res["B_write_GBps"] = samples
    res["B_median"] = {k: statistics.median(v) for k, v in samples.items()}
    print("B", res["B_median"], flush=True)
    os.unlink(wpath)
    dump()

if "C" in parts:
    import torch
    from benchmarks.peers import checkpoint as ck, _harness as h
    state = ck.make_state(ck.layout(1 << 30, 2048, 65536), "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
    arr = os.path.join(d, "a.safetensors"); arrayio.save(arr, state)
    other = os.path.join(d, "other.bin")
    wt = tools.make("direct", threads=4, task_size=64 * MiB)
    rt = tools.make("direct", threads=16, task_size=16 * MiB)

    def before(cond):
        if cond == "after_write":
            fdw = os.open(other, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); wt.write(fdw, host, 0); os.fsync(fdw); os.close(fdw)
        elif cond == "after_read":
            evict(data, True)
            fdr = os.open(data, os.O_RDONLY); rt.read(fdr, host, 0); os.close(fdr)
        elif cond == "after_pause":
            time.sleep(3)

    def raw_read():
        fdr = os.open(data, os.O_RDONLY); t = time.perf_counter(); rt.read(fdr, host, 0); s = time.perf_counter() - t; os.close(fdr)
        return (1 << 30) / s / 1e9

    def aio_load():
        t = time.perf_counter(); o = arrayio.load(arr, like="torch", device="cuda"); h.settle(); s = time.perf_counter() - t
        del o
        return nbytes / s / 1e9

    samples = {}
    conds = ("after_write", "after_read", "after_pause")
    for r in range(4):
        for cond in conds[r % 3:] + conds[:r % 3]:
            for reader, fn, path in (("raw", raw_read, data), ("aio", aio_load, arr)):
                before(cond)
                evict(path, True)
                samples.setdefault(f"{reader}_{cond}", []).append(round(fn(), 3))
        print("C", r, {k: v[-1] for k, v in samples.items()}, flush=True)
    res["C_cold_GBps"] = samples
    res["C_median"] = {k: statistics.median(v) for k, v in samples.items()}
    print("C", res["C_median"], flush=True)
    dump()

h_ = None
import shutil; shutil.rmtree(d, ignore_errors=True)
dump()
print(json.dumps({k: v for k, v in res.items() if "median" in k or "pieces" in k or "orders" in k}, indent=1))
