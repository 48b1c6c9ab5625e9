"""Sharded checkpoints: arrayio against orbax and tensorstore, saving and restoring a pytree
of jax.Arrays sharded over several devices, beside the disk's write and read ceilings, in one
run; optionally a Hugging Face checkpoint loaded with a tensor-parallel slice per device.

``python -m benchmarks.sharded --out DIR [--gib 2] [--devices 8] [--repeats 3] [--dir DIR]
[--platform cpu|gpu] [--processes 1] [--cold] [--scaling] [--peers orbax,tensorstore]
[--restore-tool NAME]
[--hf-gib 0] [--hf-files 4] [--ceiling-gib G]``, or ``--replot DIR/sharded.json``

The run happens in child processes (:mod:`benchmarks._sharded_child`) with ``--devices`` JAX
devices: CPU host devices (``--xla_force_host_platform_device_count``; the default), or the
GPUs (``--platform gpu``). ``--processes N`` starts N processes joined by
``jax.distributed`` (on GPUs, one GPU each); every figure is then timed from all processes'
start to the last one's end. The pytree is ``--gib`` GiB of 8 float32 matrices (4096
columns), each sharded along its rows over all devices (``P("data")``). Peers:

* ``arrayio``: ``arrayio.save(path, tree)``; ``arrayio.load(path, structure=...)`` with
  ``jax.ShapeDtypeStruct``s that carry the target sharding;
* ``orbax`` (optional): ``StandardCheckpointer.save`` and ``wait_until_finished``;
  ``restore`` with the same target. Its default layout, which is OCDBT in orbax 0.12
  (``use_ocdbt=True``): the JSON's ``orbax_layout`` says what it wrote, so OCDBT is no
  separate peer;
* ``tensorstore`` (optional, one process only): one zarr3 array per leaf over the ``file``
  kvstore, a chunk per shard, no compression; each addressable shard written, each device's
  region read back and assembled with ``jax.make_array_from_single_device_arrays``.

``--restore-tool TOOL`` adds the peer ``arrayio+TOOL``: right after arrayio's save and
restores in every round, the same checkpoint restored naming that transfer tool
(``tool=``), as a user can (``pagecache``: the GPU copying straight out of the page cache).
``--peers`` names the optional peers to run (all by default). A peer that does not import
is listed under ``peers_unavailable`` with the reason. Each round, in a shuffled order,
every peer and the ceilings:

* **save**: made durable inside the timing (the peer's files and directories fsynced, which
  leaves nothing to do for a peer that fsyncs its own);
* **cold_restore** (``--cold``, not in the untimed round): onto the same sharding, after the
  checkpoint's files were evicted and, where the process is root, every cache dropped;
* **restore**: onto the same sharding, from the page cache (after a cold restore, the files
  read twice first, untimed, as the page-cache ceiling's file is: the read after a cold one
  moves every page to the kernel's active list, a cost the rows' ``pgactivate`` counts);
  **reshard**: onto a devices/2 x 2 mesh sharded along
  both axes (``P("data", "model")``); **restore_n1**, ``_n2``... (``--scaling``, one
  process): along the rows of the first 1, 2, 4... devices. All checked element by element
  against the tree, on the devices;
* **tp_cold**, **tp_warm** (``--hf-gib``): the checkpoint of :mod:`benchmarks._tp_load`
  loaded with a slice per device, by arrayio and, with one process per GPU, by
  fastsafetensors' and InstantTensor's distributed modes;
* **peak host memory** during each save: the most process 0's resident set grew above where
  it was, sampled every 2 ms;
* **ceilings** (:class:`benchmarks.peers._harness.DiskCeilings`): ``write_fsync``, the
  checkpoint's bytes written into a new file in the same directory by 4 threads of plain
  ``pwrite`` then fsynced; ``warm_read``, that file read back from the page cache by 16
  threads; with ``--cold``, ``cold_read``, read by 16 threads of ``O_DIRECT`` after
  eviction, and ``cold_buffered_read``, by 16 buffered threads after eviction (the rate
  of a cold read that leaves the file in the page cache); on GPUs with torch,
  ``host_to_device``, pinned host memory copied to every GPU at once (up to 1 GiB each);
  and ``memory_copy``, host memory copied by 16 threads in each process (up to 1 GiB each:
  a read from the page cache into GPUs moves each byte through host memory once more than
  a read into host memory); with several processes, ``write_fsync_shared``, the write
  ceiling's setting with every process writing its share into one file (as their save
  does). The disk's on a file of the checkpoint's size, or of
  ``--ceiling-gib`` (a rate, not a time: a smaller file saves the minutes each round's
  ceilings take at 16 GiB). The copy ceilings hold their buffers for the whole run (per
  process 2 GiB of host memory, and on GPUs 1 GiB pinned and 1 GiB on each GPU). With
  several processes, each process samples its share of the bytes, all at once (the slowest
  one's seconds count), as their devices read at once. Saves are judged against the first,
  restores against the second, cold restores against the third, and each read also against
  the tighter ceilings it meets (``vs_tighter_ceilings``).

GB/s of array bytes (10^9 per second); each figure is the median of ``--repeats`` timed
rounds, after an untimed one; every round's seconds are in the JSON. Results go to
``DIR/sharded.json`` (rewritten after every row, ``complete`` false until the end, so that
a run stopped by a time limit keeps its rounds) and ``DIR/sharded.png``. A 16 GiB run with
orbax and ``--cold`` took about 10 minutes on the GPU VM's disk (1.2 GB/s written).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.peers import _harness as h
from benchmarks.sweep import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What each quantity is judged against: saves write the disk, restores read the page cache
# (the save just wrote the files), cold ones the disk.
CEILING_OF = {
    "save": "write_fsync",
    "restore": "warm_read",
    "reshard": "warm_read",
    "cold_restore": "cold_read",
    "tp_warm": "warm_read",
    "tp_cold": "cold_read",
}


# The tighter limits some quantities also meet, where the run sampled them: a cold read
# through the page cache (arrayio's, for a file its process reads again) meets the disk's
# buffered rate, every read onto GPUs the host-to-device copies', and a save from several
# processes the rate of their writes into one file.
ALSO_BOUNDED_BY = {
    "save": ("write_fsync_shared",),
    "restore": ("host_to_device",),
    "reshard": ("host_to_device",),
    "cold_restore": ("cold_buffered_read", "host_to_device"),
    "tp_warm": ("host_to_device",),
    "tp_cold": ("cold_buffered_read", "host_to_device"),
}
CEILINGS = (
    *dict.fromkeys(CEILING_OF.values()),
    "cold_buffered_read",
    "host_to_device",
    "write_fsync_shared",
    "memory_copy",  # no quantity's ceiling: the memory's rate, for the arithmetic
)


def base_of(quantity: str) -> str:
    """``restore_n1``... (restores onto fewer devices) are restores."""
    return quantity.split("_n")[0]


def ceiling_of(quantity: str) -> str:
    return CEILING_OF[base_of(quantity)]


def in_order(quantities: Any) -> list[str]:
    """``quantities`` in the order of :data:`CEILING_OF`, then by name."""
    return sorted(quantities, key=lambda q: (list(CEILING_OF).index(base_of(q)), q))


def summarize_ceilings(report: dict[str, Any]) -> dict[str, Any]:
    """Each ceiling's GB/s in every timed round and their median; None where its setting
    failed (the ceiling's ``error`` in ``report["ceilings"]`` says why)."""
    out = {}
    for name in CEILINGS:
        if name not in report["ceilings"]:
            continue
        nbytes = report["ceilings"][name].get("bytes", report["ceilings"]["bytes"])
        rows = [r for r in report["ceiling_rows"] if f"{name}_s" in r]
        rounds = [h.rate(nbytes, r[f"{name}_s"]) for r in rows]
        out[name] = {
            "GBps": h.median(rounds),
            "rounds_GBps": rounds,
            "setting": report["ceilings"][name]["setting"],
        }
    return out


def quantities_of(rows: list[dict[str, Any]]) -> list[str]:
    """The quantities the rows hold (``save_s`` gives ``save``), in a stable order."""
    found = {k[: -len("_s")] for r in rows for k in r if k.endswith("_s")}
    return in_order(found)


def summarize_peer(rows: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """One peer's GB/s in every round, their medians, and its largest peak during a save."""
    out: dict[str, Any] = {"rounds_GBps": {}}
    for quantity in quantities_of(rows):
        rounds = [h.rate(nbytes, r[f"{quantity}_s"]) for r in rows]
        out["rounds_GBps"][quantity] = rounds
        out[quantity] = statistics.median(rounds)
    peaks = [r["save_peak_extra_bytes"] for r in rows if "save_peak_extra_bytes" in r]
    if peaks:
        out["save_peak_extra_bytes_rounds"] = peaks
        out["save_peak_extra_bytes"] = max(peaks)
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per peer: medians of GB/s, and each as a ratio to orbax's and to its ceiling's median
    (``vs_orbax``, ``vs_ceiling``), and to the tighter ceilings it also meets where the run
    sampled them (``vs_tighter_ceilings``: ``ALSO_BOUNDED_BY``); the tensor-parallel peers
    also to InstantTensor's (``vs_instanttensor``); the ceilings' medians under
    ``ceilings``; with ``scaling``, arrayio's GB/s per device on 1, 2, 4... devices
    (``per_device``)."""
    ceilings = summarize_ceilings(report)
    tp_bytes = (report.get("tensor_parallel") or {}).get("bytes")
    peers = {}
    for name in sorted({r["peer"] for r in report["rows"]}):
        nbytes = tp_bytes if name.endswith("-tp") else report["nbytes"]
        peers[name] = summarize_peer([r for r in report["rows"] if r["peer"] == name], nbytes)
    for name, peer in peers.items():
        quantities = [q for q in peer if q in peer["rounds_GBps"]]
        peer["vs_ceiling"] = {
            q: h.ratio(peer[q], (ceilings.get(ceiling_of(q)) or {}).get("GBps")) for q in quantities
        }
        peer["vs_tighter_ceilings"] = {
            q: {
                c: h.ratio(peer[q], ceilings[c]["GBps"])
                # Restores onto fewer devices (restore_n1...) have none: the copy ceiling
                # is every device's at once.
                for c in ALSO_BOUNDED_BY.get(q, ())
                if (ceilings.get(c) or {}).get("GBps")
            }
            for q in quantities
        }
        for base in ("orbax", "instanttensor-tp"):
            if base in peers and name != base:
                key = "vs_" + base.split("-")[0]
                shared = [q for q in quantities if q in peers[base]["rounds_GBps"]]
                if shared:
                    peer[key] = {q: h.ratio(peer[q], peers[base][q]) for q in shared}
    summary: dict[str, Any] = {"ceilings": ceilings, "peers": peers}
    arrayio = peers.get("arrayio", {})
    if report.get("scaling"):
        per_device = {}
        points = {report["devices"]: arrayio.get("restore")}
        for quantity in report["scaling"]:
            points[int(quantity.split("_n")[1])] = arrayio.get(quantity)
        per_device["restore"] = {n: v / n for n, v in sorted(points.items()) if v}
        summary["per_device"] = per_device
    return summary


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    peers = sorted(summary["peers"])
    quantities = in_order({q for p in peers for q in summary["peers"][p]["rounds_GBps"]})
    scaling = summary.get("per_device")
    fig, axes = plt.subplots(1, 2 if scaling else 1, figsize=(13 if scaling else 9, 4.2))
    ax = axes[0] if scaling else axes
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        values = [summary["peers"][peer].get(q, 0.0) for q in quantities]
        offsets = [q + (i - (len(peers) - 1) / 2) * width for q in range(len(quantities))]
        ax.bar(offsets, values, width, label=peer)
    style = {
        "write_fsync": ("--", "write ceiling"),
        "warm_read": (":", "page-cache read ceiling"),
        "cold_read": ("-.", "disk read ceiling"),
    }
    labelled = set()
    for q, quantity in enumerate(quantities):
        name = ceiling_of(quantity)
        ceiling = (summary["ceilings"].get(name) or {}).get("GBps")
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
    ax.set_xticks(range(len(quantities)))
    ax.set_xticklabels([q.replace("_", " ") for q in quantities], rotation=30, ha="right")
    ax.set_ylabel("GB/s (median)")
    processes = report.get("processes", 1)
    ax.set_title(
        f"{report['gib']:g} GiB over {report['devices']} {report['platform']} devices, "
        f"{processes} process{'es' if processes > 1 else ''}, {report['date'][:10]}",
        fontsize="medium",
    )
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    if scaling:
        ax2 = axes[1]
        for state, points in scaling.items():
            counts = [int(n) for n in points]
            ax2.plot(counts, list(points.values()), marker="o", label=f"arrayio {state}")
        warm = (summary["ceilings"].get("warm_read") or {}).get("GBps")
        if warm:  # the host's page cache feeds every device: its share each
            counts = sorted({int(n) for p in scaling.values() for n in p})
            ax2.plot(counts, [warm / n for n in counts], "k:", label="page-cache ceiling / devices")
        ax2.set_xlabel("devices restored onto")
        ax2.set_ylabel("GB/s per device (median)")
        ax2.set_xticks(sorted({int(n) for p in scaling.values() for n in p}))
        ax2.set_title("scaling, one process", fontsize="medium")
        ax2.legend(fontsize="small")
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


def child_environment(platform: str, devices: int, processes: int) -> dict[str, str]:
    """CPU host devices (``devices / processes`` in each process), or the GPUs, with JAX
    allocating as it goes (the peers share the GPUs' memory with the pytree)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices // processes}"
    else:
        env["JAX_PLATFORMS"] = "cuda"
        env.pop("XLA_FLAGS", None)
    return env


def free_port() -> int:
    """A port for ``jax.distributed``'s coordinator; the next one serves torch.distributed."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            port = int(probe.getsockname()[1])
        with socket.socket() as probe:
            try:
                probe.bind(("localhost", port + 1))
                return port
            except OSError:
                continue
    raise SystemExit("no two free neighbouring ports for the processes' coordinators")


def run_child(spec: dict[str, Any], progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run :mod:`benchmarks._sharded_child` in ``spec["processes"]`` processes; process 0's
    result. ``progress`` gets the rounds so far after each row (the run's description, its
    peers' and ceilings' rows), so that a run stopped before its end leaves them."""
    env = child_environment(spec["platform"], spec["devices"], spec["processes"])
    port = free_port()
    logs = [tempfile.TemporaryFile("w+") for _ in range(spec["processes"])]
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks._sharded_child",
                json.dumps({**spec, "rank": rank, "port": port}),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE if rank == 0 else logs[rank],
            stderr=logs[rank],
            text=True,
        )
        for rank in range(spec["processes"])
    ]
    assert children[0].stdout is not None
    partial: dict[str, Any] = {"rows": [], "ceiling_rows": []}
    result = None
    for line in children[0].stdout:  # process 0's rows as they come
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            continue
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.startswith("ABOUT "):
            partial.update(json.loads(line[len("ABOUT ") :]))
        elif line.startswith("{"):
            row = json.loads(line)
            partial["rows" if "peer" in row else "ceiling_rows"].append(row)
            progress(partial)
    codes = [child.wait() for child in children]
    if any(codes) or result is None:
        errors = []
        for rank, log in enumerate(logs):
            log.seek(0)
            errors.append(f"process {rank} (exit {codes[rank]}):\n{log.read()[-4000:]}")
        raise SystemExit("the benchmark's processes failed:\n" + "\n".join(errors))
    return result


def write_report(report: dict[str, Any], out: str, *, complete: bool) -> dict[str, Any]:
    """``out/sharded.json`` (with ``complete``: whether every round ran; written whole or
    not at all) and the report it holds, summarized once it has rows and ceilings; with
    every round, the summary printed and the plot drawn."""
    report = {**report, "complete": complete}
    if report.get("rows") and "ceilings" in report:
        report["summary"] = summarize(report)
    h.write_json(report, os.path.join(out, "sharded.json"))
    if complete:
        print(json.dumps(report["summary"], indent=1))
        h.try_plot(plot, report, os.path.join(out, "sharded.png"))
    return report


def replot(path: str) -> dict[str, Any]:
    """The report at ``path`` summarized again, and plotted beside it."""
    with open(path) as f:
        report: dict[str, Any] = json.load(f)
    report["summary"] = summarize(report)
    h.write_json(report, path)
    h.replot(plot, path)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=False)
    parser.add_argument("--replot", default=None, help="summarize and plot DIR/sharded.json again")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument(
        "--processes", type=int, default=1, help="one per GPU (jax.distributed); 1: one for all"
    )
    parser.add_argument("--cold", action="store_true", help="also restore after eviction")
    parser.add_argument("--scaling", action="store_true", help="restore onto 1, 2, 4... devices")
    parser.add_argument("--peers", default=None, help="optional peers, comma-separated")
    parser.add_argument(
        "--restore-tool",
        default=None,
        help="also restore arrayio's checkpoint naming this tool (tool=, e.g. pagecache), "
        "as the peer arrayio+TOOL, right after arrayio in every round",
    )
    parser.add_argument("--hf-gib", type=float, default=0.0, help="tensor-parallel HF load")
    parser.add_argument("--hf-files", type=int, default=4)
    parser.add_argument(
        "--ceiling-gib",
        type=float,
        default=None,
        help="the ceilings' file (default: the checkpoint's size); smaller to save time",
    )
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    if not args.out:
        parser.error("--out is required")
    if args.devices % args.processes:
        parser.error("--devices must be a multiple of --processes")
    os.makedirs(args.out, exist_ok=True)
    scratch = os.path.abspath(tempfile.mkdtemp(prefix="arrayio-sharded-", dir=args.dir))
    spec = {
        "gib": args.gib,
        "devices": args.devices,
        "repeats": args.repeats,
        "dir": scratch,
        "seed": args.seed if args.seed is not None else random.randrange(1 << 30),
        "platform": args.platform,
        "processes": args.processes,
        "cold": args.cold,
        "scaling": args.scaling,
        "peers": args.peers.split(",") if args.peers is not None else None,
        "hf_gib": args.hf_gib,
        "hf_files": args.hf_files,
        "ceiling_gib": args.ceiling_gib,
        "restore_tool": args.restore_tool,
    }
    start = time.time()
    header = {
        **h.header("sharded", "benchmarks.sharded", argv),
        "gib": args.gib,
        "seed": spec["seed"],
        "restore_tool": args.restore_tool,
        "machine": {**machine(), "cpu_model": cpu_model()},
    }

    def progress(partial: dict[str, Any]) -> None:
        so_far = {**header, **partial, "seconds": time.time() - start}
        write_report(so_far, args.out, complete=False)

    try:
        result = run_child(spec, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {**header, "seconds": time.time() - start, **result}
    return write_report(report, args.out, complete=True)


if __name__ == "__main__":
    main()
