"""Offloading JAX activations to NVMe between jitted stages, with ``arrayio.Offloader``.

A model is cut into stages (here, one residual MLP block each). Each stage's forward pass is
jitted together with its VJP, ``jax.vjp(stage, params, x)``: it returns the stage's output
and a ``VJP`` object, a pytree whose leaves are the residuals (activations) the backward
pass needs. Those residuals go to the offloader right after the stage runs
(``off.put``), which keeps them on the GPU while they fit its budget and spills the oldest
to disk in the background; before each stage's backward pass, the residuals of the next
stages down are prefetched (``off.prefetch``), and ``off.get`` hands them back, waiting only
for what has not arrived yet::

    forward:   x1, vjp1 = stage(p1, x0); h1 = put(residuals(vjp1))
               x2, vjp2 = stage(p2, x1); h2 = put(residuals(vjp2))  ...
    backward:  prefetch(h[k-1], h[k-2]); g = apply(rebuild(get(h[k])), g)  for k = n..1

Run it (CPU or GPU)::

    python examples/jax_offload.py --budget-mib 8

It trains a few steps with and without offloading, checks that the losses and gradients
are identical, and prints the offloader's statistics.

Limits
------
* **Only between jitted calls.** Inside ``jax.jit`` arrays are traced values with no memory
  of their own; nothing can be written to disk mid-computation (a host callback would
  stall the device). Offloading needs a program of several jitted stages; the finer the
  stages, the more can be offloaded, the less XLA can fuse across them.
* **Not for ``jax.grad`` of a whole model.** Its residuals live inside one XLA program. Take
  the gradient stage by stage with ``jax.vjp``, as here (the ``VJP`` object is a pytree, so a
  jitted function can return it and take it back without retracing).
* **Parameters are residuals too.** They are skipped (they stay in memory anyway), matched by
  identity or device buffer. XLA may also keep redundant intermediates (several per GELU
  here); ``jax.checkpoint`` policies can shrink what is saved before anything is offloaded.
* **Memory is freed only when every reference is gone.** The offloader drops its reference
  when it spills; the caller must not keep others (here the ``VJP`` objects are discarded
  once flattened). Do not donate (``donate_argnums``) arrays the offloader holds.
* **Asynchronous dispatch.** ``put`` does not wait for the stage to finish; the writer thread
  waits until the array is ready. Reads come back through host memory and
  ``jax.device_put``, so JAX's allocator owns (and counts) what is read back.
* **One device per array.** Sharded arrays spanning several devices are refused.
* JAX's own host offloading (``jax.checkpoint`` with an offload policy and memory kind
  ``pinned_host``) moves residuals to host RAM inside one program: faster where host RAM
  suffices, but not to NVMe.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import arrayio


def block(params, x):
    w1, w2 = params
    return x + jax.nn.gelu(x @ w1) @ w2


stage_forward = jax.jit(lambda params, x: jax.vjp(block, params, x))
stage_backward = jax.jit(lambda vjp, g: vjp(g))
loss_and_grad = jax.jit(jax.value_and_grad(lambda y: jnp.mean(jnp.square(y))))


def _pointer(x) -> int | None:
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - some arrays have no single buffer
        return None


def train_step(params, x, off=None, *, min_bytes=4096, prefetch=2):
    """One forward and backward pass through the stages; returns (loss, gradients)."""
    saved = []  # per stage: (tree, leaves with handles in place of offloaded residuals)
    for p in params:
        x, vjp = stage_forward(p, x)
        leaves, tree = jax.tree.flatten(vjp)
        if off is not None:
            skip = {id(w) for w in p} | {_pointer(w) for w in p}
            leaves = [off.put(leaf) if leaf.nbytes >= min_bytes and id(leaf) not in skip
                      and _pointer(leaf) not in skip else leaf for leaf in leaves]
        saved.append((tree, leaves))
        del vjp
    loss, g = loss_and_grad(x)
    grads = [None] * len(params)
    for k in reversed(range(len(params))):
        tree, leaves = saved.pop()
        if off is not None:
            upcoming = [leaf for _, earlier in saved[-prefetch:][::-1] for leaf in earlier
                        if isinstance(leaf, arrayio.offload.Handle)]
            off.prefetch(upcoming)
            leaves = [off.get(leaf) if isinstance(leaf, arrayio.offload.Handle) else leaf
                      for leaf in leaves]  # the handles die here: their files are freed
        grads[k], g = stage_backward(jax.tree.unflatten(tree, leaves), g)
    return loss, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-mib", type=float, default=8.0)
    parser.add_argument("--dir", default=None, help="spill directory (default: a temporary one)")
    args = parser.parse_args()

    key = jax.random.PRNGKey(0)
    params = []
    for _ in range(args.depth):
        key, k1, k2 = jax.random.split(key, 3)
        params.append((jax.random.normal(k1, (args.width, 4 * args.width)) / args.width**0.5,
                       jax.random.normal(k2, (4 * args.width, args.width))
                       / (4 * args.width * args.depth) ** 0.5))
    x = jax.random.normal(key, (args.batch, args.width))

    reference = train_step(params, x)  # also compiles
    with tempfile.TemporaryDirectory() as scratch, arrayio.Offloader(
            args.dir or scratch, device_budget_bytes=int(args.budget_mib * 2**20)) as off:
        for step in range(args.steps):
            start = time.perf_counter()
            loss, grads = train_step(params, x, off)
            jax.block_until_ready(grads)
            print(f"step {step}: loss {float(loss):.6f} in {time.perf_counter() - start:.3f} s")
        stats = off.stats()
        print(f"offloader: budget {stats.budget_bytes / 2**20:.1f} MiB, peak held "
              f"{stats.peak_resident_bytes / 2**20:.1f} MiB, written "
              f"{stats.bytes_written / 2**20:.1f} MiB, read {stats.bytes_read / 2**20:.1f} MiB")
    same = float(loss) == float(reference[0]) and all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference[1]), strict=True))
    print("gradients identical to the run without offloading:", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
