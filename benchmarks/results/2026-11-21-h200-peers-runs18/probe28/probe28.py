"""Probe 28 (2026-11-21): where a warm 8 GiB arrayio load to the GPU loses against raw
KvikIO in the checkpoint harness (run 18: 29.7 against 35.4 GB/s, ceiling 37.7).  The torch
state stays on the GPU, as in the harness.  Warm loads, shuffled per round, one forced read
tool (the tuned one): arrayio like torch with and without CRC verification, like jax, like
cupy; the harness's raw KvikIO peer; and the CRC kernels alone over a loaded tree."""
import json, os, random, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, jax, numpy as np, torch  # noqa: F401
from benchmarks.peers import checkpoint as ck, _harness as h
import arrayio
from arrayio._buffers import CupyDeviceBuffer
from arrayio._device_checksum import DeviceChecksums

out, gib, rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
res = {"argv": sys.argv}
entries = ck.layout(int(gib * (1 << 30)), 2048, 65536)
state = ck.make_state(entries, "cuda"); nbytes = sum(t.numel() * t.element_size() for t in state.values()); h.settle()
d = tempfile.mkdtemp(prefix="probe28-", dir="/tmp")
paths = {"arrayio": f"{d}/a.safetensors", "kvikio": f"{d}/k.bin"}
arrayio.save(paths["arrayio"], state, tool="staged(chunk_size=33554432,direct=True,threads=8)")
kv = ck.kvikio_peer(state); kv.save(paths["kvikio"])
TOOL = "kvikio(task_size=4194304,threads=16)"


def crc_only():
    tree = arrayio.load(paths["arrayio"], like="cupy", device="cuda", tool=TOOL, verify=False)
    bufs = [CupyDeviceBuffer(a.reshape(-1).view(cupy.uint8)) for a in tree.values()]
    h.settle()
    t = time.perf_counter()
    with DeviceChecksums(bufs, own_stream=True) as c:
        c.results()
    return time.perf_counter() - t


kinds = {
    "arrayio-torch": lambda: arrayio.load(paths["arrayio"], like="torch", device="cuda", tool=TOOL),
    "arrayio-torch-noverify": lambda: arrayio.load(paths["arrayio"], like="torch", device="cuda", tool=TOOL, verify=False),
    "arrayio-jax": lambda: arrayio.load(paths["arrayio"], like="jax", device="cuda", tool=TOOL),
    "arrayio-cupy": lambda: arrayio.load(paths["arrayio"], like="cupy", device="cuda", tool=TOOL),
    "kvikio-peer": lambda: kv.load(paths["kvikio"]),
}
res["loads"], res["crc_only_s"] = [], []
rng = random.Random(28)
for r in range(rounds + 1):
    order = list(kinds) + ["crc-only"]
    rng.shuffle(order)
    for kind in order:
        if kind == "crc-only":
            s = crc_only()
            if r:
                res["crc_only_s"].append(s)
            continue
        h.warm(paths["kvikio" if kind == "kvikio-peer" else "arrayio"])
        with h.GcMeter() as g:
            t = time.perf_counter(); o = kinds[kind]()
            h.settle(jax_tree=o if kind == "arrayio-jax" else None); s = time.perf_counter() - t
        del o
        if r:
            res["loads"].append({"round": r, "kind": kind, "s": round(s, 4), "GBps": round(nbytes / s / 1e9, 2), **g.report()})
            print(res["loads"][-1], flush=True)
res["median_GBps"] = {k: statistics.median(x["GBps"] for x in res["loads"] if x["kind"] == k) for k in kinds}
res["median_ms"] = {k: round(1e3 * statistics.median(x["s"] for x in res["loads"] if x["kind"] == k), 1) for k in kinds}
res["crc_only_ms_median"] = round(1e3 * statistics.median(res["crc_only_s"]), 1)
print(json.dumps(res["median_GBps"]), json.dumps(res["median_ms"]), "crc only ms", res["crc_only_ms_median"], flush=True)
json.dump(res, open(out, "w"), indent=1)
h.remove(d)
