"""Save a sharded JAX model state and restore it onto another mesh, with arrayio.

    python examples/jax_sharded_checkpoint.py [--dir DIR] [--devices 8]

Runs on CPU host devices (it asks JAX for ``--devices`` of them) or on the GPUs a machine has.
The state's arrays are sharded over a 1-D mesh along their rows: ``arrayio.save`` writes each
unique shard from the device that holds it, into one standard safetensors file, without
gathering the arrays on the host. The restore places every array onto a 2-D mesh, sharded
along both axes, each device reading only the rows its piece covers; a ``max_shard_size``
save writes a Hugging Face style checkpoint in several files that restores the same way.
In a multi-process program (``jax.distributed``), every process runs the same calls and
writes or reads only its own shards.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary)")
    parser.add_argument("--devices", type=int, default=8, help="CPU host devices to ask for")
    args = parser.parse_args(argv)
    if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import arrayio

    devices = jax.devices()
    if len(devices) % 2:
        devices = devices[:-1] or devices
    rows = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
    grid = Mesh(np.array(devices).reshape(-1, 2 if len(devices) > 1 else 1), ("data", "model"))
    both = NamedSharding(grid, P("data", "model"))

    key = jax.random.key(0)
    state = {
        "embed": jax.random.normal(key, (len(devices) * 64, 256)),
        "dense": {
            "w": jax.random.normal(key, (len(devices) * 32, 128)),
            "b": np.zeros(16, np.float32),
        },
        "step": np.int32(1000),
    }
    state = jax.tree.map(lambda x: jax.device_put(x, rows) if x.ndim == 2 else x, state)

    directory = args.dir or tempfile.mkdtemp(prefix="arrayio-example-")
    path = os.path.join(directory, "state.safetensors")
    arrayio.save(path, state)  # every unique shard from its own device, one file

    # Restore onto another mesh, as orbax's restore takes its target.
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=both) if x.ndim == 2 else x,
        state,
    )
    restored = arrayio.load(path, structure=target)
    for name in ("embed",):
        assert restored[name].sharding == both
        assert np.array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    assert np.array_equal(np.asarray(restored["dense"]["w"]), np.asarray(state["dense"]["w"]))
    assert int(restored["step"]) == 1000

    # The same state as a checkpoint in several files, restored onto the 2-D mesh.
    flat = {"embed": state["embed"], "dense.w": state["dense"]["w"]}
    arrayio.save(os.path.join(directory, "hf"), flat, max_shard_size="64KiB")
    again = arrayio.load(os.path.join(directory, "hf"), sharding=both)
    assert all(np.array_equal(np.asarray(again[k]), np.asarray(v)) for k, v in flat.items())
    files = sorted(os.listdir(os.path.join(directory, "hf")))
    print(
        f"saved and restored on {len(devices)} {devices[0].platform} devices: {path}; "
        f"{len(files) - 1} files and an index in {os.path.join(directory, 'hf')}"
    )


if __name__ == "__main__":
    main()
