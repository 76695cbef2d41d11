"""Norm family: every strategy brute-forced against the unsharded op on simulated meshes;
the normalized dims are never sharded and the affine parameters always replicated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from autopar_passes.strategies import norm
from autopar_passes.strategies.table import rules
from autopar_passes.strategies.types import Strategy, is_partial
from autopar_passes.strategies.validate import check_rule, describe_failures
from autopar_plans.placement import Shard

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (2, 3)]
SHAPE = (4, 12, 8)  # every dim splits by 2 and 4, dim 1 by 3 too


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, dtype=torch.float64, generator=generator)


def _x() -> torch.Tensor:
    return _randn(*SHAPE)


# (op, args builder, kwargs, number of leading (shardable) dims)
CASES: list[tuple[Any, Callable[[], tuple[Any, ...]], dict[str, Any], int]] = [
    (
        aten.layer_norm.default,
        lambda: (_x(), [8], _randn(8, seed=1), _randn(8, seed=2), 1e-5, False),
        {},
        2,
    ),
    (aten.layer_norm.default, lambda: (_x(), [12, 8]), {"weight": _randn(12, 8, seed=1)}, 1),
    (aten.layer_norm.default, lambda: (_x(), [8], None, _randn(8, seed=2)), {}, 2),
    (
        aten.native_layer_norm.default,
        lambda: (_x(), [8], _randn(8, seed=1), _randn(8, seed=2), 1e-5),
        {},
        2,
    ),
    (aten.native_layer_norm.default, lambda: (_x(), [12, 8], None, None, 1e-5), {}, 1),
    (aten.rms_norm.default, lambda: (_x(), [8], _randn(8, seed=1), 1e-6), {}, 2),
    (aten.rms_norm.default, lambda: (_x(), [12, 8]), {}, 1),
    (aten._fused_rms_norm.default, lambda: (_x(), [8], _randn(8, seed=1), None), {}, 2),
    (aten.group_norm.default, lambda: (_x(), 4, _randn(12, seed=1), _randn(12, seed=2)), {}, 1),
    (aten.group_norm.default, lambda: (_randn(4, 8), 2), {}, 1),
]


def _check(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: tuple[int, ...]
) -> list[Strategy]:
    strategies, failures = check_rule(norm.RULES[op], op, args, kwargs, mesh)
    assert not failures, describe_failures(failures)
    return strategies


def _sharded_dims(strategy: Strategy) -> set[int]:
    return {p.dim for p in strategy.inputs[0] if isinstance(p, Shard)}


def test_table_holds_the_family() -> None:
    for op, *_ in CASES:
        assert rules()[op] is norm.RULES[op]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize(
    ("op", "make", "kwargs", "leading"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_norm_brute_force(
    op: Any,
    make: Callable[[], tuple[Any, ...]],
    kwargs: dict[str, Any],
    leading: int,
    mesh: tuple[int, ...],
) -> None:
    args = make()
    strategies = _check(op, args, kwargs, mesh)
    ndim = args[0].dim()
    for strategy in strategies:
        assert _sharded_dims(strategy) <= set(range(leading)), "a normalized dim is sharded"
        assert all(layout.is_replicated for layout in strategy.inputs[1:]), (
            "weight and bias must be replicated"
        )
        assert not any(is_partial(layout) for layout in (*strategy.inputs, *strategy.outputs))
    for dim in range(min(leading, ndim)):
        if all(args[0].shape[dim] % size == 0 for size in mesh):
            assert any(_sharded_dims(s) == {dim} for s in strategies), f"dim {dim} not sharded"


def test_layer_norm_shards_batch_and_sequence_with_replicated_affine() -> None:
    x, w, b = _x(), _randn(8, seed=1), _randn(8, seed=2)
    names = {s.name for s in _check(aten.layer_norm.default, (x, [8], w, b), {}, (2, 2))}
    assert "S(0)S(1),RR,RR->S(0)S(1)" in names  # data parallel x sequence parallel
    assert "S(1)S(1),RR,RR->S(1)S(1)" in names
    assert not any("S(2)" in name for name in names)
    assert len(names) == 9  # {R, S(0), S(1)} per axis


def test_native_layer_norm_statistics_follow_the_input() -> None:
    x = _x()
    names = {
        s.name for s in _check(aten.native_layer_norm.default, (x, [8], None, None, 1e-5), {}, (2,))
    }
    assert names == {"R->R,R,R", "S(0)->S(0),S(0),S(0)", "S(1)->S(1),S(1),S(1)"}


@pytest.mark.parametrize("op", [aten.layer_norm.default, aten.rms_norm.default])
def test_normalizing_every_dim_leaves_nothing_to_shard(op: Any) -> None:
    x = _x()
    names = {s.name for s in _check(op, (x, [4, 12, 8]), {}, (2,))}
    assert names == {"R->R"}  # everything is normalized: nothing to shard


def _bn_args(training: bool) -> tuple[Any, ...]:
    channels = 12
    return (
        _randn(*SHAPE, 4, seed=3),
        _randn(channels, seed=1),
        _randn(channels, seed=2),
        _randn(channels, seed=4),
        _randn(channels, seed=5).abs() + 0.5,
        training,
        0.1,
        1e-5,
        False,
    )


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_batch_norm_in_eval_mode_shards_any_dim(mesh: tuple[int, ...]) -> None:
    op = aten.batch_norm.default
    strategies, failures = check_rule(rules()[op], op, _bn_args(False), mesh_shape=mesh)
    assert not failures, describe_failures(failures)
    names = {s.name for s in strategies}
    if mesh == (2,):
        # channels with every per-channel tensor alike; the batch and space alone
        assert "S(1),S(0),S(0),S(0),S(0)->S(1)" in names
        assert {"S(0),R,R,R,R->S(0)", "S(2),R,R,R,R->S(2)"} <= names


def test_batch_norm_in_training_is_left_whole_here() -> None:
    """Its statistics span the batch: the trace writes it out as sums first (the batch norm
    equivalence on ranks is ``tests/autopar/runtime/test_vision.py``)."""
    op = aten.batch_norm.default
    strategies, _ = check_rule(rules()[op], op, _bn_args(True), mesh_shape=(2,))
    assert [s.name for s in strategies] == ["R,R,R,R,R->R"]
