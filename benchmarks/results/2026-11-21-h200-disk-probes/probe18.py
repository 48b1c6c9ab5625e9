"""Can a warm read into the GPU beat the page-cache ceiling? The ceiling copies the cached
pages into host memory (16 threads of pread), then a copy goes to the device. Mapping the
file, pinning its cached pages with cudaHostRegister (read-only) and letting the GPU's copy
engine read them skips the host memcpy. Times each phase, against the 16-thread pread
ceiling, KvikIO and staged arms forced through arrayio, in rotating order, for 1 and 4 GiB."""
import json, mmap, os, statistics, sys, tempfile, threading, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, os.getcwd())
import cupy, numpy as np
from cupy.cuda import runtime as rt
from arrayio import tools
from arrayio._buffers import aligned_empty, CupyDeviceBuffer
from arrayio.dispatch import dispatcher as dispatch
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
os.makedirs(out, exist_ok=True)
MiB = 1 << 20
READ_ONLY = 8  # cudaHostRegisterReadOnly
info = {
    "host_register_read_only": rt.deviceGetAttribute(113, 0),
    "pageable_memory_access": rt.deviceGetAttribute(88, 0),
    "uses_host_page_tables": rt.deviceGetAttribute(100, 0),
}
print(info, flush=True)
d = tempfile.mkdtemp(prefix="p18-", dir="/tmp")
forcing = dispatch.Dispatcher(None)
results = {"info": info, "rounds": rounds, "sizes": {}}


def warm(path):
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


def pread_ceiling(path, n, host):
    fd = os.open(path, os.O_RDONLY)
    try:
        task = 16 * MiB
        def one(start):
            view = memoryview(host)[start:min(start + task, n)]
            return os.preadv(fd, [view], start)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(0, n, task)))
    finally:
        os.close(fd)


def forced(arm):
    def go(path, n, dev):
        fd = os.open(path, os.O_RDONLY)
        try:
            forcing.read(fd, CupyDeviceBuffer(dev), 0, with_checksum=False, tool=arm)
        finally:
            os.close(fd)
    return go


def registered(chunk, workers):
    """Map the file, pin chunk after chunk (``workers`` threads), copy each chunk to the
    device as soon as it is pinned, unpin when the copies are done."""
    def go(path, n, dev, phases):
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        mm = mmap.mmap(fd, n, access=mmap.ACCESS_READ)
        view = np.frombuffer(mm, np.uint8)
        base = view.ctypes.data
        stream = cupy.cuda.Stream(non_blocking=True)
        starts = list(range(0, n, chunk))
        t1 = time.perf_counter()
        def pin(start):
            rt.hostRegister(base + start, min(chunk, n - start), READ_ONLY)
            return start
        try:
            with ThreadPoolExecutor(workers) as pool:
                for start in pool.map(pin, starts):
                    size = min(chunk, n - start)
                    rt.memcpyAsync(dev.data.ptr + start, base + start, size, 1, stream.ptr)
            t2 = time.perf_counter()
            stream.synchronize()
            t3 = time.perf_counter()
        finally:
            for start in starts:
                try:
                    rt.hostUnregister(base + start)
                except Exception:
                    pass
            t4 = time.perf_counter()
            del view
            mm.close()
            os.close(fd)
        phases.append({"map": t1 - t0, "pin_and_issue": t2 - t1, "drain": t3 - t2,
                       "unpin": t4 - t3, "total": time.perf_counter() - t0})
    return go


for n in (1 << 30, 4 << 30):
    path = os.path.join(d, f"f{n}.bin")
    with open(path, "wb") as f:
        block = np.random.default_rng(n).integers(0, 256, 64 * MiB, dtype=np.uint8)
        for i in range(n // (64 * MiB)):
            block[:8] = i
            f.write(block.tobytes())
    expect = cupy.asarray(np.fromfile(path, dtype=np.uint8))
    dev = cupy.empty(n, dtype=cupy.uint8)
    host = aligned_empty(n)
    variants = {
        "pread16_host": lambda p, n=n, h=host: pread_ceiling(p, n, h),
        "kvikio16x4M": lambda p, n=n, dv=dev, g=forced(dispatch.Arm.of(
            "kvikio", threads=16, task_size=4 * MiB)): g(p, n, dv),
        "staged16x8M": lambda p, n=n, dv=dev, g=forced(dispatch.Arm.of(
            "staged", threads=16, chunk_size=8 * MiB, direct=False)): g(p, n, dv),
    }
    phases = {}
    for chunk, workers in ((n, 1), (256 * MiB, 1), (64 * MiB, 4), (64 * MiB, 8), (16 * MiB, 8)):
        name = f"reg_{chunk // MiB}M_x{workers}"
        phases[name] = []
        variants[name] = (lambda p, n=n, dv=dev, g=registered(chunk, workers), ph=phases[name]:
                          g(p, n, dv, ph))
    names = list(variants)
    samples = {k: [] for k in names}
    correct = {}
    warm(path)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            if k != "pread16_host":
                dev.fill(0)
            cupy.cuda.Device().synchronize()
            t = time.perf_counter()
            variants[k](path)
            cupy.cuda.Device().synchronize()
            samples[k].append(n / (time.perf_counter() - t) / 1e9)
            if k != "pread16_host" and r == 0:
                correct[k] = bool((dev == expect).all())
        print(n, r, {k: round(v[-1], 2) for k, v in samples.items()}, flush=True)
    results["sizes"][str(n)] = {
        "median_GBps": {k: statistics.median(v) for k, v in samples.items()},
        "samples_GBps": samples, "correct": correct,
        "phases_s": {k: v for k, v in phases.items()},
    }
    print(json.dumps(results["sizes"][str(n)]["median_GBps"], indent=1), correct, flush=True)
    del expect, dev, host
    cupy.get_default_memory_pool().free_all_blocks()
    os.unlink(path)
with open(os.path.join(out, "probe18.json"), "w") as f:
    json.dump(results, f, indent=1)
