"""Matmul family: every strategy the einsum generator offers is right, by brute force."""

from __future__ import annotations

import pytest
import torch

from autopar_passes.strategies.matmul import RULES
from autopar_passes.strategies.validate import check_rule, describe_failures

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (2, 3)]


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


CASES = {
    "linear": (aten.linear.default, (r(4, 6, 8), r(12, 8), r(12))),
    "linear-no-bias": (aten.linear.default, (r(4, 8), r(12, 8))),
    "mm": (aten.mm.default, (r(4, 6), r(6, 12))),
    "addmm": (aten.addmm.default, (r(12), r(4, 6), r(6, 12))),
    "addmm-2d-bias": (aten.addmm.default, (r(4, 12), r(4, 6), r(6, 12))),
    "bmm": (aten.bmm.default, (r(4, 6, 8), r(4, 8, 12))),
    "baddbmm": (aten.baddbmm.default, (r(4, 6, 12), r(4, 6, 8), r(4, 8, 12))),
    "matmul-batched": (aten.matmul.default, (r(2, 4, 6, 8), r(4, 8, 6))),
    "matmul-broadcast": (aten.matmul.default, (r(4, 6, 8), r(8, 12))),
    "matmul-vector": (aten.matmul.default, (r(4, 8), r(8))),
    "einsum": (aten.einsum.default, ("bij,bjk->bik", [r(4, 6, 8), r(4, 8, 12)])),
    "outer": (aten.outer.default, (r(6), r(12))),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_matches_the_unsharded_op(case: str, mesh: tuple[int, ...]) -> None:
    target, args = CASES[case]
    strategies, failures = check_rule(RULES[target], target, args, mesh_shape=mesh)
    assert strategies
    assert not failures, describe_failures(failures)


def test_linear_offers_megatron_column_and_row_splits() -> None:
    target, args = CASES["linear"]
    names = {s.name for s in check_rule(RULES[target], target, args, mesh_shape=(2,))[0]}
    assert "R,S(0),S(0)->S(2)" in names  # column: weight rows (out features) split
    assert "S(2),S(1),P->P" in names  # row: contracted dim split, bias added once
    assert "S(0),R,R->S(0)" in names  # data parallel
    assert "S(2),S(1),R->P" not in names  # a replicated bias would be added twice


def test_dims_that_do_not_divide_are_not_offered() -> None:
    target, args = CASES["mm"]  # (4, 6) @ (6, 12): k = 6 does not split 4 ways
    strategies, _ = check_rule(RULES[target], target, args, mesh_shape=(4,))
    names = [s.name for s in strategies]
    assert names == ["R,R->R", "S(0),R->S(0)", "R,S(1)->S(1)", "P,R->P", "R,P->P"]
