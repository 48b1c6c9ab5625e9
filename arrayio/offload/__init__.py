"""Offloading arrays to NVMe under a device-memory budget.

:class:`Offloader` keeps the arrays given to it on their device while they fit a byte
budget and spills the least recently used ones to files in the background;
:func:`activations` offloads what torch's autograd saves for the backward pass through it.

>>> import numpy as np, arrayio
>>> with arrayio.Offloader("/tmp/scratch", device_budget_bytes=1 << 20) as off:
...     handles = [off.put(np.full((256, 256), i, np.float32)) for i in range(8)]
...     off.prefetch(handles[:2])            # bring the first ones back in the background
...     float(off.get(handles[0])[0, 0])     # waits only if not read back yet
0.0

:func:`plan_step` records one plain training step, measures the offloader's links and
plans which saved tensors stay on the device and which go to its host tier or its disk,
within a slowdown (``max_overhead``) or a device budget (``device_budget_bytes``);
``activations(offloader, plan=...)`` applies the plan, and ``offloader.explain()`` sets the
measured step beside the predicted one.

JAX has no hook for what ``jax.grad`` keeps: offload between jitted stages instead, as
``examples/jax_offload.py`` shows, putting and getting each stage's residuals through
:func:`array_step`; :func:`plan_array_step` records and plans such a step as
:func:`plan_step` does a torch one.
"""

from __future__ import annotations

from ._array_steps import ArrayStep, Kept, array_step, plan_array_step
from ._budget import OffloadBudgetError
from ._entries import Handle
from ._explain import OffloadExplanation, PlanExplanation, TierShare
from ._offloader import Offloader, OffloadStats
from ._plan import Rates
from ._rates import measure_rates
from ._step_plan import PlanWarning, StepPlan, plan_step
from ._torch_hooks import activations

__all__ = [
    "ArrayStep",
    "Handle",
    "Kept",
    "OffloadBudgetError",
    "OffloadExplanation",
    "OffloadStats",
    "Offloader",
    "PlanExplanation",
    "PlanWarning",
    "Rates",
    "StepPlan",
    "TierShare",
    "activations",
    "array_step",
    "measure_rates",
    "plan_array_step",
    "plan_step",
]
