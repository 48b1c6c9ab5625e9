"""Tune arrayio once on this machine for the checkpoint benchmark's 1 and 8 GiB sizes (the
contexts its loads and saves use), as a user would once per machine; the table is saved
under ARRAYIO_CACHE_DIR. Usage: python3 tune_ckpt.py OUT.json"""
import json, os, sys, tempfile, time
import numpy as np
import arrayio
from benchmarks.peers import checkpoint as ck

size = {"float32": 4, "bfloat16": 2}
sizes = [sum(int(np.prod(s)) * size[d] for _, s, d in ck.layout(int(g * (1 << 30)), 2048, 65536))
         for g in (1, 8)]
directory = tempfile.mkdtemp(prefix="arrayio-tune-")
start = time.perf_counter()
report = arrayio.tune(directory, device="cuda", sizes=sizes)
seconds = time.perf_counter() - start
print(report)
print(f"tuned {sizes} in {seconds:.1f} s", flush=True)
json.dump({"sizes": sizes, "seconds": seconds, "report": report.as_dict()},
          open(sys.argv[1], "w"), indent=1, default=str)
os.rmdir(directory)
