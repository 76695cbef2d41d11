"""The price of a gradient-reduction policy (``autopar_plans.reduction``) on a mesh.

A sum over replicated axes runs the calls ``reduce_steps`` lists (one all-reduce per
axis, or the hierarchical form); each call is priced on its own axis by ``MeshCost``, so
the price is of what the runtime runs. ``resolve_reduction`` turns the policy's ``auto``
form into the cheaper of the two for a full bucket over every axis of the mesh, and
records the axes' order, fastest link first, that the hierarchical form follows.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar_cost_model.collectives import MeshCost
from autopar_plans.reduction import GradReduction, ReduceStep, padded_numel, reduce_steps


def axis_order(cost: MeshCost) -> tuple[str, ...]:
    """The mesh's axis names, fastest link first (ties: the last axis first, as
    ``collective_cost`` orders a hierarchical form's groups)."""
    names = cost.mesh.axis_names
    links = sorted(cost.links, key=lambda lk: (-lk.bandwidth, lk.latency, -lk.axis))
    return tuple(names[lk.axis] for lk in links)


def step_bytes(
    steps: Sequence[ReduceStep], numel: float, itemsize: int, sizes: Sequence[tuple[str, int]]
) -> list[tuple[ReduceStep, float]]:
    """Each call's payload (``autopar_plans.ledger``'s convention: an all-gather's output, a
    reduce-scatter's input) for a bucket of ``numel`` values, padded as the runtime pads it."""
    whole = padded_numel(round(numel), steps, sizes) if numel >= 1 else numel
    return [(s, whole * itemsize / s.divisor) for s in steps]


def reduction_time(
    policy: GradReduction, cost: MeshCost, nbytes: float, axes: Sequence[int]
) -> float:
    """Seconds to sum a bucket of ``nbytes`` over mesh ``axes`` under ``policy``."""
    names = cost.mesh.axis_names
    sizes = [(names[a], cost.mesh.shape[a]) for a in axes]
    index = {name: a for a, name in enumerate(names)}
    steps = reduce_steps(policy, sizes)
    return sum(
        cost.collective(step.kind, nbytes / step.divisor, (index[step.axis],)).time
        for step in steps
    )


def resolve_reduction(policy: GradReduction, cost: MeshCost, nbytes: float) -> GradReduction:
    """``policy`` with its axes ordered for this mesh and an ``auto`` form decided: the
    hierarchical form where it sums a bucket of ``nbytes`` over all the mesh's axes faster
    than one all-reduce per axis."""
    resolved = policy.model_copy(update={"axis_order": axis_order(cost)})
    if policy.form != "auto":
        return resolved
    axes = [a for a, size in enumerate(cost.mesh.shape) if size > 1]
    per_axis = resolved.model_copy(update={"form": "per_axis"})
    if len(axes) < 2:
        return per_axis
    hierarchical = resolved.model_copy(update={"form": "hierarchical"})
    faster = reduction_time(hierarchical, cost, nbytes, axes) < reduction_time(
        per_axis, cost, nbytes, axes
    )
    return hierarchical if faster else per_axis
