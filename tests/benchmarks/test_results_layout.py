"""The committed results are data: ``benchmarks/results/<scenario>/`` holds one scenario's
latest run (its JSON, its plot, a README), no scripts and no logs; the documents that cite
them link to files that exist; the README's renderer reads the scenario folders."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCENARIOS = sorted(p for p in RESULTS.iterdir() if p.is_dir())
DOCUMENTS = [
    ROOT / "benchmarks" / "README.md",
    ROOT / "docs" / "results.md",
    ROOT / "docs" / "design" / "measurement.md",
    *(scenario / "README.md" for scenario in SCENARIOS),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_scenario_folder_holds_data_and_a_readme() -> None:
    assert SCENARIOS, "no scenario folders under benchmarks/results"
    assert not [p for p in RESULTS.iterdir() if p.is_file()]
    for scenario in SCENARIOS:
        assert (scenario / "README.md").is_file(), scenario
        assert list(scenario.glob("*.json")), scenario
        for path in scenario.iterdir():
            # A probe's lesson becomes a test, an option or a sentence in docs/; a log's
            # figures are in the JSON.
            assert path.is_file() and path.suffix in {".json", ".png", ".md"}, path


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_every_result_says_when_where_and_how_it_was_measured(scenario: Path) -> None:
    for path in scenario.glob("*.json"):
        report = json.loads(path.read_text())
        assert {"date", "command", "machine"} <= set(report), path
    readme = (scenario / "README.md").read_text()
    for heading in (
        "Command",
        "Date",
        "Library measured",
        "## How to read it",
        "## Caveats that still hold",
    ):
        assert heading in readme, f"{scenario.name}/README.md lacks {heading!r}"


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes of a document's headings."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def local_links(document: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_in_the_results_documents_resolve(document: Path) -> None:
    for target in local_links(document):
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        where = f"{document.relative_to(ROOT)}: {target}"
        assert resolved.exists(), where
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved.read_text()), where


def test_the_readmes_links_into_the_results_resolve() -> None:
    for target in local_links(ROOT / "README.md"):
        if target.startswith("benchmarks/results/"):
            assert (ROOT / target.partition("#")[0]).exists(), target


def test_the_renderer_reads_the_scenario_folders(tmp_path: Path) -> None:
    from benchmarks.readme_table import render_peers, render_sweep

    for name in ("sweep/sweep.json", "checkpoint/checkpoint-8gib.json"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(RESULTS / name, tmp_path / name)
    assert "sweep/sweep.json" in render_sweep(tmp_path)
    assert "checkpoint/checkpoint-8gib.json" in render_peers(tmp_path)
    assert render_sweep(tmp_path / "empty") == render_peers(tmp_path / "empty") == ""


def test_a_newer_checkpoint_report_replaces_an_older_one_of_its_size(tmp_path: Path) -> None:
    from benchmarks.readme_table import _latest_sizes

    for name, date in (
        ("checkpoint-old.json", "2026-01-01"),
        ("checkpoint-new.json", "2026-02-01"),
    ):
        (tmp_path / name).write_text(json.dumps({"date": date, "sizes": [{"gib": 1.0}]}))
    (tmp_path / "checkpoint-8gib.json").write_text(
        json.dumps({"date": "2025-01-01", "sizes": [{"gib": 8.0}]})
    )
    chosen = _latest_sizes(sorted(tmp_path.glob("*.json")))
    assert {gib: path.name for gib, (path, _, _) in chosen.items()} == {
        1.0: "checkpoint-new.json",
        8.0: "checkpoint-8gib.json",
    }
