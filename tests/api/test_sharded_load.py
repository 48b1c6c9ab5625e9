"""load(..., sharding=...) on 8 JAX host devices (a process of its own, started with
``--xla_force_host_platform_device_count=8``): every device gets only its piece, read on its
own, and the global arrays equal what was saved, for shardings along any axis, replicated
ones, and a checkpoint in several files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="jax is not installed"
)

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio
    from arrayio.api import _reader

    directory = sys.argv[1]
    assert len(jax.devices()) == 8
    rng = np.random.default_rng(0)
    state = {
        "w": rng.standard_normal((64, 12)).astype(np.float32),
        "b": rng.standard_normal(16).astype(np.float32),
        "scalar": np.float32(3.5),
    }
    arrayio.save(directory + "/one.safetensors", state)
    arrayio.save(directory + "/sharded", state, max_shard_size=1024)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    reads = []
    real = _reader.Reader.read
    def counting(self, key=None, index=None, **kwargs):
        reads.append((key, None if index is None else index.indices(64 if key == "w" else 16)))
        return real(self, key, index, **kwargs)
    _reader.Reader.read = counting

    report = {}
    for name, spec in {
        "rows": {"w": P("data"), "b": P("data"), "scalar": P()},
        "rows_and_columns": {"w": P("data", "model"), "b": P(), "scalar": P()},
        "columns": {"w": P(None, "model"), "b": P("model"), "scalar": P()},
    }.items():
        for source in ("one.safetensors", "sharded"):
            reads.clear()
            shardings = {k: NamedSharding(mesh, s) for k, s in spec.items()}
            loaded = arrayio.load(directory + "/" + source, sharding=shardings)
            for key, array in state.items():
                got = loaded[key]
                assert isinstance(got, jax.Array) and got.sharding == shardings[key], key
                np.testing.assert_array_equal(np.asarray(got), array)
                for shard in got.addressable_shards:  # each device holds its piece only
                    np.testing.assert_array_equal(np.asarray(shard.data), array[shard.index])
            report[name + " " + source] = sorted(set(map(str, reads)))
    one = arrayio.load(directory + "/one.safetensors", sharding=NamedSharding(mesh, P()), keys="b")
    assert one.sharding.is_fully_replicated
    print(json.dumps(report))
    """
)


def test_sharded_loads_on_eight_host_devices(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    }
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # Along the leading axis each distinct piece is read once, only its rows: 4 row blocks
    # of w (16 rows each) and of b, the replicated scalar once.
    rows = report["rows one.safetensors"]
    assert "('w', (0, 16, 1))" in rows and "('w', (48, 64, 1))" in rows
    assert "('w', None)" not in rows  # never the whole of w
    # Along the second axis only, every device needs all rows: w is read once, whole.
    assert report["columns one.safetensors"].count("('w', None)") == 1
