"""What offload costs (``autopar_plans.offload``): device and host bytes, and seconds.

**Optimizer offload** (ZeRO-Offload). The runtime (``runtime.zero``) holds every parameter
as a working copy on the device and a master piece on the host. Per value of the piece
the device steps (``N``: the local parameter over the ZeRO axes' size), with ``w`` the
working copy's width, ``g`` the width gradients are summed in, ``m`` the master's:

- device: the working copy and its gradient, ``w + w`` per local value (the gradient
  accumulates whole over the microbatches and is freed once summed);
- host: the master, its gradient and the optimizer's states, ``m + m + states x m``;
- per step, one copy each way per parameter: the summed gradient piece down (``N g``
  bytes, cast to ``m`` on the host), the stepped master up (cast to ``w`` on the host
  first: ``N w`` bytes), each ``host_copy_time``; the step itself on the CPU
  (``host_step_time``) and the two casts, passes over host memory at the node's share of
  its bandwidth. The copies run after backward and before the next forward, exposed.

**Activation offload.** Every tensor autograd saves goes down as it is saved and comes back
when backward unpacks it: ``S`` bytes per microbatch each way. The copy down runs on a
side stream while forward goes on (hidden behind the op's forward, what it does not hide
exposed); the copy up is waited for (``runtime.offload``).

**Parameter offload** (ZeRO-Infinity's ``offload_param``; with the optimizer's). The
device holds no working copy between uses: each comes up from the host every microbatch,
``W`` bytes (its local piece in the working copy's width), once in forward and again in
backward, each prefetched one layer group ahead on a side stream. Priced per parameter as
activations are: the copy beyond what the reading ops' forward (resp. backward) hides is
exposed (``parameter_offload_time``). The device keeps the working gradient, and about
two layer groups' working copies at a time (the one in use, the one prefetched:
``autopar_passes.problem.parameter_transient``); the host keeps a working copy of its own
only where its dtype is not the master's (the runtime casts from the master otherwise).

>>> from autopar_cost_model.hardware import load_preset
>>> h100 = load_preset("h100-sxm")
>>> cost = optimizer_offload(1e9, grad=2, working=2, master=4, optimizer="adamw", preset=h100)
>>> round(cost.to_host / 1e9, 1), round(cost.to_device / 1e9, 1)
(2.0, 2.0)
"""

from __future__ import annotations

from typing import NamedTuple

from autopar_cost_model.hardware import DevicePreset
from autopar_cost_model.host import host_copy_time, host_of, host_step_time

# offloaded parameters' layer groups on the device at once: the one in use and the one
# prefetched (``runtime.param_offload``)
FETCHES_IN_FLIGHT = 2


class OffloadCost(NamedTuple):
    """One parameter piece's optimizer offload per step: bytes each way and seconds."""

    to_host: float
    to_device: float
    copy_s: float  # both copies, exposed
    host_s: float  # the CPU's step and casts


def host_pass_time(nbytes: float, preset: DevicePreset) -> float:
    """Seconds to stream ``nbytes`` through host memory at one device's share of it."""
    host = host_of(preset)
    share = host.memory_bandwidth * preset.efficiency.memory / max(preset.gpus_per_node, 1)
    return nbytes / share


def optimizer_offload(
    numel: float,
    *,
    grad: int,
    working: int,
    master: int,
    optimizer: str,
    preset: DevicePreset,
) -> OffloadCost:
    """The step of ``numel`` values whose master lives on the host (module docstring)."""
    down, up = numel * grad, numel * working
    copies = host_copy_time(down, preset, "from_device") + host_copy_time(up, preset, "to_device")
    casts = host_pass_time(numel * (grad + master + master + working), preset)
    step = host_step_time(numel, optimizer, master, preset)
    return OffloadCost(down, up, copies, step + casts)


def activation_offload_time(nbytes: float, forward_s: float, preset: DevicePreset) -> float:
    """Exposed seconds per microbatch of offloading ``nbytes`` saved by an op whose forward
    takes ``forward_s``: the copy down beyond what the forward hides, the copy up whole."""
    if nbytes <= 0:
        return 0.0
    down = host_copy_time(nbytes, preset, "from_device")
    return max(down - forward_s, 0.0) + host_copy_time(nbytes, preset, "to_device")


def parameter_offload_time(
    nbytes: float, forward_s: float, backward_s: float, preset: DevicePreset
) -> float:
    """Exposed seconds per microbatch of fetching a parameter's ``nbytes`` working copy
    from the host, once for forward and once for backward, each hidden behind the reading
    ops' pass (``forward_s``, ``backward_s``) and exposed beyond it (module docstring)."""
    if nbytes <= 0:
        return 0.0
    up = host_copy_time(nbytes, preset, "to_device")
    return max(up - forward_s, 0.0) + max(up - backward_s, 0.0)
