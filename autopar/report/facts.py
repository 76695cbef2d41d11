"""What a saved plan says about one parameter or op, read from the plan alone (no model,
no trace): ``autopar explain PLAN TARGET`` answers with it at once, and costs the
alternatives (``autopar.report.explain``, which traces the model) only when asked.

For a parameter: its layout, its gradient's and its optimizer state's in the mesh's own
axis names, the share of it a device holds, its pipeline stage, and the collectives the
plan's ledger charges to it. For an op (a module path, or a node name from the plan): the
module and ATen op, its inputs' and output's layouts, and its collectives. Layer indices
are folded nowhere here: the target is one tensor or op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.report.views import short_op, what_in_words
from autopar_plans.errors import UsageError
from autopar_plans.hints import closest_names
from autopar_plans.placement import Layout, format_spec
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes, format_seconds


@dataclass
class Facts:
    """A target as the plan records it: named rows, then its collectives."""

    what: str
    rows: list[tuple[str, str]]
    # (collective, what causes it, bytes sent, time), per step and device
    collectives: list[tuple[str, str, str, str]] = field(default_factory=list)


def plan_facts(plan: Plan, target: str) -> Facts:
    mesh = plan.stage_mesh or plan.mesh
    names = mesh.axis_names
    where = mesh_in_words(plan)
    for name, param in plan.params.items():
        if target == name or target in param.aliases:
            ndim = len(param.shape)
            shards = param.param.shard_factor(mesh.shape)
            rows = [
                ("mesh", where),
                ("shape", "x".join(map(str, param.shape)) + f" ({param.dtype})"),
                ("layout", format_spec(param.param, names, ndim)),
                ("gradient", format_spec(param.grad, names, ndim)),
                ("optimizer state", format_spec(param.optimizer, names, ndim)),
                ("a device holds", "all of it" if shards == 1 else f"1/{shards} of it"),
            ]
            if plan.parallelism.pp > 1:
                rows.append(("pipeline stage", str(param.stage)))
            return Facts(f"parameter {name}", rows, _collectives(plan, {name, *param.aliases}))
    node = _op_node(plan, target)
    op = plan.ops[node]
    rows = [("mesh", where), ("op", f"{op.op} in {op.module or 'the root module'}")]
    rows.append(("strategy", op.strategy))
    rows += [
        (f"input {i}", _placements(layout, names))
        for i, layout in enumerate(op.inputs)
        if layout is not None
    ]
    rows.append(("output", _placements(op.output, names)))
    what = f"op {short_op(op.op)} of {op.module or 'the root module'}"
    return Facts(what, rows, _collectives(plan, {node}))


def _op_node(plan: Plan, target: str) -> str:
    if target in plan.ops:
        return target
    exits = [name for name, op in plan.ops.items() if op.module == target]
    if exits:
        return exits[-1]  # a module's last op: what it hands on
    close = closest_names(target, [*plan.params, *{op.module for op in plan.ops.values()}])
    guess = f"; closest: {', '.join(close)}" if close else ""
    raise UsageError(
        f"{target!r} is no parameter, op or module of the plan{guess} (`autopar show` lists "
        "the parameters)"
    )


def _collectives(plan: Plan, names: set[str]) -> list[tuple[str, str, str, str]]:
    """The ledger's entries whose reason names the target, per step and device."""
    found = []
    for entry in plan.estimate.comm:
        words = {word.strip("()") for word in entry.what.split(" ")}
        if words & names:
            found.append(
                (
                    f"{entry.phase} {entry.kind} {','.join(entry.axes)}",
                    what_in_words(plan, entry.what),
                    format_bytes(entry.sent_per_step),
                    format_seconds(entry.time_s),
                )
            )
    return found


def mesh_in_words(plan: Plan) -> str:
    if plan.stage_mesh is None:
        return plan.mesh.describe()
    stage, whole = plan.stage_mesh.describe(), plan.mesh.describe()
    return f"one pipeline stage's devices, {stage}, of {whole}"


def _placements(layout: Layout, names: tuple[str, ...]) -> str:
    """Per mesh axis, what the tensor is on it: ``node: R, gpu: S(1)`` (split on dim 1)."""
    return ", ".join(
        f"{name}: {placement!r}" for name, placement in zip(names, layout, strict=True)
    )
