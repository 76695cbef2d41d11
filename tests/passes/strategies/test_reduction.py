"""Reduction family: every strategy brute-forced against the unsharded op on simulated
meshes, and the strategies that must (and must not) be offered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from autopar_passes.strategies import reduction
from autopar_passes.strategies.table import rules
from autopar_passes.strategies.types import Local, Strategy, is_partial
from autopar_passes.strategies.validate import check_rule, describe_failures
from autopar_plans.placement import Shard

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (2, 3)]
SHAPE = (4, 8, 12)  # every dim splits by 2 and 4, the last by 3 too


def _x() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, dtype=torch.float64, generator=generator)


def _mask() -> torch.Tensor:
    return _x() > 0.5


def _ints() -> torch.Tensor:
    return (_x() * 10).to(torch.int64)


# (op, args builder, kwargs, reduced dims of the input)
CASES: list[tuple[Any, Callable[[], tuple[Any, ...]], dict[str, Any], set[int]]] = [
    (aten.sum.default, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.sum.dim_IntList, lambda: (_x(), [1]), {}, {1}),
    (aten.sum.dim_IntList, lambda: (_x(), [0, -1], True), {}, {0, 2}),
    (aten.sum.dim_IntList, lambda: (_x(), None), {}, {0, 1, 2}),
    (aten.sum.dim_IntList, lambda: (_x(), []), {}, {0, 1, 2}),
    (aten.sum.dim_IntList, lambda: (_mask(), [1]), {}, {1}),
    (aten.sum.dim_IntList, lambda: (_ints(), [2]), {"dtype": torch.float64}, {2}),
    (aten.mean.default, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.mean.dim, lambda: (_x(), [1]), {}, {1}),
    (aten.mean.dim, lambda: (_x(), [-1], True), {}, {2}),
    (aten.mean.dim, lambda: (_x(), [0, 2]), {}, {0, 2}),
    (aten.mean.dim, lambda: (_x(), None, True), {}, {0, 1, 2}),
    (aten.mean.dim, lambda: (_x(), []), {}, {0, 1, 2}),
    (aten.amax.default, lambda: (_x(), [1]), {}, {1}),
    (aten.amax.default, lambda: (_x(), [-1], True), {}, {2}),
    (aten.amin.default, lambda: (_x(), []), {}, {0, 1, 2}),
    (aten.amin.default, lambda: (_x(), [0, 2]), {}, {0, 2}),
    (aten.max.dim, lambda: (_x(), 1), {}, {1}),
    (aten.max.dim, lambda: (_x(), -1, True), {}, {2}),
    (aten.min.dim, lambda: (_x(), 0), {}, {0}),
    (aten.max.default, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.min.default, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.argmax.default, lambda: (_x(), 1), {}, {1}),
    (aten.argmax.default, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.argmin.default, lambda: (_x(), -1, True), {}, {2}),
    (aten.var.correction, lambda: (_x(), [1]), {"correction": 0}, {1}),
    (aten.var.correction, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.var.dim, lambda: (_x(), [-1], True, True), {}, {2}),
    (aten.var.default, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.std.correction, lambda: (_x(), [0]), {"keepdim": True}, {0}),
    (aten.std.dim, lambda: (_x(), [1, 2]), {}, {1, 2}),
    (aten.std.default, lambda: (_x(), False), {}, {0, 1, 2}),
    (aten.var_mean.correction, lambda: (_x(), [1]), {}, {1}),
    (aten.std_mean.correction, lambda: (_x(), [-1]), {"keepdim": True}, {2}),
    (aten.logsumexp.default, lambda: (_x(), [1]), {}, {1}),
    (aten.logsumexp.default, lambda: (_x(), [0, -1], True), {}, {0, 2}),
    (aten.prod.default, lambda: (_x(),), {}, {0, 1, 2}),
    (aten.prod.dim_int, lambda: (_x(), 1), {}, {1}),
    (aten.any.default, lambda: (_mask(),), {}, {0, 1, 2}),
    (aten.any.dim, lambda: (_mask(), -1), {}, {2}),
    (aten.any.dims, lambda: (_mask(), [0, 2], True), {}, {0, 2}),
    (aten.any.dims, lambda: (_mask(), []), {}, set()),
    (aten.all.default, lambda: (_mask(),), {}, {0, 1, 2}),
    (aten.all.dim, lambda: (_mask(), 1, True), {}, {1}),
    (aten.all.dims, lambda: (_mask(), None), {}, {0, 1, 2}),
]
LINEAR = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
SOFTMAX = [aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default]


def _check(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: tuple[int, ...]
) -> list[Strategy]:
    strategies, failures = check_rule(reduction.RULES[op], op, args, kwargs, mesh)
    assert not failures, describe_failures(failures)
    return strategies


def _names(strategies: list[Strategy]) -> set[str]:
    return {s.name for s in strategies}


def _shards(strategy: Strategy, dims: set[int]) -> bool:
    """Whether the strategy's first input is sharded on any of ``dims``."""
    return any(isinstance(p, Shard) and p.dim in dims for p in strategy.inputs[0])


def test_table_holds_the_family() -> None:
    for op, *_ in CASES:
        assert rules()[op] is reduction.RULES[op]
    for op in SOFTMAX:
        assert rules()[op] is reduction.softmax_rule


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize(
    ("op", "make", "kwargs", "reduced"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_reduction_brute_force(
    op: Any,
    make: Callable[[], tuple[Any, ...]],
    kwargs: dict[str, Any],
    reduced: set[int],
    mesh: tuple[int, ...],
) -> None:
    strategies = _check(op, make(), kwargs, mesh)
    kept = set(range(len(SHAPE))) - reduced
    # every kept dim can be sharded over one axis, alone
    for dim in kept:
        assert any(_shards(s, {dim}) and not is_partial(s.inputs[0]) for s in strategies)
    if op in LINEAR:
        for dim in reduced:
            assert any(
                _shards(s, {dim}) and all(is_partial(o) for o in s.outputs) for s in strategies
            ), f"sum/mean over a sharded dim {dim} is Partial"
        if make()[0].is_floating_point():
            assert any(is_partial(s.inputs[0]) for s in strategies)
        else:
            assert not any(is_partial(s.inputs[0]) for s in strategies)
    else:
        assert not any(_shards(s, reduced) for s in strategies), "a reduced dim is sharded"
        assert not any(is_partial(layout) for s in strategies for layout in (*s.inputs, *s.outputs))


def test_kept_dim_moves_to_its_output_position() -> None:
    x = _x()
    assert "S(2)->S(1)" in _names(_check(aten.mean.dim, (x, [0]), {}, (2,)))
    assert "S(2)->S(2)" in _names(_check(aten.mean.dim, (x, [0], True), {}, (2,)))
    assert "S(2)->S(0)" in _names(_check(aten.amax.default, (x, [0, 1]), {}, (2,)))
    # max.dim: values and indices both follow
    assert "S(2)->S(1),S(1)" in _names(_check(aten.max.dim, (x, 1), {}, (2,)))


def test_mean_over_a_sharded_dim_scales_by_the_local_fraction() -> None:
    x = _x()
    by_name = {s.name: s for s in _check(aten.mean.dim, (x, [1]), {}, (2, 2))}
    assert by_name["S(1)S(1)->PP"].local == Local("scale", (0.25,))
    assert by_name["S(1)R->PR"].local == Local("scale", (0.5,))
    assert by_name["S(0)S(1)->S(0)P"].local == Local("scale", (0.5,))
    assert by_name["S(0)R->S(0)R"].local.kind == "same"
    assert by_name["PR->PR"].local.kind == "same"  # a mean of summands is a summand
    by_name = {s.name: s for s in _check(aten.mean.default, (x,), {}, (2, 3))}
    assert by_name["S(0)S(2)->PP"].local == Local("scale", (1 / 6,))


def test_sum_shards_reduced_dims_on_both_axes() -> None:
    names = _names(_check(aten.sum.dim_IntList, (_x(), [1, 2]), {}, (2, 2)))
    assert {"S(1)S(2)->PP", "S(1)S(1)->PP", "S(0)S(2)->S(0)P", "PP->PP", "S(0)P->S(0)P"} <= names


def test_divisibility_drops_uneven_splits() -> None:
    names = _names(_check(aten.sum.dim_IntList, (_x(), [1]), {}, (3,)))
    assert "S(2)->S(1)" in names  # 12 splits by 3
    assert "S(1)->P" not in names and "S(0)->S(0)" not in names  # 8 and 4 do not


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("op", SOFTMAX)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_never_shards_its_dim(op: Any, dim: int, mesh: tuple[int, ...]) -> None:
    extra = (None,) if op in (aten.softmax.int, aten.log_softmax.int) else (False,)
    strategies = _check(op, (_x(), dim, *extra), {}, mesh)
    softmax_dim = dim % len(SHAPE)
    assert not any(_shards(s, {softmax_dim}) for s in strategies)
    assert not any(is_partial(layout) for s in strategies for layout in (*s.inputs, *s.outputs))
    for other in set(range(len(SHAPE))) - {softmax_dim}:
        assert any(_shards(s, {other}) for s in strategies)


def test_scalar_input_is_replicated() -> None:
    x = torch.tensor(2.5, dtype=torch.float64)
    for op, args in [
        (aten.sum.default, (x,)),
        (aten.mean.dim, (x, [-1])),
        (aten.max.dim, (x, 0)),
        (aten.softmax.int, (x, 0)),
    ]:
        assert _names(_check(op, args, {}, (2,))) <= {"R->R", "R->R,R", "P->P"}
