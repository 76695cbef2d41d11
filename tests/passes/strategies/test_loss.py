"""Loss family: every strategy brute-forced against the unsharded op on simulated meshes,
with targets equal to ``ignore_index``; the class dim is never sharded, the class weight
always replicated, and a mean over class-index targets never sharded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar_passes.strategies import loss
from autopar_passes.strategies.table import rules
from autopar_passes.strategies.types import Local, Strategy, is_partial
from autopar_passes.strategies.validate import check_rule, describe_failures
from autopar_plans.placement import Layout, Replicate, Shard

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (2, 3)]
N, C, D = 12, 6, 4  # batch splits by 2, 3 and 4; the extra dim by 2 and 4
IGNORE = -100
NONE, MEAN, SUM = 0, 1, 2


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, dtype=torch.float64, generator=generator)


def _targets(*shape: int, ignore: int = IGNORE) -> torch.Tensor:
    """Class indices with every fourth one ``ignore`` (so each device's share differs)."""
    generator = torch.Generator().manual_seed(3)
    target = torch.randint(0, C, shape, generator=generator)
    flat = target.view(-1)
    flat[::4] = ignore
    flat[1] = ignore
    return target


def _weight() -> torch.Tensor:
    return _randn(C, seed=4).abs() + 0.5


def _probabilities(*shape: int) -> torch.Tensor:
    return torch.softmax(_randn(*shape, seed=5), dim=1)


def _check(op: Any, args: tuple[Any, ...], mesh: tuple[int, ...]) -> list[Strategy]:
    strategies, failures = check_rule(loss.RULES[op], op, args, {}, mesh)
    assert not failures, describe_failures(failures)
    return strategies


def _class_dim_sharded(strategy: Strategy, ndim: int) -> bool:
    class_dim = 1 if ndim > 1 else 0
    return any(isinstance(p, Shard) and p.dim == class_dim for p in strategy.inputs[0])


def test_table_holds_the_family() -> None:
    for op in [
        aten.cross_entropy_loss.default,
        aten.nll_loss.default,
        aten.nll_loss_nd.default,
        aten.nll_loss_forward.default,
        aten.nll_loss2d_forward.default,
        aten.mse_loss.default,
        aten.l1_loss.default,
        aten.smooth_l1_loss.default,
        aten.huber_loss.default,
    ]:
        assert rules()[op] is loss.RULES[op]


CROSS_ENTROPY = [
    ("2d", lambda: (_randn(N, C), _targets(N))),
    ("3d", lambda: (_randn(N, C, D), _targets(N, D))),
    ("probabilities", lambda: (_randn(N, C, D), _probabilities(N, C, D))),
    ("1d", lambda: (_randn(C), torch.tensor(2))),
]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("reduction", [NONE, MEAN, SUM])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(("kind", "make"), CROSS_ENTROPY, ids=[c[0] for c in CROSS_ENTROPY])
def test_cross_entropy_brute_force(
    kind: str, make: Any, smoothing: float, weighted: bool, reduction: int, mesh: tuple[int, ...]
) -> None:
    x, target = make()
    weight = _weight() if weighted else None
    strategies = _check(
        aten.cross_entropy_loss.default, (x, target, weight, reduction, IGNORE, smoothing), mesh
    )
    for strategy in strategies:
        assert not _class_dim_sharded(strategy, x.dim())
        if weighted:
            assert strategy.inputs[2].is_replicated
    sharded = [s for s in strategies if not s.inputs[0].is_replicated]
    if kind == "1d" or (reduction == MEAN and kind != "probabilities"):
        assert not sharded  # nothing but the class dim, or a data-dependent count
        return
    batch = [s for s in sharded if s.inputs[0][0] == Shard(0) and s.inputs[1][0] == Shard(0)]
    assert batch, "the batch-sharded strategy is missing"
    for strategy in batch:
        if reduction == NONE:
            assert strategy.outputs[0][0] == Shard(0)
        else:
            assert is_partial(strategy.outputs[0])
    if reduction == MEAN:  # probability targets: a static count, scaled locally
        first_axis_only = Layout(Shard(0), *[Replicate()] * (len(mesh) - 1))
        (strategy,) = [s for s in batch if s.inputs[0] == first_axis_only]
        assert strategy.local == Local("scale", (1 / mesh[0],))


def test_cross_entropy_strategies_on_a_2x2_mesh() -> None:
    x, target = _randn(N, C, D), _targets(N, D)
    names = {
        s.name
        for s in _check(
            aten.cross_entropy_loss.default, (x, target, None, SUM, IGNORE, 0.1), (2, 2)
        )
    }
    assert {"S(0)S(0),S(0)S(0)->PP", "S(0)S(2),S(0)S(1)->PP", "RS(0),RS(0)->RP"} <= names
    assert len(names) == 9
    names = {
        s.name
        for s in _check(
            aten.cross_entropy_loss.default, (x, target, None, NONE, IGNORE, 0.1), (2, 2)
        )
    }
    assert "S(0)S(2),S(0)S(1)->S(0)S(1)" in names


@pytest.mark.parametrize("mesh", [(2,), (2, 2), (2, 3)])
@pytest.mark.parametrize("reduction", [NONE, MEAN, SUM])
@pytest.mark.parametrize("ignore", [IGNORE, 2])
def test_nll_loss_brute_force(reduction: int, ignore: int, mesh: tuple[int, ...]) -> None:
    logp = torch.log_softmax(_randn(N, C, D), dim=1)
    target = _targets(N, D, ignore=ignore)
    cases = [
        (aten.nll_loss.default, (logp[..., 0], target[:, 0], _weight(), reduction, ignore)),
        (aten.nll_loss_nd.default, (logp, target, _weight(), reduction, ignore)),
        (aten.nll_loss_forward.default, (logp[..., 0], target[:, 0], None, reduction, ignore)),
        (
            aten.nll_loss2d_forward.default,
            (
                logp.unsqueeze(-1).expand(N, C, D, 2).contiguous(),
                target.unsqueeze(-1).expand(N, D, 2).contiguous(),
                _weight(),
                reduction,
                ignore,
            ),
        ),
    ]
    for op, args in cases:
        strategies = _check(op, args, mesh)
        assert not any(_class_dim_sharded(s, args[0].dim()) for s in strategies)
        sharded = [s for s in strategies if not s.inputs[0].is_replicated]
        assert bool(sharded) == (reduction != MEAN)
        if reduction == SUM:  # the loss and total_weight are both sums over the batch
            assert all(is_partial(out) for s in sharded for out in s.outputs)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("reduction", [NONE, MEAN, SUM])
@pytest.mark.parametrize(
    "op",
    [
        aten.mse_loss.default,
        aten.l1_loss.default,
        aten.smooth_l1_loss.default,
        aten.huber_loss.default,
    ],
)
def test_elementwise_loss_brute_force(op: Any, reduction: int, mesh: tuple[int, ...]) -> None:
    x, y = _randn(N, D, 8, seed=1), _randn(N, D, 8, seed=2)
    strategies = _check(op, (x, y, reduction), mesh)
    by_name = {s.name: s for s in strategies}
    key = ",".join(["S(0)" + "R" * (len(mesh) - 1)] * 2) + "->"
    if reduction == NONE:
        assert key + "S(0)" + "R" * (len(mesh) - 1) in by_name
    else:
        strategy = by_name[key + "P" + "R" * (len(mesh) - 1)]
        expected = Local("scale", (1 / mesh[0],)) if reduction == MEAN else Local()
        assert strategy.local == expected
    assert not any(is_partial(s.inputs[0]) or is_partial(s.inputs[1]) for s in strategies)


def test_mse_mean_over_every_dim_on_two_axes() -> None:
    x, y = _randn(N, D, 8, seed=1), _randn(N, D, 8, seed=2)
    by_name = {s.name: s for s in _check(aten.mse_loss.default, (x, y, MEAN), (2, 2))}
    assert by_name["S(1)S(2),S(1)S(2)->PP"].local == Local("scale", (0.25,))


def test_loss_with_broadcast_target_is_left_replicated() -> None:
    x, y = _randn(N, D, seed=1), _randn(1, D, seed=2)
    strategies, failures = check_rule(
        loss.RULES[aten.l1_loss.default], aten.l1_loss.default, (x, y, SUM), {}, (2,)
    )
    assert not failures and not strategies
