"""Scatter family: every strategy checked against the unsharded op on simulated meshes, and
the ones sparse MoE routing needs present."""

from typing import Any

import pytest
import torch

from autopar_passes.strategies import scatter
from autopar_passes.strategies.table import rules
from autopar_passes.strategies.types import Strategy
from autopar_passes.strategies.validate import check_rule, describe_failures

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2)]
_GEN = torch.Generator().manual_seed(0)


def f(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=_GEN)


def perm(n: int, k: int) -> torch.Tensor:
    """``k`` distinct positions out of ``n`` (scatter's result is defined only then)."""
    return torch.randperm(n, generator=_GEN)[:k]


def topk_rows(n: int, e: int, k: int) -> torch.Tensor:
    """(n, k) distinct columns per row, as topk's indices are."""
    return torch.stack([perm(e, k) for _ in range(n)])


CASES: list[tuple[Any, tuple[Any, ...]]] = [
    # Mixtral: y.index_add(0, top_x, expert_out): rows of tokens
    (aten.index_add.default, (f(8, 4), 0, perm(8, 4), f(4, 4))),
    (aten.index_add.default, (f(8, 4), 0, torch.tensor([1, 1, 5, 0]), f(4, 4))),  # repeats
    (aten.index_add.default, (f(4, 8), -1, perm(8, 4), f(4, 4))),
    (aten.index_add.default, (f(2, 8, 4), 1, perm(8, 4), f(2, 4, 4))),
    # gates.scatter(1, selected, weights): (tokens, experts) from top-k (tokens, k)
    (aten.scatter.src, (f(8, 4), 1, topk_rows(8, 4, 2), f(8, 2))),
    (aten.scatter.value, (f(8, 4), 1, topk_rows(8, 4, 2), 1.0)),
    (aten.scatter_add.default, (f(8, 4), 1, topk_rows(8, 4, 2), f(8, 2))),
    (aten.scatter.src, (f(4, 8), 0, topk_rows(8, 4, 4).T.contiguous(), f(4, 8))),
]


def check(target: Any, args: tuple[Any, ...], mesh: tuple[int, ...]) -> list[Strategy]:
    strategies, failures = check_rule(scatter.RULES[target], target, args, None, mesh)
    assert not failures, describe_failures(failures)
    return strategies


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize(("target", "args"), CASES, ids=lambda v: str(v)[:30])
def test_every_strategy_matches_the_unsharded_op(target, args, mesh) -> None:
    strategies = check(target, args, mesh)
    assert len(strategies) > 1  # more than replicate-all


def test_the_rules_are_in_the_table() -> None:
    for op in scatter.RULES:
        assert rules()[op] is scatter.RULES[op]


def test_index_add_offers_what_a_sparse_moe_needs() -> None:
    (target, args) = CASES[0]
    names = {s.name for s in check(target, args, (2,))}
    # rows sharded on the feature dim; partial sums (tensor-parallel experts); each device
    # adding its own slice of rows into a partial result
    assert {"S(1),R,S(1)->S(1)", "P,R,P->P", "P,S(0),S(0)->P"} <= names
    # the indexed dim of self never sharded: the index holds global row numbers
    assert not any(s.startswith("S(0),") for s in names)


def test_scatter_shards_tokens_and_keeps_the_scattered_dim_whole() -> None:
    (target, args) = CASES[4]
    names = {s.name for s in check(target, args, (2,))}
    assert "S(0),S(0),S(0)->S(0)" in names
    assert not any("S(1)" in s for s in names)
    value = {s.name for s in check(*CASES[5], (2,))}
    assert "P,R->P" not in value  # a written constant is not linear in self
