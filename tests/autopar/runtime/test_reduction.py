"""Hierarchical all-reduce at run time (``runtime.reduction``): a gradient bucket summed over
several mesh axes by reduce-scatter over the fast axes, all-reduce over the slowest and
all-gather back equals the sum of one all-reduce per axis, on 2 x 2 and 2 x 2 x 2 gloo
meshes, and each call moves the bytes the plan's ledger charges it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.testing.ranks import run_ranks
from autopar_cost_model.reduction import step_bytes
from tests.autopar.runtime.reduction_cases import NUMEL, sum_in_each_form, train_in_each_form

pytestmark = pytest.mark.multirank

SHAPES = [(2, 2), (2, 2, 2)]


@pytest.fixture(scope="module", params=SHAPES, ids=["2x2", "2x2x2"])
def sums(request: pytest.FixtureRequest) -> tuple[tuple[int, ...], list[dict[str, Any]]]:
    shape = request.param
    return shape, run_ranks(sum_in_each_form, torch.Size(shape).numel(), (shape,))


def test_both_forms_give_the_sum_on_every_rank_alike(sums) -> None:
    _, ranks = sums
    for form in ("per_axis", "hierarchical"):
        first = ranks[0][form]["sum"]
        assert first.shape == (NUMEL,)
        torch.testing.assert_close(first.double(), ranks[0]["exact"], rtol=1e-6, atol=1e-5)
        for rank in ranks[1:]:
            assert torch.equal(rank[form]["sum"], first), form


def test_the_hierarchical_form_scatters_over_the_fast_axes_and_gathers_back(sums) -> None:
    _shape, ranks = sums
    order = ranks[0]["order"][::-1]  # fastest first: the last axis
    kinds = [(c[0], c[1][0]) for c in ranks[0]["hierarchical"]["calls"]]
    down = [("reduce_scatter", a) for a in order[:-1]]
    up = [("all_gather", a) for a in reversed(order[:-1])]
    assert kinds == [*down, ("all_reduce", order[-1]), *up]


@pytest.mark.parametrize("form", ["per_axis", "hierarchical"])
def test_each_call_moves_the_bytes_the_ledger_charges(sums, form) -> None:
    shape, ranks = sums
    names = ranks[0]["order"]
    sizes = list(zip(names, shape, strict=True))
    steps = ranks[0][form]["steps"]
    planned = [(s.kind, (s.axis,), "float32", n) for s, n in step_bytes(steps, NUMEL, 4, sizes)]
    for rank in ranks:
        assert rank[form]["calls"] == planned


def test_the_slow_axis_carries_the_bucket_over_the_fast_axes_devices(sums) -> None:
    """On 2 x 2 a half of the bucket crosses the slowest axis, on 2 x 2 x 2 a quarter."""
    shape, ranks = sums
    slowest = ranks[0]["order"][0]
    calls = ranks[0]["hierarchical"]["calls"]
    on_slowest = [c for c in calls if c[1] == (slowest,)]
    whole = calls[0][3]  # the first reduce-scatter's input: the padded bucket
    assert [c[0] for c in on_slowest] == ["all_reduce"]
    assert on_slowest[0][3] == whole / (torch.Size(shape).numel() // shape[0])


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_ranks(train_in_each_form, 8, ((2, 2, 2),))


def test_a_compiled_model_trains_alike_in_both_forms_on_2x2x2(trained) -> None:
    for rank in trained:
        flat, tiered = rank["per_axis"], rank["hierarchical"]
        assert tiered["form"] == "hierarchical"
        for name, grad in flat["grads"].items():
            torch.testing.assert_close(tiered["grads"][name], grad, rtol=1e-5, atol=1e-7)
        assert tiered["losses"] == pytest.approx(flat["losses"], abs=1e-6)


@pytest.mark.parametrize("form", ["per_axis", "hierarchical"])
def test_a_compiled_step_issues_what_its_plan_charges_on_2x2x2(trained, form) -> None:
    for rank in trained:
        assert rank[form]["observed"] == rank[form]["planned"]
