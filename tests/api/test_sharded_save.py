"""save() of sharded jax.Arrays on 8 JAX host devices (a process of its own, started with
``--xla_force_host_platform_device_count=8``): arrays sharded by whole rows are written
shard by shard, each unique shard once and from its own device, never gathered; other
layouts are gathered as before; every file is the standard safetensors file of the same
values."""

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
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio
    from arrayio.arrays import _frameworks
    from arrayio.dispatch import _transfer

    path = sys.argv[1]
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    values = {
        "rows": rng.standard_normal((64, 12)).astype(np.float32),        # 4 shards, 2 replicas
        "rows_all": rng.standard_normal((40, 3, 2)).astype(np.float32),  # 8 shards
        "bf16_rows": rng.standard_normal((16, 8)).astype(jnp.bfloat16),  # 2 shards, 4 replicas
        "replicated": rng.standard_normal((5, 7)).astype(np.float32),    # 1 shard, 8 replicas
        "columns": rng.standard_normal((64, 12)).astype(np.float32),     # 2 shards of columns
        "deep": rng.standard_normal((4, 6, 8)).astype(np.float32),       # split on axis 2
        "big_columns": rng.standard_normal((5000, 2)).astype(np.float32),  # 10000 runs
    }
    specs = {
        "rows": NamedSharding(mesh, P("data")),
        "rows_all": NamedSharding(mesh, P(("data", "model"))),
        "bf16_rows": NamedSharding(mesh, P("model")),
        "replicated": NamedSharding(mesh, P()),
        "columns": NamedSharding(mesh, P(None, "model")),
        "deep": NamedSharding(mesh, P(None, None, "model")),
        "big_columns": NamedSharding(mesh, P(None, "model")),
    }
    state = {k: jax.device_put(v, specs[k]) for k, v in values.items()}

    exported = []  # the device count of every jax array exported
    real_export = _frameworks._export_jax
    def counting_export(x):
        exported.append(len(x.sharding.device_set))
        return real_export(x)
    _frameworks._export_jax = counting_export
    requests = []
    real_write = _transfer.write_many
    def counting_write(fd, batch, **kwargs):
        requests.append(len(batch))
        return real_write(fd, batch, **kwargs)
    _transfer.write_many = counting_write

    arrayio.save(path, state)
    loaded = arrayio.load(path)
    from safetensors.numpy import load_file
    import ml_dtypes  # noqa: F401 - safetensors.numpy's bfloat16
    theirs = load_file(path)
    same = all(
        np.array_equal(np.asarray(loaded[k]).view(np.uint8), np.asarray(v).view(np.uint8))
        and np.array_equal(theirs[k].view(np.uint8), np.asarray(v).view(np.uint8))
        for k, v in values.items()
    )
    print(json.dumps({"exported": sorted(exported), "requests": requests, "same": same}))
    """
)


def test_arrays_sharded_by_rows_are_written_shard_by_shard(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("ml_dtypes")
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "ARRAYIO_CACHE_DIR": "none",
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "state.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["same"]
    # Unique shards exported one device at a time (4 + 8 + 2 + 1, 2 of columns, 2 split on
    # the third axis); only the array that would take more runs than a copy costs crossed
    # whole, gathered from its 8 devices.
    assert report["exported"] == [1] * 19 + [8]
    # One batch: a write per unique shard, per row of each column shard (2 x 64), per
    # (row, column) of each shard split on the third axis (2 x 4 x 6), and the gathered one.
    assert report["requests"] == [15 + 128 + 48 + 1]


PROCESS = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import jax
    process, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio
    from arrayio.dispatch import _transfer

    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    written, fail, reserved = [], [], []
    real = _transfer.write_many
    def counting(fd, batch, **kwargs):
        if fail:
            raise OSError("pretend: this process cannot write")
        written.append(sum(data.nbytes for _, data in batch))
        status = os.fstat(fd)
        reserved.append(status.st_blocks * 512 >= status.st_size)  # before any byte lands
        return real(fd, batch, **kwargs)
    _transfer.write_many = counting

    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    w = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    b = np.arange(16, dtype=np.int32)
    def global_array(values, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])
    c = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    state = {
        "w": global_array(w, P("data")),
        "b": global_array(b, P()),
        "c": global_array(c, P(None, "data")),
        "n": np.float32(2.5),
    }
    arrayio.save(directory + "/state.safetensors", state, metadata={"step": 7})
    deep = np.arange(2 * 3 * 16, dtype=np.float32).reshape(2, 3, 16)
    arrayio.save(directory + "/deep.safetensors", {"d": global_array(deep, P(None, None, "data"))})
    first_save = list(written)
    # One process fails to write: every process raises, and nothing is committed.
    fail.extend([True] if process == 1 else [])
    try:
        arrayio.save(directory + "/state.safetensors", {"w": global_array(w * 0, P("data"))})
        failed = None
    except (OSError, RuntimeError) as error:
        failed = type(error).__name__
    # Process 0 finds no room for the file: it raises DiskFullError, the other hears that
    # nothing was created, and nothing is written or committed.
    fail.clear()
    from arrayio.api import _save_distributed
    def no_room(fd, offset, nbytes):
        raise OSError(28, "No space left on device")
    _save_distributed.preallocate = no_room
    before = len(written)
    try:
        arrayio.save(directory + "/state.safetensors", {"w": global_array(w * 0, P("data"))})
        full = None
    except Exception as error:
        full = type(error).__name__
    print(json.dumps({
        "written": first_save,
        "failed": failed,
        "reserved": reserved[:2],
        "full": full,
        "written_when_full": len(written) - before,
    }))
    jax.distributed.shutdown()
    """
)


def _can_reserve(directory: Path) -> bool:
    from arrayio.tools._io import preallocate

    with open(directory / "probe", "wb") as f:
        reserved = preallocate(f.fileno(), 0, 1 << 20)
    (directory / "probe").unlink()
    return reserved


def test_each_process_writes_only_its_own_shards(tmp_path: Path, jax_processes) -> None:
    import numpy as np

    import arrayio

    reports = jax_processes(PROCESS, env={"ARRAYIO_CACHE_DIR": "none"})
    # Process 0: rows 0 to 31 of w (512 bytes), all of b (the one unique replica, 64), its
    # 8 columns of c (128) and n; process 1: rows 32 to 63 (512) and its 8 columns of c.
    # Then each its half of d's last axis (192). Nothing crossed between processes.
    assert [r["written"] for r in reports] == [[512 + 64 + 128 + 4, 192], [512 + 128, 192]]
    # The file's blocks were reserved before either process wrote (where the file system
    # can reserve), so that their writes overlap.
    can_reserve = _can_reserve(tmp_path)
    assert [r["reserved"] for r in reports] == [[can_reserve] * 2] * 2
    assert [r["full"] for r in reports] == ["DiskFullError", "RuntimeError"]
    assert [r["written_when_full"] for r in reports] == [0, 0]
    assert [r["failed"] for r in reports] == ["RuntimeError", "OSError"]  # the state is intact:
    loaded = arrayio.load(tmp_path / "state.safetensors")
    np.testing.assert_array_equal(loaded["w"], np.arange(256, dtype=np.float32).reshape(64, 4))
    np.testing.assert_array_equal(loaded["b"], np.arange(16, dtype=np.int32))
    np.testing.assert_array_equal(loaded["c"], np.arange(64, dtype=np.float32).reshape(4, 16))
    assert float(loaded["n"]) == 2.5
    assert arrayio.open(tmp_path / "state.safetensors").metadata["step"] == 7
    deep = arrayio.load(tmp_path / "deep.safetensors")["d"]  # split on its last axis
    np.testing.assert_array_equal(deep, np.arange(96, dtype=np.float32).reshape(2, 3, 16))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["deep.safetensors", "state.safetensors"]  # no temporary left


def test_the_sharded_checkpoint_example_runs(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "jax_sharded_checkpoint.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ARRAYIO_CACHE_DIR": "none"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-W", "error", str(example), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "saved and restored on 8 cpu devices" in done.stdout
    assert (tmp_path / "state.safetensors").exists()
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()


SHARDS_PROCESS = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import jax
    process, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio
    from arrayio.dispatch import _transfer

    written, fail_at = [], []
    real = _transfer.write_many
    def counting(fd, batch, **kwargs):
        if fail_at and len(written) == fail_at[0]:
            raise OSError("pretend: this process cannot write")
        written.append(sum(data.nbytes for _, data in batch))
        return real(fd, batch, **kwargs)
    _transfer.write_many = counting

    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    def global_array(values, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])
    def state(scale):
        rows = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) * scale
        columns = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * scale
        return {
            "model.a.weight": global_array(rows, P("data")),
            "model.b.weight": global_array(-rows, P("data")),
            "model.c.weight": global_array(columns, P(None, "data")),
            "model.norm": np.full(8, scale, np.float32),
        }
    # 2 KiB, 2 KiB, 512 B and 32 B at most 2 KiB a shard: three shards.
    arrayio.save(directory + "/ckpt", state(1.0), max_shard_size=2048)
    first = list(written)
    names_first = sorted(os.listdir(directory + "/ckpt"))
    # Saved again over itself: the standard names belong to the checkpoint being replaced,
    # so the shards go under a token (process 0's: it names every file), and the old shards
    # go. Process 1 is made to see no index at all (a stale view of a shared file system):
    # it then takes other names than process 0, and no process may wait for the other.
    from arrayio.api import _save_shards
    if process == 1:
        _save_shards._referenced = lambda index_path: set()
    arrayio.save(directory + "/ckpt", state(2.0), max_shard_size=2048)
    names_second = sorted(os.listdir(directory + "/ckpt"))
    # Process 1 fails to write the second shard of a third save: every process raises, and
    # the index still names the second checkpoint.
    if process == 1:
        fail_at.append(len(written) + 1)
    try:
        arrayio.save(directory + "/ckpt", state(3.0), max_shard_size=2048)
        failed = None
    except (OSError, RuntimeError) as error:
        failed = type(error).__name__
    print(json.dumps({
        "first": first, "names_first": names_first, "names_second": names_second,
        "failed": failed,
    }))
    """
)


def test_a_checkpoint_in_several_files_is_saved_by_every_process(
    tmp_path: Path, jax_processes
) -> None:
    import numpy as np

    import arrayio

    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    reports = jax_processes(SHARDS_PROCESS, env={"ARRAYIO_CACHE_DIR": "none"})
    # Each shard is one distributed save: process 0 writes its rows of a and b (1 KiB each,
    # rows 0 to 31), its 4 columns of c (256 B) and the norm (32 B); process 1 the rest.
    # Nothing is gathered in one process.
    assert reports[0]["first"] == [1024, 1024, 256 + 32]
    assert reports[1]["first"] == [1024, 1024, 256]
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert reports[0]["names_first"] == sorted([*shards, "model.safetensors.index.json"])
    second = reports[0]["names_second"]
    assert second == reports[1]["names_second"] and len(second) == 4
    assert not set(shards) & set(second)  # the replaced checkpoint's shards are gone
    tokens = {name.split(".")[1] for name in second if name != "model.safetensors.index.json"}
    assert len(tokens) == 1  # one token for every shard
    assert [r["failed"] for r in reports] == ["RuntimeError", "OSError"]
    loaded = arrayio.load(tmp_path / "ckpt")  # the second checkpoint, whole
    expected = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) * 2.0
    np.testing.assert_array_equal(loaded["model.a.weight"], expected)
    np.testing.assert_array_equal(loaded["model.b.weight"], -expected)
    c = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * 2.0
    np.testing.assert_array_equal(loaded["model.c.weight"], c)
    np.testing.assert_array_equal(loaded["model.norm"], np.full(8, 2.0, np.float32))
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    for key, file in index["weight_map"].items():  # safetensors reads each shard as it is
        theirs = safetensors_numpy.load_file(tmp_path / "ckpt" / file)
        np.testing.assert_array_equal(theirs[key], loaded[key])
