"""arrayio imports no framework and no heavy optional library on its own.

Each check runs in a fresh interpreter (``sys.executable``), where nothing else has imported
JAX or torch yet, and reports which modules ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ["jax", "jaxlib", "cupy", "torch", "kvikio", "zarr", "arrayio.zarr", "dask"]
REPORTED = [*HEAVY, "ml_dtypes"]


def imported_after(code: str, tmp_path) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; return which REPORTED modules it imported."""
    script = textwrap.dedent(code) + textwrap.dedent(
        f"""
        import json, sys
        print(json.dumps({{name: name in sys.modules for name in {REPORTED!r}}}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_alone_is_light(tmp_path):
    seen = imported_after("import arrayio", tmp_path)
    assert [name for name in HEAVY if seen[name]] == []
    assert not seen["ml_dtypes"]


def test_numpy_save_load_open_is_light(tmp_path):
    seen = imported_after(
        """
        import numpy as np
        import arrayio

        tree = {
            "params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                       "b": np.zeros(4, np.int64)},
            "layers": [np.ones(2, np.float16), (np.complex64(1j), None)],
            "step": 7,
        }
        arrayio.save("tree.safetensors", tree, metadata={"epoch": 3})
        loaded = arrayio.load("tree.safetensors")
        assert np.array_equal(loaded["params"]["w"], tree["params"]["w"])
        assert loaded["step"] == 7
        assert np.array_equal(arrayio.load("tree.safetensors", keys="params.b"), np.zeros(4))
        with arrayio.open("tree.safetensors") as reader:
            assert reader.metadata == {"epoch": 3}
            assert reader.read("params.w", index=slice(1, 3)).shape == (2, 4)
        out = np.empty(4, np.int64)
        arrayio.read_into("tree.safetensors", out, key="params.b")

        a = np.arange(20, dtype=np.float64).reshape(5, 4)
        arrayio.save("a.npy", a)
        assert np.array_equal(np.load("a.npy"), a)
        assert np.array_equal(arrayio.load("a.npy"), a)
        with arrayio.open("a.npy") as reader:
            assert np.array_equal(reader.read(index=slice(1, 3)), a[1:3])
        """,
        tmp_path,
    )
    assert [name for name in HEAVY if seen[name]] == []
    assert not seen["ml_dtypes"]  # no bfloat16 or float8 was involved
