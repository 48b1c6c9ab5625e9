"""Every Python block of the README and of docs/ runs as pasted, in a scratch directory.

Blocks that need a GPU run where there is one (marked ``gpu``); blocks that import an
optional library skip where it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from arrayio.testing import gpu_available

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OPTIONAL = ("jax", "torch", "zarr", "dask", "cupy")


def _blocks() -> list:
    params = []
    for page in PAGES:
        for number, code in enumerate(
            re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S), 1
        ):
            gpu = any(word in code for word in ("cuda", "cupy", "enable_gpu"))
            params.append(
                pytest.param(
                    code,
                    id=f"{page.relative_to(ROOT)}-{number}",
                    marks=[pytest.mark.gpu] if gpu else [],
                )
            )
    return params


@pytest.mark.slow
@pytest.mark.parametrize("code", _blocks())
def test_the_block_runs_as_pasted(tmp_path: pathlib.Path, code: str) -> None:
    if any(w in code for w in ("cuda", "cupy", "enable_gpu")) and not gpu_available():
        pytest.skip("needs a CUDA GPU")
    for name in OPTIONAL:
        if (
            re.search(rf"^\s*(import|from) {name}\b", code, flags=re.M)
            and importlib.util.find_spec(name) is None
        ):
            pytest.skip(f"needs {name}")
    env = {**os.environ, "ARRAYIO_CACHE_DIR": str(tmp_path / "cache"), "ARRAYIO_PROGRESS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
