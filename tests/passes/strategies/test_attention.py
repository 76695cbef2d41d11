"""Attention family: every strategy brute-forced against the unsharded op on simulated meshes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar_passes.strategies import attention
from autopar_passes.strategies.table import rules
from autopar_passes.strategies.types import OpCall, Rule, Strategy
from autopar_passes.strategies.validate import check_rule, describe_failures, op_call
from autopar_plans.placement import Layout, Partial, Replicate, Shard

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
MESHES = [(2,), (4,), (2, 2)]

B, H, L, S, E, EV = 4, 4, 4, 6, 4, 2


def _randn(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


def _mask(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        mask = torch.rand(*shape, generator=generator) > 0.3
        mask[..., 0] = True  # every query row sees at least one key: no NaN rows
        return mask
    return torch.randn(*shape, dtype=dtype, generator=generator)


def _qkv(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _randn(*q_shape, seed=1), _randn(*k_shape, seed=2), _randn(*v_shape, seed=3)


def _check(
    rule: Rule, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: tuple[int, ...]
) -> list[Strategy]:
    strategies, failures = check_rule(rule, target, args, kwargs, mesh)
    assert not failures, describe_failures(failures)
    return strategies


def _layouts(strategies: list[Strategy]) -> set[tuple[tuple[Layout, ...], tuple[Layout, ...]]]:
    return {(s.inputs, s.outputs) for s in strategies}


def _one_axis(*placements: Shard | Replicate) -> tuple[Layout, ...]:
    return tuple(Layout(p) for p in placements)


R = Replicate()

MaskCase = tuple[tuple[int, ...] | None, torch.dtype | None, bool, bool]

# (mask shape or None, mask dtype, is_causal, mask passed as a keyword)
MASKS: list[MaskCase] = [
    (None, None, False, False),
    (None, None, True, False),
    ((B, 1, L, S), torch.bool, False, False),
    ((1, H, L, S), torch.float64, False, True),
    ((L, S), torch.bool, False, True),
    ((B, H, L, S), torch.float64, False, False),
    ((H, L, S), torch.bool, False, False),
    ((B, 1, 1, S), torch.bool, False, False),
]


def _sdpa_call(
    mask_shape: tuple[int, ...] | None, dtype: torch.dtype | None, causal: bool, as_kwarg: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    q, k, v = _qkv((B, H, L, E), (B, H, S, E), (B, H, S, EV))
    kwargs: dict[str, Any] = {"is_causal": causal}
    args: tuple[Any, ...] = (q, k, v)
    if mask_shape is not None:
        assert dtype is not None
        mask = _mask(mask_shape, dtype)
        if as_kwarg:
            kwargs["attn_mask"] = mask
        else:
            args = (q, k, v, mask)
    return args, kwargs


def _mask_placement(mask_shape: tuple[int, ...], out_dim: int) -> Shard | Replicate:
    """Where the mask follows an output split on leading dim ``out_dim`` of [B, H, L, Ev]."""
    dim = out_dim - (4 - len(mask_shape))
    return R if dim < 0 or mask_shape[dim] == 1 else Shard(dim)


def test_table_holds_the_family() -> None:
    assert rules()[SDPA] is attention.sdpa_rule
    assert rules()[FLASH_CPU] is attention.flash_attention_cpu_rule


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize(("mask_shape", "dtype", "causal", "as_kwarg"), MASKS)
def test_sdpa_brute_force(
    mesh: tuple[int, ...],
    mask_shape: tuple[int, ...] | None,
    dtype: torch.dtype | None,
    causal: bool,
    as_kwarg: bool,
) -> None:
    args, kwargs = _sdpa_call(mask_shape, dtype, causal, as_kwarg)
    strategies = _check(attention.sdpa_rule, SDPA, args, kwargs, mesh)
    if mesh == (2,):
        found = _layouts(strategies)
        for dim in (0, 1):  # batch, heads
            mask = () if mask_shape is None else (_mask_placement(mask_shape, dim),)
            inputs = _one_axis(Shard(dim), Shard(dim), Shard(dim), *mask)
            assert (inputs, _one_axis(Shard(dim))) in found, f"dim {dim} split missing"


@pytest.mark.parametrize("mesh", [*MESHES, (2, 3)])
@pytest.mark.parametrize(("mask_shape", "dtype", "causal", "as_kwarg"), MASKS)
def test_sdpa_never_splits_sequence_or_features(
    mesh: tuple[int, ...],
    mask_shape: tuple[int, ...] | None,
    dtype: torch.dtype | None,
    causal: bool,
    as_kwarg: bool,
) -> None:
    """L, S and E (and the mask's L, S) never sharded, nothing ever Partial."""
    args, kwargs = _sdpa_call(mask_shape, dtype, causal, as_kwarg)
    call = op_call(SDPA, args, kwargs)
    strategies = attention.sdpa_rule(call, mesh)
    assert strategies
    for strategy in strategies:
        layouts = strategy.inputs + strategy.outputs
        for layout, info in zip(layouts, call.inputs + call.outputs, strict=True):
            for placement in layout:
                assert not isinstance(placement, Partial), strategy.name
                if isinstance(placement, Shard):
                    assert placement.dim < len(info.shape) - 2, strategy.name


def test_sdpa_counts_on_2x2() -> None:
    """3 choices per axis (replicate, batch, heads), squared, less nothing: 9."""
    args, kwargs = _sdpa_call((B, 1, L, S), torch.bool, False, False)
    strategies = _check(attention.sdpa_rule, SDPA, args, kwargs, (2, 2))
    assert len(strategies) == 9
    names = {s.name for s in strategies}
    assert "S(0)S(1),S(0)S(1),S(0)S(1),S(0)R->S(0)S(1)" in names  # batch x heads
    assert "S(1)S(1),S(1)S(1),S(1)S(1),RR->S(1)S(1)" in names  # heads over both axes


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
def test_causal_attention_never_split_on_queries(mesh: tuple[int, ...]) -> None:
    q, k, v = _qkv((B, H, 8, E), (B, H, 8, E), (B, H, 8, E))  # L = S = 8 would divide
    strategies = _check(attention.sdpa_rule, SDPA, (q, k, v), {"is_causal": True}, mesh)
    for strategy in strategies:
        for layout in (strategy.inputs[0], strategy.outputs[0]):
            assert Shard(2) not in tuple(layout), strategy.name


def test_splitting_causal_queries_would_be_wrong() -> None:
    """Why L is never offered: a causal mask is built from local positions."""
    q, k, v = _qkv((2, 2, 8, E), (2, 2, 8, E), (2, 2, 8, E))

    def split_queries(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
        del call, mesh_shape
        return [Strategy(_one_axis(Shard(2), R, R), _one_axis(Shard(2)))]

    _, failures = check_rule(split_queries, SDPA, (q, k, v), {"is_causal": True}, (2,))
    assert failures


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2), (2, 3)])
def test_grouped_query_attention(mesh: tuple[int, ...]) -> None:
    """Hq=8, Hkv=2: heads split over 2 devices (groups stay whole), never over 4."""
    q, k, v = _qkv((4, 8, L, E), (4, 2, S, E), (4, 2, S, EV))
    mask = _mask((4, 8, L, S), torch.bool)
    strategies = _check(attention.sdpa_rule, SDPA, (q, k, v, mask), {"enable_gqa": True}, mesh)
    head_splits = [
        s for s in strategies if any(isinstance(p, Shard) and p.dim == 1 for p in s.inputs[0])
    ]
    for strategy in head_splits:
        head_axes = strategy.inputs[0].sharded_dims()[1]
        assert len(head_axes) == 1 and mesh[head_axes[0]] == 2, strategy.name
        assert strategy.inputs[1] == strategy.inputs[0] == strategy.inputs[2]
    if mesh == (2,):
        heads = _one_axis(Shard(1), Shard(1), Shard(1), Shard(1))
        assert (heads, _one_axis(Shard(1))) in _layouts(strategies)
    if mesh == (4,):
        assert not head_splits
    if mesh == (2, 2):
        names = {s.name for s in strategies}
        assert "S(1)S(0),S(1)S(0),S(1)S(0),S(1)S(0)->S(1)S(0)" in names
        assert not any(s.inputs[0] == Layout(Shard(1), Shard(1)) for s in strategies)


def test_gqa_groups_split_unevenly_would_be_wrong() -> None:
    """Why q and k must split the head dim together: splitting only the query heads pairs
    them with the wrong key heads."""
    q, k, v = _qkv((2, 8, L, E), (2, 2, S, E), (2, 2, S, EV))

    def split_query_heads(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
        del call, mesh_shape
        return [Strategy(_one_axis(Shard(1), R, R), _one_axis(Shard(1)))]

    _, failures = check_rule(split_query_heads, SDPA, (q, k, v), {"enable_gqa": True}, (2,))
    assert failures


@pytest.mark.parametrize("mesh", [(3,), (2, 3)])
def test_sdpa_divisibility(mesh: tuple[int, ...]) -> None:
    """B=4 does not split over 3 devices; H=6 does."""
    q, k, v = _qkv((4, 6, L, E), (4, 6, S, E), (4, 6, S, EV))
    strategies = _check(attention.sdpa_rule, SDPA, (q, k, v), {"scale": 0.3}, mesh)
    last = len(mesh) - 1
    assert not any(s.outputs[0][last] == Shard(0) for s in strategies)
    assert any(s.outputs[0][last] == Shard(1) for s in strategies)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
@pytest.mark.parametrize(
    ("q_shape", "k_shape", "mask_shape"),
    [
        ((2, 4, 4, L, E), (2, 4, 4, S, E), (4, 1, L, S)),  # two leading batch dims
        ((4, L, E), (4, S, E), None),  # no head dim
        ((4, 4, L, E), (1, 4, S, E), None),  # keys broadcast over the batch
        ((4, 4, L, E), (S, E), (4, 1, 1, S)),  # keys shared by all
    ],
)
def test_sdpa_other_ranks_and_broadcasting(
    mesh: tuple[int, ...],
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    mask_shape: tuple[int, ...] | None,
) -> None:
    v_shape = (*k_shape[:-1], EV)
    q, k, v = _qkv(q_shape, k_shape, v_shape)
    args: tuple[Any, ...] = (q, k, v)
    if mask_shape is not None:
        args = (*args, _mask(mask_shape, torch.bool))
    strategies = _check(attention.sdpa_rule, SDPA, args, {}, mesh)
    assert any(s.outputs[0][0] == Shard(0) for s in strategies)
    if len(k_shape) < len(q_shape) or k_shape[0] == 1:
        batch = next(s for s in strategies if s.outputs[0][0] == Shard(0))
        assert batch.inputs[1][0] == R  # a broadcast key is not split


def test_dropout_changes_no_layout() -> None:
    """dropout_p > 0 offers the same layouts (the RNG is not managed here, see the module)."""
    args, kwargs = _sdpa_call((B, 1, L, S), torch.bool, False, False)
    plain = attention.sdpa_rule(op_call(SDPA, args, kwargs), (2, 2))
    torch.manual_seed(0)
    dropped = attention.sdpa_rule(op_call(SDPA, args, {**kwargs, "dropout_p": 0.1}), (2, 2))
    assert [s.name for s in plain] == [s.name for s in dropped]


@pytest.mark.parametrize("mesh", [*MESHES, (2, 3)])
@pytest.mark.parametrize(
    ("hkv", "mask_shape", "causal"),
    [
        (4, None, False),
        (4, None, True),
        (4, (4, 1, L, S), False),
        (4, (L, S), False),
        (2, (4, 4, L, S), False),
    ],
)
def test_flash_attention_cpu(
    mesh: tuple[int, ...], hkv: int, mask_shape: tuple[int, ...] | None, causal: bool
) -> None:
    """The CPU kernel's (out, logsumexp) split together on batch or heads."""
    q, k, v = _qkv((4, 4, L, E), (4, hkv, S, E), (4, hkv, S, E))
    kwargs: dict[str, Any] = {}
    if mask_shape is not None:
        kwargs["attn_mask"] = _mask(mask_shape, torch.float64)
    strategies = _check(
        attention.flash_attention_cpu_rule, FLASH_CPU, (q, k, v, 0.0, causal), kwargs, mesh
    )
    for strategy in strategies:
        assert strategy.outputs[0] == strategy.outputs[1]
    if mesh == (2,):
        assert any(s.outputs[1] == Layout(Shard(1)) for s in strategies)
        assert any(s.outputs[1] == Layout(Shard(0)) for s in strategies)
