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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from autopar_cost_model.hardware import DevicePreset
from autopar_cost_model.host import host_copy_time
from autopar_cost_model.memory import microbatches_in_flight
from autopar_passes.ledger import Walk, grad_dtype, itemsize, regathered_params, working_dtype
from autopar_passes.lower_stages import stage_of_nodes
from autopar_passes.mixed_precision import cast_for_gather
from autopar_passes.pipeline.layer_costs import Part
from autopar_passes.strategies.graph import tensor_inputs
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
    # after backward and before the next forward: the step waits for both; with the
    # parameters offloaded too the stepped masters stay on the host (fetched per layer)
    ways = [("to_host", down, down_s), ("to_device", up, up_s)]
    return [
        HostCopy(
            purpose="optimizer",
            direction=direction,
            bytes=nbytes,
            calls=len(names),
            seconds=seconds,
            exposed_s=seconds,
        )
        for direction, nbytes, seconds in ways[: 1 if plan.offload.parameters else 2]
    ]


@dataclass(frozen=True)
class ParamReads:
    """How a program reads one parameter (``runtime.param_offload``): per microbatch its
    forward fetches it ``forward`` times and its backward ``backward`` times."""

    forward: int
    backward: int


def param_reads(
    traced: TracedModel, plan: Plan, walk: Walk, nodes: Collection[str] | None
) -> dict[str, ParamReads]:
    """Per parameter the ops ``nodes`` (None: all) read, as the runtime fetches it: once in
    forward where an op reads it (through views) in the program itself, and again in
    backward where such an op outside the recompute regions keeps it (or its FSDP group is
    gathered again); once each way per recompute region that takes it as it is (the region
    fetches its own, its replay again), not a copy a reshard before the region made.
    ``walk``: the plan's, run (its reshards and recompute regions)."""
    notes = traced.annotations()
    param_of = {n: name for name, info in traced.params.items() for n in info.nodes}
    root: dict[str, str] = {}
    reads: dict[str, tuple[bool, bool, set[int]]] = {}
    for node in traced.graph.nodes:
        note = notes[node.name]
        if note.alias_of is not None:  # a view reads nothing: its users read its base
            root[node.name] = root.get(note.alias_of, note.alias_of)
            continue
        if nodes is not None and node.name not in nodes:
            continue
        for index, source in enumerate(tensor_inputs(node)):
            name = param_of.get(root.get(source.producer, source.producer))
            if name is None:
                continue
            top, saved, regions = reads.get(name, (False, False, set()))
            region = walk.regions.get(node.name)
            made = walk.made.get((source.producer, walk.layouts.strategy(node.name).inputs[index]))
            as_it_is = source.producer in param_of or (
                region is not None and source.producer in region.ops
            )
            if region is not None and as_it_is and (made is None or made.in_region):
                regions = regions | {id(region)}
            else:
                # a region's input made before it: its checkpoint saves that (the
                # fetched weight, a view or a gather of it), which backward fetches again
                top = True
                saved = saved or (index in note.saved_inputs if region is None else True)
            reads[name] = (top, saved, regions)
    # a gathered parameter's group is fetched whole to be gathered again
    regathered = regathered_params(traced, plan, walk.reshards) if reads else set()
    return {
        name: ParamReads(
            int(top) + len(regions), int(saved or (top and name in regathered)) + len(regions)
        )
        for name, (top, saved, regions) in reads.items()
    }


def parameter_copies(
    plan: Plan,
    reads: Mapping[str, ParamReads],
    cast: frozenset[str],
    preset: DevicePreset,
    exposed_s: float,
) -> list[HostCopy]:
    """Offloaded parameters up from the host, every microbatch: each working copy as many
    times as ``reads`` says, forward and backward (one copy per fetch)."""
    mesh = plan.stage_mesh or plan.mesh
    microbatches = plan.parallelism.microbatches
    nbytes = calls = seconds = 0.0
    for name, read in reads.items():
        param = plan.params[name]
        local = math.prod(param.param.local_shape(param.shape, mesh.shape))
        each = local * itemsize(working_dtype(plan, param, name in cast))
        times = microbatches * (read.forward + read.backward)
        nbytes += times * each
        calls += times
        seconds += times * host_copy_time(each, preset, "to_device")
    return [
        HostCopy(
            purpose="parameters",
            direction="to_device",
            bytes=nbytes,
            calls=int(calls),
            seconds=seconds,
            exposed_s=min(exposed_s, seconds),
        )
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
    stage_of = {
        node: stage % par.pp
        for node, stage in (stage_of_nodes(traced, plan) if par.pp > 1 else {}).items()
    }
    walk: Walk | None = None  # the plan's reshards, walked once for every stage
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
        if plan.offload.parameters:
            nodes = None if par.pp == 1 else {n for n, s in stage_of.items() if s == index}
            if walk is None:
                walk = Walk(traced, plan, plan.stage_mesh or plan.mesh, 1.0)
                walk.run()
            reads = param_reads(traced, plan, walk, nodes)
            # prefetched per layer: what the layers' compute does not hide (``Part.fetch_s``)
            fetch_waits = par.microbatches * sum(p.fetch_s for p in parts)
            mine += parameter_copies(plan, reads, cast, preset, fetch_waits)
        if plan.offload.activations:
            mine += activation_copies(acts, par.microbatches, moved, preset)
        held.append(sum(states.values()) + flight * acts)
        waits = sum(c.seconds for c in mine if c.purpose == "optimizer")
        waits += sum(c.exposed_s for c in mine if c.purpose == "parameters")
        seconds.append(moved + waits)
        copies += [c.model_copy(update={"stage": index}) for c in mine]
    return held, seconds, tuple(copies)
