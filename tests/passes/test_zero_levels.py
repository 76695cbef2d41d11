"""ZeRO stages in the solver: the fastest feasible stage, ties to the lower one, found fast.

``solve_ilp``'s cutoff makes a stage that cannot match the plan in hand infeasible (proved
at once), ``dominates`` says when a stage can only tie another (ZeRO-1 against ZeRO-2), and
``_solve_levels`` uses both. The closed forms are hand-built ILPs of one or two decisions;
end to end, the planner's answer is the one solving every stage on its own would give.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import pytest

import autopar
from autopar.force import style_constraints
from autopar_examples.models import build
from autopar_passes.ilp import GIB, IlpProblem, WorkCutoff, cannot_beat, dominates, solve_ilp
from autopar_passes.problem import ProblemParts
from autopar_passes.solve import (
    Built,
    SolveRequest,
    _fastest_unlimited,
    _solve_levels,
    solve_sharding,
)
from autopar_passes.trace import trace
from autopar_plans import InfeasiblePlanError


def two_decisions(limit_gib: float = 5.0) -> IlpProblem:
    """Four combinations, closed form (seconds; memory in GiB, as the memory row is):

    ==========  ====  ======  ==================================
    (a, b)      time  memory
    ==========  ====  ======  ==================================
    (0, 0)      4.0   5       fits
    (0, 1)      2.5   7       the fastest, over a limit of 5 GiB
    (1, 0)      5.0   2       fits
    (1, 1)      3.5   4       fits: the optimum under 5 GiB
    ==========  ====  ======  ==================================
    """
    return IlpProblem(
        choices={"a": 2, "b": 2},
        cost={"a": [1.0, 2.0], "b": [3.0, 1.5]},
        memory={"a": [4 * GIB, 1 * GIB], "b": [1 * GIB, 3 * GIB]},
        memory_limit=limit_gib * GIB,
    )


# Objectives are compared to HiGHS's absolute MIP gap (1e-6 s): the exposed-communication
# variable is continuous, and a solve may leave it that far above its least.
GAP = 1e-6


def test_without_a_cutoff_the_optimum_under_the_memory_limit():
    solution = solve_ilp(two_decisions())
    assert solution.feasible
    assert solution.choice == {"a": 1, "b": 1}
    assert solution.report.objective == pytest.approx(3.5, abs=GAP)


def test_a_cutoff_below_the_optimum_is_proved_infeasible_not_timed_out():
    """No choice is that fast: the solver says infeasible, well inside its time limit."""
    solution = solve_ilp(two_decisions(), time_limit=30.0, cutoff=3.4)
    assert not solution.feasible
    assert not solution.timed_out
    assert solution.report.status == "infeasible"
    assert solution.report.time_s < 5.0
    assert solution.choice == {}


@pytest.mark.parametrize("cutoff", [3.5, 3.5 * (1 + 1e-7), 4.0, 100.0])
def test_a_cutoff_at_or_above_the_optimum_finds_the_same_optimum(cutoff):
    solution = solve_ilp(two_decisions(), cutoff=cutoff)
    assert solution.feasible
    assert solution.choice == {"a": 1, "b": 1}
    assert solution.report.objective == pytest.approx(3.5, abs=GAP)


def test_a_cutoff_that_only_the_memory_breaking_choice_meets_is_infeasible():
    """(0, 1) takes 2.5 s but needs 7 GiB: a cutoff of 3 s leaves nothing that fits."""
    assert not solve_ilp(two_decisions(), cutoff=3.0).feasible
    assert solve_ilp(two_decisions(limit_gib=7.0), cutoff=3.0).choice == {"a": 0, "b": 1}


def stage(memory: list[float], overlappable: list[float], cost=(1.0, 2.0), limit=5.0):
    """One decision of two choices, as a ZeRO stage gives it: ``overlappable`` (gradient
    sync, parameter gathers) and ``memory`` (GiB) change with the stage, ``cost`` does not."""
    return IlpProblem(
        choices={"a": 2},
        cost={"a": list(cost)},
        memory={"a": [m * GIB for m in memory]},
        overlappable={"a": list(overlappable)},
        memory_limit=limit * GIB,
    )


def test_a_problem_dominates_one_it_is_no_worse_than_in_every_coefficient():
    """Same costs, memory and overlappable communication each no larger per choice."""
    worse = stage(memory=[4.0, 2.0], overlappable=[0.6, 0.0])
    assert dominates(worse, worse)  # a problem can only tie itself
    assert dominates(stage(memory=[3.0, 2.0], overlappable=[0.6, 0.0]), worse)  # ZeRO-2/-1
    assert dominates(stage(memory=[3.0, 1.0], overlappable=[0.5, 0.0]), worse)
    assert not dominates(worse, stage(memory=[3.0, 2.0], overlappable=[0.6, 0.0]))


@pytest.mark.parametrize(
    "other",
    [
        stage(memory=[3.0, 2.5], overlappable=[0.6, 0.0]),  # less memory in one, more in one
        stage(memory=[4.0, 2.0], overlappable=[0.5, 0.1]),  # less sync in one, more in one
        stage(memory=[4.0, 2.0], overlappable=[0.7, 0.0]),  # ZeRO-0 against ZeRO-1's sync
        stage(memory=[3.0, 2.0], overlappable=[0.6, 0.0], cost=(0.9, 2.0)),  # even faster
        stage(memory=[3.0, 2.0], overlappable=[0.6, 0.0], limit=6.0),  # another problem
    ],
    ids=["more-memory", "more-overlappable", "slower-sync", "other-cost", "other-limit"],
)
def test_a_larger_coefficient_or_another_cost_is_not_dominance(other):
    """Only memory and overlappable communication may differ, and only downwards: a
    different compute cost, even a lower one, makes another problem, not a better one."""
    assert not dominates(other, stage(memory=[4.0, 2.0], overlappable=[0.6, 0.0]))


def test_a_stage_that_saves_time_on_no_choice_cannot_beat_the_base():
    """``cannot_beat``: another ZeRO stage's optimum can be lower only if some choice costs
    it less (its optimizer steps a piece) or hides more; the bound takes each decision's
    least difference, so it never rules out a stage that could win (checked by solving)."""
    base = stage(memory=[4.0, 2.0], overlappable=[0.6, 0.0])
    slower = stage(memory=[3.0, 2.0], overlappable=[0.7, 0.1])  # more sync on every choice
    cheaper = stage(memory=[3.0, 2.0], overlappable=[0.6, 0.0], cost=(0.5, 2.0))
    assert cannot_beat(base, slower) and cannot_beat(base, base)
    assert not cannot_beat(base, cheaper)
    unlimited = [replace(p, memory_limit=None) for p in (base, slower, cheaper)]
    best = solve_ilp(unlimited[0]).report.objective
    assert solve_ilp(unlimited[1]).report.objective >= best
    assert solve_ilp(unlimited[2]).report.objective < best  # the stage the bound kept


@dataclass
class _Solved:
    """What ``_solve_levels`` reads of a ``Solved``."""

    zero: int
    choice: dict[str, int]
    report: object


def _levels(limit: float):
    """Three ZeRO stages of one decision (replicate: 0, shard: 1), solved for real:

    =====  ======================  ==========================  ====================
    stage  time s (choice 0, 1)    memory GiB (choice 0, 1)    sync of choice 0
    =====  ======================  ==========================  ====================
    0      1.0 + 0.5, 2.0          6, 2                        all-reduce
    1      1.0 + 0.6, 2.0          4, 2                        reduce-scatter + gather
    2      1.0 + 0.6, 2.0          3, 2                        the same: dominates 1
    =====  ======================  ==========================  ====================
    """
    problems = {
        0: stage(memory=[6.0, 2.0], overlappable=[0.5, 0.0], limit=limit),
        1: stage(memory=[4.0, 2.0], overlappable=[0.6, 0.0], limit=limit),
        2: stage(memory=[3.0, 2.0], overlappable=[0.6, 0.0], limit=limit),
    }
    built = [Built(zero, None, ProblemParts(p), []) for zero, p in problems.items()]
    calls: list[tuple[int, float | None, dict | None]] = []

    def run(level: Built, cutoff: float | None = None, fixed: dict | None = None):
        calls.append((level.zero, cutoff, fixed))
        problem = level.parts.problem
        if fixed is not None:
            problem = replace(problem, allowed={d: {k} for d, k in fixed.items()})
        solution = solve_ilp(problem, cutoff=cutoff)
        return _Solved(level.zero, solution.choice, solution.report) if solution.feasible else None

    return built, calls, run


@pytest.mark.parametrize(
    ("limit", "zero", "time"),
    [
        (7.0, 0, 1.5),  # everything fits: the all-reduce is the fastest
        (5.0, 1, 1.6),  # ZeRO-0 must shard (2.0 s); ZeRO-1 ties ZeRO-2: the lower stage
        (3.5, 2, 1.6),  # only ZeRO-2 holds the replicated choice
        (2.0, 0, 2.0),  # every stage must shard, at the same time: all tie, ZeRO-0
    ],
)
def test_levels_give_the_fastest_stage_ties_to_the_lower(limit, zero, time):
    built, _, run = _levels(limit)
    found = _solve_levels(built, run)
    assert found is not None
    assert (found.zero, found.report.objective) == (zero, pytest.approx(time, abs=GAP))


def test_nothing_fits_no_stage():
    built, _, run = _levels(1.0)
    assert _solve_levels(built, run) is None


def test_most_sharded_first_then_under_its_cutoff_and_the_dominated_stage_only_for_a_tie():
    """ZeRO-2 is solved outright; ZeRO-0 under ZeRO-2's time (a tie allowed), which it
    cannot meet within 5 GiB; ZeRO-1, which ZeRO-2 dominates, never on its own: only
    ZeRO-2's choice costed in it, which ties, so ZeRO-1 with ZeRO-2's report."""
    built, calls, run = _levels(5.0)
    found = _solve_levels(built, run)
    assert [(zero, fixed) for zero, _, fixed in calls] == [(2, None), (0, None), (1, {"a": 0})]
    assert calls[0][1] is None
    assert calls[1][1] == calls[2][1] == pytest.approx(1.6, rel=1e-6)
    assert calls[1][1] >= 1.6  # a tie is not cut off
    assert found is not None and found.zero == 1 and found.choice == {"a": 0}


def test_a_stage_that_wins_only_with_other_layouts_is_still_solved():
    """Memory aside, ZeRO-1 is looked for wherever it could be faster, not only where the
    lowest stage's plan, costed in it, is: here ZeRO-0's best (replicate, 1.0 s) costs
    ZeRO-1 the same, and ZeRO-1 wins (0.8 s) by sharding, which ZeRO-0 prices at 1.2 s.
    Skipping it lost gpt3-13b on 64 H100s its best plan."""
    problems = {
        0: replace(
            stage(memory=[1.0, 1.0], overlappable=[0.0, 0.0], cost=(1.0, 1.2)), memory_limit=None
        ),
        1: replace(
            stage(memory=[1.0, 1.0], overlappable=[0.0, 0.0], cost=(1.0, 0.8)), memory_limit=None
        ),
    }

    def build(zero: int, limit: float | None) -> Built:
        return Built(zero, None, ProblemParts(problems[zero]), [])  # type: ignore[arg-type]

    def run(level: Built, cutoff: float | None = None):
        solution = solve_ilp(level.parts.problem, cutoff=cutoff)
        return _Solved(level.zero, solution.choice, solution.report) if solution.feasible else None

    found = _fastest_unlimited((0, 1), build, run)
    assert found is not None
    assert (found.zero, found.choice) == (1, {"a": 1})
    assert found.report.objective == pytest.approx(0.8, abs=GAP)


# End to end. The cpu preset's slow links and FLOPs make a step take tens of milliseconds
# to seconds, so HiGHS's absolute tolerances (1e-7 on a row, 1e-6 on the gap, in seconds)
# are far below the 1e-9 the objectives are compared to; on an H100 these models step in
# a fraction of a millisecond, where the same tolerances are up to 1e-3 of the objective
# and two routes to one optimum can report it differently.


@dataclass
class Case:
    traced: object
    request: SolveRequest
    memory: dict[int, float]  # stage -> bytes per device of its fastest plan
    objective: dict[int, float]  # stage -> the time of its fastest plan

    @property
    def fastest_memory(self) -> float:
        """The memory of the fastest plan over the stages (ties to the lower stage)."""
        return self.memory[min(self.objective, key=lambda z: (self.objective[z], z))]


def _case(model_and_inputs, constraints=None) -> Case:
    traced = trace(*model_and_inputs)
    request = SolveRequest(autopar.Mesh((4,), device="cpu"))
    if constraints is not None:
        request = replace(request, constraints=constraints)
    solved = {
        zero: solve_sharding(traced, replace(request, zero_levels=(zero,))) for zero in (0, 1, 2)
    }
    return Case(
        traced,
        request,
        {zero: s.memory() for zero, s in solved.items()},
        {zero: s.report.objective for zero, s in solved.items()},
    )


@pytest.fixture(scope="module")
def data_parallel():
    """Big weights, a batch whose activations recomputation can free: plain data
    parallelism (forced), so that only the ZeRO stage and recomputation save memory."""
    model = build(
        "mlp-tiny",
        d_in=1024,
        d_hidden=4096,
        d_out=1024,
        n_layers=2,
        batch_size=16384,
        device="meta",
    )
    return _case(model, partial(style_constraints, "dp"))


@pytest.fixture(scope="module")
def free_gpt():
    """A GPT that may shard anything: under a limit, sharding weights competes with ZeRO."""
    model = build(
        "gpt-tiny", d_model=256, n_layer=2, vocab_size=4096, seq_len=64, batch_size=8, device="meta"
    )
    return _case(model)


def _each_stage_on_its_own(case: Case, limit: float) -> dict[int, float]:
    found = {}
    for zero in case.request.zero_levels:
        request = replace(case.request, memory_limit=limit, zero_levels=(zero,))
        try:
            found[zero] = solve_sharding(case.traced, request).report.objective
        except InfeasiblePlanError:
            continue
    return found


def _between(low: float, high: float) -> float:
    return (low + high) / 2


@pytest.mark.parametrize(
    ("case", "limit", "zero"),
    [
        # between ZeRO-1's memory and ZeRO-0's: ZeRO-0 fits only by recomputing (slower);
        # ZeRO-1 and ZeRO-2 fit as they are, at one time: the lower stage
        ("data_parallel", lambda m: _between(m[1], m[0]), 1),
        # between ZeRO-2's and ZeRO-1's: ZeRO-1 fits only by recomputing; ZeRO-2 as it is
        ("data_parallel", lambda m: _between(m[2], m[1]), 2),
        # below ZeRO-2's: ZeRO-0 does not fit at all; ZeRO-1 and ZeRO-2 fit by recomputing,
        # the same layers, and tie again
        ("data_parallel", lambda m: m[2] - (m[1] - m[2]) / 2, 1),
        # between ZeRO-2's and ZeRO-0's: ZeRO-0 must shard more weights, and that costs
        # less than ZeRO-2's reduce-scatter and gathers of its stepped masters, each call
        # paid whole as the runtime runs it (priced as shares of model-wide calls, ZeRO-1
        # won here)
        ("free_gpt", lambda m: _between(m[2], m[0]), 0),
    ],
    ids=["dp-zero1-ties-zero2", "dp-only-zero2", "dp-all-recompute", "gpt-zero0-shards-more"],
)
def test_planning_gives_the_fastest_stage_as_solving_each_on_its_own(request, case, limit, zero):
    """The fastest over ZeRO stages (ties to the lower) is the fastest of the stages each
    solved on its own: the cutoffs and the skipped dominated stage lose nothing."""
    case = request.getfixturevalue(case)
    limit = limit(case.memory)
    assert limit < case.fastest_memory  # the limit binds: the fastest plan does not fit
    alone = _each_stage_on_its_own(case, limit)
    fastest = min(alone.values())
    expected = min(z for z, time in alone.items() if time <= fastest * (1 + 1e-9))
    assert expected == zero  # the case is what it says
    solved = solve_sharding(case.traced, replace(case.request, memory_limit=limit))
    assert solved.zero == expected
    assert solved.report.objective == pytest.approx(alone[expected], rel=1e-9)
    assert solved.memory() <= limit + 1e-6 * GIB  # HiGHS's tolerance on the GiB row


def test_a_work_cutoff_bounds_compute_and_resharding_not_the_exposed_communication():
    """The pipeline search's cutoff: with ``a``'s second choice adding 1 s of gradient sync
    that nothing hides, (1, 1) costs 4.5 s of which 3.5 s is work, and (0, 0) 4.0 s, all
    work. The optimum under 5 GiB is (0, 0); under a work cutoff of 3.6 s only (1, 1) is
    left (slower in all, less work), and under 3.4 s nothing that fits."""
    problem = replace(two_decisions(), overlappable={"a": [0.0, 1.0]})
    assert solve_ilp(problem).choice == {"a": 0, "b": 0}
    cut = solve_ilp(problem, work_cutoff=WorkCutoff(3.6))
    assert cut.choice == {"a": 1, "b": 1}
    assert cut.report.objective == pytest.approx(4.5, abs=GAP)
    assert not solve_ilp(problem, work_cutoff=WorkCutoff(3.4)).feasible


def test_a_work_cutoff_stretches_the_work_per_microbatch_not_the_steps_once():
    """A pipeline's bubble stretches what a step runs per microbatch, not what it runs once
    after the schedule (the optimizer, ZeRO's gathers after the step): with ``b``'s first
    choice 1 s a step of work per microbatch and 2 s once, a stretch of 2 and room for
    6.4 s of stretched work (``p best``) leave (0, 0) (2 x 2 + 2 = 6 s; 4.0 s in all),
    where the whole work stretched (8 s) would leave nothing; (1, 1), the optimum under
    the memory limit, stretches to 7 s."""
    problem = replace(two_decisions(), once={"a": [0.0, 0.0], "b": [2.0, 0.0]})
    stretched = solve_ilp(problem, work_cutoff=WorkCutoff(6.4 / 2, stretch=2.0))
    assert stretched.choice == {"a": 0, "b": 0}
    assert stretched.report.objective == pytest.approx(4.0, abs=GAP)
    assert not solve_ilp(problem, work_cutoff=WorkCutoff(6.4 / 2)).feasible


def test_a_work_cutoff_nothing_meets_says_nothing_faster():
    """``solve_sharding`` under a work cutoff below every plan's compute raises
    ``NothingFaster`` (the caller keeps the plan it holds), not a memory error."""
    from autopar_passes.solve import NothingFaster

    model, inputs = build("mlp-tiny")
    traced = trace(model, inputs)
    mesh = autopar.Mesh((2,), device="cpu")
    request = SolveRequest(mesh, work_cutoff=WorkCutoff(1e-12))
    with pytest.raises(NothingFaster):
        solve_sharding(traced, request)
    # the same request with room finds the fastest plan
    assert solve_sharding(traced, replace(request, work_cutoff=None)).report.objective > 1e-12
