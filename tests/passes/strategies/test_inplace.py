"""In-place ops: every strategy brute-forced against the op on one device (the validator
hands each device its own copy to write into); the result keeps the written tensor's
layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar_passes.strategies.inplace import RULES, mutates_first_input
from autopar_passes.strategies.validate import check_rule, describe_failures

aten = torch.ops.aten
MESHES = [(2,), (2, 2)]


def r(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


CASES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "add_": (aten.add_.Tensor, (r(4, 8), r(4, 8, seed=1))),
    "add_-broadcast": (aten.add_.Tensor, (r(4, 8), r(8, seed=1))),
    "add_-scalar": (aten.add_.Scalar, (r(4, 8), 1.5)),
    "mul_": (aten.mul_.Tensor, (r(4, 8), r(4, 8, seed=1))),
    "div_": (aten.div_.Scalar, (r(4, 8), 3.0)),
    "copy_": (aten.copy_.default, (r(4, 8), r(4, 8, seed=1))),
    "copy_-broadcast": (aten.copy_.default, (r(4, 8), r(8, seed=1))),
    "masked_fill_": (aten.masked_fill_.Scalar, (r(4, 8), r(4, 8, seed=1) > 0, 0.0)),
    "clamp_": (aten.clamp_.default, (r(4, 8), -0.5, 0.5)),
    "fill_": (aten.fill_.Tensor, (r(4, 8), torch.tensor(2.5, dtype=torch.float64))),
    "fill_-scalar": (aten.fill_.Scalar, (r(4, 8), -1.0)),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_matches_the_op_on_one_device(case: str, mesh: tuple[int, ...]) -> None:
    target, args = CASES[case]
    strategies, failures = check_rule(RULES[target], target, args, mesh_shape=mesh)
    assert len(strategies) > 1
    assert all(s.outputs[0] == s.inputs[0] for s in strategies)
    assert not failures, describe_failures(failures)


def test_the_written_tensor_keeps_its_layout_and_copy_takes_a_partial_source() -> None:
    target, args = CASES["copy_"]
    names = {s.name for s in check_rule(RULES[target], target, args, mesh_shape=(2,))[0]}
    assert names == {"R,R->R", "S(0),S(0)->S(0)", "S(1),S(1)->S(1)", "P,P->P"}


def test_in_place_ops_are_told_from_their_out_of_place_ones() -> None:
    assert mutates_first_input(aten.add_.Tensor) and mutates_first_input(aten.copy_.default)
    assert not mutates_first_input(aten.add.Tensor)
    assert not mutates_first_input(aten.view.default)  # an alias, not a write


WRITES = {  # the functional forms of writes through views (``autopar_passes.functionalize``)
    "slice_scatter": (aten.slice_scatter.default, (r(4, 8), r(4, 4, seed=1), 1, 0, 4, 1)),
    "slice_scatter-rows": (aten.slice_scatter.default, (r(4, 8), r(2, 8, seed=1), 0, 1, 3, 1)),
    "select_scatter": (aten.select_scatter.default, (r(4, 8), r(4, seed=1), 1, 2)),
    "select_scatter-3d": (aten.select_scatter.default, (r(4, 8, 2), r(8, 2, seed=1), 0, 1)),
    "fill": (aten.fill.Scalar, (r(4, 8), 2.0)),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", list(WRITES))
def test_functional_writes_match_the_op_on_one_device(case: str, mesh: tuple[int, ...]) -> None:
    target, args = WRITES[case]
    strategies, failures = check_rule(RULES[target], target, args, mesh_shape=mesh)
    assert len(strategies) > 2
    assert not failures, describe_failures(failures)
