"""A/B: 300 .npy saves of small CUDA tensors, one file each, fsynced (file and directory),
as benchmarks.peers.small_arrays does; which code is on sys.path[0] decides the variant."""
import os, sys, tempfile, time
import torch
import arrayio
rng = torch.Generator(device="cuda").manual_seed(0)
sizes = torch.randint(1024, 16384, (300,), generator=torch.Generator().manual_seed(0))
arrays = [torch.randn(int(n), device="cuda", generator=rng) for n in sizes]
torch.cuda.synchronize()
d = tempfile.mkdtemp(dir="/tmp", prefix="ab-")
def fsync_path(p):
    fd = os.open(p, os.O_RDONLY)
    try: os.fsync(fd)
    finally: os.close(fd)
out = {}
for rep in range(3):
    t = time.perf_counter()
    for i, a in enumerate(arrays):
        p = os.path.join(d, f"a{i}.npy")
        arrayio.save(p, a)
        fsync_path(p)
    fsync_path(d)
    save = (time.perf_counter() - t) / len(arrays) * 1e6
    t = time.perf_counter()
    for i, a in enumerate(arrays):
        p = os.path.join(d, f"t{i}.pt")
        torch.save(a, p)
        fsync_path(p)
    fsync_path(d)
    tsave = (time.perf_counter() - t) / len(arrays) * 1e6
    print(f"{sys.argv[1]:4s} rep {rep}: arrayio save {save:7.1f} us/array, torch.save {tsave:7.1f}", flush=True)
