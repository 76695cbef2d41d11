"""The MIP the planner's ILP is written into: HiGHS and the CBC fallback solve the same
model to the same answer; an infeasible model says so."""

from __future__ import annotations

import doctest

import pytest

import autopar_passes.mip
from autopar_passes.mip import Lin, Mip


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
