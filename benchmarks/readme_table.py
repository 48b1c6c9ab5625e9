"""Render the README's results table from the committed JSON under ``benchmarks/results/``.

``python -m benchmarks.readme_table`` rewrites the block between the README's
``<!-- results:start -->`` and ``<!-- results:end -->`` markers; ``--check`` only reports
whether the README is up to date (exit 1 if not).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render(results_dir: pathlib.Path = ROOT / "benchmarks" / "results") -> str:
    lines: list[str] = []
    # The simple path first, then the same benchmark through the dispatcher.
    for path in sorted(results_dir.glob("*/core_baseline*.json"),
                       key=lambda p: (p.parent.name, "-" in p.stem)):
        report = json.loads(path.read_text())
        machine = report["machine"]
        where = f"{machine.get('gpu') or 'CPU'}, {machine['cpus']} cores"
        size = report["bytes"] / (1 << 30)
        lines += [
            f"**Core baseline{', through the dispatcher' if '-' in path.stem else ''}** "
            f"({report['date'][:10]}, {where}; `{report['command']}`; "
            f"[{path.parent.name}]({path.relative_to(ROOT).as_posix()})): a {size:g} GiB dict of "
            f"{report['arrays']} float32 arrays on `{report['device']}`, median of "
            f"{report['repeats']}, saves fsynced, cold reads after dropping the page cache.",
            "",
            "| library | write GB/s | cold read GB/s | warm read GB/s |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, row in report["results"].items():
            lines.append(f"| {name} | {_fmt(row['write_GBps'])} | {_fmt(row['cold_read_GBps'])} "
                         f"| {_fmt(row['warm_read_GBps'])} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def render_sweep(results_dir: pathlib.Path = ROOT / "benchmarks" / "results") -> str:
    """The GPU panels of each committed sweep: best single tool and dispatcher per size."""
    lines: list[str] = []
    sweeps = [p for p in sorted(results_dir.glob("*/sweep*.json"),
                                key=lambda p: (p.parent.name, "-" in p.stem))
              if json.loads(p.read_text())["machine"].get("gpu")]
    # The latest results folder only: older sweeps stay committed, as history.
    latest = max((p.parent.name for p in sweeps), default=None)
    for path in sweeps:
        if path.parent.name != latest:
            continue
        report = json.loads(path.read_text())
        ceilings = report["ceilings"]
        mode = "checksums on (the default)" if report["checksum"] else "checksums off"
        lines += [
            f"**Transfer sweep, {mode}** ({report['date'][:10]}, {report['machine']['summary']}; "
            f"`{report['command']}`; [{path.parent.name}/{path.name}]"
            f"({path.relative_to(ROOT).as_posix()})). Ceilings measured in the same run: "
            f"cold O_DIRECT read {ceilings['cold_read_direct']:.2f} GB/s, warm read (16 "
            f"threads) {ceilings['warm_read_16_threads']:.2f}, write+fsync "
            f"{ceilings['write_fsync']:.2f}, pinned host-to-device "
            f"{ceilings.get('pinned_host_to_device', float('nan')):.2f}. GB/s, medians of "
            f"{report['repeats']}; ratio = dispatcher / best single tool at that size.",
            "",
            "| GPU | " + " | ".join(_size(n) for n in report["panels"]["read/cold/cuda"]["sizes"])
            + " | beats every fixed tool (geomean) |",
            "| --- |" + " ---: |" * (len(report["panels"]["read/cold/cuda"]["sizes"]) + 1),
        ]
        for panel in ("read/cold/cuda", "read/warm/cuda", "write/-/cuda"):
            rows = [r for r in report["rows"]
                    if f"{r['direction']}/{r['cache']}/{r['memory']}" == panel]
            cells = [f"{r['dispatcher_GBps']:.2f} ({r['summary']['ratio']:.2f})" for r in rows]
            beats = report["panels"][panel]["dispatcher_beats_every_fixed_arm"]
            lines.append(f"| {panel.replace('/-', '')} | " + " | ".join(cells)
                         + f" | {'yes' if beats else 'no'} |")
        lines.append("")
        if report.get("targets"):
            lines += [
                "Against the hardware at the largest size (ceiling: the higher of the one "
                "measured before the sweep and the one measured in the same rounds):",
                "",
                "| GPU, " + _size(next(iter(report["targets"].values()))["bytes"])
                + " | dispatcher GB/s | ceiling GB/s | ratio | goal | met |",
                "| --- | ---: | ---: | ---: | ---: | --- |",
            ]
            for panel, t in report["targets"].items():
                ceiling = max(v for v in (t["ceiling_upfront_GBps"],
                                          t["ceiling_interleaved_GBps"]) if v is not None)
                lines.append(f"| {panel.replace('/-', '')} | {t['dispatcher_GBps']:.2f} | "
                             f"{ceiling:.2f} | {t['ratio']:.2f} | {t['goal']:.1f} | "
                             f"{'yes' if t['met'] else '**no**'} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n" if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{START}\n{render()}\n{render_sweep()}{END}{tail}"
    if args.check:
        return 0 if updated == readme else 1
    readme_path.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
