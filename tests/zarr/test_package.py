"""The optional ``zarr`` extra: ``arrayio.zarr`` says how to install what it misses, and
using it imports neither CuPy nor a framework that was not asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run(code: str, tmp_path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )


def test_without_zarr_the_import_error_says_how_to_install_it(tmp_path):
    result = run(
        """
        import sys
        sys.modules["zarr"] = None  # as if zarr were not installed
        import arrayio
        try:
            import arrayio.zarr
        except ImportError as error:
            print("ImportError:", error)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'arrayio[zarr]'" in result.stdout


def test_cpu_use_imports_no_cupy_and_no_framework(tmp_path):
    pytest.importorskip("zarr")
    result = run(
        """
        import sys
        import numpy as np
        import zarr  # zarr itself imports CuPy where it is installed (its GPU buffers)

        before = set(sys.modules)
        from arrayio.zarr import NVMeStore, read

        z = zarr.create_array(NVMeStore("a"), shape=(10, 10), chunks=(3, 3), dtype="f4")
        z[...] = np.ones((10, 10), np.float32)
        assert read("a").sum() == 100
        z = zarr.create_array(NVMeStore("b"), shape=(2000, 600), chunks=(1000, 600), dtype="f4")
        z[...] = 1
        assert read("b").sum() == 1_200_000  # chunks over 1 MiB: through the learned tools
        added = set(sys.modules) - before
        # (Not KvikIO: the dispatcher imports it, where installed, to see whether its tool
        # can serve large reads.)
        print(sorted(n for n in ("cupy", "jax", "torch") if n in added))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
