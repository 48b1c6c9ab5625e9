"""Sharded checkpoints: arrayio against orbax and tensorstore, saving and restoring a pytree
of jax.Arrays sharded over 8 devices, beside the disk's write and page-cache read ceilings,
in one run.

``python -m benchmarks.sharded --out DIR [--gib 2] [--devices 8] [--repeats 3] [--dir DIR]``

The run happens in a child process (:mod:`benchmarks._sharded_child`) with ``--devices`` JAX
devices: CPU host devices (``--xla_force_host_platform_device_count``; the default, and the
only choice without several GPUs). The pytree is ``--gib`` GiB of 8 float32 matrices (4096
columns), each sharded along its rows over all devices (``P("data")``). Peers:

* ``arrayio``: ``arrayio.save(path, tree)``; ``arrayio.load(path, structure=...)`` with
  ``jax.ShapeDtypeStruct``s that carry the target sharding;
* ``orbax`` (optional): ``StandardCheckpointer.save`` and ``wait_until_finished``;
  ``restore`` with the same target. Its default layout, which is OCDBT in orbax 0.12
  (``use_ocdbt=True``): the JSON's ``orbax_layout`` says what it wrote, so OCDBT is no
  separate peer;
* ``tensorstore`` (optional): one zarr3 array per leaf over the ``file`` kvstore, a chunk
  per shard, no compression; each addressable shard written, each device's region read
  back and assembled with ``jax.make_array_from_single_device_arrays``.

A peer that does not import is listed under ``peers_unavailable`` with the reason. Each
round, in a shuffled order, every peer and the ceilings:

* **save**: made durable inside the timing (the peer's files and directories fsynced, which
  leaves nothing to do for a peer that fsyncs its own);
* **restore**: onto the same sharding; **reshard**: onto a 4 x 2 mesh sharded along both
  axes (``P("data", "model")``); both checked against the tree;
* **peak host memory** during each save: the most the process's resident set grew above
  where it was, sampled every 2 ms;
* **ceilings** (:class:`benchmarks.peers._harness.DiskCeilings`): ``write_fsync``, the
  checkpoint's bytes written into a new file in the same directory by 4 threads of plain
  ``pwrite`` then fsynced; ``warm_read``, that file read back from the page cache by 16
  threads. Saves are judged against the first, restores (which read files the save just
  wrote, so mostly from the page cache) against the second.

GB/s of array bytes (10^9 per second); each figure is the median of ``--repeats`` timed
rounds, after an untimed one; every round's seconds are in the JSON. Results go to
``DIR/sharded.json`` and ``DIR/sharded.png``.
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
import time
from typing import Any

from benchmarks.sweep import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


QUANTITIES = ("save", "restore", "reshard")
# What each quantity is judged against: saves write the disk, restores read the page cache.
CEILING_OF = {"save": "write_fsync", "restore": "warm_read", "reshard": "warm_read"}


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_ceilings(report: dict[str, Any]) -> dict[str, Any]:
    """Each ceiling's GB/s in every timed round and their median; None where its setting
    failed (the ceiling's ``error`` in ``report["ceilings"]`` says why)."""
    nbytes = report["ceilings"]["bytes"]
    out = {}
    for name in dict.fromkeys(CEILING_OF.values()):
        rounds = [rate(nbytes, r[f"{name}_s"]) for r in report["ceiling_rows"] if f"{name}_s" in r]
        out[name] = {
            "GBps": statistics.median(rounds) if rounds else None,
            "rounds_GBps": rounds,
            "setting": report["ceilings"][name]["setting"],
        }
    return out


def summarize_peer(rows: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """One peer's GB/s in every round, their medians, and its largest peak during a save."""
    out: dict[str, Any] = {"rounds_GBps": {}}
    for quantity in QUANTITIES:
        rounds = [rate(nbytes, r[f"{quantity}_s"]) for r in rows]
        out["rounds_GBps"][quantity] = rounds
        out[quantity] = statistics.median(rounds)
    out["save_peak_extra_bytes_rounds"] = [r["save_peak_extra_bytes"] for r in rows]
    out["save_peak_extra_bytes"] = max(out["save_peak_extra_bytes_rounds"])
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per peer: medians of GB/s, and each as a ratio to orbax's and to its ceiling's median
    (``vs_orbax``, ``vs_ceiling``); the ceilings' medians under ``ceilings``."""
    ceilings = summarize_ceilings(report)
    peers = {
        name: summarize_peer([r for r in report["rows"] if r["peer"] == name], report["nbytes"])
        for name in sorted({r["peer"] for r in report["rows"]})
    }
    for name, peer in peers.items():
        peer["vs_ceiling"] = {
            q: ratio(peer[q], ceilings[CEILING_OF[q]]["GBps"]) for q in QUANTITIES
        }
        if "orbax" in peers and name != "orbax":
            peer["vs_orbax"] = {q: ratio(peer[q], peers["orbax"][q]) for q in QUANTITIES}
    return {"ceilings": ceilings, "peers": peers}


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    peers = sorted(summary["peers"])
    fig, ax = plt.subplots(figsize=(8.5, 4))
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        ax.bar(
            [q + (i - (len(peers) - 1) / 2) * width for q in range(len(QUANTITIES))],
            [summary["peers"][peer][q] for q in QUANTITIES],
            width,
            label=peer,
        )
    style = {"write_fsync": ("--", "write ceiling"), "warm_read": (":", "page-cache read ceiling")}
    labelled = set()
    for q, quantity in enumerate(QUANTITIES):
        name = CEILING_OF[quantity]
        ceiling = summary["ceilings"][name]["GBps"]
        if ceiling is not None:
            line, label = style[name]
            ax.hlines(
                ceiling,
                q - 0.45,
                q + 0.45,
                colors="k",
                linestyles=line,
                label=None if name in labelled else label,
            )
            labelled.add(name)
    ax.set_xticks(range(len(QUANTITIES)))
    ax.set_xticklabels(QUANTITIES)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(
        f"{report['gib']} GiB sharded over {report['devices']} {report['platform']} devices, "
        f"{report['date'][:10]}"
    )
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run_child(spec: dict[str, Any], devices: int) -> dict[str, Any]:
    """Run :mod:`benchmarks._sharded_child` with ``devices`` CPU host devices; its result."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks._sharded_child", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    sys.stdout.write(done.stdout[-4000:])
    if done.returncode != 0:
        raise SystemExit(f"the benchmark's process failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.split("RESULT ", 1)[1])
    return result


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
    scratch = os.path.abspath(tempfile.mkdtemp(prefix="arrayio-sharded-", dir=args.dir))
    spec = {
        "gib": args.gib,
        "devices": args.devices,
        "repeats": args.repeats,
        "dir": scratch,
        "seed": args.seed if args.seed is not None else random.randrange(1 << 30),
    }
    start = time.time()
    try:
        result = run_child(spec, args.devices)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {
        "benchmark": "sharded",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        "command": " ".join(["python", "-m", "benchmarks.sharded", *(argv or sys.argv[1:])]),
        "gib": args.gib,
        "seed": spec["seed"],
        "machine": {**machine(), "cpu_model": cpu_model()},
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
