"""Embedding family: every strategy brute-forced against the unsharded op, forward and the
weight's gradient, on simulated meshes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from autopar_passes import local_ops
from autopar_passes.strategies import embedding
from autopar_passes.strategies.localize import localize
from autopar_passes.strategies.table import local_kinds, rules
from autopar_passes.strategies.types import Local, OpCall, Strategy
from autopar_passes.strategies.validate import check_rule, describe_failures, op_call
from autopar_plans.placement import PARTIAL, Layout, Partial, Replicate, Shard

aten = torch.ops.aten
EMBEDDING = aten.embedding.default
MESHES = [(2,), (4,), (2, 2)]
R = Replicate()
V, D = 8, 4


def _weight(rows: int = V, cols: int = D) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, cols, dtype=torch.float64, generator=generator)


def _indices(
    shape: tuple[int, ...], rows: int = V, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Indices that hit every row (so every device of a vocabulary split), then random."""
    generator = torch.Generator().manual_seed(1)
    flat = torch.randint(0, rows, (torch.Size(shape).numel(),), generator=generator)
    flat[: min(rows, flat.numel())] = torch.arange(min(rows, flat.numel()))
    return flat.reshape(shape).to(dtype)


def _check(args: tuple[Any, ...], kwargs: dict[str, Any], mesh: tuple[int, ...]) -> list[Strategy]:
    strategies, failures = check_rule(embedding.embedding_rule, EMBEDDING, args, kwargs, mesh)
    assert not failures, describe_failures(failures)
    return strategies


def _names(strategies: list[Strategy]) -> set[str]:
    return {s.name for s in strategies}


def test_table_holds_the_family() -> None:
    assert rules()[EMBEDDING] is embedding.embedding_rule
    assert local_kinds()["vocab_embedding"] is embedding.vocab_embedding_local


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("index_shape", [(8,), (4, 8), (2, 4, 4)])
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_embedding_brute_force(
    mesh: tuple[int, ...], index_shape: tuple[int, ...], padding_idx: int
) -> None:
    strategies = _check((_weight(), _indices(index_shape), padding_idx), {}, mesh)
    if mesh == (2,):
        out_last = len(index_shape)
        assert _names(strategies) >= {
            "S(0),R->P",  # vocabulary-parallel
            f"S(1),R->S({out_last})",  # embedding dim
            *(f"R,S({d})->S({d})" for d in range(len(index_shape))),  # any index dim
        }
        vocab = next(s for s in strategies if s.name == "S(0),R->P")
        assert vocab.local == Local("vocab_embedding")
        assert not vocab.split > 1  # every device writes the whole output


def test_embedding_counts_on_2x2() -> None:
    """5 choices per axis (replicate, D, 2 index dims, vocabulary), 25 products."""
    strategies = _check((_weight(), _indices((4, 8))), {}, (2, 2))
    assert len(strategies) == 25
    names = _names(strategies)
    assert "S(0)S(0),RR->PP" in names  # vocabulary over both axes
    assert "S(0)S(1),RR->PS(2)" in names  # vocabulary x embedding dim
    assert "S(0)R,RS(0)->PS(0)" in names  # vocabulary x batch


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_embedding_keyword_arguments(dtype: torch.dtype) -> None:
    kwargs = {"padding_idx": 0, "scale_grad_by_freq": False, "sparse": False}
    strategies = _check((_weight(), _indices((4, 4), dtype=dtype)), kwargs, (2, 2))
    assert "S(0)S(0),RR->PP" in _names(strategies)


def test_scale_grad_by_freq_keeps_indices_whole() -> None:
    """Counts are over all the indices: no index split, no vocabulary split."""
    strategies = _check((_weight(), _indices((4, 8)), -1, True), {}, (2, 2))
    for strategy in strategies:
        assert strategy.inputs[1].is_replicated, strategy.name
        assert not any(isinstance(p, Partial) for p in strategy.outputs[0]), strategy.name
    assert "S(1)S(1),RR->S(2)S(2)" in _names(strategies)


def test_sparse_gradient_has_no_vocabulary_split() -> None:
    strategies = _check((_weight(), _indices((4, 8)), -1, False, True), {}, (2,))
    assert "S(0),R->P" not in _names(strategies)
    assert {"R,S(0)->S(0)", "S(1),R->S(2)"} <= _names(strategies)


@pytest.mark.parametrize("mesh", [(3,), (2, 3)])
def test_embedding_divisibility(mesh: tuple[int, ...]) -> None:
    """weight [6, 4], indices [4, 6]: over 3 devices, rows and index dim 1 split, D and index
    dim 0 do not."""
    strategies = _check((_weight(6, 4), _indices((4, 6), rows=6)), {}, mesh)
    last = len(mesh) - 1
    on_last = {(s.inputs[0][last], s.inputs[1][last]) for s in strategies}
    assert (Shard(0), R) in on_last
    assert (R, Shard(1)) in on_last
    assert (Shard(1), R) not in on_last
    assert (R, Shard(0)) not in on_last


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
@pytest.mark.parametrize("padding_idx", [-1, 5])
def test_vocabulary_parallel_sum_is_the_lookup(mesh: tuple[int, ...], padding_idx: int) -> None:
    """Each device's rows only; the sum over the devices is the lookup, for indices that hit
    every device's rows. Only the device holding the padding row runs the padded kind."""
    weight, indices = _weight(), _indices((3, 8))
    call = op_call(EMBEDDING, (weight, indices, padding_idx), {})
    layout = Layout(*(Shard(0) for _ in mesh))
    strategy = Strategy(
        (layout, Layout.replicated(len(mesh))),
        (Layout(*(PARTIAL for _ in mesh)),),
        local=Local("vocab_embedding"),
    )
    rows = V // len(list(itertools.product(*map(range, mesh))))
    total = torch.zeros(3, 8, D, dtype=torch.float64)
    for block, coords in enumerate(itertools.product(*map(range, mesh))):
        local_weight = weight[block * rows : (block + 1) * rows]
        fn, args, kwargs = embedding.vocab_embedding_local(
            call, strategy, (local_weight, indices, padding_idx), {}, coords, mesh
        )
        assert args[2:4] == (block * rows, (block + 1) * rows)
        holds_padding = block * rows <= padding_idx < (block + 1) * rows
        expected_fn = (
            embedding.vocab_parallel_embedding_padded
            if holds_padding
            else local_ops.vocab_parallel_embedding
        )
        assert fn is expected_fn
        piece = fn(*args, **kwargs)
        mine = (indices >= block * rows) & (indices < (block + 1) * rows)
        assert mine.any()
        assert torch.equal(piece[~mine], torch.zeros_like(piece[~mine]))
        total += piece
    assert torch.equal(total, torch.nn.functional.embedding(indices, weight))


# --- the weight's gradient -------------------------------------------------------------


def _piece(
    tensor: torch.Tensor, layout: Layout, coords: tuple[int, ...], mesh: tuple[int, ...]
) -> torch.Tensor:
    """The device's chunk (a view) of a tensor laid out by ``layout``, ignoring Partial."""
    for axis, placement in enumerate(layout):
        if isinstance(placement, Shard):
            tensor = tensor.chunk(mesh[axis], dim=placement.dim)[coords[axis]]
    return tensor


def _output_grad(
    grad: torch.Tensor, layout: Layout, coords: tuple[int, ...], mesh: tuple[int, ...]
) -> torch.Tensor:
    """The adjoint of assembling the output: a shard gets its chunk, a partial summand the
    whole gradient, a replica the gradient on the first device only (it is read once)."""
    piece = _piece(grad, layout, coords, mesh)
    for axis, placement in enumerate(layout):
        if isinstance(placement, Replicate) and coords[axis] != 0:
            return torch.zeros_like(piece)
    return piece


def _sharded_weight_grad(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    grad: torch.Tensor,
    mesh: tuple[int, ...],
) -> torch.Tensor:
    """Run every device's local call with autograd and gather d(loss)/d(weight): each
    device's gradient lands in its chunk of the table; replicas' gradients add up."""
    weight, indices, *rest = args
    total = torch.zeros_like(weight)
    for coords in itertools.product(*map(range, mesh)):
        local_weight = _piece(weight, strategy.inputs[0], coords, mesh).detach()
        local_weight.requires_grad_(True)
        local_indices = _piece(indices, strategy.inputs[1], coords, mesh)
        fn, a, k = localize(call, strategy, (local_weight, local_indices, *rest), {}, coords, mesh)
        fn(*a, **k).backward(_output_grad(grad, strategy.outputs[0], coords, mesh))
        assert local_weight.grad is not None
        _piece(total, strategy.inputs[0], coords, mesh).add_(local_weight.grad.to_dense())
    return total


def _weight_grad_failures(
    strategies: list[Strategy], args: tuple[Any, ...], mesh: tuple[int, ...]
) -> list[str]:
    call = op_call(EMBEDDING, args, {})
    weight = args[0].detach().requires_grad_(True)
    out = EMBEDDING(weight, *args[1:])
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    out.backward(grad)
    assert weight.grad is not None
    want = weight.grad.to_dense()
    return [
        s.name
        for s in strategies
        if not torch.allclose(_sharded_weight_grad(call, s, args, grad, mesh), want)
    ]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize(
    "options",
    [
        (-1, False, False),
        (3, False, False),
        (0, False, False),
        (3, True, False),
        (-1, False, True),
        (2, False, True),
    ],
    ids=["plain", "padding", "padding0", "by_freq", "sparse", "sparse_padding"],
)
def test_embedding_weight_gradient(mesh: tuple[int, ...], options: tuple[int, bool, bool]) -> None:
    """Autograd through every device's local call gives the unsharded op's weight gradient:
    the padding row gets none, frequency scaling sees every index."""
    args = (_weight(), _indices((4, 8)), *options)
    strategies = embedding.embedding_rule(op_call(EMBEDDING, args, {}), mesh)
    assert len(strategies) > 1
    assert _weight_grad_failures(strategies, args, mesh) == []


def test_gradient_check_catches_split_indices_with_frequency_scaling() -> None:
    """Why ``scale_grad_by_freq`` keeps the indices whole: local counts are wrong."""
    args = (_weight(), _indices((4, 8)), -1, True)
    split = Strategy((Layout(R), Layout(Shard(0))), (Layout(Shard(0)),))
    assert _weight_grad_failures([split], args, (2,)) == [split.name]


def test_gradient_check_catches_an_unpadded_vocabulary_split() -> None:
    """Why the padded kind exists: the plain vocabulary-parallel lookup would give the
    padding row a gradient."""
    weight, indices = _weight(), _indices((4, 8))
    grad = torch.ones(4, 8, D, dtype=torch.float64)
    local_weight = weight[:4].clone().requires_grad_(True)
    local_ops.vocab_parallel_embedding(local_weight, indices, 0, 4).backward(grad)
    assert local_weight.grad is not None and local_weight.grad[3].abs().sum() > 0
    local_weight.grad = None
    embedding.vocab_parallel_embedding_padded(local_weight, indices, 0, 4, 3).backward(grad)
    assert local_weight.grad is not None
    assert torch.equal(local_weight.grad[3], torch.zeros(D, dtype=torch.float64))
    assert local_weight.grad[:3].abs().sum() > 0
