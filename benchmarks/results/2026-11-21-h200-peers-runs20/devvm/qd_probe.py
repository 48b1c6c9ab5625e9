import os, time, ctypes, sys
import numpy as np
sys.path.insert(0, '.')
from arrayio import tools
from arrayio._buffers import aligned_empty
libc = ctypes.CDLL(None, use_errno=True)
n = int(sys.argv[1]) << 20
buf = aligned_empty(n); buf[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
path = '/tmp/fprobe.bin'
def stat():
    f = open('/sys/block/vda/stat').read().split()
    return int(f[4]), int(f[7]), int(f[10])  # write ios, write ticks ms, weighted time in queue ms
def go(threads, task, pre):
    if os.path.exists(path): os.unlink(path)
    t = tools.make("direct", threads=threads, task_size=task)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    a = stat(); s = time.perf_counter()
    if pre:
        assert libc.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(n)) == 0
    t.write(fd, buf, 0); os.fsync(fd)
    e = time.perf_counter() - s; b = stat()
    os.close(fd); t.close()
    ios = b[0]-a[0]
    return round(n / e / 1e9, 3), ios, round((b[1]-a[1]) / (e*1000), 2), round(n/max(ios,1)/1024)
for rep in range(2):
    for threads, task in [(1, 64 << 20), (4, 64 << 20), (16, 16 << 20)]:
        for pre in (False, True):
            print(rep, threads, task >> 20, pre, go(threads, task, pre), flush=True)
os.unlink(path)
