"""Sharded checkpoints: arrayio against orbax, saving and restoring a pytree of jax.Arrays
sharded over 8 devices, in one run.

``python -m benchmarks.sharded --out DIR [--gib 2] [--devices 8] [--repeats 3] [--dir DIR]``

The run happens in a child process with ``--devices`` JAX devices: CPU host devices
(``--xla_force_host_platform_device_count``; the default, and the only choice without
several GPUs). The pytree is ``--gib`` GiB of float32 matrices (4096 columns), each sharded
along its rows over all devices (``P("data")``). Each round, peers in a shuffled order:

* **save**: ``arrayio.save(path, tree)`` against orbax's ``StandardCheckpointer.save``
  (its default layout, OCDBT where the version has it) and ``wait_until_finished``;
* **restore**: onto the same sharding (``arrayio.load(path, structure=...)`` with
  ``jax.ShapeDtypeStruct``s that carry it; orbax's ``restore`` with the same target);
* **reshard**: onto a 4 x 2 mesh sharded along both axes (``P("data", "model")``);
* **peak host memory** during each save: the most the process's resident set grew above
  where it was, sampled every 2 ms.

GB/s of array bytes (10^9 per second); the figure of each is the median of ``--repeats``
rounds. Restores read files the save just wrote, so mostly from the page cache. Results go
to ``DIR/sharded.json`` and ``DIR/sharded.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

from benchmarks.sweep import machine

CHILD = textwrap.dedent(
    r"""
    import json, os, random, shutil, statistics, sys, threading, time
    import numpy as np
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio

    args = json.loads(sys.argv[1])
    devices = jax.devices()
    assert len(devices) == args["devices"], devices
    mesh = Mesh(np.array(devices).reshape(-1), ("data",))
    mesh2 = Mesh(np.array(devices).reshape(-1, 2), ("data", "model"))
    rows = NamedSharding(mesh, P("data"))
    both = NamedSharding(mesh2, P("data", "model"))
    columns, matrices = 4096, 8
    per = int(args["gib"] * (1 << 30)) // (4 * columns * matrices)
    per -= per % (2 * len(devices))
    rng = np.random.default_rng(0)
    tree = {
        f"layer{i}": jax.device_put(rng.standard_normal((per, columns), np.float32), rows)
        for i in range(matrices)
    }
    jax.block_until_ready(tree)
    nbytes = sum(x.nbytes for x in tree.values())

    def target(sharding):
        return {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for k, x in tree.items()
        }

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def peak_during(run):
        base, peak, done = rss(), [0], []
        def sample():
            while not done:
                peak[0] = max(peak[0], rss() - base)
                time.sleep(0.002)
        thread = threading.Thread(target=sample)
        thread.start()
        start = time.perf_counter()
        try:
            run()
        finally:
            seconds = time.perf_counter() - start
            done.append(1)
            thread.join()
        return seconds, max(peak[0], rss() - base)

    def timed(run):
        start = time.perf_counter()
        out = run()
        jax.block_until_ready(out)
        return time.perf_counter() - start, out

    def check(out, sharding):
        for k, x in out.items():
            assert x.sharding == sharding, k
            assert np.array_equal(np.asarray(x[:: per // 4]), np.asarray(tree[k][:: per // 4])), k

    scratch = args["dir"]
    peers = {}

    def arrayio_peer():
        path = os.path.join(scratch, "arrayio.safetensors")
        return {
            "save": lambda: arrayio.save(path, tree),
            "restore": lambda s: arrayio.load(path, structure=target(s)),
            "clean": lambda: os.path.exists(path) and os.remove(path),
        }
    peers["arrayio"] = arrayio_peer()
    try:
        import orbax.checkpoint as ocp
        checkpointer = ocp.StandardCheckpointer()
        orbax_path = os.path.join(scratch, "orbax")
        def orbax_save():
            checkpointer.save(orbax_path, tree, force=True)
            checkpointer.wait_until_finished()
        peers["orbax"] = {
            "save": orbax_save,
            "restore": lambda s: checkpointer.restore(orbax_path, target(s)),
            "clean": lambda: shutil.rmtree(orbax_path, ignore_errors=True),
        }
        orbax_version = ocp.__version__
    except Exception as error:
        orbax_version = f"unavailable: {type(error).__name__}: {error}"

    rows_out = []
    rng_order = random.Random(args["seed"])
    for repetition in range(args["repeats"] + 1):  # the first round untimed: imports, caches
        order = list(peers)
        rng_order.shuffle(order)
        for name in order:
            peer = peers[name]
            peer["clean"]()
            save_s, peak = peak_during(peer["save"])
            restore_s, out = timed(lambda: peer["restore"](rows))
            check(out, rows)
            del out
            reshard_s, out = timed(lambda: peer["restore"](both))
            check(out, both)
            del out
            if repetition:
                rows_out.append({"peer": name, "repetition": repetition, "save_s": save_s,
                                 "restore_s": restore_s, "reshard_s": reshard_s,
                                 "save_peak_extra_bytes": peak})
                print(json.dumps(rows_out[-1]), flush=True)
    for peer in peers.values():
        peer["clean"]()
    print("RESULT " + json.dumps({
        "rows": rows_out, "nbytes": nbytes, "shard_bytes": nbytes // len(tree) // len(devices),
        "array_bytes": nbytes // len(tree), "arrays": len(tree), "devices": len(devices),
        "platform": devices[0].platform, "orbax": orbax_version, "jax": jax.__version__,
    }))
    """
)


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    nbytes = report["nbytes"]
    for peer in sorted({r["peer"] for r in report["rows"]}):
        mine = [r for r in report["rows"] if r["peer"] == peer]
        out[peer] = {
            quantity: statistics.median(nbytes / r[f"{quantity}_s"] / 1e9 for r in mine)
            for quantity in ("save", "restore", "reshard")
        }
        out[peer]["save_peak_extra_bytes"] = max(r["save_peak_extra_bytes"] for r in mine)
    if "orbax" in out:
        for quantity in ("save", "restore", "reshard"):
            out["arrayio"][f"{quantity}_vs_orbax"] = (
                out["arrayio"][quantity] / out["orbax"][quantity]
            )
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    peers = sorted(summary)
    quantities = ("save", "restore", "reshard")
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        ax.bar(
            [q + (i - (len(peers) - 1) / 2) * width for q in range(len(quantities))],
            [summary[peer][q] for q in quantities],
            width,
            label=peer,
        )
    ax.set_xticks(range(len(quantities)))
    ax.set_xticklabels(quantities)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(
        f"{report['gib']} GiB sharded over {report['devices']} {report['platform']} devices, "
        f"{report['date'][:10]}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="arrayio-sharded-", dir=args.dir)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
    }
    spec = {
        "gib": args.gib,
        "devices": args.devices,
        "repeats": args.repeats,
        "dir": scratch,
        "seed": args.seed if args.seed is not None else random.randrange(1 << 30),
    }
    start = time.time()
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.stdout.write(done.stdout[-4000:])
    if done.returncode != 0:
        raise SystemExit(f"the benchmark's process failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    report = {
        "benchmark": "sharded",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        "command": " ".join(["python", "-m", "benchmarks.sharded", *(argv or sys.argv[1:])]),
        "gib": args.gib,
        "machine": machine(),
        "seconds": time.time() - start,
        **result,
    }
    report["summary"] = summarize(report)
    with open(os.path.join(args.out, "sharded.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["summary"], indent=1))
    try:
        plot(report, os.path.join(args.out, "sharded.png"))
    except ImportError:
        pass
    return report


if __name__ == "__main__":
    main()
