"""The MIP the planner's ILP is written into: HiGHS and the CBC fallback solve the same
model to the same answer; an infeasible model says so; a relaxation that is integral but
for a few columns settles the MIP when its rounding is within HiGHS's gap of its bound,
and only then; a cap (a cutoff) left out of the relaxation is checked after it, and proves
no plan only where no point of the relaxation meets it."""

from __future__ import annotations

import doctest
import math
import os
import random
import signal
import threading
from typing import Any

import pytest

import autopar_passes.mip
from autopar_passes.mip import (
    REFUTE,
    REFUTED,
    REFUTER,
    ROUNDED_GAP,
    Lin,
    Mip,
    solve_or_refute,
    solve_rounded,
)


def test_docstring_example():
    result = doctest.testmod(autopar_passes.mip)
    assert result.failed == 0 and result.attempted > 0


def _knapsack() -> tuple[Mip, list[Lin]]:
    """Most value in weight 10: items (value, weight) (6, 5), (5, 4), (4, 3), (3, 2), as a
    minimisation of minus the value, with a constant in the objective."""
    model = Mip()
    items = [(6, 5), (5, 4), (4, 3), (3, 2)]
    take = [model.binary() for _ in items]
    model.add(Lin.total(x.scaled(w) for x, (_, w) in zip(take, items, strict=True)), upper=10)
    model.minimize(Lin.total((x.scaled(-v) for x, (v, _) in zip(take, items, strict=True))).add(1))
    return model, take


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_both_backends_find_the_optimum(backend):
    model, take = _knapsack()
    result = model.solve(time_limit=10.0, backend=backend)
    # 5 + 3 + 2 fills 10 with 6 + 4 + 3 = 13; 5 + 4 holds 11; 4 + 3 + 2 holds 12
    assert result.backend == backend and result.status == "optimal"
    assert result.objective == pytest.approx(1 - 13)
    assert [round(result.value(x)) for x in take] == [1, 0, 1, 1]


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_an_infeasible_model_has_no_solution(backend):
    model = Mip()
    x = model.binary()
    model.add(x, lower=2.0)
    result = model.solve(time_limit=10.0, backend=backend)
    assert not result.has_solution and result.infeasible and result.status == "infeasible"


def test_an_expression_moves_its_constant_to_the_row_bounds():
    model = Mip()
    x = model.variable(0.0, 10.0)
    model.equal(x.scaled(2.0).add(3.0), 7.0)  # 2x + 3 = 7
    model.minimize(x)
    result = model.solve(time_limit=10.0)
    assert result.value(x) == pytest.approx(2.0)
    assert model.rows == [(4.0, 4.0, {0: 2.0})]


def _one_of_each(costs: list[list[float]]) -> tuple[Mip, list[list[Lin]]]:
    """One choice per row, each at its cost: a relaxation that is integral."""
    model = Mip()
    picks = [[model.binary() for _ in row] for row in costs]
    for row in picks:
        model.equal(Lin.total(row), 1.0)
    terms = (
        x.scaled(c)
        for row, cs in zip(picks, costs, strict=True)
        for x, c in zip(row, cs, strict=True)
    )
    model.minimize(Lin.total(terms))
    return model, picks


def test_an_integral_relaxation_settles_the_mip():
    model, picks = _one_of_each([[3.0, 1.0, 2.0], [0.5, 4.0], [2.0, 2.5, 7.0]])
    rounded = solve_rounded(model, time_limit=10.0)
    assert rounded is not None and rounded.status == "optimal" and rounded.gap == 0.0
    assert rounded.objective == pytest.approx(model.solve(time_limit=10.0).objective)
    assert [[round(rounded.value(x)) for x in row] for row in picks] == [
        [0, 1, 0],
        [1, 0],
        [1, 0, 0],
    ]


def _knapsack_among_many() -> Mip:
    """The knapsack with 100 binaries besides that cost something (0 at the optimum): its
    relaxation takes a fifth of item (6, 5), 1 column of 104, and bounds the value by
    13.2; fixing the rest leaves that item out, 12, where the optimum is 13."""
    model, _ = _knapsack()
    spare = [model.binary() for _ in range(100)]
    model.minimize(model.objective.add(Lin.total(spare)))
    return model


def test_a_rounding_further_from_the_bound_than_the_gap_is_a_plan_not_proved_optimal():
    model = _knapsack_among_many()
    found = solve_rounded(model, time_limit=10.0)
    assert found is not None and found.has_solution and found.status != "optimal"
    assert found.objective == pytest.approx(1 - 12)
    assert found.gap == pytest.approx((13.2 - 12) / 11) and found.gap > ROUNDED_GAP


def test_a_relaxation_with_no_solution_proves_the_mip_has_none():
    model = Mip()
    x, y = model.binary(), model.binary()
    model.add(Lin.total([x, y]), lower=3.0)
    model.minimize(Lin.total([x, y]))
    rounded = solve_rounded(model, time_limit=10.0)
    assert rounded is not None and rounded.infeasible and not rounded.has_solution


def test_a_relaxation_left_fractional_on_many_columns_is_left_to_the_mip():
    model, _ = _knapsack()  # 1 column of 4 fractional: over ROUNDED_MOST
    assert solve_rounded(model, time_limit=10.0) is None


def test_caps_are_rows_of_the_mip():
    model, _ = _one_of_each([[3.0, 1.0, 2.0], [0.5, 4.0]])
    model.cap(model.objective, 1.0)  # the optimum is 1.5
    assert model.solve(time_limit=10.0).infeasible
    assert model.all_rows()[-1] == (-math.inf, 1.0, model.objective.terms)


@pytest.fixture(params=["with time for the caps as rows", "without it"])
def capped_seconds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cap test both ways: with time for the relaxation with the caps as rows (tried
    where two caps together may be refuted) and without: the same answers where each cap
    is refuted, or met, on its own."""
    if request.param == "without it":
        monkeypatch.setattr(autopar_passes.mip, "CAPPED_SECONDS", 0.0)


def test_a_cap_the_relaxation_meets_leaves_its_answer_as_it_was(capped_seconds):
    model, picks = _one_of_each([[3.0, 1.0, 2.0], [0.5, 4.0], [2.0, 2.5, 7.0]])
    model.cap(model.objective, 3.5 * (1 + 1e-7))
    rounded = solve_rounded(model, time_limit=10.0)
    assert rounded is not None and rounded.status == "optimal"
    assert rounded.objective == pytest.approx(3.5)
    assert [round(rounded.value(x)) for x in picks[0]] == [0, 1, 0]


def test_an_objective_cap_under_the_relaxation_bound_proves_no_plan(capped_seconds):
    model, _ = _one_of_each([[3.0, 1.0, 2.0], [0.5, 4.0], [2.0, 2.5, 7.0]])
    model.cap(model.objective, 3.4)
    rounded = solve_rounded(model, time_limit=10.0)
    assert rounded is not None and rounded.infeasible
    assert model.solve(time_limit=10.0).infeasible


def _work_and_penalty() -> tuple[Mip, Lin, list[Lin]]:
    """Two choices of work 1 and 2; the first costs a penalty of 10 besides (``e``, a
    column apart, as the ILP's exposed communication): the optimum takes the second."""
    model = Mip()
    picks = [model.binary(), model.binary()]
    model.equal(Lin.total(picks), 1.0)
    penalty = model.variable(0.0)
    model.at_most(picks[0], penalty)
    work = Lin.total([picks[0], picks[1].scaled(2.0)])
    model.minimize(work.scaled(1.0).add(penalty, 10.0))
    return model, work, picks


def test_a_cap_on_part_of_the_objective_is_refuted_by_its_least_over_the_relaxation(capped_seconds):
    model, work, _ = _work_and_penalty()
    model.cap(work, 0.5)  # no choice works less than 1
    rounded = solve_rounded(model, time_limit=10.0)
    assert rounded is not None and rounded.infeasible
    assert model.solve(time_limit=10.0).infeasible


def test_a_cap_the_relaxation_misses_but_could_meet_is_left_to_the_mip(capped_seconds):
    model, work, picks = _work_and_penalty()
    model.cap(work, 1.5)  # the relaxation's optimum works 2; the first choice meets it
    assert solve_rounded(model, time_limit=10.0) is None
    solved = model.solve(time_limit=10.0)
    assert solved.objective == pytest.approx(11.0) and solved.value(picks[0]) == 1.0


def test_a_cap_refuted_on_its_own_needs_neither_the_relaxation_nor_the_caps_as_rows(
    monkeypatch: pytest.MonkeyPatch,
):
    model, work, _ = _work_and_penalty()
    model.cap(work, 0.5)
    solved: list[float] = []
    run = autopar_passes.mip._highs

    def counted(lp: object, time_limit: float, options: dict[str, object]) -> object:
        solved.append(time_limit)
        return run(lp, time_limit, options)

    def unused(*args: object) -> None:
        raise AssertionError("the relaxation with the caps as rows was solved")

    monkeypatch.setattr(autopar_passes.mip, "_highs", counted)
    monkeypatch.setattr(autopar_passes.mip, "_caps_refuted", unused)
    rounded = solve_rounded(model, time_limit=10.0)
    assert rounded is not None and rounded.infeasible
    assert len(solved) == 1  # the cap's least, and nothing after it


def _one_of_three_under_two_caps() -> tuple[Mip, list[Lin]]:
    """One of three choices, the first the cheapest; caps ``a <= 0`` and ``b + c <= 0``:
    each alone is met (by ``b``, by ``a``), the two together by none."""
    model, (picks,) = _one_of_each([[0.5, 1.0, 1.0]])
    model.cap(picks[0], 0.0)
    model.cap(Lin.total(picks[1:]), 0.0)
    return model, picks


def test_two_caps_met_each_alone_but_not_together_are_refuted_as_rows():
    model, _ = _one_of_three_under_two_caps()
    rounded = solve_rounded(model, time_limit=10.0)
    assert rounded is not None and rounded.infeasible
    assert model.solve(time_limit=10.0).infeasible


def test_two_caps_the_rows_have_no_time_for_are_left_to_the_mip(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(autopar_passes.mip, "CAPPED_SECONDS", 0.0)
    model, _ = _one_of_three_under_two_caps()
    assert solve_rounded(model, time_limit=10.0) is None
    assert model.solve(time_limit=10.0).infeasible


def _knapsack_of(items: int) -> Mip:
    """Most value in half the weight of ``items`` random items, as a minimisation."""
    rng = random.Random(items)
    model = Mip()
    take = [model.binary() for _ in range(items)]
    weights = [rng.randint(20, 60) for _ in range(items)]
    values = [w + rng.randint(-5, 5) for w in weights]
    model.add(
        Lin.total(x.scaled(w) for x, w in zip(take, weights, strict=True)), upper=sum(weights) // 2
    )
    model.minimize(Lin.total(x.scaled(-v) for x, v in zip(take, values, strict=True)))
    return model


class _Checkpoints:
    """An interrupt callback that counts the checkpoints it sees and stops nothing."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, kind: int, message: str, out: Any, into: Any, data: Any) -> None:
        self.seen += 1


def test_a_search_beside_a_proof_answers_as_the_search_alone_where_there_is_a_plan():
    model = _knapsack_of(20)
    alone = model.solve(time_limit=10.0)
    assert alone.status == "optimal" and alone.objective is not None
    model.cap(model.objective, alone.objective + 0.5)
    found = solve_or_refute(model, 10.0, {}, _Checkpoints())
    assert found.status == "optimal" and found.objective == pytest.approx(alone.objective)
    assert found.values == model.solve(time_limit=10.0).values


def test_a_proof_beside_the_search_stops_it_where_the_mip_has_no_plan(monkeypatch):
    model = _knapsack_of(20)
    best = model.solve(time_limit=10.0).objective
    assert best is not None
    model.cap(model.objective, best - 0.5)
    options: list[dict[str, Any]] = []
    highs = autopar_passes.mip._highs

    def spy(lp: Any, time_limit: float, given: dict[str, Any]) -> Any:
        options.append(given)
        return highs(lp, time_limit, given)

    monkeypatch.setattr(autopar_passes.mip, "_highs", spy)

    def wait_for_the_proof(kind: int, message: str, out: Any, into: Any, data: Any) -> None:
        """The search's first checkpoint waits until the proof beside it has ended."""
        for thread in threading.enumerate():
            if thread.name == REFUTER:
                thread.join()

    refuted = solve_or_refute(model, 10.0, {}, wait_for_the_proof)
    assert options == [{}, REFUTE]
    assert refuted.infeasible and not refuted.has_solution and refuted.status == REFUTED


def test_a_search_that_proves_no_plan_itself_says_so():
    model = _knapsack_of(20)
    model.cap(model.objective, -1e6)  # below even the relaxation's bound
    found = solve_or_refute(model, 10.0, {}, _Checkpoints())
    assert found.infeasible and not found.has_solution


@pytest.mark.parametrize("beside", ["alone", "beside a proof"])
def test_ctrl_c_during_a_solve_stops_it_and_raises_keyboard_interrupt(beside: str):
    """Python raises KeyboardInterrupt at the next Python code the main thread runs: during
    a solve, inside the interrupt callback, where HiGHS swallowed it and the solve ended
    "not solved" as if it had found nothing."""
    model = _knapsack_of(40)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as the CLI runs
    checks = 0

    def ctrl_c_at_the_first(kind: int, message: str, out: Any, into: Any, data: Any) -> None:
        nonlocal checks
        checks += 1
        if checks == 1:
            os.kill(os.getpid(), signal.SIGINT)

    try:
        with pytest.raises(KeyboardInterrupt):
            if beside == "alone":
                model.solve(10.0, "highs", {"presolve": "off"}, ctrl_c_at_the_first)
            else:
                solve_or_refute(model, 10.0, {"presolve": "off"}, ctrl_c_at_the_first)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, before)
    assert checks == 1  # stopped at the checkpoint after Ctrl-C
