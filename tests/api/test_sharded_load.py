"""load(..., sharding=...) on 8 JAX host devices (a process of its own, started with
``--xla_force_host_platform_device_count=8``): every device gets only its piece, read on its
own, and the global arrays equal what was saved, for shardings along any axis, replicated
ones, and a checkpoint in several files; and in two ``jax.distributed`` processes of 4
devices each, every process reads only its own rows."""

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

    reads, batches = [], []
    real = _reader.Reader.read
    def counting(self, key=None, index=None, **kwargs):
        reads.append((key, None if index is None else index.indices(64 if key == "w" else 16)))
        return real(self, key, index, **kwargs)
    _reader.Reader.read = counting
    real_pieces = _reader.Reader.read_row_pieces
    def counting_pieces(self, pieces, advance=None):
        batches.append(len(pieces))
        for key, span, _ in pieces:
            rows = self[key].shape[0] if self[key].shape else 1
            whole = (span.start, span.stop) == (0, rows)
            reads.append((key, None if whole else (span.start, span.stop, 1)))
        return real_pieces(self, pieces, advance)
    _reader.Reader.read_row_pieces = counting_pieces

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
    # As orbax restores: placeholders that carry shardings (the scalar carries none).
    rows = NamedSharding(mesh, P("data"))
    example = {
        "w": jax.ShapeDtypeStruct((64, 12), np.float32, sharding=rows),
        "b": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(mesh, P("model"))),
        "scalar": jax.ShapeDtypeStruct((), np.float32),
    }
    for source in ("one.safetensors", "sharded"):  # one file, or several with an index
        restored = arrayio.load(directory + "/" + source, structure=example)
        assert restored["w"].sharding == rows and restored["b"].sharding.spec == P("model")
        for key, array in state.items():
            np.testing.assert_array_equal(np.asarray(restored[key]), array)
    # Every piece of every array of one file moves in one batch of transfers.
    batches.clear()
    by_rows = NamedSharding(mesh, P("data"))
    arrayio.load(directory + "/one.safetensors", sharding=by_rows, keys=["w", "b"])
    assert batches == [8], batches
    # A flipped bit in a piece fails the array's checksum, combined from its pieces' CRCs.
    raw = bytearray(open(directory + "/one.safetensors", "rb").read())
    start = raw.index(state["w"][40].tobytes())  # a row in the third device's piece
    raw[start + 5] ^= 0x10
    open(directory + "/damaged.safetensors", "wb").write(bytes(raw))
    try:
        arrayio.load(directory + "/damaged.safetensors", sharding=by_rows, keys="w")
    except arrayio.errors.ChecksumError as error:
        assert "'w'" in str(error), error
    else:
        raise AssertionError("a damaged piece loaded")
    loaded = arrayio.load(
        directory + "/damaged.safetensors", sharding=by_rows, keys="w", verify=False
    )
    assert not np.array_equal(np.asarray(loaded), state["w"])
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


PROCESS = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    process, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio
    from arrayio.api import _reader

    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    reads = []
    real = _reader.Reader.read_row_pieces
    def counting(self, pieces, advance=None):
        out = real(self, pieces, advance)
        for (key, span, _), piece in zip(pieces, out):
            reads.append([key, [span.start, span.stop, 1], int(np.asarray(piece).nbytes)])
        return out
    _reader.Reader.read_row_pieces = counting
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    rows = NamedSharding(mesh, P("data"))
    w = arrayio.load(directory + "/w.safetensors", sharding=rows, keys="w")
    expected = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    for shard in w.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    print(json.dumps(reads))
    jax.distributed.shutdown()
    """
)


def test_each_process_reads_only_its_own_rows(tmp_path: Path, jax_processes) -> None:
    import numpy as np

    import arrayio

    arrayio.save(
        tmp_path / "w.safetensors", {"w": np.arange(64 * 4, dtype=np.float32).reshape(64, 4)}
    )
    reads = jax_processes(PROCESS, timeout=180)
    rows = [sorted(tuple(r[1]) for r in process_reads) for process_reads in reads]
    assert rows == [
        [(start, start + 8, 1) for start in range(0, 32, 8)],
        [(start, start + 8, 1) for start in range(32, 64, 8)],
    ]
    assert [sum(r[2] for r in process_reads) for process_reads in reads] == [512, 512]


TENSOR_PARALLEL = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    process, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio
    from arrayio.api import _reader

    read_bytes = []
    real = _reader.Reader.read_row_pieces
    def counting(self, pieces, advance=None):
        out = real(self, pieces, advance)
        read_bytes.extend(int(np.asarray(piece).nbytes) for piece in out)
        return out
    _reader.Reader.read_row_pieces = counting
    mesh = Mesh(np.array(jax.devices()), ("data",))
    def tensor_parallel(key):  # matrices split along their rows, the rest whole everywhere
        return NamedSharding(mesh, P("data") if key.endswith(".weight") else P())
    state = arrayio.load(directory + "/checkpoint", sharding=tensor_parallel)
    checked = 0
    for key in sorted(state):
        x = state[key]
        assert x.sharding == tensor_parallel(key), key
        expected = np.load(directory + "/" + key + ".npy")
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
            checked += 1
    print(json.dumps({"keys": sorted(state), "checked": checked, "read": sum(read_bytes)}))
    jax.distributed.shutdown()
    """
)


def test_a_checkpoint_in_several_files_loads_a_tensor_parallel_slice_per_process(
    tmp_path: Path, jax_processes
) -> None:
    # A Hugging Face-style checkpoint in 3 files, loaded by two processes of 4 devices with
    # a slice of every matrix per device: each process holds (and reads) only its rows of
    # the matrices, and the biases whole.
    import numpy as np

    import arrayio

    rng = np.random.default_rng(1)
    state = {}
    for layer in range(3):
        state[f"layer{layer}.weight"] = rng.standard_normal((64, 32)).astype(np.float32)
        state[f"layer{layer}.bias"] = rng.standard_normal(32).astype(np.float32)
    for key, value in state.items():
        np.save(tmp_path / f"{key}.npy", value)
    arrayio.save(tmp_path / "checkpoint", state, max_shard_size=64 * 32 * 4 + 32 * 4)
    assert len(list((tmp_path / "checkpoint").glob("*.safetensors"))) == 3
    reports = jax_processes(TENSOR_PARALLEL, timeout=180)
    for report in reports:
        assert report["keys"] == sorted(state)
        assert report["checked"] == 6 * 4  # every array's 4 local pieces
    # Each process reads half of every matrix and each bias once (its devices share it).
    half_of_matrices = 3 * 32 * 32 * 4
    assert [r["read"] for r in reports] == [half_of_matrices + 3 * 32 * 4] * 2


COLUMNS_PROCESS = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    process, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import arrayio
    from arrayio.dispatch import _transfer

    asked = []
    for name in ("read_many", "read_into"):
        real = getattr(_transfer, name)
        def counting(fd, *args, real=real, name=name, **kwargs):
            if name == "read_many":
                asked.extend(int(buffer.nbytes) for _, buffer in args[0])
            else:
                asked.append(int(args[1].nbytes))
            return real(fd, *args, **kwargs)
        setattr(_transfer, name, counting)
    mesh = Mesh(np.array(jax.devices()), ("model",))
    columns = NamedSharding(mesh, P(None, "model"))
    loaded = arrayio.load(directory + "/w.safetensors", sharding=columns)
    expected = {
        "w": np.arange(8 * 131072, dtype=np.float32).reshape(8, 131072),
        "narrow": np.arange(8 * 64, dtype=np.float32).reshape(8, 64),
    }
    for key, x in loaded.items():
        assert x.sharding == columns
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[key][shard.index])
    print(json.dumps({"asked": asked}))
    jax.distributed.shutdown()
    """
)


def test_each_process_reads_only_its_own_columns(tmp_path: Path, jax_processes) -> None:
    # A matrix split by columns over two processes of 4 devices: each device's columns are
    # runs of 64 KiB per row, so each process reads its half of every row and nothing of
    # the other half (before, each read every row whole, then sliced).
    import numpy as np

    import arrayio

    # A narrow matrix, whose runs would be 32 bytes, is read once as rows and sliced.
    matrix = np.arange(8 * 131072, dtype=np.float32).reshape(8, 131072)
    narrow = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    arrayio.save(tmp_path / "w.safetensors", {"w": matrix, "narrow": narrow})
    reports = jax_processes(COLUMNS_PROCESS, timeout=180)
    for report in reports:
        asked = sorted(report["asked"])
        assert asked == [narrow.nbytes] + [64 << 10] * 32, report  # 4 devices x 8 rows
