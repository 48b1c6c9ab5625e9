"""Render the results tables from the committed JSON under ``benchmarks/results/``: a short
one in the README, the full ones in ``docs/results.md``.

``python -m benchmarks.readme_table`` rewrites the blocks between the
``<!-- results:start -->`` and ``<!-- results:end -->`` markers of both files; ``--check``
only reports whether they are up to date (exit 1 if not).

Each scenario has one folder, ``benchmarks/results/<scenario>/``, holding its latest run
(see ``benchmarks/README.md``). The README's block shows the largest checkpoint against its
peers; the full one shows the transfer sweep (``sweep/``), the checkpoint against its peers
(``checkpoint/``, one JSON per configuration), the feature-map offload (``featuremap/``)
and the small arrays (``small_arrays/``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _gbps(ceilings: dict[str, Any], name: str) -> str:
    """A ceiling for the prose: a run cut short may not have reached its panel."""
    value = ceilings.get(name)
    return f"{value:.2f}" if isinstance(value, float) else "not measured"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def _link(path: pathlib.Path) -> str:
    """A committed result as a link from the README, named by its scenario folder."""
    name = f"{path.parent.name}/{path.name}"
    return f"[{name}]({path.relative_to(ROOT).as_posix()})" if path.is_relative_to(ROOT) else name


def render_sweep(results_dir: pathlib.Path = RESULTS) -> str:
    """The GPU panels of the committed sweep (``sweep/*.json``): best single tool and
    dispatcher per size, and the targets against the hardware at the largest size."""
    lines: list[str] = []
    reports = {p: json.loads(p.read_text()) for p in sorted((results_dir / "sweep").glob("*.json"))}
    sweeps = {p: r for p, r in reports.items() if r["machine"].get("gpu")}
    for path, report in sweeps.items():
        ceilings = report["ceilings"]
        mode = "checksums on (the default)" if report["checksum"] else "checksums off"
        sizes = sorted({r["bytes"] for r in report["rows"] if r["memory"] == "cuda"})
        lines += [
            f"**Transfer sweep, {mode}** ({report['date'][:10]}, {report['machine']['summary']}; "
            f"`{report['command']}`; {_link(path)}). Ceilings measured in the same run: "
            f"cold O_DIRECT read {_gbps(ceilings, 'cold_read_direct')} GB/s, warm read (16 "
            f"threads) {_gbps(ceilings, 'warm_read_16_threads')}, write+fsync "
            f"{_gbps(ceilings, 'write_fsync')}, pinned host-to-device "
            f"{_gbps(ceilings, 'pinned_host_to_device')}. GB/s, medians of "
            f"{report['repeats']}; ratio = dispatcher / best single tool at that size.",
            "",
            "| GPU | "
            + " | ".join(_size(n) for n in sizes)
            + " | beats every fixed tool (geomean) |",
            "| --- |" + " ---: |" * (len(sizes) + 1),
        ]
        for panel in ("read/cold/cuda", "read/warm/cuda", "write/-/cuda"):
            rows = [
                r for r in report["rows"] if f"{r['direction']}/{r['cache']}/{r['memory']}" == panel
            ]
            by_size = {r["bytes"]: r for r in rows}
            # A size the run did not reach (its time ran out) is shown as not measured.
            cells = [
                f"{by_size[n]['dispatcher_GBps']:.2f} ({by_size[n]['summary']['ratio']:.2f})"
                if n in by_size
                else "not measured"
                for n in sizes
            ]
            beats = report["panels"][panel]["dispatcher_beats_every_fixed_arm"]
            lines.append(
                f"| {panel.replace('/-', '')} | "
                + " | ".join(cells)
                + f" | {'yes' if beats else 'no'} |"
            )
        lines.append("")
        if report.get("targets"):
            rule = (
                "the setting a search up front picked, measured in the same rounds on the "
                "same file; ratio to the search's best beside it"
                if "judged_on" in next(iter(report["targets"].values()))
                else "the higher of the one from the search up front and the one measured in "
                "the same rounds"
            )
            lines += [
                f"Against the hardware at the largest size (ceiling: {rule}; the "
                "last column compares round by round with the one in the rounds):",
                "",
                "| GPU, "
                + _size(next(iter(report["targets"].values()))["bytes"])
                + " | dispatcher GB/s | ceiling GB/s (search / rounds) | ratio | goal | met "
                "| ratio, round by round |",
                "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
            ]
            for panel, t in report["targets"].items():
                paired = t.get("paired_ratio")  # dispatcher / ceiling, the median of the rounds
                lines.append(
                    f"| {panel.replace('/-', '')} | {t['dispatcher_GBps']:.2f} | "
                    f"{_fmt(t['ceiling_upfront_GBps'])} / "
                    f"{_fmt(t['ceiling_interleaved_GBps'])} | {t['ratio']:.2f}"
                    + (
                        f" ({t['ratio_vs_search']:.2f} of the search's)"
                        if "ratio_vs_search" in t
                        else ""
                    )
                    + " | "
                    f"{t['goal']:.1f} | {'yes' if t['met'] else '**no**'} | "
                    f"{_fmt(paired)} |"
                )
            lines.append("")
    return "\n".join(lines).rstrip() + "\n" if lines else ""


def _goal_rounds(report: dict) -> str:
    """Where the targets' terms ran more rounds than the other peers (--goal-repeats)."""
    others = report.get("peer_repeats", report["repeats"])
    if others >= report["repeats"]:
        return ""
    return (
        f"; arrayio's front doors, torch, safetensors and the ceilings in every round, "
        f"the other peers in at most the first {others}"
    )


def _passes(passes: int | None) -> str:
    """How many times the harness read a file into the page cache before a warm load. Older
    reports, from a harness that read it once, do not record it; the sentence then does not
    say."""
    return {None: "", 1: " once", 2: " twice"}.get(passes, f" {passes} times")


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _gbps_of(value: float | None, ceiling: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f} ({value / ceiling:.2f})" if ceiling else f"{value:.2f}"


def _ceiling_rule(ceilings: dict[str, Any]) -> str:
    """How a checkpoint report's ceilings were judged: older reports took the best of the
    search up front and the samples in the rounds."""
    if "judged_on" not in ceilings["cold_read"]:
        return "the best of the settings measured up front and in the rounds."
    search = ", ".join(
        f"{_fmt(ceilings[k].get('search_GBps'))}" for k in ("write_fsync", "cold_read", "warm_read")
    )
    return (
        "the medians of the settings a search picked up front, sampled in the rounds "
        "beside the peers (the cold read's sample reads arrayio's file, right before or "
        f"after arrayio's cold load, alternately); the search's best medians were {search}."
    )


def _latest_sizes(paths: list[pathlib.Path]) -> dict[float, tuple[pathlib.Path, dict, dict]]:
    """Each checkpoint size once, from the newest report that measured it: one scenario
    folder holds one JSON per configuration (size), and a newer run replaces an older one."""
    chosen: dict[float, tuple[pathlib.Path, dict, dict]] = {}
    for path in paths:
        report = json.loads(path.read_text())
        for size in report["sizes"]:
            held = chosen.get(size["gib"])
            if held is None or report["date"] >= held[1]["date"]:
                chosen[size["gib"]] = (path, report, size)
    return chosen


def render_peers(results_dir: pathlib.Path = RESULTS) -> str:
    """The peer benchmarks (``benchmarks/peers``), each from its scenario folder: checkpoint
    (``checkpoint/checkpoint*.json``, each size from the newest report that has it: every
    peer beside the ceilings, and the targets), feature-map offload (``featuremap/``, step
    times) and small arrays (``small_arrays/``, microseconds per array)."""
    lines: list[str] = []

    def source(report: dict, path: pathlib.Path) -> str:
        return (
            f"{report['date'][:10]}, {report['machine']['summary']}; "
            f"`{report['command']}`; {_link(path)}"
        )

    from benchmarks.peers.checkpoint import goal_ratio_text, targets, verdict

    folder = results_dir / "checkpoint"
    chosen = _latest_sizes(sorted(folder.glob("checkpoint*.json")))
    for gib in sorted(chosen):
        path, report, size = chosen[gib]
        where = "the GPU" if report["device"].startswith("cuda") else report["device"]
        if not size.get("peers"):
            lines += [f"**Checkpoint, {gib:g} GiB**: not measured ({size.get('skipped')}).", ""]
            continue
        c = size["ceilings"]
        write, cold, warm = (c[k]["GBps"] for k in ("write_fsync", "cold_read", "warm_read"))
        label = f"{gib:g} GiB ({size['bytes'] / 1e9:.2f} GB)"
        lines += [
            f"**Checkpoint against its peers, {label}** ({source(report, path)}): "
            f"{size['tensors']} tensors from {_size(size['smallest_bytes'])} to "
            f"{_size(size['largest_bytes'])}, bfloat16 and float32, saved from and loaded to "
            f"{where}; saves fsynced, cold loads after dropping the page cache, warm loads "
            f"after reading the file into it{_passes(report.get('warm_passes'))}. GB/s, "
            f"medians of up to {report['repeats']} "
            f"rounds (samples column{_goal_rounds(report)}), each in three phases (every "
            "save, then every cold load, then every warm load, each phase shuffled with the "
            "ceiling's sample among the peers), with the fraction of the ceiling: "
            f"write+fsync {_fmt(write)}, cold read {_fmt(cold)}, warm (page-cache) read "
            f"{_fmt(warm)} GB/s, " + _ceiling_rule(c),
            "",
            "| peer | save GB/s | cold load GB/s | warm load GB/s | save vs torch | "
            "cold vs torch | warm vs torch | warm vs safetensors | samples |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| *ceiling* | {_fmt(write)} | {_fmt(cold)} | {_fmt(warm)} | | | | | |",
        ]
        for name, row in size["peers"].items():
            if not row.get("samples"):
                why = row.get("error") or (
                    "skipped for time" if row.get("rounds_skipped_for_time") else "not measured"
                )
                lines.append(f"| {name} | {why.replace('|', '/')[:80]} | | | | | | | 0 |")
                continue
            vs_t, vs_s = row.get("vs_torch", {}), row.get("vs_safetensors", {})
            lines.append(
                f"| {name} | {_gbps_of(row['save_GBps'], write)} | "
                f"{_gbps_of(row['cold_load_GBps'], cold)} | "
                f"{_gbps_of(row['warm_load_GBps'], warm)} | {_ratio(vs_t.get('save'))} | "
                f"{_ratio(vs_t.get('cold_load'))} | {_ratio(vs_t.get('warm_load'))} | "
                f"{_ratio(vs_s.get('warm_load'))} | {row['samples']} |"
            )
        lines.append("")
        # Judged again by today's rule (at least MIN_ROUNDS rounds a side), from the figures.
        goals = targets(size).get("arrayio")
        if goals:
            lines += [
                f"Targets, {label} (arrayio with torch tensors; for the "
                "ceilings also the ratio round by round to the ceiling sampled in the "
                "same phase of the same round):",
                "",
                "| target | arrayio GB/s | against GB/s | ratio | in-round ratio | "
                "ratio to the search's best | goal | met |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
            ]
            for goal_name, t in goals.items():
                met = {True: "yes", False: "**no**"}.get(t["met"]) or verdict(t)
                lines.append(
                    f"| {goal_name.replace('_', ' ')} ({t['reference']}) | "
                    f"{_fmt(t['GBps'])} | {_fmt(t['reference_GBps'])} | "
                    f"{goal_ratio_text(t['ratio'], t['goal'])} | "
                    f"{_fmt(t.get('paired_ratio'))} | "
                    f"{_fmt(t.get('ratio_vs_search'))} | {t['goal']:g} | {met} |"
                )
            lines.append("")
    unavailable = {
        name: why
        for _, report, _ in chosen.values()
        for name, why in (report.get("peers_unavailable") or {}).items()
    }
    if unavailable:
        lines += [
            "Not measured here: "
            + "; ".join(f"{name} ({why})" for name, why in unavailable.items())
            + ".",
            "",
        ]
    # The plot of every size (drawn with --replot from the folder's JSONs), else the one
    # beside the JSON the first size came from.
    candidates = [
        folder / "checkpoint.png",
        *(path.with_suffix(".png") for path, _, _ in chosen.values()),
    ]
    png = next((p for p in candidates if p.exists()), None)
    if png is not None and png.is_relative_to(ROOT):
        lines += [f"![checkpoint against its peers]({png.relative_to(ROOT).as_posix()})", ""]

    path = results_dir / "featuremap" / "featuremap.json"
    if path.exists():
        report = json.loads(path.read_text())
        rows = report["results"]
        lines += [
            f"**Feature-map offload** ({source(report, path)}): {report['arrays']} arrays of "
            f"{_size(report['array_bytes'])} written and read back while the "
            f"{'GPU' if report['device'].startswith('cuda') else 'CPU'} computes; step time "
            "(compute, offload and reload), medians of "
            f"{report['repeats']}. Cold: files fsynced and evicted before the reload; floor: "
            "compute alone or the I/O at the disk's ceilings, whichever is longer.",
            "",
            "| method | cache | step ms | offload ms | reload ms | torch step / this | "
            "floor / this |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            lines.append(
                f"| {r['method']} | {r['cache']} | {_fmt(r['step_ms'])} | "
                f"{_fmt(r['offload_ms'])} | {_fmt(r['reload_ms'])} | "
                f"{_ratio(r.get('torch_step_over_this'))} | "
                f"{_fmt(r.get('floor_over_step'))} |"
            )
        lines.append("")

    path = results_dir / "small_arrays" / "small_arrays.json"
    if path.exists():
        report = json.loads(path.read_text())
        lines += [
            f"**Small arrays** ({source(report, path)}): 4 to 64 KiB float32 arrays on "
            f"`{report['device']}`, us per array (medians of {report['repeats']}); saves "
            "fsynced; ratio = torch's time / this one's.",
            "",
            "| layout | peer | save us per array | cold load | warm load | "
            "torch / this (save, cold, warm) |",
            "| --- | --- | ---: | ---: | ---: | --- |",
        ]
        for layout, result in report["layouts"].items():
            floor = result["floor"]
            if layout == "one file":
                lines.append(
                    f"| {layout} ({result['arrays']}) | *disk ceilings* | "
                    + " | ".join(
                        _fmt(floor.get(f"{q}_us_per_array"))
                        for q in ("save", "cold_load", "warm_load")
                    )
                    + " | |"
                )
            for name, row in result["peers"].items():
                ratios = row.get("torch_time_over_this", {})
                lines.append(
                    f"| {layout} ({result['arrays']}) | {name} | "
                    + " | ".join(
                        _fmt(row.get(f"{q}_us_per_array"))
                        for q in ("save", "cold_load", "warm_load")
                    )
                    + " | "
                    + ", ".join(_ratio(ratios.get(q)) for q in ("save", "cold_load", "warm_load"))
                    + " |"
                )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n" if lines else ""


# The README's summary: arrayio's three front doors and the peers people compare it with.
SUMMARY_PEERS = (
    "arrayio",
    "arrayio-jax",
    "arrayio-cupy",
    "torch",
    "safetensors",
    "kvikio",
    "fastsafetensors",
    "orbax",
)


def render_summary(results_dir: pathlib.Path = RESULTS) -> str:
    """One short table for the README: the largest checkpoint measured, saved from and loaded
    to the GPU, every row as GB/s with the fraction of the ceiling sampled in the same run."""
    chosen = _latest_sizes(sorted((results_dir / "checkpoint").glob("checkpoint*.json")))
    measured = [gib for gib in sorted(chosen) if chosen[gib][2].get("peers")]
    if not measured:
        return ""
    path, report, size = chosen[measured[-1]]
    c = size["ceilings"]
    write, cold, warm = (c[k]["GBps"] for k in ("write_fsync", "cold_read", "warm_read"))
    lines = [
        f"The {size['gib']:g} GiB checkpoint benchmark ({size['tensors']} bfloat16 and "
        f"float32 tensors saved from and loaded to the GPU), on {report['machine']['summary']}"
        f" on {report['date'][:10]}, KvikIO in compatibility mode: GB/s, medians of up to "
        f"{report['repeats']} rounds, with the fraction of the ceiling sampled in the same "
        "rounds (the disk for saves and cold loads, the page cache for warm loads). These are "
        "figures of a dispatcher that has learned the machine; a fresh process's first call "
        f"is slower (see the known gaps). From {_link(path)}; every figure is in "
        "[the results](docs/results.md).",
        "",
        "| | save | cold load | warm load |",
        "| --- | ---: | ---: | ---: |",
        f"| *ceiling* | {_fmt(write)} | {_fmt(cold)} | {_fmt(warm)} |",
    ]
    for name in SUMMARY_PEERS:
        row = size["peers"].get(name) or {}
        if row.get("samples"):
            shown = "arrayio (torch)" if name == "arrayio" else name
            lines.append(
                f"| {shown} | {_gbps_of(row['save_GBps'], write)} | "
                f"{_gbps_of(row['cold_load_GBps'], cold)} | "
                f"{_gbps_of(row['warm_load_GBps'], warm)} |"
            )
    png = results_dir / "checkpoint" / "checkpoint.png"
    if png.exists() and png.is_relative_to(ROOT):
        lines += ["", f"![checkpoint against its peers]({png.relative_to(ROOT).as_posix()})"]
    return "\n".join(lines) + "\n"


def _replace_block(text: str, block: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    peers = render_peers()
    # The README holds one short table; docs/results.md the full ones (the other scenarios,
    # zarr, zstd, offload, core, are summarised there in prose).
    blocks = {
        ROOT / "README.md": render_summary(),
        ROOT / "docs" / "results.md": render_sweep() + (f"\n{peers}" if peers else ""),
    }
    stale = []
    for path, block in blocks.items():
        text = path.read_text()
        if path.parent.name == "docs":  # links relative to docs/
            block = block.replace("](benchmarks/", "](../benchmarks/")
        updated = _replace_block(text, block)
        if updated != text:
            stale.append(path)
            if not args.check:
                path.write_text(updated)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
