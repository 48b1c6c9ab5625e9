"""A tour of arrayio: ``python -m arrayio.demo [DIRECTORY]``.

Saves a small model-like pytree made of NumPy and JAX arrays (JAX if installed), opens the
file lazily, loads it back as NumPy and as JAX, reads a slice of rows, and prints what
happened at each step.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from typing import Any

import numpy as np

import arrayio


def _sample_tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    tree: dict[str, Any] = {
        "embedding": rng.standard_normal((4096, 256), dtype=np.float32),
        "layers": [
            {"w": rng.standard_normal((256, 256), dtype=np.float32), "b": np.zeros(256, np.float32)}
            for _ in range(2)
        ],
        "step": 1000,
    }
    if importlib.util.find_spec("jax") is not None:
        import jax.numpy as jnp

        tree["head"] = jnp.asarray(rng.standard_normal((256, 10)), dtype=jnp.bfloat16)
    return tree


def _describe(x: Any) -> str:
    module = type(x).__module__.split(".")[0].replace("jaxlib", "jax")
    return f"{module:6s} {str(x.dtype):9s} {list(x.shape)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "directory",
        nargs="?",
        help="where to write and keep the files "
        "(default: a temporary directory, removed at the end)",
    )
    args = parser.parse_args(argv)
    if args.directory is not None:
        _tour(args.directory)
        print(f"\nfiles are in {args.directory}")
        return
    with tempfile.TemporaryDirectory(prefix="arrayio-demo-") as directory:
        _tour(directory)
    print(f"\nfiles were in {directory}, now removed (name a DIRECTORY to keep them)")


def _tour(directory: str) -> None:
    path = os.path.join(directory, "model.safetensors")

    tree = _sample_tree()
    print(f"arrayio {arrayio.__version__}: saving a pytree of {len(tree)} top-level entries")
    start = time.perf_counter()
    arrayio.save(path, tree, metadata={"description": "arrayio demo", "epoch": 3})
    print(
        f"  saved {path} ({os.path.getsize(path):,} bytes) in "
        f"{1e3 * (time.perf_counter() - start):.1f} ms\n"
    )

    with arrayio.open(path) as reader:
        print(
            f"open() reads only the header: {len(reader)} arrays, {reader.nbytes:,} bytes, "
            f"saved from {reader.framework}, metadata {reader.metadata}"
        )
        for key, info in reader.arrays.items():
            print(
                f"  {key:14s} {info.dtype:9s} {str(list(info.shape)):12s} at byte "
                f"{info.file_offset:>8,} crc32c {info.crc32c}"
            )
        rows = reader.read("embedding", index=slice(1000, 1004))
        print(
            f"\nread('embedding', index=slice(1000, 1004)) read {rows.nbytes} bytes, not "
            f"{reader['embedding'].nbytes:,}; equal to the original: "
            f"{np.array_equal(rows, tree['embedding'][1000:1004])}\n"
        )

    for like in ("numpy", "jax"):
        if like == "jax" and importlib.util.find_spec("jax") is None:
            print("JAX is not installed: pip install 'arrayio[jax]' to load as JAX too")
            continue
        start = time.perf_counter()
        loaded = arrayio.load(path, like=like)
        elapsed = 1e3 * (time.perf_counter() - start)
        print(f"load(like={like!r}) in {elapsed:.1f} ms, checksums verified:")
        print(f"  embedding  {_describe(loaded['embedding'])}")
        print(f"  layers.0.w {_describe(loaded['layers'][0]['w'])}")
        if "head" in loaded:
            print(f"  head       {_describe(loaded['head'])}")
        print(f"  step       {loaded['step']!r}")
        same = all(
            np.asarray(loaded[k]).tobytes() == np.asarray(tree[k]).tobytes()
            for k in ("embedding", "head")
            if k in tree
        )
        print(f"  bit-identical to what was saved: {same}\n")

    if importlib.util.find_spec("safetensors") is not None:
        from safetensors.numpy import load_file

        print(f"safetensors.numpy.load_file reads the same file: {sorted(load_file(path))}")


if __name__ == "__main__":
    main()
