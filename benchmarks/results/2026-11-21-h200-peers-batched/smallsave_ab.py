"""A/B: 300 .npy saves of small CUDA tensors, one file each, fsynced (file and directory),
as benchmarks.peers.small_arrays does; which arrayio is first on sys.path decides the variant
(the name given as the argument only labels the output).

Run on the GPU machine as ``.devrun/final.sh`` did: ``old`` with the code of commit 52e52b0
first on ``PYTHONPATH``, ``new`` with this repository's, alternating. (Tidied after the run,
for the linter and to share ``fsync_path``; the logic is what ran.)
"""

import os
import sys
import tempfile
import time

import torch

import arrayio
from benchmarks._pagecache import fsync_path  # run from the repository root


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.randint(1024, 16384, (300,), generator=torch.Generator().manual_seed(0))
    arrays = [torch.randn(int(n), device="cuda", generator=generator) for n in sizes]
    torch.cuda.synchronize()
    directory = tempfile.mkdtemp(dir="/tmp", prefix="ab-")
    for rep in range(3):
        start = time.perf_counter()
        for i, array in enumerate(arrays):
            path = os.path.join(directory, f"a{i}.npy")
            arrayio.save(path, array)
            fsync_path(path)
        fsync_path(directory)
        save = (time.perf_counter() - start) / len(arrays) * 1e6
        start = time.perf_counter()
        for i, array in enumerate(arrays):
            path = os.path.join(directory, f"t{i}.pt")
            torch.save(array, path)
            fsync_path(path)
        fsync_path(directory)
        torch_save = (time.perf_counter() - start) / len(arrays) * 1e6
        print(f"{sys.argv[1]:4s} rep {rep}: arrayio save {save:7.1f} us/array, "
              f"torch.save {torch_save:7.1f}", flush=True)


if __name__ == "__main__":
    main()
