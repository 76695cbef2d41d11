"""Why a plan offloads, or does not: ``autopar explain PLAN offload``.

Answered from the saved plan, without tracing. For each kind of offload
(``autopar_plans.offload``) it says what the kind moves off each device and what that
costs a step: for a kind the plan uses, the plan's own figures (its host copies,
``Estimate.host``, and the host bytes); for a kind it does not, an estimate by the same
cost model (``autopar_cost_model.offload``, ``autopar_passes.offload_ledger``), on the
busiest device:

- optimizer: frees the optimizer's bytes (states and masters, ``MemoryBreakdown.optimizer``)
  and puts them on the host with the masters' gradients; each step copies the summed
  gradients down and the stepped weights up (working copies taken at the stored width:
  under mixed precision the plan would cast matmul weights, so the bytes are an upper
  bound) and steps on the CPU instead of the device;
- activations: frees the saved activations; each microbatch copies them down and back
  (the copy down taken as not hidden: an upper bound);
- parameters (with the optimizer's, which it needs): frees the working copies (the
  device's ``params``; it still holds about two layers' in flight) and keeps one on the
  host only where its dtype is not the master's (under mixed precision every weight
  taken as cast: an upper bound); each microbatch copies every working copy up twice, for
  forward and again for backward (taken as not hidden: an upper bound).

The verdict weighs the freed bytes against the memory limit: the planner offloads only
where the plan would not fit otherwise, or where it is faster (an offloaded optimizer lets
it drop recomputation), or where a hint or option said so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar_cost_model.hardware import load_preset
from autopar_cost_model.host import host_copy_time, host_step_time
from autopar_cost_model.memory import optimizer_state_values, precision_policy
from autopar_cost_model.optimizer import optimizer_step_time
from autopar_passes.ledger import itemsize, working_dtype
from autopar_passes.offload_ledger import optimizer_copies
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes, format_seconds


@dataclass
class KindCost:
    """One kind of offload on the plan, per step and device (busiest stage)."""

    kind: str
    used: bool
    frees_bytes: float  # device bytes it moves to the host
    host_bytes: float  # host bytes it takes
    moved_bytes: float  # bytes over the host link per step, both ways
    cost_s: float  # seconds it adds to a step (the plan's own, or the estimate)


@dataclass
class OffloadReport:
    """``explain_offload``'s answer."""

    rows: list[KindCost]
    device_bytes: float
    limit_bytes: float | None
    verdict: str


def explain_offload(plan: Plan) -> OffloadReport:
    """Each kind of offload on ``plan`` and a verdict (module docstring)."""
    memory = plan.estimate.memory_per_device_bytes
    parameters = _parameters_row(plan)
    rows = [_optimizer_row(plan, parameters.host_bytes), _activations_row(plan), parameters]
    return OffloadReport(rows, memory.total, plan.memory_limit_bytes, _verdict(plan, rows))


def _busiest_params(plan: Plan) -> list[str]:
    """The parameters of the stage that holds the most of them (all without a pipeline; a
    pipeline plan whose parameters do not say their stage gives all: an upper bound)."""
    by_stage: dict[int, list[str]] = {}
    for name, param in plan.params.items():
        by_stage.setdefault(param.stage, []).append(name)
    return max(by_stage.values(), key=len)


def _optimizer_host(plan: Plan, names: list[str]) -> tuple[float, float]:
    """(values the device steps, host bytes an offloaded optimizer holds for them: the
    master, its gradient and the states)."""
    mesh = plan.stage_mesh or plan.mesh
    policy = precision_policy(plan.precision)
    stepped = 0.0
    host = 0.0
    for name in names:
        param = plan.params[name]
        numel = math.prod(param.shape) / param.optimizer.shard_factor(mesh.shape)
        states = optimizer_state_values(param.shape, plan.optimizer) / math.prod(param.shape)
        stepped += numel
        host += numel * policy.master * (2 + states)  # master, its gradient, the states
    return stepped, host


def _optimizer_row(plan: Plan, parameters_host: float) -> KindCost:
    """``parameters_host``: what offloaded parameters hold on the host besides."""
    preset = load_preset(plan.mesh.device)
    e = plan.estimate
    names = _busiest_params(plan)
    policy = precision_policy(plan.precision)
    stepped, host = _optimizer_host(plan, names)
    on_device = optimizer_step_time(stepped, plan.optimizer, policy.master, preset)
    if plan.offload.optimizer:
        # the plan's step on the CPU with its copies, against the device's step
        copies = [c for c in e.host if c.purpose == "optimizer"]
        held = e.memory_per_device_bytes.host - _activation_host(plan) - parameters_host
        seconds = max(e.optimizer_s - on_device, 0.0)
        return KindCost("optimizer", True, held, held, sum(c.bytes for c in copies), seconds)
    copies = optimizer_copies(plan, names, frozenset(), preset)
    cpu = host_step_time(stepped, plan.optimizer, policy.master, preset) if preset.host else 0.0
    seconds = sum(c.seconds for c in copies) + max(cpu - e.optimizer_s, 0.0)
    frees = e.memory_per_device_bytes.optimizer
    return KindCost("optimizer", False, frees, host, sum(c.bytes for c in copies), seconds)


def _activation_host(plan: Plan) -> float:
    """Host bytes of the plan's offloaded activations: a microbatch's (its copies down over
    the microbatches) times those in flight (one without a pipeline; 1F1B's first stage
    holds ``min(p, m)``)."""
    if not plan.offload.activations:
        return 0.0
    par = plan.parallelism
    down = [
        c.bytes
        for c in plan.estimate.host
        if c.purpose == "activations" and c.direction == "to_host"
    ]
    flight = min(par.pp, par.microbatches) if par.pp > 1 else 1
    return max(down, default=0.0) / par.microbatches * flight


def _activations_row(plan: Plan) -> KindCost:
    e = plan.estimate
    if plan.offload.activations:
        copies = [c for c in e.host if c.purpose == "activations"]
        held = _activation_host(plan)
        seconds = sum(c.exposed_s for c in copies)
        return KindCost("activations", True, held, held, sum(c.bytes for c in copies), seconds)
    preset = load_preset(plan.mesh.device)
    saved = e.memory_per_device_bytes.activations
    microbatches = plan.parallelism.microbatches
    per_microbatch = saved / max(min(plan.parallelism.pp, microbatches), 1)
    seconds = 0.0
    if preset.host is not None and per_microbatch:
        seconds = microbatches * (
            host_copy_time(per_microbatch, preset, "from_device")
            + host_copy_time(per_microbatch, preset, "to_device")
        )
    return KindCost("activations", False, saved, saved, 2 * per_microbatch * microbatches, seconds)


def _working_bytes(plan: Plan, names: list[str]) -> list[float]:
    """Each parameter's local working copy in bytes, at the stored width (under mixed
    precision a matmul's weight is cast to the compute dtype, which the plan alone does
    not say: an upper bound)."""
    mesh = plan.stage_mesh or plan.mesh
    found = []
    for name in names:
        param = plan.params[name]
        local = math.prod(param.param.local_shape(param.shape, mesh.shape))
        found.append(local * itemsize(working_dtype(plan, param, cast=False)))
    return found


def _parameters_row(plan: Plan) -> KindCost:
    """Offloaded parameters: the plan's own copies and host bytes where it offloads them,
    else estimated; what it frees, the working copies, at the stored width either way."""
    e = plan.estimate
    microbatches = plan.parallelism.microbatches
    names = _busiest_params(plan)
    working = _working_bytes(plan, names)
    policy = precision_policy(plan.precision)
    # the host's own working copy, where it is cast from the master (every weight: a bound)
    cast = policy.param / policy.master if policy.param != policy.master else 0.0
    if plan.offload.parameters:
        copies = [c for c in e.host if c.purpose == "parameters"]
        frees = sum(working)
        # what the host holds beyond the optimizer's and the activations' own
        _, optimizer = _optimizer_host(plan, names)
        held = max(e.memory_per_device_bytes.host - optimizer - _activation_host(plan), 0.0)
        seconds = sum(c.exposed_s for c in copies)
        return KindCost("parameters", True, frees, held, sum(c.bytes for c in copies), seconds)
    preset = load_preset(plan.mesh.device)
    seconds = 0.0
    if preset.host is not None:
        seconds = 2 * microbatches * sum(host_copy_time(w, preset, "to_device") for w in working)
    frees = sum(working)
    return KindCost("parameters", False, frees, cast * frees, 2 * microbatches * frees, seconds)


def _verdict(plan: Plan, rows: list[KindCost]) -> str:
    memory = plan.estimate.memory_per_device_bytes
    limit = plan.memory_limit_bytes
    used = [r for r in rows if r.used]
    if used:
        without = memory.total + sum(r.frees_bytes for r in used)
        kinds = " and ".join(r.kind for r in used)
        cost = format_seconds(sum(r.cost_s for r in used))
        if limit is not None and without > limit:
            return (
                f"{kinds} offloaded: on the device alone this plan would need about "
                f"{format_bytes(without)} per device, over the limit of {format_bytes(limit)}; "
                f"offload costs {cost} a step"
            )
        return (
            f"{kinds} offloaded though the plan would fit without it ({format_bytes(without)} "
            f"of {format_bytes(limit or 0)}): a hint or option forced it, or it let the "
            f"planner drop recomputation; it costs {cost} a step"
        )
    best = max(rows, key=lambda r: r.frees_bytes)
    room = f" of {format_bytes(limit)}" if limit is not None else ""
    return (
        f"nothing offloaded: the plan fits ({format_bytes(memory.total)}{room}); offloading "
        f"the {best.kind} would free {format_bytes(best.frees_bytes)} per device and add "
        f"about {format_seconds(best.cost_s)} a step"
    )
