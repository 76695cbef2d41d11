"""Time of the optimizer step: streaming the weights, gradients and states through memory.

PyTorch's optimizers step a list of parameters with ``torch._foreach_*`` ops (the default
on CPU and CUDA), each of which reads and writes whole tensors, so a step is memory-bound:

    t = N * passes * itemsize / (mem_bw * e_memory)  +  tensors * ops * host

for ``N`` values of ``tensors`` parameters stored ``itemsize`` bytes wide (the masters':
4, or 2 under pure bf16). ``passes`` counts the tensor-sized reads and writes of one step
per value, ``ops`` the foreach calls, read off torch 2.13's ``_multi_tensor_*`` code with
default arguments:

============  ======  ===  ===============================================================
optimizer     passes  ops  foreach calls (reads + writes per value)
============  ======  ===  ===============================================================
sgd           3       1    ``add_(params, grads)`` (2 + 1)
sgd_momentum  8       3    ``mul_(bufs)`` 2, ``add_(bufs, grads)`` 3, ``add_(params, bufs)`` 3
adam          18      7    ``lerp_(m, g)`` 3, ``mul_(v)`` 2, ``addcmul_(v, g, g)`` 3,
                           ``sqrt(v)`` 2, ``div_`` 2, ``add_(eps)`` 2, ``addcdiv_(p, m, d)`` 4
adamw         20      8    adam's, and ``mul_(params)`` for the decoupled weight decay 2
adafactor     19      10   ``norm(p)`` 1, the row and column norms of ``g`` 2, the outer
                           product of the factors 1, ``div_`` 2, ``clamp_min_`` 2,
                           ``rsqrt_`` 2, ``mul_(g)`` 3, ``norm(update)`` 1, ``mul_`` 2,
                           ``add_(params)`` 3
lars          13      5    ``norm([params, grads])`` 2 (one call), ``mul_(bufs)`` 2,
                           ``addcmul_(bufs, grads, ratios)`` 3, ``addcmul_(bufs, params)``
                           for the weight decay 3, ``sub_(params, bufs)`` 3
lamb          25      10   ``lerp_(m, g)`` 3, ``mul_(v)`` 2, ``addcmul_(v, g, g)`` 3,
                           ``sqrt(v)`` 2, ``mul_`` 2, ``add_(eps)`` 2, ``div(m, d)`` 3,
                           ``add_(r, params)`` for the weight decay 3,
                           ``norm([params, r])`` 2 (one call), ``addcmul_(params, r, ratios)`` 3
============  ======  ===  ===============================================================

``lars`` and ``lamb`` are ``autopar.optim``'s (defaults: weight decay on, which large-batch
recipes use), counted on the parameters with a trust ratio, where nearly all values are;
a bias or norm gain skips its norm and weight decay. Their trust ratios need whole-parameter
norms: on a sharded parameter one all-reduce of a few scalars per mesh axis, left out here.
LAMB also holds its update ``r`` (one value per value) until the norms are known.

``host`` is the preset's forward op overhead (``DevicePreset.op_overhead``): on a CPU the
foreach ops loop over the tensors one op at a time, so it is paid per tensor and op; an
accelerator's foreach kernels take many tensors at once and run while the host issues the
next, so there it is hidden (a few calls a step).

A ZeRO-sharded optimizer steps only its piece: ``N`` is the values of the optimizer-state
layout on the device.

What it leaves out: the step counter and bias-correction scalars, Adafactor's three
``.item()`` reads per tensor (host synchronisations on a GPU), fused kernels
(``fused=True`` reads each tensor once: 4 passes for Adam), and caches that hold a small
model's states (a CPU's last-level cache can).

>>> from autopar_cost_model.hardware import load_preset
>>> round(optimizer_step_time(1e9, "adamw", 4, load_preset("h100-sxm")) * 1e3, 1)
28.1
"""

from __future__ import annotations

from typing import NamedTuple

from autopar_cost_model.hardware import DevicePreset
from autopar_plans.errors import UsageError


class StepTraffic(NamedTuple):
    """Tensor-sized reads and writes per value of one step, and the foreach calls."""

    passes: int
    ops: int


STEP_TRAFFIC: dict[str, StepTraffic] = {
    "sgd": StepTraffic(3, 1),
    "sgd_momentum": StepTraffic(8, 3),
    "adam": StepTraffic(18, 7),
    "adamw": StepTraffic(20, 8),
    "adafactor": StepTraffic(19, 10),
    "lars": StepTraffic(13, 5),
    "lamb": StepTraffic(25, 10),
}


def optimizer_step_time(
    numel: float, optimizer: str, itemsize: int, preset: DevicePreset, tensors: int = 1
) -> float:
    """Seconds of one optimizer step over ``numel`` values in ``tensors`` parameters."""
    if optimizer not in STEP_TRAFFIC:
        raise UsageError(f"unknown optimizer {optimizer!r}; one of {', '.join(STEP_TRAFFIC)}")
    if numel <= 0:
        return 0.0
    traffic = STEP_TRAFFIC[optimizer]
    bandwidth = preset.memory_bandwidth * preset.efficiency.memory
    host = preset.op_overhead
    calls = 0 if host.asynchronous else traffic.ops * tensors
    return numel * traffic.passes * itemsize / bandwidth + calls * host.forward
