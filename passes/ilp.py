"""The intra-op ILP: choose one strategy per decision, minimising step time under memory.

Variables (``autopar_passes.decisions`` made them few):

- ``s[d, k]`` binary: decision ``d`` takes choice ``k``; ``sum_k s[d, k] = 1``. Decisions
  with one choice are constants, not variables.
- ``e[edge, p, q]`` continuous >= 0, one per pair of *layout classes* of an edge: the
  producer's choices grouped by the layout they give the tensor (``p``), the consumer's by
  the layout they need it in (``q``). The resharding cost depends only on ``(p, q)``, and
  the classes are far fewer than the choices (a matmul has ~50 strategies on a 2-D mesh but
  its input arrives in ~10 layouts). The marginal constraints (Alpa's, on classes)
  ``sum_q e[p, q] = sum_{k in p} s[d, k]`` and ``sum_p e[p, q] = sum_{l in q} s[d', l]``
  make ``e`` the joint choice; their LP relaxation is tight on tree-shaped graphs, so
  branch and bound has little to do.
- An edge's pair may also hold memory: a consumer that keeps its input for backward keeps
  the resharded copy when the input arrives resharded; that is a term of the memory row.
- ``t >= 0`` continuous: the overlappable communication of one pass (gradient sync;
  parameter gathers have their own rows, ``PrefetchLink``) that one microbatch's
  backward cannot hide: gradients are synchronised in ``k`` buckets (the runtime's DDP
  buckets), each launched when full, so all but the last can hide behind the backward
  still to run (``autopar_cost_model.step.exposed_gradient_sync``). A step runs ``P`` such passes
  (``sync_passes``: once, in the last microbatch's backward; ZeRO-2: every microbatch's).

Objective::

    min  sum_d sum_k s[d,k] (compute[d,k] + comm[d,k])
       + sum_edges sum_{p,q} R[p,q] e[p,q]
       + sum_groups cost_g g        (a grouped call's fixed cost, once: ``GroupCall``;
                                     but the overlappable ones, in O below)
       + f sum_links weight_l w_l   (prefetched gathers' waits: ``PrefetchLink``)
       + P t
       + recomputed forward time (``RecomputeTerm``)

Constraints::

    sum_k s[d,k] = 1                                 for every decision d
    sum_q e[p,q] = sum_{k in p} s[d,k],  sum_p e[p,q] = sum_{l in q} s[d',l]   per edge
    t >= O - f (k - 1) / k B_min,   t >= (1 - f (k - 1) / k) O,
        O = sum s.overlappable + sum_{overlappable groups} cost_g g   (gradient sums, and
        the first call of each bucket key: ``costs.SyncCall``)
        (B_min: the backward at its least, sum_d min_k hidden_by[d,k], a constant; f: the
        share of it compute really hides, ``DevicePreset.comm_overlap``)
    sum_d sum_k s[d,k] memory[d,k] - freed + w <= memory limit   (bytes per device;
        freed: what the recomputed layer copies give back, ``RecomputeTerm``; w: offloaded
        parameters' copies in flight, the largest group's, below)
    w >= sum_d sum_k s[d,k] transient_g[d,k]         for every group g of ``transient``
    s[d,k] = 0 for k not in allowed[d]               (forced strategies and hints)
    objective <= cutoff                              (optional: "beat this or say so",
        which the solver proves fast; ``autopar_passes.solve`` chains ZeRO stages with it)
    objective - P t - (1 - 1/b) sum s.once <= work cutoff   (optional: the same on
        compute and resharding alone, which a pipeline of the plan's stages cannot hide,
        with the per-step part ``once`` weighed as a pipeline runs it, outside the
        bubble ``b``; the pipeline search's bound: ``WorkCutoff``)

HiGHS solves it (``autopar_passes.mip``: the model as arrays, given to highspy whole); CBC,
through PuLP, is the fallback. The status, time,
gap and problem size are returned, never hidden.

With a cutoff (either) the question is "is there a plan better than the one in hand?".
Where there is one, HiGHS finds a first plan under the cutoff within seconds; where there
is none, it proves it once the relaxation's bound passes the cutoff. With recomputation
on its convex hull (``RecomputeTerm``) that takes 3 to 4 s on llama3-70b over 64 devices,
where under the big-M form before it four such solves ran their 20 s (below) and found
nothing, and that planning took 203 s instead of 483 s, for the same plan. A solve that
has no plan once a third of its limit has gone by still gives up (``GIVE_UP_FRACTION``),
and the caller keeps the plan in hand, as when the time limit ends it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from autopar_passes.ilp_relax import relax_edges
from autopar_passes.mip import Lin, Mip, MipResult, solve_or_refute, solve_rounded
from autopar_plans.plan import SolverReport

Matrix = dict[tuple[int, int], float]
GIB = 2.0**30  # memory rows are written in GiB: coefficients of one magnitude with times


@dataclass
class EdgeTerm:
    """One edge between two decisions: choice -> class on each side, cost per class pair."""

    left: str
    right: str
    left_class: tuple[int, ...]
    right_class: tuple[int, ...]
    cost: Matrix  # (p, q) -> seconds; missing pairs cost nothing
    # (p, q) -> bytes per device the pair adds (a resharded copy a consumer saves)
    memory: Matrix = field(default_factory=dict)


@dataclass
class RecomputeTerm:
    """A recompute candidate repeated in ``copies`` identical layers (``autopar_passes.recompute``).

    The copies share their strategies, so what matters is how many are recomputed, ``n``,
    not which: ``n = sum_b 2^b r[b]`` in binary digits ``r[b]`` (7 binaries for 96 layers,
    where a binary per copy made the MIP take minutes). The memory it frees is
    ``n S(s)`` and the forward it adds ``n F(s)``, with ``S`` and ``F`` linear in the
    choices (``saving``, ``forward``: decision -> per-choice coefficients; ``edge_saving``,
    ``edge_forward``: the resharded copies its consumers keep and the reshards its replay
    makes again, linear in the edges' pair variables). Per
    digit, the products ``S(s) r[b]`` and ``F(s) r[b]`` are written part by part (a
    decision, or an edge), on the convex hull of each part's one-hot choice ``x`` (the
    choices, or an edge's pairs, grouped by equal ``(S, F)`` coefficients ``g``)::

        z[g, b] >= 0,   z[g, b] <= sum_{k in g} x[k],   sum_g z[g, b] = r[b]
        S(s) r[b] = sum_g S_g z[g, b]   (memory row: - sum_b 2^b of it)
        F(s) r[b] = sum_g F_g z[g, b]   (objective: + weight sum_b 2^b of it)
        n <= copies;  n = copies or 0 when a hint forces or forbids it

    Exact for whole choices; in the LP relaxation, memory freed costs its own forward
    time in proportion. The big-M form before it (``y <= S_max r``, ``w >= F(s) - F_max
    (1 - r)`` with the unsharded worst cases) let a fraction of a recomputed layer free
    memory almost free of time: on llama3-70b over 64 devices its root bound was the plan
    without a memory limit (48.5 s against 61.6 s), and the solve stopped at its 60 s
    limit with a 21% gap; on the hull the root bound is 54.0 s and the solve proves the
    same plan optimal in 33 s, for 1,920 more (continuous) variables.

    Regions that cannot share a layer (``RecomputeBudget``) share its copies.
    """

    name: str
    kind: str
    copies: int
    saving: dict[str, list[float]]
    forward: dict[str, list[float]]
    # index in ``IlpProblem.edges`` -> (p, q) -> bytes per device per copy
    edge_saving: dict[int, Matrix] = field(default_factory=dict)
    # the same -> (p, q) -> forward seconds per copy: the reshards its replay makes again
    edge_forward: dict[int, Matrix] = field(default_factory=dict)
    weight: float = 1.0  # microbatches per step: the forward runs again for each
    forced: bool | None = None  # True: recompute every copy; False: none


@dataclass(frozen=True)
class RecomputeBudget:
    """Regions of one layer class of which at most one applies per layer (the full layer
    and selective regions that share ops): ``sum_regions n <= copies``. Which copies each
    takes is ``autopar_passes.recompute.chosen_layers``."""

    regions: tuple[str, ...]
    copies: int


@dataclass
class GroupCall:
    """A collective the runtime runs once for a group of parameters whatever how many of
    them join it (an FSDP layer's gather over some mesh axes, ``runtime.param_groups``):
    its fixed ``cost`` (seconds a step) is paid once when any member's chosen layouts run
    it. Members are edge pairs (``edges``: index in ``IlpProblem.edges`` -> class pairs)
    and choices of decisions whose edge is inside them (``choices``). With ``g`` in
    [0, 1]::

        g >= sum_{(p, q) in members of edge} e[edge, p, q]    for each member edge
        g >= sum_{k in members of d} s[d, k]                   for each member decision
        objective: + cost g

    Each right side is 0 or 1 for whole choices, so ``g`` is their maximum: priced per
    member instead, a group of small tensors paid a layer's call for each (FSDP priced
    many times over), and priced as a share of one call, the solver sharded a few tiny
    parameters for a fraction of a call the runtime pays whole."""

    cost: float
    edges: dict[int, frozenset[tuple[int, int]]] = field(default_factory=dict)
    choices: dict[str, frozenset[int]] = field(default_factory=dict)
    # a gradient sum the backward may hide: ``cost g`` joins the overlappable communication
    # of the exposed-communication rows instead of the objective (``costs.SyncCall``)
    overlappable: bool = False

    def runs(self, problem: IlpProblem, choice: dict[str, int]) -> bool:
        """Whether ``choice`` runs the call."""
        for e, members in self.edges.items():
            edge = problem.edges[e]
            pair = (edge.left_class[choice[edge.left]], edge.right_class[choice[edge.right]])
            if pair in members:
                return True
        return any(choice[d] in members for d, members in self.choices.items())


@dataclass
class PrefetchLink:
    """A parameter gather the runtime prefetches behind the part before it (FSDP2's
    prefetch, ``runtime.param_groups``; ``autopar_cost_model.step.prefetch_waits``): of its
    seconds ``G`` (linear in the members: edge pairs, ``edges``, choices of decisions whose
    edge is inside them, ``choices``, and group calls' fixed costs, ``calls``), the part before
    hides what compute hides of it, its compute at its least (``hiding``, ``C``, a constant
    as the gradient sync's ``B_min``). With ``f`` the share compute hides
    (``IlpProblem.overlap``) it waits ``(1 - f) G + f max(0, G - C)``: the edges carry
    ``(1 - f) G`` (``autopar_passes.problem`` takes ``f G`` off them) and, with ``w >= 0``
    and ``0 <= y <= 1`` at most the sum of the indicators of its members that gather (and
    of the link's before it, ``after``)::

        w >= G - C y,    objective: + f weight w

    ``weight``: how many such gathers a step runs (identical layers times microbatches).
    The first gather of a pass hides behind nothing (``C = 0``)."""

    weight: float
    hiding: float
    edges: dict[int, dict[tuple[int, int], float]] = field(default_factory=dict)
    choices: dict[str, list[float]] = field(default_factory=dict)
    calls: dict[int, float] = field(default_factory=dict)  # ``IlpProblem.group_calls`` index
    # the link (index in ``IlpProblem.prefetch``) whose gathers launch this one: ``C``
    # hides it only when that link gathers (``y <= its members``); None: whenever this
    # one gathers (a layer behind an identical one gathers whenever it does)
    after: int | None = None

    def seconds(self, problem: IlpProblem, choice: dict[str, int]) -> float:
        """``G`` under ``choice``."""
        calls = problem.group_calls
        runs = sum(s for g, s in self.calls.items() if calls[g].runs(problem, choice))
        return sum(self._members(problem, choice)) + runs

    def gathers(self, problem: IlpProblem, choice: dict[str, int]) -> bool:
        """Whether a member gathers under ``choice`` (the indicators ``y`` is bounded by;
        a group call's fixed cost is none: its members are)."""
        return any(self._members(problem, choice))

    def _members(self, problem: IlpProblem, choice: dict[str, int]) -> Iterator[float]:
        """The seconds of each member (choice row, edge pair) under ``choice``."""
        for d, row in self.choices.items():
            yield row[choice[d]]
        for e, members in self.edges.items():
            edge = problem.edges[e]
            pair = (edge.left_class[choice[edge.left]], edge.right_class[choice[edge.right]])
            yield members.get(pair, 0.0)


@dataclass
class IlpProblem:
    """Coefficients per decision choice and per edge, as ``autopar_passes.solve`` builds them."""

    choices: dict[str, int]  # decision -> number of choices
    cost: dict[str, list[float]] = field(default_factory=dict)
    memory: dict[str, list[float]] = field(default_factory=dict)
    overlappable: dict[str, list[float]] = field(default_factory=dict)
    hidden_by: dict[str, list[float]] = field(default_factory=dict)
    edges: list[EdgeTerm] = field(default_factory=list)
    allowed: dict[str, set[int]] = field(default_factory=dict)
    memory_limit: float | None = None
    recompute: list[RecomputeTerm] = field(default_factory=list)
    recompute_budgets: list[RecomputeBudget] = field(default_factory=list)
    # offloaded parameters (``runtime.param_offload``): per layer group, the bytes its
    # fetched copies hold on the device per choice (times the groups in flight); the memory
    # row holds the largest group's
    transient: list[dict[str, list[float]]] = field(default_factory=list)
    group_calls: list[GroupCall] = field(default_factory=list)
    prefetch: list[PrefetchLink] = field(default_factory=list)
    # the part of ``cost`` a step pays once, not per microbatch (the step's collectives,
    # the optimizer, offload traffic): a pipeline runs it after its schedule (``WorkCutoff``)
    once: dict[str, list[float]] = field(default_factory=dict)
    buckets: int = 1  # gradient-sync buckets (layers): see the exposed-communication rows
    sync_passes: int = 1  # how often a step runs the overlappable sync (P in the objective)
    overlap: float = 1.0  # the share of hideable communication compute hides (f)
    # a lower bound instead: the backward hides all overlappable communication (the
    # exposed-communication rows dropped; whatever the ZeRO stage, that part costs >= 0)
    hide_all: bool = False


@dataclass(frozen=True)
class WorkCutoff:
    """Only plans whose work a pipeline could run faster than a plan in hand: the pipeline
    search's bound (``autopar_passes.pipeline.search``). A pipeline stretches the work a
    step runs per microbatch ``W_mb`` by its bubble (at least ``stretch``) and runs the
    per-step part ``W_once`` (``IlpProblem.once``) once after its schedule, so a plan
    whose work spread over the stages beats ``best`` only if::

        stretch W_mb + W_once <= p best   <=>   W_mb + W_once / stretch <= seconds

    with ``seconds = p best / stretch`` (``W_mb + W_once``: the objective less the exposed
    communication ``P t``). ``stretch`` 1: the whole work at most ``seconds``."""

    seconds: float
    stretch: float = 1.0

    def once_weight(self) -> float:
        """How much less than the rest the per-step part weighs in the cap."""
        return 1.0 - 1.0 / self.stretch


@dataclass
class IlpSolution:
    choice: dict[str, int]
    report: SolverReport
    feasible: bool
    timed_out: bool = False  # the time limit came before any feasible choice
    recompute: dict[str, int] = field(default_factory=dict)  # region -> copies recomputed


def dominates(better: IlpProblem, worse: IlpProblem) -> bool:
    """Whether every choice costs ``better`` no more time and no more memory than ``worse``:
    the same problem but for overlappable communication and memory, each no larger per
    choice. Then ``better``'s optimum is at most ``worse``'s, and solving ``worse`` can only
    find a tie (ZeRO-1 against ZeRO-2: the same collectives, more gradient memory)."""

    def no_larger(mine: dict[str, list[float]], theirs: dict[str, list[float]]) -> bool:
        return mine.keys() == theirs.keys() and all(
            len(mine[d]) == len(theirs[d])
            and all(a <= b for a, b in zip(mine[d], theirs[d], strict=True))
            for d in mine
        )

    return (
        better.choices == worse.choices
        and better.allowed == worse.allowed
        and better.cost == worse.cost
        and better.hidden_by == worse.hidden_by
        and better.buckets == worse.buckets
        and better.sync_passes == worse.sync_passes
        and better.overlap == worse.overlap
        and better.memory_limit == worse.memory_limit
        and better.edges == worse.edges
        and better.group_calls == worse.group_calls
        and better.prefetch == worse.prefetch
        and better.recompute == worse.recompute
        and better.recompute_budgets == worse.recompute_budgets
        and better.transient == worse.transient
        and better.once == worse.once
        and no_larger(better.overlappable, worse.overlappable)
        and no_larger(better.memory, worse.memory)
    )


def objective_at(problem: IlpProblem, choice: dict[str, int]) -> float:
    """The objective of ``choice`` in ``problem`` (without recomputation): the choices' own
    costs, the edges' pairs, and the exposed communication the rows leave (``t`` at its
    least)."""
    total = sum(problem.cost.get(d, [0.0] * (k + 1))[k] for d, k in choice.items())
    for edge in problem.edges:
        pair = (edge.left_class[choice[edge.left]], edge.right_class[choice[edge.right]])
        total += edge.cost.get(pair, 0.0)
    running = [call for call in problem.group_calls if call.runs(problem, choice)]
    total += sum(call.cost for call in running if not call.overlappable)
    for link in problem.prefetch:
        hidden = link.gathers(problem, choice) and (
            link.after is None or problem.prefetch[link.after].gathers(problem, choice)
        )
        waits = max(link.seconds(problem, choice) - (link.hiding if hidden else 0.0), 0.0)
        total += problem.overlap * link.weight * waits
    overlapped = sum(problem.overlappable.get(d, [0.0] * (k + 1))[k] for d, k in choice.items())
    overlapped += sum(call.cost for call in running if call.overlappable)
    if problem.hide_all:
        return total
    k = max(problem.buckets, 1)
    hides = problem.overlap * (k - 1) / k
    hiding = sum(min(row) for row in problem.hidden_by.values() if row)
    exposed = max(overlapped - hides * hiding, (1 - hides) * overlapped, 0.0)
    return total + problem.sync_passes * exposed


def cannot_beat(base: IlpProblem, other: IlpProblem) -> bool:
    """Whether no choice costs ``other`` less time than the same choice costs ``base``, so
    ``other``'s optimum cannot beat ``base``'s (memory set aside): the same problem but for
    each choice's own cost and overlappable communication (another ZeRO stage: its
    parameters' step, sync and gathers), the difference bounded from below decision by
    decision. Then solving ``other`` without a memory limit could at best tie.

    With ``D`` the least difference of overlappable communication over the choices and
    ``h`` the share of it one backward may hide, the exposed part ``t`` differs by at least
    ``min(D, (1 - h) D)`` (``t`` is the larger of two functions of it, one of slope 1, one
    of slope ``1 - h``), counted ``P`` times, the fewer of the two problems' passes."""
    if (
        base.choices != other.choices
        or base.allowed != other.allowed
        or base.edges != other.edges
        or base.group_calls != other.group_calls
        or base.prefetch != other.prefetch
        or base.hidden_by != other.hidden_by
        or base.buckets != other.buckets
        or base.overlap != other.overlap
        or base.recompute != other.recompute
        or base.sync_passes > other.sync_passes
    ):
        return False

    def least(mine: dict[str, list[float]], theirs: dict[str, list[float]]) -> float:
        total = 0.0
        for name, count in base.choices.items():
            ours, yours = mine.get(name, [0.0] * count), theirs.get(name, [0.0] * count)
            allowed = base.allowed.get(name, set(range(count)))
            total += min(yours[k] - ours[k] for k in allowed) if allowed else 0.0
        return total

    k = max(base.buckets, 1)
    hides = base.overlap * (k - 1) / k
    overlappable = least(base.overlappable, other.overlappable)
    exposed = min(overlappable, (1 - hides) * overlappable)
    return least(base.cost, other.cost) + base.sync_passes * exposed >= 0


def solve_ilp(
    problem: IlpProblem,
    time_limit: float = 60.0,
    backend: str = "highs",
    cutoff: float | None = None,
    work_cutoff: WorkCutoff | None = None,
) -> IlpSolution:
    """Build and solve the ILP; ``feasible`` is False when no choice fits (or, with
    ``cutoff``, none is faster than it: the solver prunes by it and proves that quickly;
    ``work_cutoff`` bounds the objective less the exposed communication ``t``:
    ``WorkCutoff``).

    Where a memory limit or a cutoff may leave no plan, the relaxation without edge
    variables (``autopar_passes.ilp_relax``) is solved first: when it has no plan, neither
    has the ILP, proved at a tenth of the cost (llama3-8b's search on 64 devices: 14 of its
    27 proofs, 0.1 s each against 1.3-3 s). Otherwise the ILP is solved as before."""
    start = time.perf_counter()
    may_have_none = (
        cutoff is not None or work_cutoff is not None or problem.memory_limit is not None
    )
    if may_have_none and _pair_columns(problem) >= RELAXED_WHEN * sum(problem.choices.values()):
        budget = time_limit / RELAXED_SHARE
        relaxed = _solve(relax_edges(problem), budget, backend, cutoff, work_cutoff, any_plan=True)
        if not relaxed.feasible and not relaxed.timed_out:  # proved to have none
            report = relaxed.report.model_copy(
                update={
                    "status": "infeasible (its relaxation without edge variables has no plan)",
                    "time_s": time.perf_counter() - start,
                }
            )
            return replace(relaxed, report=report)
    solution = _solve(problem, time_limit, backend, cutoff, work_cutoff)
    report = solution.report.model_copy(update={"time_s": time.perf_counter() - start})
    return replace(solution, report=report)


# the relaxation's work budget: a share of the ILP's (it has a twentieth of its columns,
# and a proof it cannot give quickly is left to the ILP)
RELAXED_SHARE = 10.0
# tried where the edges' pair columns outnumber the choices this many times: its cost
# goes with the choices, the ILP's with both (llama3-8b on 8x8: 58,900 pairs, 2,521
# choices; where they are few, a proof costs the ILP little more than the relaxation)
RELAXED_WHEN = 10


def _pair_columns(problem: IlpProblem) -> int:
    """The class-pair columns the edges would take (an upper bound: fixed sides take none)."""
    return sum(len(set(e.left_class)) * len(set(e.right_class)) for e in problem.edges)


def _solve(
    problem: IlpProblem,
    time_limit: float,
    backend: str,
    cutoff: float | None,
    work_cutoff: WorkCutoff | None,
    any_plan: bool = False,
) -> IlpSolution:
    """``solve_ilp`` on ``problem`` itself; ``any_plan``: only whether it has a plan (the
    solve stops at the first it finds)."""
    start = time.perf_counter()
    model = Mip()
    select: dict[str, list[Lin | float]] = {}
    n_binary = 0
    for name, count in problem.choices.items():
        allowed = problem.allowed.get(name, set(range(count)))
        if count == 1 or len(allowed) == 1:
            (only,) = allowed if len(allowed) == 1 else (0,)
            select[name] = [1.0 if k == only else 0.0 for k in range(count)]
            continue
        row: list[Lin | float] = []
        for k in range(count):
            if k in allowed:
                row.append(model.binary())
                n_binary += 1
            else:
                row.append(0.0)
        select[name] = row
        model.add(Lin.total(row), 1.0, 1.0)

    objective = _per_choice(select, problem.cost)
    edge_memory = Lin()  # GiB
    pairs: list[dict[tuple[int, int], Lin | float]] = []  # per edge: (p, q) -> its product
    grouped = {e for call in problem.group_calls for e in call.edges}
    grouped |= {e for link in problem.prefetch for e in link.edges}
    before_edges = model.num_columns
    for edge in problem.edges:
        pairs.append(
            _add_edge(
                model,
                edge,
                select[edge.left],
                select[edge.right],
                objective,
                edge_memory,
                len(pairs) in grouped,
            )
        )
    n_edge = model.num_columns - before_edges
    runs_of = []
    overlapped_calls = Lin()
    for call in problem.group_calls:
        runs = model.variable(0.0, 1.0)
        runs_of.append(runs)
        for e, members in call.edges.items():
            model.at_most(Lin.total(pairs[e][pq] for pq in members), runs)
        for d, chosen in call.choices.items():
            model.at_most(Lin.total(select[d][k] for k in chosen), runs)
        (overlapped_calls if call.overlappable else objective).add(runs, call.cost)
    links = problem.prefetch if problem.overlap > 0 else []
    gathers_of = [_link_terms(link, pairs, select, runs_of) for link in links]
    for i, link in enumerate(links):
        wait = model.variable(0.0)
        seconds, gathers = gathers_of[i]
        if link.hiding > 0:
            # C hides it where it gathers and, for a link after another, where that one
            # gathers too (it launches this gather): w >= G - C y, with y at most both
            # indicators; y <= its own is exact for whole choices and keeps the LP from
            # hiding C behind a fraction of a gather (llama3-8b of 96 layers: a root bound
            # 4.2% under the optimum)
            hidden = model.variable(0.0, 1.0)
            model.at_most(hidden, gathers)
            if link.after is not None:
                model.at_most(hidden, gathers_of[link.after][1])
            seconds = seconds.minus(hidden.scaled(link.hiding))
        model.at_most(seconds, wait)
        objective.add(wait, problem.overlap * link.weight)
    exposed = model.variable(0.0)
    overlapped = _per_choice(select, problem.overlappable).add(overlapped_calls)
    # the backward that hides it, at its least (each decision's fastest choice): a constant,
    # so the row couples only the communication choices (with the backward's choices in it,
    # HiGHS took 4x longer on llama3-8b 8x8); the plan's estimate uses the chosen backward
    hiding = sum(min(row) for row in problem.hidden_by.values() if row)
    k = max(problem.buckets, 1)
    hides = problem.overlap * (k - 1) / k  # autopar_cost_model.step.exposed_gradient_sync
    if not problem.hide_all:
        model.at_most(overlapped.minus(hides * hiding), exposed)
        model.at_most(overlapped.scaled(1 - hides), exposed)
    objective.add(exposed, problem.sync_passes)

    freed, recompute_vars = _add_recompute(model, problem, select, pairs, objective)

    if problem.memory_limit is not None:
        memory = _per_choice(select, problem.memory, scale=1 / GIB)
        memory.add(edge_memory).add(freed, -1.0)
        if problem.transient:
            in_flight = model.variable()
            for group in problem.transient:
                model.at_most(_per_choice(select, group, scale=1 / GIB), in_flight)
            memory.add(in_flight)
        model.add(memory, upper=problem.memory_limit / GIB)
    model.minimize(objective)
    if cutoff is not None:
        model.cap(objective, cutoff)
    if work_cutoff is not None:
        work = objective.minus(exposed.scaled(problem.sync_passes))
        if work_cutoff.once_weight():
            work = work.minus(_per_choice(select, problem.once, scale=work_cutoff.once_weight()))
        model.cap(work, work_cutoff.seconds)

    beat_this = cutoff is not None or work_cutoff is not None
    limit = replace(WorkLimit.of(time_limit, beat_this), any_plan=any_plan)
    clock = CLOCK_FACTOR * time_limit
    # most of the planner's MIPs are settled by their relaxation, rounded (``solve_rounded``)
    rounded = solve_rounded(model, clock) if backend == "highs" else None
    if rounded is not None and (rounded.status == "optimal" or rounded.infeasible or any_plan):
        result = rounded
    elif beat_this and not any_plan and rounded is None and backend == "highs":
        # a proof or a search, which shows only at the end: both at once (module comment)
        result = solve_or_refute(model, clock, dict(SEARCH), limit)
    else:
        # under a cutoff, whether there is a plan at all is a proof or the first plan; a
        # plan under the cutoffs in hand (the rounding's) leaves nothing to refute
        options = PROOF if beat_this and any_plan else SEARCH
        result = model.solve(clock, backend, dict(options), limit)
    elapsed = time.perf_counter() - start
    gave_up = limit.fired == "gave up"
    feasible = result.has_solution and not gave_up
    timed_out = not feasible and not result.infeasible
    choice: dict[str, int] = {}
    recompute: dict[str, int] = {}
    if feasible:
        for name, row in select.items():
            values = [result.value(v) for v in row]
            choice[name] = max(range(len(values)), key=lambda k: values[k])
        recompute = {
            name: sum(weight for weight, r in digits if result.value(r) > 0.5)
            for name, digits in recompute_vars.items()
        }
    report = SolverReport(
        backend=result.backend,
        status=_status(result, limit),
        time_s=elapsed,
        time_limit_s=time_limit,
        variables=n_binary + n_edge + len(problem.group_calls) + len(problem.prefetch) + 1,
        constraints=len(model.all_rows()),
        objective=result.objective if feasible else None,
        gap=result.gap,
    )
    return IlpSolution(
        choice=choice, report=report, feasible=feasible, timed_out=timed_out, recompute=recompute
    )


def _per_choice(
    select: dict[str, list[Lin | float]], coefficients: dict[str, list[float]], scale: float = 1.0
) -> Lin:
    """``scale sum_d sum_k coefficients[d][k] s[d, k]``."""
    out = Lin()
    for name, row in select.items():
        row_coefficients = coefficients.get(name)
        if row_coefficients:
            for value, coefficient in zip(row, row_coefficients, strict=True):
                if coefficient:
                    out.add(value, scale * coefficient)
    return out


def _add_recompute(
    model: Mip,
    problem: IlpProblem,
    select: dict[str, list[Lin | float]],
    pairs: list[dict[tuple[int, int], Lin | float]],
    objective: Lin,
) -> tuple[Lin, dict[str, list[tuple[int, Lin]]]]:
    """Recompute variables (see ``RecomputeTerm``); returns the memory they free (GiB) and,
    per region, the binary digits of its count with their weights."""
    freed = Lin()
    digits: dict[str, list[tuple[int, Lin]]] = {}
    terms = problem.recompute
    if problem.memory_limit is None:
        # recomputing only costs time when memory does not bind: only what hints force
        terms = [term for term in terms if term.forced]
    for term in terms:
        parts = _recompute_parts(term, select, pairs)
        digits[term.name] = []
        for bit in range(term.copies.bit_length()):
            weight = 1 << bit
            r = model.binary()
            saving, forward = Lin(), Lin()
            for groups in parts:
                _times_digit(model, groups, r, saving, forward)
            freed.add(saving, weight)
            objective.add(forward, term.weight * weight)
            digits[term.name].append((weight, r))
        count = Lin.total(r.scaled(weight) for weight, r in digits[term.name])
        model.add(count, upper=term.copies)
        if term.forced is not None:
            model.equal(count, term.copies if term.forced else 0.0)
    for budget in problem.recompute_budgets:
        counts = [r.scaled(w) for name in budget.regions for w, r in digits.get(name, [])]
        if counts:
            model.add(Lin.total(counts), upper=budget.copies)
    return freed, digits


Groups = dict[tuple[float, float], Lin]
"""A part of a region (a decision, or an edge) as the sums of its one-hot members (choice
variables, or the edge's pair products) grouped by what their choice gives the region:
(GiB freed, forward seconds). Members a choice cannot take (fixed at 0) are left out.
Summed once, not once for each digit of a region's count (up to seven): llama3-70b@64's
search wrote its recomputation rows in 4.96 s instead of 7.65 s, the same MIPs."""


def _recompute_parts(
    term: RecomputeTerm,
    select: dict[str, list[Lin | float]],
    pairs: list[dict[tuple[int, int], Lin | float]],
) -> list[Groups]:
    """The region's decisions and edges, each as ``Groups``: choices with equal
    coefficients share one hull variable per digit."""
    parts: list[Groups] = []
    for d in sorted(term.saving.keys() | term.forward.keys()):
        saving, forward = term.saving.get(d), term.forward.get(d)
        groups: Groups = {}
        for k, member in enumerate(select[d]):
            key = (saving[k] / GIB if saving else 0.0, forward[k] if forward else 0.0)
            _add_member(groups, key, member)
        parts.append(groups)
    for e in sorted(term.edge_saving.keys() | term.edge_forward.keys()):
        saved, seconds = term.edge_saving.get(e, {}), term.edge_forward.get(e, {})
        groups = {}
        for pq, member in pairs[e].items():
            _add_member(groups, (saved.get(pq, 0.0) / GIB, seconds.get(pq, 0.0)), member)
        parts.append(groups)
    return parts


def _add_member(groups: Groups, key: tuple[float, float], member: Lin | float) -> None:
    if isinstance(member, float) and member == 0.0:
        return
    summed = groups.get(key)
    if summed is None:  # (not setdefault: a new Lin for every member, kept for none but one)
        summed = groups[key] = Lin()
    summed.add(member)


def _times_digit(model: Mip, groups: Groups, r: Lin, saving: Lin, forward: Lin) -> None:
    """Add the GiB freed and the forward seconds of one part times a digit ``r`` (module
    docstring) to ``saving`` and ``forward``: ``sum_g c_g z_g`` and ``sum_g f_g z_g`` with
    ``z_g <= sum of g's members`` and ``sum_g z_g = r``, which is ``r`` times the chosen
    group's ``c, f`` when the choice is whole, and their convex hull when it is not."""
    if len(groups) == 1:  # one outcome, whichever member is chosen (or a fixed choice)
        ((c, f),) = groups
        saving.add(r, c)
        forward.add(r, f)
        return
    shares = Lin()
    for (c, f), members in groups.items():
        z = model.variable(0.0)
        model.at_most(z, members)
        shares.add(z)
        saving.add(z, c)
        forward.add(z, f)
    model.equal(shares, r)


def _link_terms(
    link: PrefetchLink,
    pairs: list[dict[tuple[int, int], Lin | float]],
    select: dict[str, list[Lin | float]],
    runs_of: list[Lin],
) -> tuple[Lin, Lin]:
    """A link's gather seconds ``G``, and the sum of the indicators of its members that
    gather (at least 1 when it gathers at all). A group call's ``g`` is no indicator:
    bounded only from below, with its fixed cost taken off where the prefetch hides it,
    the solver could raise it for free to launch the next gather (gpt on 4 cpu ranks: FSDP
    for one layer, its gathers hidden behind a layer that gathers nothing, 0.89 of the
    ledger's step); the members that run it are indicators already."""
    seconds, indicators = Lin(), Lin()
    for e, members in link.edges.items():
        for pq, value in members.items():
            seconds.add(pairs[e][pq], value)
            indicators.add(pairs[e][pq])
    for d, row in link.choices.items():
        for k, value in enumerate(row):
            if value:
                seconds.add(select[d][k], value)
                indicators.add(select[d][k])
    for g, value in link.calls.items():
        seconds.add(runs_of[g], value)
    return seconds, indicators


def _add_edge(
    model: Mip,
    edge: EdgeTerm,
    left: list[Lin | float],
    right: list[Lin | float],
    objective: Lin,
    memory: Lin,
    grouped: bool = False,
) -> dict[tuple[int, int], Lin | float]:
    """Add one edge's class variables and marginal constraints, its cost to ``objective``
    and its memory (GiB) to ``memory``; returns each class pair's product (a variable, or
    an expression when one side is fixed). ``grouped``: a group call reads its pairs."""
    if not grouped and not any(edge.cost.values()) and not any(edge.memory.values()):
        return {}
    left_sum: dict[int, list[Lin | float]] = {}
    right_sum: dict[int, list[Lin | float]] = {}
    for k, p in enumerate(edge.left_class):
        left_sum.setdefault(p, []).append(left[k])
    for m, q in enumerate(edge.right_class):
        right_sum.setdefault(q, []).append(right[m])
    constant_left = all(isinstance(v, float) for v in left)
    constant_right = all(isinstance(v, float) for v in right)
    pairs: dict[tuple[int, int], Lin | float] = {}
    if constant_left or constant_right:
        # one side is fixed: the pair is linear in the other side's choice
        for p, lefts in left_sum.items():
            for q, rights in right_sum.items():
                if constant_left and constant_right:
                    pairs[(p, q)] = float(sum(lefts)) * float(sum(rights))  # type: ignore[arg-type]
                    continue
                fixed = float(sum(lefts if constant_left else rights))  # type: ignore[arg-type]
                pairs[(p, q)] = (
                    Lin.total(rights if constant_left else lefts, fixed) if fixed else 0.0
                )
    else:
        for p in left_sum:
            for q in right_sum:
                pairs[(p, q)] = model.variable(0.0)
        for p, members in left_sum.items():
            model.equal(Lin.total(pairs[(p, q)] for q in right_sum), Lin.total(members))
        for q, members in right_sum.items():
            model.equal(Lin.total(pairs[(p, q)] for p in left_sum), Lin.total(members))
    for pq, cost in edge.cost.items():
        if cost:
            objective.add(pairs[pq], cost)
    for pq, extra in edge.memory.items():
        if extra:
            memory.add(pairs[pq], extra / GIB)
    return pairs


# HiGHS's presolve, off only in the proofs that nothing beats a cutoff, where it costs
# more than it saves; on (HiGHS's default) in every solve that looks for a plan. Measured on
# every MIP the quality benchmark solves for llama3-8b on 8x8 (63 problems, each solved both
# ways with the same status and objective): the proofs took 1.5-10 s with presolve and
# 0.5-1.1 s without. Where a plan is looked for, presolve is a bounded cost and can save
# most of the solve: 0.1-0.5 s more on each of that set's 23 solves with memory set aside
# (on gpt3-13b's, 0.1-0.2 s; the CLI's default llama3-8b on 8x8, 0.23 s over its two), but
# ResNet-50 at 8,192 images on 8x8 (198,193 columns, memory set aside) took 13 s with it
# and 36 s without, an unbounded solve with recomputation forced by hints (llama-tiny,
# ``tests/passes/test_hints.py``) 6 s and 114 s, and llama3-8b's first memory-bounded solve
# 6.8 s and 20.8 s. (Probing alone, with presolve on, once took a minute on llama-tiny 4x2
# with a cutoff row over the whole objective: it stays off.)
#
# Which of the two a solve under a cutoff is, a proof or a search, shows only at its end,
# so the search runs with a proof beside it (``mip.solve_or_refute``: without presolve or
# heuristics, answering only "no plan"): the first memory-bounded solve of llama3-8b's
# search on 64 devices (work cutoff only) found its plan after 37 s without presolve,
# 14 s with it, while llama3-70b's on 64x8 without a pipeline proved it had none in 29 s
# without presolve and 100 s with it. (A switch to presolve after the proof's sixth
# checkpoint, before, took that proof to the search: 124 s.) ``PROOF``: the solves that
# ask only whether there is a plan (``any_plan``), which stop at the first.
#
# A search runs without HiGHS's two sub-MIP heuristics, RINS and RENS. With presolve on,
# HiGHS restarts the root each time reduced-cost fixing frees a share of the columns, and
# each restart ran them again: llama3-8b of 96 layers on 8x8 (memory set aside, the same
# 28,362 columns as at 8 layers) spent 8.4 s of 12.1 s in 71 sub-MIPs. Measured side by
# side, each problem solved both ways: llama3-8b of 16, 64 and 96 layers 7.0, 9.4 and
# 11.7 s with them, 3.4, 6.2 and 6.5 s without; ResNet-50's above 26.8 s and 11.3-14.0 s;
# every MIP of llama3-8b's quality search on 8x8 80.7 s and 79.7 s; the CLI's default two
# 2.5 s and 2.7 s (medians of 3). Same statuses, objectives equal within the gap tolerance.
# (Restarts off instead gained more on the depth sweep but doubled llama3-8b's first
# memory-bounded solve, 20 s to 40 s.)
PROOF = {"presolve": "off"}
SEARCH = {
    "presolve_rule_off": 1 << 15,  # probing off
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
}


# The solver stops by the work it has done, not by the clock, so the same problem gives the
# same plan on a loaded machine and on a quiet one. ``time_limit`` is a budget of work: HiGHS's
# MIP callback does not count simplex iterations (it reports -1), so the work is counted in
# the solver's own checkpoints, which it passes at fixed points of its search (its nodes and
# rounds of cuts and heuristics), the same on every run (checked: 98, 98 and 83, 83 for one
# problem solved twice each way). A root node with no branching passes 2; the longest
# solves of the quality benchmark pass 4 to 14 a second on this project's 2-core machine.
# A budget of ``t`` seconds is ``CHECKS_PER_SECOND * t`` checkpoints (200 for the default
# 60 s); a solve with a cutoff that has found no plan gives up after a third of them, as
# the clock-based rule did after a third of the time. The clock stops a solve only at
# ``CLOCK_FACTOR`` times its budget, a last resort, and a plan it decided says so
# (``autopar_passes.solve``).
CHECKS_PER_SECOND = 10 / 3
WORK_LIMIT = "work limit"  # what a report's status says when the work limit stopped it
CLOCK_FACTOR = 3.0


@dataclass
class WorkLimit:
    """HiGHS's interrupt callback: stop a solve by the work it did, in the solver's
    checkpoints (``WorkLimit.of`` a budget). ``give_up``: with a cutoff, stop a solve that
    has no plan after this many (None: no cutoff); ``most``: stop any solve after this
    many, with its best plan; ``any_plan``: stop at the first plan. ``fired`` says which
    stopped it ("" for none)."""

    give_up: int | None
    most: int
    checks: int = 0
    fired: str = ""
    any_plan: bool = False  # stop at the first plan: only whether there is one matters

    @staticmethod
    def of(budget_s: float, beat_this: bool) -> WorkLimit:
        """The checkpoints a budget of ``budget_s`` seconds allows (module comment)."""
        most = round(budget_s * CHECKS_PER_SECOND)
        return WorkLimit(most // 3 if beat_this else None, most)

    def __call__(self, kind: int, message: str, out: Any, into: Any, data: Any) -> None:
        self.checks += 1
        if self.any_plan and math.isfinite(out.mip_primal_bound):
            into.user_interrupt = True
            self.fired = "found a plan"
        elif (
            self.give_up is not None
            and self.checks > self.give_up
            and not math.isfinite(out.mip_primal_bound)
        ):
            into.user_interrupt = True
            self.fired = "gave up"
        elif self.checks > self.most:
            into.user_interrupt = True
            self.fired = WORK_LIMIT


def _status(result: MipResult, limit: WorkLimit) -> str:
    if limit.fired == "gave up":
        return f"gave up: no plan under the cutoff in {limit.give_up:,} solver checkpoints"
    if limit.fired == WORK_LIMIT:
        if result.has_solution:
            return f"feasible ({WORK_LIMIT} of {limit.most:,} solver checkpoints; best found)"
        return f"not solved ({WORK_LIMIT} of {limit.most:,} solver checkpoints)"
    return result.status
