"""Where does a warm arrayio.load of the checkpoint lose against raw KvikIO? In checkpoint run
1 (8 GiB) arrayio loaded warm at 0.72 of the page-cache ceiling, the raw KvikIO peer at 1.09.
Rotating order, after tuning warm reads: the raw KvikIO peer, arrayio.load (tuned choice;
without checksums; forced onto KvikIO 16 x 4 MiB; CuPy results), allocating the results
alone, and the 16-thread pread ceiling into host memory. One cProfile of a tuned load."""
import cProfile, io, json, os, pstats, statistics, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch
import arrayio
from arrayio._buffers import aligned_empty
from arrayio.dispatch import Arm
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
gibs = [float(g) for g in (sys.argv[3] if len(sys.argv) > 3 else "8").split(",")]
os.makedirs(out, exist_ok=True)
MiB = 1 << 20
results = {"rounds": rounds, "sizes": {}}


def pread16(path, host):
    n = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def one(start):
            return os.preadv(fd, [memoryview(host)[start:min(start + 16 * MiB, n)]], start)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(0, n, 16 * MiB)))
    finally:
        os.close(fd)


for gib in gibs:
    state = ck.make_state(ck.layout(int(gib * (1 << 30)), 2048, 65536), "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    h.settle()
    d = tempfile.mkdtemp(prefix="p19-", dir="/tmp")
    t = time.perf_counter()
    tuned = arrayio.tune(d, device="cuda", sizes=[nbytes], directions=("read",), caches=("warm",))
    tune_s = time.perf_counter() - t
    chosen = {e.key: e.chosen for e in tuned.explanations}
    print(gib, "tuned", round(tune_s, 1), chosen, flush=True)
    kv = ck.kvikio_peer(state)
    kv_path = os.path.join(d, "kv.bin"); kv.save(kv_path)
    path = os.path.join(d, "a.safetensors"); arrayio.save(path, state)
    host = aligned_empty(os.path.getsize(path))
    forced = Arm.of("kvikio", threads=16, task_size=4 * MiB)
    held = []

    def alloc():
        held.append({k: torch.empty_like(v) for k, v in state.items()}); h.settle()

    variants = {
        "kvikio_raw": lambda: held.append(kv.load(kv_path)),
        "arrayio": lambda: held.append(arrayio.load(path, like="torch", device="cuda")),
        "arrayio_noverify": lambda: held.append(
            arrayio.load(path, like="torch", device="cuda", verify=False)),
        "arrayio_kvikio": lambda: held.append(
            arrayio.load(path, like="torch", device="cuda", tool=forced)),
        "arrayio_cupy": lambda: held.append(arrayio.load(path, like="cupy", device="cuda")),
        "alloc_only": alloc,
        "pread16_host": lambda: pread16(path, host),
    }
    for f in (path, kv_path):
        pread16(f, aligned_empty(os.path.getsize(f)))  # warm
    names = list(variants)
    samples = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            held.clear(); h.settle()
            t = time.perf_counter()
            variants[k]()
            h.settle()
            samples[k].append(nbytes / (time.perf_counter() - t) / 1e9)
        print(gib, r, {k: round(v[-1], 1) for k, v in samples.items()}, flush=True)
    held.clear(); h.settle()
    prof = cProfile.Profile()
    prof.enable(); got = arrayio.load(path, like="torch", device="cuda"); h.settle(); prof.disable()
    del got
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text); st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(25)
    with open(os.path.join(out, f"probe19-profile-{gib:g}gib.txt"), "w") as f:
        f.write(text.getvalue())
    results["sizes"][f"{gib:g}"] = {
        "bytes": nbytes, "tensors": len(state), "tune_seconds": tune_s, "tuned": chosen,
        "median_GBps": {k: statistics.median(v) for k, v in samples.items()},
        "samples_GBps": samples}
    print(json.dumps(results["sizes"][f"{gib:g}"]["median_GBps"], indent=1), flush=True)
    del state, host, kv
    h.settle(); torch.cuda.empty_cache(); cupy.get_default_memory_pool().free_all_blocks()
    h.remove(d)
with open(os.path.join(out, "probe19.json"), "w") as f:
    json.dump(results, f, indent=1)
