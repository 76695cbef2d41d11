"""Why a plan gives a parameter or an op its layout: ``autopar explain PLAN TARGET``.

The plan records what was chosen, not what it beat, so the model is traced again (on
``meta``) and the solver's problem is rebuilt on the mesh the plan was solved on (one
pipeline stage's; a grouping of it for meshes of more than two axes). Every decision is set
to the plan's choice; then the target's decision is tried at each of its choices with the
rest held as planned. For each alternative: its compute, resharding and overlappable
communication (gradient sync, counted in full: the solver may hide some behind the backward)
per step, its memory per device, and why it lost: a hint or forced style
that forbids it, the memory limit, or its cost. Recomputation is left out of the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.report.views import short_op
from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.hardware import load_preset
from autopar_passes.costs import CostModel, fsdp_group_shares
from autopar_passes.decisions import Decisions, group_decisions
from autopar_passes.hints import ResolvedHints, forbidden_choices, hint_rules
from autopar_passes.ilp import GroupCall, IlpProblem
from autopar_passes.layer_sharing import traced_representatives
from autopar_passes.mixed_precision import autocast_saved, working_cast_nodes
from autopar_passes.plan_build import expand_layout
from autopar_passes.problem import ProblemParts, build_problem
from autopar_passes.solve import group_axes, grouped_mesh
from autopar_passes.strategies.graph import traced_choices
from autopar_passes.trace import TracedModel
from autopar_plans.errors import PlanFileError, UsageError
from autopar_plans.hints import closest_names
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout, format_spec
from autopar_plans.plan import Plan


@dataclass
class Option:
    """One choice of the target's decision, with everything else as planned."""

    layout: str  # the target's layout (a parameter) or strategy (an op), user's axes
    compute_s: float
    reshard_s: float
    overlap_s: float
    memory_bytes: float
    chosen: bool = False
    forbidden_by: list[str] = field(default_factory=list)
    over_memory: bool = False

    @property
    def time_s(self) -> float:
        return self.compute_s + self.reshard_s + self.overlap_s


@dataclass
class Explanation:
    """What ``autopar explain`` prints about one target."""

    target: str
    what: str  # "parameter layers.0.attn.q_proj.weight (64x64)" or "op linear_3 (...)"
    mesh: MeshSpec
    options: list[Option]  # the chosen one first, then by time
    decided_by: str
    notes: list[str]


def explain(
    plan: Plan, traced: TracedModel, target: str, hints: ResolvedHints | None = None
) -> Explanation:
    """Explain ``target`` (a parameter name, an op's node name or a module path)."""
    mesh = plan.stage_mesh or plan.mesh
    groups = _grouping(plan, mesh)
    solved_mesh = grouped_mesh(mesh, groups)
    choices, _ = traced_choices(traced, solved_mesh.shape)
    tied = {n: info.nodes[0] for info in traced.params.values() for n in info.nodes[1:]}
    decisions = group_decisions(choices, traced_representatives(traced), tied)
    representatives = decisions.representatives
    node, what = _find_target(plan, traced, target)
    chosen = _plan_choices(plan, decisions, groups, mesh)
    microbatches = max(plan.global_batch // _traced_batch(traced), 1)
    cost = CostModel(
        MeshCost(solved_mesh, load_preset(mesh.device)),
        plan.optimizer,
        plan.precision,
        _zero_level(plan),
        working_cast=(cast := working_cast_nodes(traced, plan.precision)),
        autocast_saved=autocast_saved(traced, plan.precision),
        gather_share=fsdp_group_shares(traced, plan.precision, cast),
    )
    stages = max(plan.parallelism.pp, 1)
    limit = plan.memory_limit_bytes
    # the whole model's problem on one stage's mesh (the layers of every stage)
    parts = build_problem(
        decisions, cost, representatives, limit * stages if limit else None, None, microbatches
    )
    decision = decisions.bindings[node].decision
    forbidders = _forbidders(plan, decisions, solved_mesh, hints, decision)
    # memory in the plan's unit: the plan's own figure per device (of the target's stage),
    # and for an alternative its change, of the copies that lie on that stage
    stage, share = _stage_share(plan, traced, node, decisions.decisions[decision].members)
    planned = _planned_memory(plan, stage)
    row = parts.problem.memory[decision]
    options: dict[str, Option] = {}
    for k in range(len(decisions.decisions[decision].strategies)):
        option = _option(parts, decisions, decision, node, k, chosen, microbatches, groups, mesh)
        option.memory_bytes = planned + (row[k] - row[chosen[decision]]) * share
        option.chosen = k == chosen[decision]
        option.forbidden_by = sorted(forbidders.get(k, []))
        option.over_memory = limit is not None and option.memory_bytes > limit * 1.000001
        known = options.get(option.layout)
        if known is None or option.chosen or (not known.chosen and option.time_s < known.time_s):
            options[option.layout] = option
    ranked = sorted(options.values(), key=lambda o: (not o.chosen, o.time_s))
    members = decisions.decisions[decision].members
    notes = []
    if len(members) > 1:
        notes.append(
            f"one decision places it and its {len(members) - 1} copies in identical layers: "
            "the times are theirs together"
        )
    if stages > 1:
        notes.append(
            f"memory is per device of stage {stage}, which holds {share:.0%} of its copies: "
            "the plan's figure for that stage, and each alternative's change to it"
        )
    if decision != node:
        notes.append(f"takes its layout from {_readable(traced, decision)}'s decision")
    return Explanation(target, what, mesh, ranked, _decided_by(ranked), notes)


def _grouping(plan: Plan, mesh: MeshSpec) -> tuple[tuple[int, ...], ...]:
    """The grouping of ``mesh``'s axes on which every layout of the plan can be written
    (meshes of more than two axes are solved grouped, ``autopar_passes.solve.group_axes``)."""
    layouts = [p.param for p in plan.params.values()] + [o.output for o in plan.ops.values()]
    for groups in group_axes(mesh):
        if all(_collapse(layout, groups) is not None for layout in layouts):
            return groups
    return group_axes(mesh)[0]


def _collapse(layout: Layout, groups: tuple[tuple[int, ...], ...]) -> Layout | None:
    placements = []
    for group in groups:
        first = layout[group[0]]
        if any(layout[a] != first for a in group):
            return None
        placements.append(first)
    return Layout(*placements)


def _stage_share(
    plan: Plan, traced: TracedModel, node: str, members: Sequence[str]
) -> tuple[int, float]:
    """The pipeline stage that runs ``node``, and the share of a decision's ``members``
    (the node and its copies in identical layers) that stage runs."""
    if not plan.stages:
        return 0, 1.0
    notes = traced.annotations()

    def stage_of(name: str) -> int | None:
        note = notes.get(name)
        if note is None or note.layer is None:
            return None
        return next(
            (
                s.index % plan.parallelism.pp
                for s in plan.stages
                if s.layers[0] <= note.layer <= s.layers[1]
            ),
            None,
        )

    here = stage_of(node)
    if here is None:
        here = next((p.stage for p in plan.params.values() if node in p.aliases), 0)
    on = [m for m in members if stage_of(m) in (here, None)]
    return here, len(on) / max(len(members), 1)


def _planned_memory(plan: Plan, stage: int) -> float:
    """The plan's memory per device (of ``stage``'s devices in a pipeline)."""
    for found in plan.estimate.stages:
        if found.stage == stage:
            return found.memory_per_device_bytes.total
    return plan.estimate.memory_per_device_bytes.total


def _readable(traced: TracedModel, node: str) -> str:
    """A graph node said as the user knows it: a parameter by its name, an op by its ATen
    op and module."""
    for name, info in traced.params.items():
        if node in info.nodes:
            return name
    note = traced.annotations().get(node)
    if note is None:
        return "another op"
    return f"the {short_op(note.op)} of {note.module or 'the root module'}"


def _find_target(plan: Plan, traced: TracedModel, target: str) -> tuple[str, str]:
    """The node a target names, and how to call it."""
    for name, info in traced.params.items():
        if target == name or target in info.aliases:
            shape = "x".join(map(str, info.shape))
            return info.nodes[0], f"parameter {name} ({shape})"
    notes = traced.annotations()
    if target in plan.ops and target in notes:
        op = plan.ops[target]
        return target, f"op {_readable(traced, target).removeprefix('the ')} ({op.op})"
    exits = [
        n
        for n, note in notes.items()
        if note.kind in ("op", "view") and note.module == target and n in plan.ops
    ]
    if exits:
        last = exits[-1]
        return last, f"module {target}'s last op ({notes[last].op})"
    close = closest_names(target, [*traced.params, *plan.ops, *{n.module for n in notes.values()}])
    guess = f"; closest: {', '.join(close)}" if close else ""
    raise UsageError(
        f"{target!r} is no parameter, op or module of the plan{guess} (`autopar show` lists "
        "the parameters)"
    )


def _plan_choices(
    plan: Plan, decisions: Decisions, groups: tuple[tuple[int, ...], ...], mesh: MeshSpec
) -> dict[str, int]:
    """The choice of every decision that gives the plan's recorded layouts."""
    chosen: dict[str, int] = {}
    for name, decision in decisions.decisions.items():
        count = len(decision.strategies)
        if count == 1:
            chosen[name] = 0
            continue
        note = decisions.choices[name].note
        if note is not None and note.kind == "param" and note.param in plan.params:
            want = plan.params[note.param].param
            match = [
                k
                for k in range(count)
                if expand_layout(decisions.strategy(name, k).outputs[0], groups, mesh.shape) == want
            ]
        elif name in plan.ops:
            recorded = plan.ops[name]
            match = [
                k
                for k in range(count)
                if expand_layout(decisions.strategy(name, k).outputs[0], groups, mesh.shape)
                == recorded.output
                and tuple(
                    None if i is None else expand_layout(i, groups, mesh.shape)
                    for i in decisions.strategy(name, k).inputs
                )
                == recorded.inputs
            ]
        else:
            match = [0]
        if not match:
            raise PlanFileError(
                f"the plan's layout of {note.param if note and note.param else name} is not one "
                f"this model offers on {mesh.describe()}: was the plan made for this model "
                "(and --config)?"
            )
        chosen[name] = match[0]
    return chosen


def _option(
    parts: ProblemParts,
    decisions: Decisions,
    decision: str,
    node: str,
    k: int,
    chosen: dict[str, int],
    microbatches: int,
    groups: tuple[tuple[int, ...], ...],
    mesh: MeshSpec,
) -> Option:
    compute = microbatches * (parts.compute_fwd[decision][k] + parts.compute_bwd[decision][k])
    reshard = microbatches * parts.self_edge[decision][k]
    overlap = parts.sync[decision][k]
    for term, _, _ in parts.edge_terms:
        if decision not in (term.left, term.right):
            continue
        left = k if term.left == decision else chosen[term.left]
        right = k if term.right == decision else chosen[term.right]
        reshard += microbatches * term.cost.get(
            (term.left_class[left], term.right_class[right]), 0.0
        )
    inline, overlapped = _calls_alone(parts.problem, decision, k, chosen)
    reshard += inline
    overlap += overlapped
    strategy = decisions.strategy(node, k)
    note = decisions.choices[node].note
    axes = mesh.axis_names
    output = expand_layout(strategy.outputs[0], groups, mesh.shape)
    if note is not None and note.kind == "param":
        layout = format_spec(output, axes, len(note.outputs[0].shape))
    else:
        call = decisions.choices[node].call
        shapes = [info.shape for info in call.inputs] if call is not None else []
        inputs = ", ".join(
            "-"
            if layout is None
            else format_spec(expand_layout(layout, groups, mesh.shape), axes, len(shape))
            for layout, shape in zip(strategy.inputs, shapes, strict=False)
        )
        ndim = len(note.outputs[0].shape) if note is not None and note.outputs else len(output)
        layout = f"({inputs}) -> {format_spec(output, axes, ndim)}"
    return Option(layout, compute, reshard, overlap, parts.problem.memory[decision][k])


def _calls_alone(
    problem: IlpProblem, decision: str, k: int, chosen: dict[str, int]
) -> tuple[float, float]:
    """Seconds of the grouped calls (FSDP groups' gathers, bucket keys' first sums) that
    choice ``k`` of ``decision`` runs and no other decision's chosen choice does: what
    taking ``k`` adds, inline and overlappable (a call others run anyway costs it
    nothing more)."""
    choice = {**chosen, decision: k}
    inline = overlapped = 0.0
    for call in problem.group_calls:
        if not call.runs(problem, choice):
            continue
        ends = {e: (problem.edges[e].left, problem.edges[e].right) for e in call.edges}
        others = GroupCall(
            call.cost,
            {e: m for e, m in call.edges.items() if decision not in ends[e]},
            {d: m for d, m in call.choices.items() if d != decision},
        )
        if others.runs(problem, choice):
            continue
        if call.overlappable:
            overlapped += call.cost
        else:
            inline += call.cost
    return inline, overlapped


def _forbidders(
    plan: Plan,
    decisions: Decisions,
    mesh: MeshSpec,
    hints: ResolvedHints | None,
    decision: str,
) -> dict[int, list[str]]:
    """Choice -> the hints that forbid it."""
    found: dict[int, list[str]] = {}
    if hints is None:
        return found
    for hint, (rule, nodes) in hint_rules(hints, mesh).items():
        forbidden = forbidden_choices(decisions, [rule], nodes).get(decision, set())
        for k in forbidden:
            found.setdefault(k, []).append(str(hint))
    return found


def _decided_by(options: Sequence[Option]) -> str:
    chosen = options[0]
    rest = [o for o in options[1:]]
    allowed = [o for o in rest if not o.forbidden_by]
    if rest and not allowed:
        hints = sorted({h for o in rest for h in o.forbidden_by})
        return "the hints: every other layout is forbidden by " + "; ".join(hints)
    fits = [o for o in allowed if not o.over_memory]
    cheaper = [o for o in fits if o.time_s < chosen.time_s * (1 - 1e-9)]
    forbidden = len(rest) - len(allowed)
    by_hints = f"; hints forbid {forbidden} other layout(s)" if forbidden else ""
    if not rest:
        return "nothing: it has a single possible layout"
    if cheaper:
        return (
            "the plan as a whole: with everything else as planned a cheaper layout exists "
            "here, but the solver's joint choice (identical layers, memory, hidden "
            f"communication) is cheaper overall{by_hints}"
        )
    runner = min(fits, key=lambda o: o.time_s) if fits else None
    if runner is None:
        return f"memory: every other allowed layout exceeds the limit{by_hints}"
    margin = runner.time_s - chosen.time_s
    if margin <= 1e-9 * max(chosen.time_s, 1e-12):
        ties = sum(1 for o in fits if o.time_s - chosen.time_s <= 1e-9 * max(chosen.time_s, 1e-12))
        return (
            f"cost: the cheapest allowed layout, tied with {ties} other(s) (the solver took "
            f"one of them){by_hints}"
        )
    return f"cost: the cheapest allowed layout, {_seconds(margin)} per step ahead{by_hints}"


def _seconds(value: float) -> str:
    from autopar_plans.units import format_seconds

    return format_seconds(value)


def _traced_batch(traced: TracedModel) -> int:
    for node in traced.graph.nodes:
        if node.name in traced.user_inputs:
            val = node.meta.get("val")
            if val is not None and getattr(val, "dim", lambda: 0)() > 0:
                return int(val.shape[0])
    return 1


def _zero_level(plan: Plan) -> int:
    """The ZeRO stage the optimizer state was solved with, read off the layouts."""
    if any(p.grad != p.param for p in plan.params.values()):
        return 2
    if any(p.optimizer != p.param for p in plan.params.values()):
        return 1
    return 0
