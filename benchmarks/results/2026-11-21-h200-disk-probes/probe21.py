"""Do checksums overlapped with the reads (each array's kernel launched as it lands) load
faster than checksums after the batch (how loads ran before 120ced3)? Alternating rounds of a
warm arrayio.load forced onto KvikIO 16 x 4 MiB: overlapped, after the batch, without
checksums; and the raw KvikIO peer."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch
import arrayio
from arrayio import _device_checksum as dc
from arrayio.dispatch import Arm, batches
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
gibs = [float(g) for g in (sys.argv[3] if len(sys.argv) > 3 else "1,8").split(",")]
os.makedirs(out, exist_ok=True)
MiB = 1 << 20
Overlapped = dc.DeviceChecksums


class AfterBatch(dc.DeviceChecksums):
    """Launches nothing until results(): every kernel after the whole batch is read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.collecting = False

    def launch(self, index):
        if self.collecting:
            super().launch(index)

    def results(self):
        self.collecting = True
        return super().results()


results = {"rounds": rounds, "sizes": {}}
forced = Arm.of("kvikio", threads=16, task_size=4 * MiB)
for gib in gibs:
    state = ck.make_state(ck.layout(int(gib * (1 << 30)), 2048, 65536), "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    h.settle()
    d = tempfile.mkdtemp(prefix="p21-", dir="/tmp")
    kv = ck.kvikio_peer(state)
    kv_path = os.path.join(d, "kv.bin"); kv.save(kv_path)
    path = os.path.join(d, "a.safetensors"); arrayio.save(path, state)
    for f in (path, kv_path):
        with open(f, "rb") as fh:
            while fh.read(64 * MiB):
                pass
    held = []

    def load(kind, verify=True):
        def go():
            batches._device_checksum.DeviceChecksums = kind
            try:
                held.append(arrayio.load(path, like="torch", device="cuda", tool=forced,
                                         verify=verify))
            finally:
                batches._device_checksum.DeviceChecksums = Overlapped
        return go

    variants = {"overlapped": load(Overlapped), "after_batch": load(AfterBatch),
                "no_checksums": load(Overlapped, verify=False),
                "kvikio_raw": lambda: held.append(kv.load(kv_path))}
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
    results["sizes"][f"{gib:g}"] = {
        "bytes": nbytes, "tensors": len(state),
        "median_GBps": {k: statistics.median(v) for k, v in samples.items()},
        "samples_GBps": samples}
    print(json.dumps(results["sizes"][f"{gib:g}"]["median_GBps"], indent=1), flush=True)
    held.clear(); del state, kv
    h.settle(); torch.cuda.empty_cache(); cupy.get_default_memory_pool().free_all_blocks()
    h.remove(d)
with open(os.path.join(out, "probe21.json"), "w") as f:
    json.dump(results, f, indent=1)
