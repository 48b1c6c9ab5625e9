"""``python -m arrayio.demo`` runs, and removes what it wrote unless told where to keep it."""

from __future__ import annotations

import os
import subprocess
import sys


def run_demo(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ARRAYIO_")},
        "TMPDIR": str(temp),
        "ARRAYIO_CACHE_DIR": "none",
    }
    result = subprocess.run(
        [sys.executable, "-m", "arrayio.demo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_the_demo_removes_its_temporary_directory(tmp_path):
    result = run_demo(tmp_path)
    assert "bit-identical to what was saved: True" in result.stdout
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "removed" in result.stdout.splitlines()[-1]


def test_the_demo_keeps_files_in_a_directory_it_is_given(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    result = run_demo(tmp_path, str(kept))
    assert (kept / "model.safetensors").is_file()
    assert result.stdout.splitlines()[-1] == f"files are in {kept}"
    assert list((tmp_path / "tmp").iterdir()) == []
