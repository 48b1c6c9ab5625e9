"""Why is a cold read right after a write slower? Probe the VM's disk."""
import concurrent.futures, json, os, subprocess, sys, time
sys.path.insert(0, os.getcwd())
from arrayio import tools
from arrayio._buffers import aligned_empty
from benchmarks._pagecache import drop_caches

MiB = 1 << 20; GiB = int(os.environ.get("PROBE_BYTES", 1 << 30))
d = sys.argv[1]; out = sys.argv[2]
os.makedirs(d, exist_ok=True)
host = aligned_empty(GiB); host[:] = 7
res = {}
def sh(c):
    return subprocess.run(c, shell=True, capture_output=True, text=True).stdout
res["env"] = sh("uname -r; findmnt -T %s; cat /sys/block/vda/queue/scheduler /sys/block/vda/queue/max_sectors_kb /sys/block/vda/queue/nr_requests /sys/block/vda/queue/read_ahead_kb /sys/block/vda/queue/rotational; lsblk; nproc" % d)
T = {}
def tool(kind, th, task):
    k = (kind, th, task)
    if k not in T: T[k] = tools.make(kind, threads=th, task_size=task)
    return T[k]
def write(path, kind="direct", th=4, task=64*MiB, trunc=True):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if trunc else 0), 0o644)
    t = time.perf_counter(); tool(kind, th, task).write(fd, host, 0); os.fsync(fd); s = time.perf_counter() - t
    os.close(fd); return round(GiB / s / 1e9, 2)
def read(path, th=16, task=16*MiB, kind="direct", drop=True):
    if drop: drop_caches()
    fd = os.open(path, os.O_RDONLY)
    t = time.perf_counter(); tool(kind, th, task).read(fd, host, 0); s = time.perf_counter() - t
    os.close(fd); return round(GiB / s / 1e9, 2)
def log(k, v):
    res[k] = v; print(k, v, flush=True)
    json.dump(res, open(out, "w"), indent=1)
A = os.path.join(d, "a.bin")
# 1: write direct then read at once, read again, sleep then read
for i in range(3):
    log(f"cycle{i}", {"write_direct": write(A), "read_now": read(A), "read_again": read(A),
                      "read_again2": read(A)})
log("filefrag_direct", sh(f"filefrag {A}"))
time.sleep(float(os.environ.get("PROBE_SLEEP", 5))); log("read_after_5s", [read(A) for _ in range(2)])
# 2: buffered write then read
for i in range(2):
    log(f"bcycle{i}", {"write_posix": write(A, "posix"), "read_now": read(A), "read_again": read(A)})
log("filefrag_posix", sh(f"filefrag {A}"))
# 3: write without truncation (blocks stay allocated)
log("write_overwrite", [write(A, trunc=False) for _ in range(3)])
log("read_after_overwrite", [read(A) for _ in range(2)])
log("write_new_trunc", [write(A) for _ in range(3)])
log("write_1x64", [write(A, th=1) for _ in range(2)])
log("write_8x32", [write(A, th=8, task=32*MiB) for _ in range(2)])
# 4: read settings on a settled file
time.sleep(float(os.environ.get("PROBE_SLEEP", 2)))
for th, task in [(4, 16*MiB), (8, 16*MiB), (16, 16*MiB), (32, 4*MiB), (16, 64*MiB), (32, 16*MiB), (64, 4*MiB)]:
    log(f"read_{th}x{task>>20}M", [read(A, th, task) for _ in range(2)])
log("read_buffered_16x16", [read(A, 16, 16*MiB, "posix") for _ in range(2)])
# 5: 16 files of 64 MiB, written direct, read one thread per file
files = [os.path.join(d, f"s{i}.bin") for i in range(16)]
def wfile(i):
    fd = os.open(files[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    v = memoryview(host)[i*(GiB//16):(i+1)*(GiB//16)]
    os.pwrite(fd, v, 0); os.fsync(fd); os.close(fd)
def rfile(i):
    fd = os.open(files[i], os.O_RDONLY | os.O_DIRECT)
    v = memoryview(host)[i*(GiB//16):(i+1)*(GiB//16)]
    n = 0
    while n < GiB//16: n += os.preadv(fd, [v[n:n+16*MiB]], n)
    os.close(fd)
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    for i in range(3):
        t = time.perf_counter(); list(pool.map(wfile, range(16))); w = GiB / (time.perf_counter() - t) / 1e9
        drop_caches(); t = time.perf_counter(); list(pool.map(rfile, range(16))); r = GiB / (time.perf_counter() - t) / 1e9
        drop_caches(); t = time.perf_counter(); list(pool.map(rfile, range(16))); r2 = GiB / (time.perf_counter() - t) / 1e9
        log(f"files16_{i}", [round(w, 2), round(r, 2), round(r2, 2)])
log("A_after_files", [read(A) for _ in range(2)])
for f in files + [A]: os.unlink(f)
