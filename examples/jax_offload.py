"""Offloading JAX activations to NVMe between jitted stages, with ``arrayio.Offloader``.

A model is cut into stages (here, one residual MLP block each), each a jitted function. The
forward pass keeps only each stage's input, and hands it over right after the stage has
used it (``stash.put``, where ``stash`` is the ``arrayio.offload.array_step`` of this
step): the offloader keeps it on the device while it fits its budget and spills the oldest
to disk in the background. The backward pass goes through the stages in reverse: it gets
this stage's input back (``stash.get``, which waits only for what has not arrived yet, and
starts reading back the inputs of the next stages down), and runs the stage's jitted VJP,
which recomputes the stage's internals from its input (rematerialisation, as
``jax.checkpoint`` does) and returns the parameter gradients and the gradient for the stage
below::

    forward:   h1 = put(x0); x1 = stage(p1, x0); h2 = put(x1); x2 = stage(p2, x1) ...
    backward:  dp_k, g = stage_vjp(p_k, get(h[k]), g)            k = n..1

With ``--plan-overhead F``, one plain step is recorded first
(``arrayio.offload.plan_array_step``: when each input is made and needed back, and the
links' rates) and the steps run under the spill plan made from it, which keeps on the
device what the links cannot hide within a slowdown of ``F`` (and sends the rest to the
offloader's host tier on a GPU, or to the disk); ``offloader.explain()`` prints the plan.

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


# Offload every stage input, however small (a real model's are far larger than this
# example's): the offloader's own default leaves arrays under 1 MiB on the device.
MIN_BYTES = 1


def train(params, x, steps, lr, off=None, plan=None):
    """``steps`` of gradient descent; returns each step's loss (before its update), the
    trained parameters and the last gradients. With ``off``, each step's stage inputs go
    through an ``array_step`` (under ``plan`` if given)."""
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        if off is None:
            loss, grads = train_step(params, x)
        else:
            min_bytes = None if plan is not None else MIN_BYTES  # (a plan's own)
            with arrayio.offload.array_step(off, plan, min_bytes=min_bytes) as stash:
                loss, grads = train_step(params, x, stash)
            if plan is not None and step < 2:
                plan.forget_runs()  # the first steps compile and start the I/O threads
        params = [update(p, g, lr) for p, g in zip(params, grads, strict=True)]
        jax.block_until_ready(params)
        losses.append(float(loss))
        if off is not None:
            print(f"step {step}: loss {float(loss):.6f} in {time.perf_counter() - start:.3f} s")
    return losses, params, grads


def train_step(params, x, stash=None):
    """One forward and backward pass through the stages; returns (loss, gradients).

    ``x`` (the batch) stays with the caller; the inputs of the later stages go to ``stash``
    (an ``arrayio.offload.ArrayStep``), or stay in memory without one.
    """
    inputs = []
    for k, p in enumerate(params):
        inputs.append(stash.put(x) if stash is not None and k > 0 else x)
        x = stage(p, x)
    loss, g = loss_and_grad(x)
    del x
    grads = [None] * len(params)
    for k in reversed(range(len(params))):
        saved = inputs.pop()
        if stash is not None and k > 0:
            saved = stash.get(saved)  # its handle dies here: its file is removed
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
    parser.add_argument(
        "--plan-overhead",
        type=float,
        default=None,
        help="run the steps under a spill plan made from one recorded step, within this "
        "slowdown (0.1: at most 10%% slower)",
    )
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
        plan = None
        if args.plan_overhead is not None:
            with arrayio.offload.plan_array_step(
                off, max_overhead=args.plan_overhead, min_bytes=MIN_BYTES
            ) as recording:
                train_step(params, x, recording)
            plan = recording.plan
        losses, trained, grads = train(params, x, args.steps, args.lr, off, plan)
        if plan is not None:
            print(off.explain())
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
