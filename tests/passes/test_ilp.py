"""A solve asked to beat a plan in hand gives up when it finds none in a third of its time
(``autopar_passes.ilp.GiveUp``), and then reports no plan, never a made-up one."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from autopar_passes import ilp
from autopar_passes.ilp import GIB, GiveUp, IlpProblem, solve_ilp


def _callback(give_up: GiveUp, running_time: float, incumbent: float) -> bool:
    into = SimpleNamespace(user_interrupt=False)
    out = SimpleNamespace(running_time=running_time, mip_primal_bound=incumbent)
    give_up(0, "", out, into, None)
    return into.user_interrupt


def test_it_interrupts_only_a_solve_past_its_time_without_a_plan() -> None:
    give_up = GiveUp(20.0)
    assert not _callback(give_up, 19.0, float("inf")) and not give_up.fired
    assert not _callback(give_up, 30.0, 7.5)  # a plan under the cutoff: let it improve
    assert _callback(give_up, 21.0, float("inf")) and give_up.fired


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


@pytest.mark.parametrize("cutoff", ["cutoff", "work_cutoff"])
def test_a_solve_that_gave_up_has_no_plan(monkeypatch: pytest.MonkeyPatch, cutoff: str) -> None:
    """HiGHS reports an interrupted solve as feasible even without a solution (PuLP maps
    kInterrupt so); the solve must say it has none, as when its time limit ends it."""
    problem = _random_problem()
    best = solve_ilp(problem)
    assert best.feasible
    fired: list[GiveUp] = []
    call = GiveUp.__call__

    def spy(self: GiveUp, *args: object) -> None:
        call(self, *args)
        if self.fired:
            fired.append(self)

    monkeypatch.setattr(GiveUp, "__call__", spy)
    monkeypatch.setattr(ilp, "GIVE_UP_FRACTION", 0.0)  # give up at once
    bound = best.report.objective * 2  # loose: a plan under it exists
    gave_up = solve_ilp(problem, **{cutoff: bound})
    assert fired, "the solve found its plan before the first interrupt check"
    assert not gave_up.feasible and gave_up.timed_out and not gave_up.choice
    assert gave_up.report.status.startswith("gave up")


def test_a_solve_with_time_to_spare_finds_the_plan_under_its_cutoff() -> None:
    problem = _random_problem()
    best = solve_ilp(problem)
    again = solve_ilp(problem, cutoff=best.report.objective * 1.01)
    assert again.feasible and again.report.objective == pytest.approx(best.report.objective)
