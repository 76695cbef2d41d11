"""The solve pass: from an annotated graph to chosen strategies.

Reads the ``TracedModel`` and a ``SolveRequest`` (mesh, memory limit, optimizer, precision,
constraints); runs, in order:

1. ``graph_choices``: strategies per node (``autopar_passes.strategies.graph``);
2. ``layer_representatives``: identical layers (``autopar_passes.layer_sharing``);
3. ``group_decisions``: the ILP's decisions (``autopar_passes.decisions``);
4. ``build_problem``: coefficients from the cost model (``autopar_passes.problem``);
5. ``solve_ilp`` (``autopar_passes.ilp``), first the fastest plan over the ZeRO stages with no
   memory row, then, if it does not fit, under the limit for each ZeRO stage with
   recomputation as variables.

Writes a ``Solved``: the choice of every decision and what it costs. When nothing fits even
with everything sharded, raises ``InfeasiblePlanError`` with the minimum memory per device,
the term that dominates it and what would help.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.hardware import DevicePreset, load_preset
from autopar_cost_model.memory import precision_policy
from autopar_cost_model.reduction import resolve_reduction
from autopar_passes.collector import collector_paused
from autopar_passes.costs import CostModel, fsdp_group_shares, gradient_bytes, sync_buckets
from autopar_passes.decisions import Decisions, group_decisions
from autopar_passes.ilp import (
    CLOCK_FACTOR,
    WORK_LIMIT,
    IlpProblem,
    WorkCutoff,
    cannot_beat,
    dominates,
    solve_ilp,
)
from autopar_passes.layer_sharing import traced_representatives
from autopar_passes.mixed_precision import (
    MIXED,
    AutocastSaved,
    autocast_saved,
    working_cast_nodes,
)
from autopar_passes.problem import (
    ProblemParts,
    build_problem,
    parameter_transient,
    reuses_edges,
    unmerged_size,
)
from autopar_passes.recompute import (
    RecomputeHint,
    Region,
    apply_recompute_hints,
    find_regions,
    recompute_budgets,
    recompute_terms,
)
from autopar_passes.strategies.graph import NodeChoices, traced_choices
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel
from autopar_plans.buckets import BUCKET_BYTES
from autopar_plans.errors import InfeasiblePlanError, UsageError
from autopar_plans.mesh import MeshSpec
from autopar_plans.offload import AUTO_OFFLOAD, KINDS, NO_OFFLOAD, Offload, OffloadRequest
from autopar_plans.plan import SolverReport
from autopar_plans.reduction import PER_AXIS, GradReduction
from autopar_plans.units import format_bytes

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
    batch_scale: float = 1.0  # activations' share of the traced batch (see CostModel)
    in_flight: float = 1.0  # microbatches held at once, of those in batch_scale (CostModel)
    recompute_hints: tuple[RecomputeHint, ...] = ()  # forced or forbidden (hints)
    # the caller found the fastest plan too large already: solve under the limit directly
    known_unfit: bool = False
    # only plans whose compute and resharding (the objective less exposed communication)
    # stay within this are wanted: the caller holds a plan that any other beats only so
    # (the pipeline search's bound); none found raises ``NothingFaster``
    work_cutoff: WorkCutoff | None = None
    # what autograd keeps under a mixed precision's autocast (``autocast_saved``), when the
    # caller found it already (the pipeline search: once per trace); None: found here
    autocast_saved: AutocastSaved | None = None
    # how gradients cross replicated axes (its ``auto`` form resolved per mesh here)
    reduction: GradReduction = PER_AXIS
    # what may (or must) live in host memory (``autopar_plans.offload``)
    offload: OffloadRequest = AUTO_OFFLOAD


class NothingFaster(Exception):
    """No plan within ``SolveRequest.work_cutoff`` was found (or proved to exist in time)."""


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
    regions: list[Region] = field(default_factory=list)  # recompute candidates
    recompute: dict[str, int] = field(default_factory=dict)  # region -> layers recomputed

    def memory(self) -> float:
        """Bytes per device of the chosen strategies, recomputation included (offloaded
        activations and states not: they are in ``host_memory``); offloaded parameters'
        working copies in flight at the chosen layouts (``parameter_transient``)."""
        parts = self.parts
        total = sum(
            parts.problem.memory[d][k] for d, k in self.choice.items() if d in parts.problem.memory
        )
        if not self.cost.offload.activations:
            total += parts.edge_memory(self.choice)
        total += self.transient()
        return total - self.recomputed_bytes()

    def transient(self) -> float:
        """Offloaded parameters' working copies in flight at the chosen layouts (0 without)."""
        return parameter_transient(self.parts.working, self.parts.problem.allowed, self.choice)

    def host_memory(self) -> float:
        """Bytes per device in host memory: offloaded states, and one microbatch's saved
        activations with the resharded copies their consumers keep."""
        parts = self.parts
        total = sum(parts.host_states[d][k] for d, k in self.choice.items())
        if self.cost.offload.activations:
            total += sum(parts.host_activations[d][k] for d, k in self.choice.items())
            total += parts.edge_memory(self.choice)
        return total

    def recomputed_bytes(self) -> float:
        saved = 0.0
        for region in self.regions:
            copies = self.recompute.get(region.name, 0)
            if copies:
                saved += copies * region.saving_at(self.choice)
        return saved

    def recompute_seconds(self) -> float:
        """Forward time added per microbatch by the recomputed regions."""
        total = 0.0
        for region in self.regions:
            copies = self.recompute.get(region.name, 0)
            if copies:
                total += copies * region.forward_at(self.choice)
        return total

    def strategy(self, node: str) -> Strategy:
        binding = self.decisions.bindings[node]
        return self.decisions.strategy(node, self.choice[binding.decision])

    def output_layout(self, node: str, index: int = 0):
        binding = self.decisions.bindings[node]
        return self.decisions.output_layout(node, self.choice[binding.decision], index)


@collector_paused()
def solve_sharding(traced: TracedModel, request: SolveRequest) -> Solved:
    """Choose a strategy for every node of ``traced`` on ``request.mesh``.

    A mesh of more than two axes (of size > 1) is solved as each of its 2-d groupings of
    adjacent axes (``group_axes``), and the cheapest is kept: a layout on a grouped axis is
    the same layout on each axis of the group (Shard(d) on both splits d outer axis first,
    exactly as the grouped axis does), so the plan maps back exactly. Per-op strategies grow
    as (choices per axis) ** axes; grouping keeps the ILP at a 2-d mesh's size, at the price
    of the strategies that treat the axes of a group differently.
    """
    if request.autocast_saved is None and request.precision in MIXED:
        request = replace(request, autocast_saved=autocast_saved(traced, request.precision))
    groupings = group_axes(request.mesh)
    if len(groupings) == 1:
        return _solve(traced, request, groupings[0])
    best: Solved | None = None
    failure: InfeasiblePlanError | NothingFaster | None = None
    for groups in groupings:
        try:
            solved = _solve(traced, request, groups)
        except (InfeasiblePlanError, NothingFaster) as error:
            # under a cutoff, "nothing faster" is the answer whatever the other groupings say
            failure = failure if isinstance(failure, NothingFaster) else error
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
        if len(big) == mesh.ndim:
            return [tuple((a,) for a in range(mesh.ndim))]
        # an axis of size 1 (a pipeline stage's share of the outer axis) would multiply
        # every op's strategies for nothing: it joins the next axis of size > 1
        groups: list[tuple[int, ...]] = []
        pending: list[int] = []
        for axis, size in enumerate(mesh.shape):
            pending.append(axis)
            if size > 1:
                groups.append(tuple(pending))
                pending = []
        if pending:
            groups = [*groups[:-1], (*groups[-1], *pending)] if groups else [tuple(pending)]
        return [tuple(groups)]
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
    """Solve on one grouping of the mesh.

    First the fastest plan over the ZeRO stages with memory set aside: when it fits the
    limit, memory does not bind and recomputation could make nothing faster. Otherwise
    every allowed ZeRO stage is solved under the limit, with the recompute candidates
    (``autopar_passes.recompute``) as variables, and the fastest feasible one is kept.
    """
    mesh = grouped_mesh(request.mesh, groups)
    request = replace(request, mesh=mesh)
    choices, warnings = traced_choices(traced, mesh.shape)
    tied = {node: info.nodes[0] for info in traced.params.values() for node in info.nodes[1:]}
    decisions = group_decisions(choices, traced_representatives(traced), tied)
    representatives = decisions.representatives
    allowed = allowed_choices(decisions, request.constraints(mesh))
    for decision, ok in allowed.items():
        if not ok:  # no solve can help: say which op, before building any
            raise no_strategy_error(decisions, decision, mesh)
    mesh_cost = MeshCost(mesh, load_preset(mesh.device))
    # buckets fill by the gradients' bytes as held (fp32 under mixed precision) and are
    # summed in the bytes the cost model charges for them (``precision_policy.grad``)
    held = 2 if request.precision == "bf16" else 4
    summed = precision_policy(request.precision).grad
    grads = [(info.shape, held) for info in traced.params.values()]
    cap = BUCKET_BYTES * summed / held
    bucket = min(cap, max(gradient_bytes(grads) * summed / held, 1.0))

    reduction = resolve_reduction(request.reduction, mesh_cost, bucket)
    working_cast = working_cast_nodes(traced, request.precision)
    gather_share = fsdp_group_shares(traced, request.precision, working_cast)

    built_edges: list[tuple[CostModel, ProblemParts]] = []  # resharding terms, shared

    def build(zero: int, limit: float | None, offload: Offload = NO_OFFLOAD) -> Built:
        cost = CostModel(
            mesh_cost,
            request.optimizer,
            request.precision,
            zero,
            batch_scale=request.batch_scale,
            in_flight=request.in_flight,
            bucket_bytes=bucket,
            bucket_cap=cap,
            working_cast=working_cast,
            autocast_saved=request.autocast_saved,
            gather_share=gather_share,
            reduction=reduction,
            offload=offload,
        )
        shared = next((p for c, p in built_edges if reuses_edges(c, cost)), None)
        parts = build_problem(
            decisions, cost, representatives, limit, allowed, request.microbatches, shared
        )
        if shared is None:
            built_edges.append((cost, parts))
        # offloaded activations leave nothing on the device for recomputation to free
        regions = (
            find_regions(
                traced.graph,
                decisions,
                cost,
                representatives,
                parts.kept_copies,
                parts.reshard_forward,
            )
            if (limit is not None or request.recompute_hints) and not offload.activations
            else []
        )
        apply_recompute_hints(regions, request.recompute_hints, traced.graph)
        parts.problem.recompute = recompute_terms(regions, request.microbatches)
        parts.problem.recompute_budgets = recompute_budgets(regions)
        parts.problem.buckets = sync_buckets(grads)
        return Built(zero, cost, parts, regions)

    def run(
        built: Built, cutoff: float | None = None, fixed: dict[str, int] | None = None
    ) -> Solved | None:
        problem = built.parts.problem
        if fixed is not None:  # another ZeRO stage's choice, costed in this one
            problem = replace(problem, allowed={d: {k} for d, k in fixed.items()})
        solution = solve_ilp(
            problem, request.time_limit, cutoff=cutoff, work_cutoff=request.work_cutoff
        )
        if solution.timed_out and (cutoff is not None or request.work_cutoff is not None):
            return None  # nothing better than the plan in hand found in time: keep that one
        by_work = WORK_LIMIT in solution.report.status
        if solution.timed_out:
            limit = "work" if by_work else "time, by the clock,"
            raise InfeasiblePlanError(
                f"the solver found no plan within its time limit of {request.time_limit:g} "
                f"s of {limit} ({solution.report.variables} variables); allow it more time "
                "(time_limit=, --time-limit) or fix part of the plan with hints"
            )
        if not solution.feasible:
            return None
        report = solution.report.model_copy(
            update={"variables_before_merging": unmerged_size(decisions)}
        )
        notes = list(warnings)
        if report.status != "optimal" and by_work:
            notes.append(
                f"the solver stopped at its time limit ({request.time_limit:g} s of work, the "
                f"same on any machine) with the best plan found so far (gap {report.gap})"
            )
        elif report.status != "optimal":
            notes.append(
                f"the solver stopped at its time limit by the clock ({CLOCK_FACTOR:g} x "
                f"{request.time_limit:g} s) with the best plan found so far (gap "
                f"{report.gap}): the machine's load, not the work done, decided, so another "
                "run may give another plan; allow more time (time_limit=, --time-limit)"
            )
        return Solved(
            decisions,
            representatives,
            solution.choice,
            built.parts,
            built.cost,
            report,
            built.zero,
            notes,
            groups,
            built.regions,
            solution.recompute,
        )

    host_limit = _host_limit(mesh_cost)
    candidates = [
        c
        for c in offload_candidates(request, mesh_cost.preset)
        if offload_levels(request.zero_levels, c)
    ]
    if not candidates:
        raise _no_level_error(request)
    first = candidates[0]
    if request.memory_limit is None or not request.known_unfit:
        fastest = _fastest_unlimited(
            offload_levels(request.zero_levels, first), partial(build, offload=first), run
        )
        if fastest is None and request.work_cutoff is not None:
            raise NothingFaster
        if fastest is None:  # no plan even with memory set aside: none within a limit either
            raise no_plan_error()
        fits_host = fastest.host_memory() <= host_limit
        if request.memory_limit is None and not fits_host:
            raise infeasible_error(None, request, fastest.host_memory(), host_limit)
        if request.memory_limit is None or (fastest.memory() <= request.memory_limit and fits_host):
            return fastest
    # under the limit: every ZeRO stage with the recompute candidates as variables, so the
    # MIP trades recomputation against sharding and ZeRO (``ilp.RecomputeTerm``), and then
    # each offload policy allowed, cheapest first, where it could beat the best so far
    limit = request.memory_limit
    assert limit is not None
    best: Solved | None = None
    last: Built | None = None
    over_host = 0.0
    refuted: list[IlpProblem] = []  # memory set aside, proved no faster than a best in hand
    for offload in candidates:
        levels = offload_levels(request.zero_levels, offload)
        if not levels:
            continue
        if best is not None and not _could_beat(levels, offload, best, build, run, refuted):
            continue
        built = [build(zero, limit, offload) for zero in levels]
        last = built[-1]  # the most offload tried: the least memory, for the message
        # a stage whose model states alone exceed the limit needs no MIP to rule out (which
        # the solver can take long to prove: recomputation's relaxation frees memory in
        # fractions of layers)
        fitting = [b for b in built if states_floor(b.parts) <= limit]
        found = _solve_levels(fitting, run, best) if fitting else None
        if found is not None and found.host_memory() > host_limit:
            over_host = max(over_host, found.host_memory())
            found = None
        if found is not None and (best is None or _faster(found, best)):
            best = found
    if best is None and request.work_cutoff is not None:
        raise NothingFaster
    if best is None:
        assert last is not None
        raise infeasible_error(last, request, over_host, host_limit)
    return best


def offload_candidates(request: SolveRequest, preset: DevicePreset) -> list[Offload]:
    """The offload policies to try, cheapest first: only those forced where the device's
    memory is the host's (offload frees nothing there: ``HostLink.shared``), and a forced
    recomputation (a hint) keeps activations on the device, where it recomputes them."""
    candidates = request.offload.candidates()
    if preset.host is None or preset.host.shared:
        forced = request.offload.model_copy(
            update={k: "off" for k in KINDS if getattr(request.offload, k) == "auto"}
        )
        candidates = forced.candidates()
    forced = [h for h in request.recompute_hints if h.force]
    if not forced:
        return candidates
    kept = [c for c in candidates if not c.activations]
    if not kept:
        raise UsageError(
            f"{forced[0].label} recomputes activations that offload=activations moves to "
            "the host instead: drop one of the two"
        )
    return kept


def offload_levels(levels: tuple[int, ...], offload: Offload) -> tuple[int, ...]:
    """The ZeRO stages an offload policy plans with: an offloaded optimizer sums each
    gradient into its host master once a step, so ZeRO-2 (a sum per microbatch into the
    master's piece) is not one of them; offloaded parameters plan with ZeRO-0 alone (a
    ZeRO axis would gather the stepped masters on the host; the layouts still shard)."""
    if offload.parameters:
        return tuple(z for z in levels if z == 0)
    return tuple(z for z in levels if z < 2) if offload.optimizer else levels


def _no_level_error(request: SolveRequest) -> UsageError:
    """No allowed offload policy plans with a ZeRO stage allowed: say which pair to drop."""
    if request.offload.parameters == "on":
        forced = ", ".join(str(z) for z in request.zero_levels)
        return UsageError(
            f"offloaded parameters plan with ZeRO stage 0 only (a ZeRO axis would gather "
            f"the masters on the host; FSDP layouts still shard them), and zero={forced} "
            "was forced: force zero 0 or leave it to the planner, or do not force "
            "offload='parameters'"
        )
    return UsageError(
        "zero=2 sums each microbatch's gradients into the master's piece, and an "
        "offloaded optimizer keeps the masters on the host: force zero 0 or 1, or do "
        "not force offload='optimizer'"
    )


def _host_limit(mesh_cost: MeshCost) -> float:
    """Host bytes one device may fill: its node's memory over the devices sharing it
    (unbounded for a preset that names no host)."""
    preset = mesh_cost.preset
    if preset.host is None:
        return math.inf
    sharing = min(preset.gpus_per_node, mesh_cost.mesh.size)
    return preset.host.memory_bytes / max(sharing, 1)


def _faster(found: Solved, best: Solved) -> bool:
    """Strictly faster: ties go to the policy tried first (less offload)."""
    return (found.report.objective or 0.0) < (best.report.objective or 0.0) * (1 - 1e-7)


def _could_beat(
    levels: tuple[int, ...],
    offload: Offload,
    best: Solved,
    build: Callable[..., Built],
    run: Callable[..., Solved | None],
    refuted: list[IlpProblem],
) -> bool:
    """Whether an offload policy's fastest plan with memory set aside (a lower bound on its
    plans under the limit) beats ``best``: solved under ``best``'s cutoff, quick to refute.
    A level whose problem costs every choice no less than one already refuted
    (``ilp.cannot_beat``: more offloaded, the same copies and more) is refuted without a
    solve; each one solved and refuted joins ``refuted`` (a best found later is faster
    still, so they stay refuted)."""
    bound = tie(best.report.objective or 0.0)
    for zero in levels:
        problem = build(zero, None, offload)
        if any(cannot_beat(done, problem.parts.problem) for done in refuted):
            continue
        found = run(problem, bound)
        if found is not None and _faster(found, best):
            return True
        refuted.append(problem.parts.problem)
    return False


def _fastest_unlimited(
    levels: tuple[int, ...],
    build: Callable[[int, float | None], Built],
    run: Callable[..., Solved | None],
) -> Solved | None:
    """The fastest plan over the ZeRO stages, memory set aside. A sharded optimizer steps
    fewer values and its gathers cost less than that on fast links, so ZeRO can be the
    fastest with memory to spare (``autopar_cost_model.optimizer``). The lowest stage is solved;
    another only where it could be faster: not ZeRO-2 beside ZeRO-1 (memory aside, the
    same sums or more of them), not a stage that saves time on no choice
    (``ilp.cannot_beat``); one that may is solved under the lowest's time. (Skipping a
    stage whose solve the lowest stage's plan, costed in it, did not beat lost the best
    plan where the stage wins with other layouts: gpt3-13b on 64 H100s, ZeRO-1 on 4
    stages, 0.2% faster than the plan chosen without it.)"""
    lowest = build(levels[0], None)
    best = run(lowest)
    if best is None:
        return None
    for zero in levels[1:]:
        if zero == 2 and 1 in levels:
            continue
        other = build(zero, None)
        problem = other.parts.problem
        if cannot_beat(lowest.parts.problem, problem):
            continue
        found = run(other, tie(best.report.objective or 0.0))
        if found is not None and (found.report.objective or 0.0) < (best.report.objective or 0.0):
            best = found
    return best


def states_floor(parts: ProblemParts) -> float:
    """The least memory per device for parameters, gradients and optimizer state that any
    allowed choice needs: every plan needs at least this much (its activations, less
    what recomputation frees, are never negative), with offloaded parameters' transient
    term, a constant of the memory row."""
    total = parts.transient
    for name, row in parts.model_states.items():
        states = [sum(row[k]) for k in parts.problem.allowed.get(name, range(len(row)))]
        total += min(states, default=0.0)  # none allowed: the MIP reports that
    return total


@dataclass
class Built:
    """One ZeRO stage's problem, before solving."""

    zero: int
    cost: CostModel
    parts: ProblemParts
    regions: list[Region]


def _solve_levels(
    built: list[Built], run: Callable[..., Solved | None], best: Solved | None = None
) -> Solved | None:
    """The fastest feasible plan over ZeRO stages, ties to the lower stage.

    From the most sharded stage down (the one most likely to fit, and quickest to solve),
    each under the cutoff of the fastest found so far: a stage that cannot match it is
    proved so in a fraction of a second, where solving it outright took up to half a
    minute (gpt3-175b on 32x8: plain data parallelism 27 s, under the ZeRO-2 cutoff 0.4 s).
    A stage that a solved one dominates (``ilp.dominates``: ZeRO-1 by ZeRO-2) is not
    solved at all; it can only tie, which the winner's choice, costed in it, tells.
    ``best``: a plan in hand (another offload policy's), whose time is the first cutoff.
    """
    given = best
    solved: list[Built] = []
    dominated: list[Built] = []
    for level in sorted(built, key=lambda b: -b.zero):
        if any(dominates(other.parts.problem, level.parts.problem) for other in solved):
            dominated.append(level)
            continue
        solved.append(level)
        bound = None if best is None else tie(best.report.objective or 0.0)
        found = run(level, bound)
        if found is not None and (bound is None or (found.report.objective or 0.0) <= bound):
            best = found
    if best is None or best is given:
        return None
    for level in sorted(dominated, key=lambda b: b.zero):
        if level.zero < best.zero:
            tied = run(level, tie(best.report.objective or 0.0), best.choice)
            if tied is not None:
                return replace(tied, report=best.report)  # the solve that chose it
    return best


def tie(objective: float) -> float:
    """An objective within the solver's tolerances of ``objective``: a tie."""
    return objective * (1 + 1e-7) + 1e-9


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


def no_plan_error() -> InfeasiblePlanError:
    """No choice satisfies the constraints, whatever the memory."""
    return InfeasiblePlanError(
        "the constraints (forced strategies or hints) allow no plan at all; relax them"
    )


def no_strategy_error(decisions: Decisions, decision: str, mesh: MeshSpec) -> InfeasiblePlanError:
    """No strategy of one op meets the constraints: name the op and its shape, as the
    usual cause is a dim they split that the devices do not divide."""
    node = next(n for n, b in decisions.bindings.items() if b.decision == decision)
    note = decisions.choices[node].note
    what = (
        f"{node} ({note.op}, output {'x'.join(map(str, note.outputs[0].shape))})"
        if note is not None and note.outputs
        else node
    )
    return InfeasiblePlanError(
        f"the constraints (forced strategies or hints) allow no strategy for {what} on "
        f"{mesh.describe()}; a dim they split that the devices do not divide is the usual "
        "cause (such as a batch smaller than the data-parallel devices): use a batch they "
        "divide, or relax them"
    )


def infeasible_error(
    built: Built | None, request: SolveRequest, over_host: float = 0.0, host_limit: float = math.inf
) -> InfeasiblePlanError:
    """The minimum memory per device any allowed plan needs, what dominates it, what helps
    (``over_host``: the host bytes per device of a plan that fitted the device but not its
    host's memory, ``host_limit`` each device's share of it)."""
    if over_host:
        return InfeasiblePlanError(
            f"the model fits {request.mesh.describe()} only with state offloaded to host "
            f"memory, and then needs {format_bytes(over_host)} of host memory per device "
            f"where each device's share of its node's is {format_bytes(host_limit)}: use "
            "more devices or pipeline stages, or a preset whose host has more memory"
        )
    assert built is not None
    parts = built.parts
    problem = parts.problem
    # with every layer recomputed in full, what it saves comes off each choice's memory
    freed: dict[str, list[float]] = {}
    for term in problem.recompute:
        if term.kind == "full":
            for d, row in term.saving.items():
                mine = freed.setdefault(d, [0.0] * len(row))
                for k, value in enumerate(row):
                    mine[k] += term.copies * value
    cost = {
        name: [v - f for v, f in zip(values, freed.get(name, [0.0] * len(values)), strict=True)]
        for name, values in problem.memory.items()
    }
    minimum = IlpProblem(choices=problem.choices, cost=cost, allowed=problem.allowed)
    solution = solve_ilp(minimum, request.time_limit)
    if not solution.feasible:
        return no_plan_error()
    terms = {"parameters": 0.0, "gradients": 0.0, "optimizer states": 0.0, "activations": 0.0}
    # offloaded activations are on the host (``Solved.host_memory``), not in the rows
    on_device = 0.0 if built.cost.offload.activations else 1.0
    for name, k in solution.choice.items():
        params, grads, optimizer = parts.model_states[name][k]
        terms["parameters"] += params
        terms["gradients"] += grads
        terms["optimizer states"] += optimizer
        kept = parts.activations[name][k] - freed.get(name, [0.0] * (k + 1))[k]
        terms["activations"] += on_device * kept
    terms["parameters"] += parts.transient  # offloaded parameters' copies in flight
    need = sum(terms.values())
    dominant = max(terms, key=lambda t: terms[t])
    limit = request.memory_limit or 0.0
    helps = (
        "more pipeline stages (fewer layers' activations per device), a smaller microbatch"
        if dominant == "activations"
        else "more devices, pipeline stages, or a lighter optimizer/precision policy"
    )
    offload = built.cost.offload
    if offload.active:
        helps += f" ({offload.describe()} already offloaded to host memory)"
    elif request.offload.candidates()[-1] == offload:
        helps += ", or allowing offload to host memory (offload='auto')"
    return InfeasiblePlanError(
        f"the model does not fit in {format_bytes(limit)} per device on "
        f"{request.mesh.describe()}: even sharded as far as the rules allow and with every "
        f"layer recomputed, it needs "
        f"{format_bytes(need)} per device (short by {format_bytes(need - limit)}); "
        f"{dominant} dominate with {format_bytes(terms[dominant])}. What would help: {helps}"
    )
