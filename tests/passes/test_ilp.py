"""A solve stops by the work it did, not by the clock (``autopar_passes.ilp.WorkLimit``):
one asked to beat a plan in hand gives up when it finds none in its share of the solver's
checkpoints, and then reports no plan, never a made-up one; any solve stops at its work
limit with its best plan, and says so."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from autopar_passes import ilp
from autopar_passes.ilp import GIB, IlpProblem, WorkCutoff, WorkLimit, solve_ilp
from autopar_passes.mip import MipResult, solve_or_refute


def _callback(limit: WorkLimit, checks: int, incumbent: float) -> bool:
    """Call ``limit`` as HiGHS does at ``checks`` checkpoints; whether the last one stops."""
    into = SimpleNamespace(user_interrupt=False)
    out = SimpleNamespace(mip_primal_bound=incumbent, running_time=1e9)
    while limit.checks < checks:
        into.user_interrupt = False
        limit(0, "", out, into, None)
    return into.user_interrupt


def test_it_gives_up_only_on_a_solve_past_its_checks_without_a_plan() -> None:
    limit = WorkLimit(give_up=10, most=50)
    assert not _callback(limit, 10, float("inf")) and not limit.fired
    assert not _callback(limit, 30, 7.5)  # a plan under the cutoff: let it improve
    assert _callback(limit, 31, float("inf")) and limit.fired == "gave up"


def test_any_solve_stops_at_its_work_limit_whatever_the_clock_says() -> None:
    limit = WorkLimit(give_up=None, most=50)
    assert not _callback(limit, 50, float("inf"))  # the clock (running_time) is not read
    assert _callback(limit, 51, 7.5) and limit.fired == "work limit"


def _random_problem(decisions: int = 40, choices: int = 3) -> IlpProblem:
    """Choices of random time and memory under a memory limit that binds."""
    rng = random.Random(0)
    names = [f"d{i}" for i in range(decisions)]
    return IlpProblem(
        choices=dict.fromkeys(names, choices),
        cost={n: [rng.uniform(1, 2) for _ in range(choices)] for n in names},
        memory={n: [rng.uniform(0, 1) * GIB for _ in range(choices)] for n in names},
        memory_limit=decisions / 3 * GIB,
    )


def _cut(kind: str, seconds: float) -> dict[str, float | WorkCutoff]:
    """``solve_ilp``'s keyword for a cutoff of ``kind`` at ``seconds``."""
    return {"cutoff": seconds} if kind == "cutoff" else {"work_cutoff": WorkCutoff(seconds)}


@pytest.mark.parametrize("cutoff", ["cutoff", "work_cutoff"])
def test_a_solve_that_gave_up_has_no_plan(monkeypatch: pytest.MonkeyPatch, cutoff: str) -> None:
    """HiGHS reports an interrupted solve as feasible even without a solution (PuLP maps
    kInterrupt so); the solve must say it has none, as when its time limit ends it."""
    problem = _random_problem()
    best = solve_ilp(problem)
    assert best.feasible
    fired: list[WorkLimit] = []
    call = WorkLimit.__call__

    def spy(self: WorkLimit, *args: object) -> None:
        call(self, *args)
        if self.fired:
            fired.append(self)

    monkeypatch.setattr(WorkLimit, "__call__", spy)
    monkeypatch.setattr(ilp, "CHECKS_PER_SECOND", 0.0)  # give up at once
    bound = best.report.objective * 2  # loose: a plan under it exists
    gave_up = solve_ilp(problem, **_cut(cutoff, bound))
    assert fired, "the solve found its plan before the first interrupt check"
    assert not gave_up.feasible and gave_up.timed_out and not gave_up.choice
    assert gave_up.report.status.startswith("gave up")


def test_a_solve_with_time_to_spare_finds_the_plan_under_its_cutoff() -> None:
    problem = _random_problem()
    best = solve_ilp(problem)
    again = solve_ilp(problem, cutoff=best.report.objective * 1.01)
    assert again.feasible and again.report.objective == pytest.approx(best.report.objective)


def test_a_solve_stopped_by_its_work_limit_keeps_its_best_plan_the_same_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped early by work, a solve reports the limit and its gap, and two runs give the
    same plan: no clock is read."""
    problem = _random_problem(decisions=120, choices=4)
    monkeypatch.setattr(ilp, "CHECKS_PER_SECOND", 0.1)  # 6 checkpoints for 60 s
    first, second = solve_ilp(problem, 60.0), solve_ilp(problem, 60.0)
    assert first.report.status.startswith("feasible (work limit of 6 solver checkpoints")
    assert first.feasible and first.choice == second.choice
    assert first.report.objective == second.report.objective


def test_a_budget_in_seconds_is_a_number_of_checkpoints() -> None:
    """The default 60 s allow 200 checkpoints; with a cutoff, a solve without a plan gives up
    after a third of them, as the clock-based rule did after a third of the time."""
    assert WorkLimit.of(60.0, beat_this=False) == WorkLimit(None, 200)
    assert WorkLimit.of(60.0, beat_this=True) == WorkLimit(66, 200)


@pytest.mark.parametrize("cutoff", ["cutoff", "work_cutoff"])
def test_a_solve_under_a_cutoff_is_a_search_with_a_proof_beside_it(
    monkeypatch: pytest.MonkeyPatch, cutoff: str
) -> None:
    """Where the rounding does not settle it, a solve under a cutoff is a proof or a
    search, which shows only at its end: the search runs with presolve and a proof beside
    it (``mip.solve_or_refute``), to the answer the solve without the cutoff gives, or
    none under a cutoff below it."""
    problem = _random_problem(decisions=120, choices=4)
    best = solve_ilp(problem)
    assert best.feasible and best.report.objective is not None
    runs: list[dict[str, object]] = []

    def spy(mip: ilp.Mip, time_limit: float, options: dict, callback: object) -> MipResult:
        runs.append(dict(options))
        return solve_or_refute(mip, time_limit, options, callback)

    monkeypatch.setattr(ilp, "solve_or_refute", spy)
    monkeypatch.setattr(ilp, "solve_rounded", lambda mip, time_limit: None)
    found = solve_ilp(problem, **_cut(cutoff, best.report.objective * 1.5))
    assert runs == [ilp.SEARCH]
    assert found.feasible and found.report.objective == pytest.approx(best.report.objective)
    assert found.report.status == "optimal"
    # only the cutoff on the whole objective is certain to leave none below the optimum
    none = solve_ilp(problem, cutoff=best.report.objective * 0.9)
    assert not none.feasible and not none.timed_out


@pytest.mark.parametrize("cutoff", ["cutoff", "work_cutoff"])
def test_a_plan_the_rounding_finds_under_a_cutoff_leaves_the_search_alone(
    monkeypatch: pytest.MonkeyPatch, cutoff: str
) -> None:
    """Where the relaxation, rounded, finds a plan under the cutoff but not within HiGHS's
    gap of the bound, there is nothing to refute: the MIP is the search alone, with
    presolve, to the same answer."""
    problem = _random_problem(decisions=120, choices=4)
    best = solve_ilp(problem)
    assert best.feasible and best.report.objective is not None
    runs: list[dict[str, object]] = []
    rounded: list[MipResult | None] = []
    solve, solve_rounded = ilp.Mip.solve, ilp.solve_rounded

    def spy(self: ilp.Mip, time_limit: float, backend: str, options: dict, callback: object):
        runs.append(dict(options))
        return solve(self, time_limit, backend, options, callback)

    def spy_rounded(mip: ilp.Mip, time_limit: float) -> MipResult | None:
        rounded.append(solve_rounded(mip, time_limit))
        return rounded[-1]

    monkeypatch.setattr(ilp.Mip, "solve", spy)
    monkeypatch.setattr(ilp, "solve_rounded", spy_rounded)
    found = solve_ilp(problem, **_cut(cutoff, best.report.objective * 1.5))
    (plan,) = rounded
    assert plan is not None and plan.has_solution and plan.status != "optimal"
    assert runs == [ilp.SEARCH]
    assert found.feasible and found.report.objective == pytest.approx(best.report.objective)
