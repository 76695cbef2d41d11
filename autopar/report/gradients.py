"""When gradient compression (or local SGD) would pay: ``autopar explain PLAN gradients``.

Answered from the saved plan, without tracing: the plan's parameters give the gradient
buckets (``autopar_passes.ledger.sync_buckets``), and each candidate policy's calls are
priced by the same ledger code that priced the plan (``gradient_sync_entries``). What
backward hides of a sum follows the plan's own rule (``hide_overlapped``), with one
microbatch's backward taken as two thirds of its compute (the plan keeps compute, not its
split); the plan's own policy is priced the same way, so the differences are like for like.

Compression only pays where the gradient sum is exposed: a plan whose sums hide behind
backward gains nothing from sending fewer bytes and pays the encoding. Each scheme changes
the numbers (it is opt-in: ``grad_compression=``); local SGD changes the algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar_cost_model.hardware import load_preset
from autopar_passes.ledger import Ledger, gradient_sync_entries, hide_overlapped
from autopar_plans.compression import GradCompression, state_values
from autopar_plans.errors import UsageError
from autopar_plans.ledger import CommEntry
from autopar_plans.placement import Replicate
from autopar_plans.plan import Plan
from autopar_plans.reduction import GradReduction

# the schemes weighed, at the settings their papers report (DGC: 0.1% density after
# warm-up, here 1%; PowerSGD: rank 4; SenseTime's blocks)
CANDIDATES: tuple[tuple[str, dict[str, object]], ...] = (
    ("bf16", {"compression": {"scheme": "bf16"}}),
    ("terngrad", {"compression": {"scheme": "terngrad"}}),
    ("topk 1%", {"compression": {"scheme": "topk", "ratio": 0.01}}),
    ("block_topk 1%", {"compression": {"scheme": "block_topk", "ratio": 0.01}}),
    ("powersgd r=4", {"compression": {"scheme": "powersgd", "rank": 4}}),
    ("local SGD H=4", {"sync": "local_sgd", "period": 4}),
)


@dataclass
class PolicyCost:
    """One gradient-reduction policy on the plan, per step and device."""

    name: str
    sent_bytes: float  # bytes each device sends for the gradients (or the averaging)
    comm_s: float  # the gradient sum's time, hidden or not
    exposed_s: float  # what backward does not hide
    step_time_s: float  # the plan's step with this policy instead of its own
    state_bytes: float  # compression state held between steps
    planned: bool = False


@dataclass
class GradientReport:
    """``explain_gradients``' answer."""

    rows: list[PolicyCost]
    verdict: str


def explain_gradients(plan: Plan) -> GradientReport:
    """The plan's gradient sum next to each candidate policy, and whether any pays."""
    if plan.parallelism.pp > 1:
        raise UsageError(
            "explain gradients weighs the policies of plans without pipeline stages; this "
            f"plan has {plan.parallelism.pp}"
        )
    own = _cost("as planned", plan, plan.grad_reduction)
    own.planned = True
    rows = [own]
    for name, fields in CANDIDATES:
        policy = plan.grad_reduction.model_validate(
            {**plan.grad_reduction.model_dump(), "compression": GradCompression(), **fields}
        )
        if policy == plan.grad_reduction:
            continue
        if policy.compression.cast_dtype and plan.precision != "fp32":
            continue  # mixed precision sums in 16 bits already
        if policy.sync == "local_sgd" and plan.parallelism.dp != plan.mesh.size:
            continue  # local SGD plans pure data parallelism only
        rows.append(_cost(name, plan, policy))
    return GradientReport(rows, _verdict(own, rows[1:]))


def _cost(name: str, plan: Plan, policy: GradReduction) -> PolicyCost:
    variant = plan.model_copy(update={"grad_reduction": policy})
    mesh = plan.stage_mesh or plan.mesh
    microbatches = plan.parallelism.microbatches
    ledger = Ledger(mesh, microbatches, reduction=policy)
    gradient_sync_entries(list(plan.params), variant, ledger)
    preset = load_preset(mesh.device)
    backward_s = 2.0 / 3.0 * plan.estimate.compute_s / microbatches
    priced = hide_overlapped(ledger.entries, microbatches, backward_s, overlap=preset.comm_overlap)
    exposed = sum(e.exposed_s for e in priced)
    return PolicyCost(
        name=name,
        sent_bytes=sum(e.sent_per_step for e in priced),
        comm_s=sum(e.time_s for e in priced),
        exposed_s=exposed,
        step_time_s=plan.estimate.step_time_s - _planned_exposed(plan) + exposed,
        state_bytes=4.0 * sum(_state(plan, policy)),
    )


def _planned_exposed(plan: Plan) -> float:
    """The exposed seconds of the plan's own gradient sum, as its ledger has them."""
    return sum(e.exposed_s for e in sync_entries(plan.estimate.comm))


def sync_entries(entries: Sequence[CommEntry]) -> list[CommEntry]:
    """The ledger's entries of the gradient sum (or local SGD's averaging)."""
    return [e for e in entries if e.what.startswith(("gradient sync", "local SGD"))]


def _state(plan: Plan, policy: GradReduction) -> list[int]:
    mesh = plan.stage_mesh or plan.mesh
    return [
        state_values(policy.compression, p.param.local_shape(p.shape, mesh.shape))
        for p in plan.params.values()
        if any(isinstance(q, Replicate) and mesh.shape[a] > 1 for a, q in enumerate(p.param))
    ]


def _verdict(own: PolicyCost, others: list[PolicyCost]) -> str:
    if own.comm_s <= 0:
        return "no gradient crosses devices in this plan: nothing to compress"
    share = own.exposed_s / own.comm_s
    best = min(others, key=lambda r: r.step_time_s, default=None)
    if best is None or best.step_time_s >= own.step_time_s * 0.99:
        hidden = "backward hides most of it" if share < 0.5 else "yet"
        return (
            f"the gradient sum is {share:.0%} exposed: {hidden}, and no policy here makes "
            "the step faster by 1% or more; keep the plan's"
        )
    gain = own.step_time_s - best.step_time_s
    return (
        f"the gradient sum is {share:.0%} exposed (communication-bound): {best.name} would "
        f"save about {gain * 1e3:.3g} ms a step ({gain / own.step_time_s:.0%}); it changes "
        "the numbers, so it is opt-in (docs/communication.md)"
    )
