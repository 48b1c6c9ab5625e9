"""Does launching a checksum kernel per array cost a warm load time? Alternating rounds of a
warm arrayio.load (forced onto KvikIO 16 x 4 MiB) with the kernel given the buffer's
address (now) or a CuPy view of it (before: torch builds __cuda_array_interface__ in Python),
without checksums, and the raw KvikIO peer; and the launch alone, in microseconds."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import cupy, numpy as np, torch
import arrayio
from arrayio import _device_checksum as dc
from arrayio._buffers import TorchDeviceBuffer
from arrayio.dispatch import Arm
from benchmarks.peers import checkpoint as ck, _harness as h
out = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
gibs = [float(g) for g in (sys.argv[3] if len(sys.argv) > 3 else "1,8").split(",")]
os.makedirs(out, exist_ok=True)
MiB = 1 << 20
new_launch = dc.DeviceChecksums._launch


def view_launch(self, cupy, index):  # the launch of 120ced3-b59e0d5
    buffer = self.buffers[index]
    device, row = self._rows[index]
    nbytes = buffer.nbytes
    per_thread = self._segment or dc.segment_for(nbytes)
    segments = -(-nbytes // per_thread)
    with cupy.cuda.Device(device), self._stream(cupy, device):
        out = self._out.get(device)
        if out is None:
            out = self._out[device] = cupy.zeros((self._counts[device], 2), cupy.uint32)
        data = cupy.asarray(buffer.cuda_array).view(cupy.uint8).reshape(-1)
        kernel, tables, powers = dc._kernel(cupy, device, per_thread)
        blocks = -(-segments // dc._THREADS)
        kernel((blocks,), (dc._THREADS,),
               (data, np.uint64(nbytes), np.uint64(per_thread), np.uint64(segments),
                tables, powers, out[row]))
    self._shapes[index] = (nbytes, per_thread, segments)


results = {"rounds": rounds, "sizes": {}}
forced = Arm.of("kvikio", threads=16, task_size=4 * MiB)
for gib in gibs:
    state = ck.make_state(ck.layout(int(gib * (1 << 30)), 2048, 65536), "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    h.settle()
    d = tempfile.mkdtemp(prefix="p20-", dir="/tmp")
    kv = ck.kvikio_peer(state)
    kv_path = os.path.join(d, "kv.bin"); kv.save(kv_path)
    path = os.path.join(d, "a.safetensors"); arrayio.save(path, state)
    for f in (path, kv_path):
        with open(f, "rb") as fh:
            while fh.read(64 * MiB):
                pass
    held = []

    def load(launch, verify=True):
        def go():
            dc.DeviceChecksums._launch = launch
            try:
                held.append(arrayio.load(path, like="torch", device="cuda", tool=forced,
                                         verify=verify))
            finally:
                dc.DeviceChecksums._launch = new_launch
        return go

    variants = {"address": load(new_launch), "view": load(view_launch),
                "no_checksums": load(new_launch, verify=False),
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
    # The launches alone, on the state's own tensors (already complete).
    buffers = [TorchDeviceBuffer(t.reshape(-1).view(torch.uint8)) for t in state.values()
               if t.numel() * t.element_size() >= (4 << 20)]
    launch_us = {}
    for name, launch in (("address", new_launch), ("view", view_launch)):
        per = []
        for _ in range(5):
            sums = dc.DeviceChecksums(buffers, own_stream=True)
            dc.DeviceChecksums._launch = launch
            try:
                t = time.perf_counter()
                for i in range(len(buffers)):
                    sums.launch(i)
                per.append((time.perf_counter() - t) / len(buffers) * 1e6)
                sums.results()
            finally:
                dc.DeviceChecksums._launch = new_launch
        launch_us[name] = statistics.median(per)
    print(gib, "launch us", launch_us, len(buffers), flush=True)
    results["sizes"][f"{gib:g}"] = {
        "bytes": nbytes, "tensors": len(state), "checksummed_on_gpu": len(buffers),
        "median_GBps": {k: statistics.median(v) for k, v in samples.items()},
        "samples_GBps": samples, "launch_us": launch_us}
    print(json.dumps(results["sizes"][f"{gib:g}"]["median_GBps"], indent=1), flush=True)
    held.clear(); del state, kv
    h.settle(); torch.cuda.empty_cache(); cupy.get_default_memory_pool().free_all_blocks()
    h.remove(d)
with open(os.path.join(out, "probe20.json"), "w") as f:
    json.dump(results, f, indent=1)
