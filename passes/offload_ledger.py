"""The host side of a plan under offload (``autopar_plans.offload``): the copies a step makes
between each device and its host (``Estimate.host``), the bytes the host holds per device
(``MemoryBreakdown.host``) and the seconds they add (``Estimate.offload_s``).

The copies are those the runtime makes (``runtime.zero``, ``runtime.offload``), which its
``HostLog`` counts and the tests hold to these entries:

- **optimizer**: per parameter this device steps, once a step, the summed gradient piece
  down in the dtype it was summed in (the compute dtype under mixed precision, for a
  working copy cast to it) and the stepped master piece up in the working copy's dtype;
- **activations**: every saved tensor down in forward and up in backward, every
  microbatch: the plan's saved bytes per microbatch (``docs/activation_memory.md``: what
  autograd keeps, within the estimate's accuracy) times the microbatches.

A pipeline rank's figures are its own stage's, the busiest stage's for the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar_cost_model.hardware import DevicePreset
from autopar_cost_model.host import host_copy_time
from autopar_cost_model.memory import microbatches_in_flight
from autopar_passes.ledger import grad_dtype, itemsize, working_dtype
from autopar_passes.mixed_precision import cast_for_gather
from autopar_passes.pipeline.layer_costs import Part
from autopar_passes.trace import TracedModel
from autopar_plans.offload import HostCopy
from autopar_plans.placement import zero_axes
from autopar_plans.plan import Plan


def optimizer_copies(
    plan: Plan, names: Sequence[str], cast: frozenset[str], preset: DevicePreset
) -> list[HostCopy]:
    """The optimizer's copies of one step for parameters ``names`` (those a device holds)."""
    mesh = plan.stage_mesh or plan.mesh
    down = up = down_s = up_s = 0.0
    for name in names:
        param = plan.params[name]
        local = math.prod(param.param.local_shape(param.shape, mesh.shape))
        pieces = math.prod(
            mesh.shape[a] for a, _ in zero_axes(param.param, param.optimizer, mesh.shape)
        )
        working = working_dtype(plan, param, name in cast)
        grad_b = local / pieces * itemsize(grad_dtype(plan, working))
        master_b = local / pieces * itemsize(working)
        down, up = down + grad_b, up + master_b
        down_s += host_copy_time(grad_b, preset, "from_device")
        up_s += host_copy_time(master_b, preset, "to_device")
    # after backward and before the next forward: the step waits for both
    return [
        HostCopy(
            purpose="optimizer",
            direction=direction,
            bytes=nbytes,
            calls=len(names),
            seconds=seconds,
            exposed_s=seconds,
        )
        for direction, nbytes, seconds in (("to_host", down, down_s), ("to_device", up, up_s))
    ]


def activation_copies(
    per_microbatch: float, microbatches: int, exposed_s: float, preset: DevicePreset
) -> list[HostCopy]:
    """Saved activations down and up, ``per_microbatch`` bytes each way every microbatch."""
    nbytes = per_microbatch * microbatches
    seconds = microbatches * (
        host_copy_time(per_microbatch, preset, "from_device")
        + host_copy_time(per_microbatch, preset, "to_device")
    )
    return [
        HostCopy(
            purpose="activations",
            direction=direction,
            bytes=nbytes,
            seconds=seconds / 2,
            exposed_s=exposed_s / 2,
        )
        for direction in ("to_host", "to_device")
    ]


def stage_host(
    plan: Plan,
    traced: TracedModel,
    stages: Sequence[Sequence[Part]],
    scale: float,
    preset: DevicePreset,
) -> tuple[list[float], list[float], tuple[HostCopy, ...]]:
    """Per stage of ``stages`` (each its parts; one for a plan without a pipeline), with
    activations of ``scale`` times the traced microbatch: the host bytes per device and the
    exposed offload seconds; and every stage's host copies."""
    par = plan.parallelism
    cast = cast_for_gather(traced, plan.precision)
    held: list[float] = []
    seconds: list[float] = []
    copies: list[HostCopy] = []
    for index, parts in enumerate(stages):
        schedule = par.schedule if par.pp > 1 else "none"
        flight = microbatches_in_flight(schedule, par.pp, index, par.microbatches, par.chunks)
        acts = scale * sum(p.host_activations for p in parts)
        # a parameter two of the stage's parts read (a tied embedding) is held once
        states = {name: nbytes for p in parts for name, nbytes in p.host_of.items()}
        moved = par.microbatches * scale * sum(p.offload_s for p in parts)
        mine: list[HostCopy] = []
        if plan.offload.optimizer:
            mine += optimizer_copies(plan, list(states), cast, preset)
        if plan.offload.activations:
            mine += activation_copies(acts, par.microbatches, moved, preset)
        held.append(sum(states.values()) + flight * acts)
        seconds.append(moved + sum(c.seconds for c in mine if c.purpose == "optimizer"))
        copies += [c.model_copy(update={"stage": index}) for c in mine]
    return held, seconds, tuple(copies)
