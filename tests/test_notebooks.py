"""The CPU notebooks run from top to bottom (executed with nbclient in a scratch directory;
the committed files, executed with their outputs, are never rewritten), and what is committed
is the executed version: every code cell ran, none failed.

The GPU notebooks are executed on the GPU machine instead; only their committed state is
checked here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CPU_NOTEBOOKS = ["01-quickstart-cpu.ipynb", "04-dispatcher.ipynb"]


def outputs(notebook, output_type: str) -> list:
    return [
        out
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == output_type
    ]


@pytest.mark.parametrize("name", CPU_NOTEBOOKS)
def test_a_cpu_notebook_runs(name, tmp_path, monkeypatch):
    # The kernel inherits the environment: what the dispatcher learns stays in tmp_path.
    monkeypatch.setenv("ARRAYIO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    committed = (NOTEBOOKS / name).read_bytes()
    notebook = nbformat.reads(committed.decode(), as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on failure
    assert outputs(notebook, "error") == []
    rich = [out for kind in ("display_data", "execute_result") for out in outputs(notebook, kind)]
    assert any("text/html" in out.data for out in rich)  # the Reader's or report's table
    if name == "04-dispatcher.ipynb":
        assert sum("image/png" in out.data for out in rich) == 2
    assert (NOTEBOOKS / name).read_bytes() == committed
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(("cache", "mpl"))] == []


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_committed_notebooks_are_executed(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, "a notebook without code"
    counts = [cell.execution_count for cell in code]
    assert None not in counts, "committed without running every cell"
    assert counts == sorted(counts), "cells ran out of order"
    assert outputs(notebook, "error") == []
