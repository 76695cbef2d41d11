"""The solve pass: from an annotated graph to chosen strategies.

Reads the ``TracedModel`` and a ``SolveRequest`` (mesh, memory limit, optimizer, precision,
constraints); runs, in order:

1. ``graph_choices``: strategies per node (``passes.strategies.graph``);
2. ``layer_representatives``: identical layers (``passes.layer_sharing``);
3. ``group_decisions``: the ILP's decisions (``passes.decisions``);
4. ``build_problem``: coefficients from the cost model (``passes.problem``);
5. ``solve_ilp`` (``passes.ilp``), first with plain data-parallel optimizer state, then
   with ZeRO-1 and ZeRO-2 sharding of it if the memory limit calls for them.

Writes a ``Solved``: the choice of every decision and what it costs. When nothing fits even
with everything sharded, raises ``InfeasiblePlanError`` with the minimum memory per device,
the term that dominates it and what would help.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from cost_model.collectives import MeshCost
from cost_model.hardware import load_preset
from passes.costs import CostModel
from passes.decisions import Decisions, group_decisions
from passes.ilp import IlpProblem, solve_ilp
from passes.layer_sharing import layer_representatives
from passes.problem import ProblemParts, build_problem, unmerged_size
from passes.strategies.graph import NodeChoices, graph_choices
from passes.strategies.types import Strategy
from passes.trace import TracedModel
from plans.errors import InfeasiblePlanError
from plans.mesh import MeshSpec
from plans.plan import SolverReport
from plans.units import format_bytes

# (node name, its choices, one strategy) -> may the node take it? Forced strategies, hints
# and bans are all this one mechanism: a constraint s[d, k] = 0 in the ILP.
Constraint = Callable[[str, NodeChoices, Strategy], bool]


# Constraints are made for the mesh the ILP is solved on (see ``solve_sharding``).
Constraints = Callable[[MeshSpec], list[Constraint]]


def no_constraints(mesh: MeshSpec) -> list[Constraint]:
    return []


@dataclass
class SolveRequest:
    mesh: MeshSpec
    memory_limit: float | None = None
    optimizer: str = "adamw"
    precision: str = "fp32"
    time_limit: float = 60.0
    constraints: Constraints = no_constraints
    zero_levels: tuple[int, ...] = (0, 1, 2)
    microbatches: int = 1  # per step: weighs per-microbatch time against per-step sync


@dataclass
class Solved:
    """The chosen strategy of every decision, with the problem that chose it."""

    decisions: Decisions
    representatives: dict[str, str]
    choice: dict[str, int]
    parts: ProblemParts
    cost: CostModel
    report: SolverReport
    zero: int
    warnings: list[str]
    # the mesh's axes each solved axis stands for (``group_axes``); one each when ungrouped
    axis_groups: tuple[tuple[int, ...], ...] = ()

    def strategy(self, node: str) -> Strategy:
        binding = self.decisions.bindings[node]
        return self.decisions.strategy(node, self.choice[binding.decision])

    def output_layout(self, node: str, index: int = 0):
        binding = self.decisions.bindings[node]
        return self.decisions.output_layout(node, self.choice[binding.decision], index)


def solve_sharding(traced: TracedModel, request: SolveRequest) -> Solved:
    """Choose a strategy for every node of ``traced`` on ``request.mesh``.

    A mesh of more than two axes (of size > 1) is solved as each of its 2-d groupings of
    adjacent axes (``group_axes``), and the cheapest is kept: a layout on a grouped axis is
    the same layout on each axis of the group (Shard(d) on both splits d outer axis first,
    exactly as the grouped axis does), so the plan maps back exactly. Per-op strategies grow
    as (choices per axis) ** axes; grouping keeps the ILP at a 2-d mesh's size, at the price
    of the strategies that treat the axes of a group differently.
    """
    groupings = group_axes(request.mesh)
    if len(groupings) == 1:
        return _solve(traced, request, groupings[0])
    best: Solved | None = None
    failure: InfeasiblePlanError | None = None
    for groups in groupings:
        try:
            solved = _solve(traced, request, groups)
        except InfeasiblePlanError as error:
            failure = error
            continue
        if best is None or (solved.report.objective or 0.0) < (best.report.objective or 0.0):
            best = solved
    if best is None:
        assert failure is not None
        raise failure
    return best


def group_axes(mesh: MeshSpec) -> list[tuple[tuple[int, ...], ...]]:
    """The ways to see ``mesh`` as at most two axes of size > 1 by merging adjacent ones
    (axes of size 1 ride along with a neighbour)."""
    big = [a for a, size in enumerate(mesh.shape) if size > 1]
    if len(big) <= 2:
        return [tuple((a,) for a in range(mesh.ndim))]
    groupings = []
    for cut in big[1:]:
        groupings.append((tuple(range(cut)), tuple(range(cut, mesh.ndim))))
    return groupings


def grouped_mesh(mesh: MeshSpec, groups: tuple[tuple[int, ...], ...]) -> MeshSpec:
    """The mesh whose axis ``i`` is the product of ``mesh``'s axes ``groups[i]``."""
    if all(len(g) == 1 for g in groups):
        return mesh
    shape = tuple(math.prod(mesh.shape[a] for a in g) for g in groups)
    names = tuple("_".join(mesh.axis_names[a] for a in g) for g in groups)
    return mesh.model_copy(update={"shape": shape, "axis_names": names})


def _solve(
    traced: TracedModel, request: SolveRequest, groups: tuple[tuple[int, ...], ...]
) -> Solved:
    mesh = grouped_mesh(request.mesh, groups)
    request = SolveRequest(
        mesh,
        request.memory_limit,
        request.optimizer,
        request.precision,
        request.time_limit,
        request.constraints,
        request.zero_levels,
    )
    choices, warnings = graph_choices(traced.graph, mesh.shape)
    representatives = layer_representatives(traced.graph)
    tied = {node: info.nodes[0] for info in traced.params.values() for node in info.nodes[1:]}
    decisions = group_decisions(choices, representatives, tied)
    allowed = allowed_choices(decisions, request.constraints(mesh))
    mesh_cost = MeshCost(mesh, load_preset(mesh.device))
    last: tuple[ProblemParts, CostModel] | None = None
    for zero in request.zero_levels:
        cost = CostModel(mesh_cost, request.optimizer, request.precision, zero)
        parts = build_problem(
            decisions,
            cost,
            representatives,
            request.memory_limit,
            allowed,
            request.microbatches,
        )
        solution = solve_ilp(parts.problem, request.time_limit)
        last = (parts, cost)
        if solution.timed_out:
            raise InfeasiblePlanError(
                f"the solver found no plan within its time limit of {request.time_limit:g} s "
                f"({solution.report.variables} variables); allow it more time (time_limit=, "
                "--time-limit)"
            )
        if solution.feasible:
            report = solution.report.model_copy(
                update={"variables_before_merging": unmerged_size(decisions)}
            )
            if report.status != "optimal":
                warnings.append(
                    f"the solver stopped at its time limit ({request.time_limit:g} s) with "
                    f"the best plan found so far (gap {report.gap})"
                )
            return Solved(
                decisions,
                representatives,
                solution.choice,
                parts,
                cost,
                report,
                zero,
                warnings,
                groups,
            )
    assert last is not None
    raise infeasible_error(last[0], request)


def allowed_choices(decisions: Decisions, constraints: list[Constraint]) -> dict[str, set[int]]:
    """For each decision, the choices every bound node's constraints accept."""
    if not constraints:
        return {}
    allowed: dict[str, set[int]] = {}
    for node, binding in decisions.bindings.items():
        if binding.source is not None:
            continue
        choices = decisions.choices[node]
        decision = decisions.decisions[binding.decision]
        ok = allowed.setdefault(binding.decision, set(range(len(decision.strategies))))
        for k in list(ok):
            strategy = decisions.strategy(node, k)
            if not all(c(node, choices, strategy) for c in constraints):
                ok.discard(k)
    return allowed


def infeasible_error(parts: ProblemParts, request: SolveRequest) -> InfeasiblePlanError:
    """The minimum memory per device any allowed plan needs, what dominates it, what helps."""
    problem = parts.problem
    minimum = IlpProblem(
        choices=problem.choices,
        cost={name: list(values) for name, values in problem.memory.items()},
        allowed=problem.allowed,
    )
    solution = solve_ilp(minimum, request.time_limit)
    if not solution.feasible:
        return InfeasiblePlanError(
            "the constraints (forced strategies or hints) allow no plan at all; relax them"
        )
    terms = {"parameters": 0.0, "gradients": 0.0, "optimizer states": 0.0, "activations": 0.0}
    for name, k in solution.choice.items():
        params, grads, optimizer = parts.model_states[name][k]
        terms["parameters"] += params
        terms["gradients"] += grads
        terms["optimizer states"] += optimizer
        terms["activations"] += parts.activations[name][k]
    need = sum(terms.values())
    dominant = max(terms, key=lambda t: terms[t])
    limit = request.memory_limit or 0.0
    helps = (
        "activation recomputation or more pipeline stages (fewer activations per device), "
        "a smaller microbatch"
        if dominant == "activations"
        else "more devices, pipeline stages, or a lighter optimizer/precision policy"
    )
    return InfeasiblePlanError(
        f"the model does not fit in {format_bytes(limit)} per device on "
        f"{request.mesh.describe()}: even sharded as far as the rules allow it needs "
        f"{format_bytes(need)} per device (short by {format_bytes(need - limit)}); "
        f"{dominant} dominate with {format_bytes(terms[dominant])}. What would help: {helps}"
    )
