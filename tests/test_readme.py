"""The README's test command is what CI runs."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    test_block = next(b for b in blocks if "pytest" in b)
    command = [line for line in test_block.splitlines() if line and not line.startswith("#")]
    assert len(command) == 1
    assert command[0] in ci.splitlines()


def test_readme_results_table_is_generated_from_committed_json() -> None:
    from benchmarks.readme_table import main

    assert main(["--check"]) == 0, "run: python -m benchmarks.readme_table"
