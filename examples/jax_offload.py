"""Offloading JAX activations to NVMe between jitted stages, with ``arrayio.Offloader``.

A model is cut into stages (here, one residual MLP block each), each a jitted function. The
forward pass keeps only each stage's input, and hands it to the offloader right after the
stage has used it (``off.put``): the offloader keeps it on the device while it fits its
budget and spills the oldest to disk in the background. The backward pass goes through the
stages in reverse: it prefetches the inputs of the next stages down (``off.prefetch``), gets
this stage's input back (``off.get``, which waits only for what has not arrived yet), and
runs the stage's jitted VJP, which recomputes the stage's internals from its input
(rematerialisation, as ``jax.checkpoint`` does) and returns the parameter gradients and the
gradient for the stage below::

    forward:   h1 = put(x0); x1 = stage(p1, x0); h2 = put(x1); x2 = stage(p2, x1) ...
    backward:  prefetch(h[k-1], h[k-2]); dp_k, g = stage_vjp(p_k, get(h[k]), g)  k = n..1

Run it (CPU or GPU)::

    python examples/jax_offload.py --budget-mib 2

It trains a few steps of plain gradient descent with and without offloading, checks that
every step's loss and the trained parameters are identical, and prints the offloader's
statistics.

Limits
------
* **Only between jitted calls.** Inside ``jax.jit`` arrays are traced values with no memory
  of their own; nothing can be written to disk mid-computation (a host callback would
  stall the device). Offloading needs a program of several jitted stages; the finer the
  stages, the more can be offloaded, the less XLA can fuse across them.
* **Not for ``jax.grad`` of a whole model.** Its residuals live inside one XLA program. Take
  the gradient stage by stage, as here.
* **What is offloaded is the stage boundaries.** A stage's own intermediates are recomputed
  in its backward pass (one more forward pass per stage). To offload them instead, return
  them explicitly from the forward stage and write the backward stage to take them. (The
  ``VJP`` object that a jitted ``jax.vjp`` returns is a pytree of the residuals, but it
  carries copies of the parameters among them.)
* **Memory is freed only when every reference is gone.** The offloader drops its reference
  when it spills; the caller must not keep others (here, only the handles are kept). Do
  not donate (``donate_argnums``) arrays the offloader holds.
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


stage = jax.jit(block)
stage_vjp = jax.jit(lambda params, x, g: jax.vjp(block, params, x)[1](g))
loss_and_grad = jax.jit(jax.value_and_grad(lambda y: jnp.mean(jnp.square(y))))
update = jax.jit(lambda p, g, lr: jax.tree.map(lambda a, b: a - lr * b, p, g))


def train(params, x, steps, lr, off=None):
    """``steps`` of gradient descent; returns each step's loss (before its update), the
    trained parameters and the last gradients."""
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        loss, grads = train_step(params, x, off)
        params = [update(p, g, lr) for p, g in zip(params, grads, strict=True)]
        jax.block_until_ready(params)
        losses.append(float(loss))
        if off is not None:
            print(f"step {step}: loss {float(loss):.6f} in {time.perf_counter() - start:.3f} s")
    return losses, params, grads


def train_step(params, x, off=None, *, prefetch=2):
    """One forward and backward pass through the stages; returns (loss, gradients).

    ``x`` (the batch) stays with the caller; the inputs of the later stages go to ``off``.
    """
    inputs = []
    for k, p in enumerate(params):
        inputs.append(off.put(x) if off is not None and k > 0 else x)
        x = stage(p, x)
    loss, g = loss_and_grad(x)
    del x
    grads = [None] * len(params)
    for k in reversed(range(len(params))):
        saved = inputs.pop()
        if off is not None:
            off.prefetch(
                [h for h in inputs[-prefetch:][::-1] if isinstance(h, arrayio.offload.Handle)]
            )
            if isinstance(saved, arrayio.offload.Handle):
                saved = off.get(saved)  # the handle dies here: its file is removed
        grads[k], g = stage_vjp(params[k], saved, g)
    return loss, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-mib", type=float, default=2.0)
    parser.add_argument("--lr", type=float, default=0.1, help="gradient descent's step")
    parser.add_argument("--dir", default=None, help="spill directory (default: a temporary one)")
    args = parser.parse_args()

    key = jax.random.PRNGKey(0)
    params = []
    for _ in range(args.depth):
        key, k1, k2 = jax.random.split(key, 3)
        params.append(
            (
                jax.random.normal(k1, (args.width, 4 * args.width)) / args.width**0.5,
                jax.random.normal(k2, (4 * args.width, args.width))
                / (4 * args.width * args.depth) ** 0.5,
            )
        )
    x = jax.random.normal(key, (args.batch, args.width))

    reference = train(params, x, args.steps, args.lr)  # also compiles
    with (
        tempfile.TemporaryDirectory() as scratch,
        arrayio.Offloader(
            args.dir or scratch, device_budget_bytes=int(args.budget_mib * 2**20)
        ) as off,
    ):
        losses, trained, grads = train(params, x, args.steps, args.lr, off)
        stats = off.stats()
        print(
            f"offloader: budget {stats.budget_bytes / 2**20:.1f} MiB, peak held "
            f"{stats.peak_resident_bytes / 2**20:.1f} MiB, written "
            f"{stats.bytes_written / 2**20:.1f} MiB, read {stats.bytes_read / 2**20:.1f} MiB"
        )
    print(f"loss went from {losses[0]:.6f} to {losses[-1]:.6f}")
    same = losses == reference[0] and all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves((trained, grads)),
            jax.tree.leaves((reference[1], reference[2])),
            strict=True,
        )
    )
    print("losses and parameters identical to the run without offloading:", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
