"""Library comments stay true on any machine: no run or probe numbers, commit hashes, dates
or VM names in ``arrayio/`` (the story of a figure belongs in ``docs/design/`` or a commit)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
HISTORY = re.compile(
    r"\b(probe|run)s? [0-9]+\b"  # probe 26, runs 20
    r"|\bH[12]00\b|\bVMs?\b"  # one machine's name
    r"|\b20\d\d-[01]\d-[0-3]\d\b"  # a date
    r"|\b(?=[0-9a-f]{7,40}\b)(?=[0-9a-f]*[a-f])[0-9a-f]*[0-9][0-9a-f]*\b",  # a commit hash
    re.IGNORECASE,
)


def test_library_code_cites_no_runs_probes_hashes_dates_or_machines() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "arrayio").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not found, "history in library code:\n" + "\n".join(found[:20])
