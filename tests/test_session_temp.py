"""The test session cleans up after itself: ``tests/conftest.py`` gives the session (and the
processes it starts) a temporary directory of its own, fails the session if anything named
``arrayio-*`` is left in it, and removes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_session(tmp_path: Path, test_source: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A pytest session with this conftest, its temporary files under ``tmp_path/tmp``."""
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", inner / "conftest.py")
    (inner / "test_inner.py").write_text(test_source)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ARRAYIO_")},
        "TMPDIR": str(temp),
        "PYTHONPATH": str(ROOT),
        "PYTEST_DEBUG_TEMPROOT": str(temp),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:asyncio",
            str(inner),
        ],
        cwd=inner,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    return result, temp


def test_a_clean_session_leaves_nothing(tmp_path):
    result, temp = run_session(
        tmp_path,
        "import arrayio, numpy as np\n\n"
        "def test_save(tmp_path):\n"
        "    arrayio.save(tmp_path / 'x.npy', np.ones(4))\n",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p.name for p in temp.iterdir() if p.name.startswith("arrayio-")] == []


def test_a_session_that_leaves_a_directory_fails(tmp_path):
    result, temp = run_session(
        tmp_path,
        "import tempfile\n\ndef test_leaks():\n    tempfile.mkdtemp(prefix='arrayio-leak-')\n",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "left behind" in result.stdout and "arrayio-leak-" in result.stdout
    assert [p.name for p in temp.iterdir() if p.name.startswith("arrayio-")] == []
