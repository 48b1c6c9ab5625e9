"""Head-to-head benchmarks of arrayio against the libraries people use today, beside the
hardware's limits measured in the same run.

* :mod:`benchmarks.peers.checkpoint`: a model-like pytree saved from and loaded to the GPU
  (torch, safetensors, NumPy, orbax, raw KvikIO, fastsafetensors, arrayio's front doors);
* :mod:`benchmarks.peers.featuremap`: many medium arrays offloaded and read back while the
  GPU computes, as a step time;
* :mod:`benchmarks.peers.small_arrays`: thousands of 4 to 64 KiB arrays, per-array overhead.

Each takes ``--out DIR`` (JSON and, where matplotlib is installed, a PNG) and ``--smoke``
(tiny sizes in host memory, what CI runs). ``--replot DIR/NAME.json`` redraws a plot from
its JSON. What they share is in :mod:`benchmarks.peers._harness`.
"""
