"""Convolution family: every strategy brute-forced against the unsharded op on simulated
meshes; no spatial dim is ever sharded, and tensor parallelism is offered."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar_passes.strategies.conv import RULES
from autopar_passes.strategies.validate import check_rule, describe_failures

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (2, 3)]


def r(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


# batch and channels split by 2, 3 and 4 (12); spatial dims small
CASES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "conv2d": (aten.conv2d.default, (r(12, 12, 5, 5), r(24, 12, 3, 3, seed=1), r(24, seed=2))),
    "conv2d-strided-padded": (
        aten.conv2d.default,
        (r(4, 12, 7, 7), r(12, 12, 3, 3, seed=1), None, [2, 2], [1, 1], [1, 1], 1),
    ),
    "conv2d-dilated": (
        aten.conv2d.default,
        (r(4, 12, 7, 7), r(12, 12, 3, 3, seed=1), r(12, seed=2), [1, 1], [2, 2], [2, 2], 1),
    ),
    "conv2d-grouped": (
        aten.conv2d.default,
        (r(4, 24, 5, 5), r(24, 2, 3, 3, seed=1), r(24, seed=2), [1, 1], [1, 1], [1, 1], 12),
    ),
    "conv2d-depthwise": (
        aten.conv2d.default,
        (r(4, 12, 5, 5), r(12, 1, 3, 3, seed=1), None, [1, 1], [1, 1], [1, 1], 12),
    ),
    "conv2d-same-padding": (
        aten.conv2d.padding,
        (r(4, 12, 5, 5), r(12, 12, 3, 3, seed=1), r(12, seed=2), [1, 1], "same"),
    ),
    "conv2d-unbatched": (aten.conv2d.default, (r(12, 5, 5), r(12, 12, 3, 3, seed=1))),
    "conv1d": (aten.conv1d.default, (r(12, 12, 9), r(24, 12, 3, seed=1), r(24, seed=2))),
    "conv3d": (aten.conv3d.default, (r(4, 12, 3, 4, 4), r(12, 12, 2, 2, 2, seed=1))),
    "convolution": (
        aten.convolution.default,
        (
            r(4, 12, 5, 5),
            r(12, 12, 3, 3, seed=1),
            r(12, seed=2),
            [1, 1],
            [1, 1],
            [1, 1],
            False,
            [0, 0],
            1,
        ),
    ),
    "convolution-transposed": (
        aten.convolution.default,
        (
            r(4, 12, 5, 5),
            r(12, 6, 3, 3, seed=1),
            r(6, seed=2),
            [2, 2],
            [1, 1],
            [1, 1],
            True,
            [1, 1],
            1,
        ),
    ),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_matches_the_unsharded_op(case: str, mesh: tuple[int, ...]) -> None:
    target, args = CASES[case]
    strategies, failures = check_rule(RULES[target], target, args, mesh_shape=mesh)
    assert len(strategies) > 1  # more than replicating everything
    assert not failures, describe_failures(failures)


def _names(case: str, mesh: tuple[int, ...] = (2,)) -> set[str]:
    target, args = CASES[case]
    return {s.name for s in check_rule(RULES[target], target, args, mesh_shape=mesh)[0]}


def test_a_convolution_is_data_and_tensor_parallel_and_never_split_in_space() -> None:
    names = _names("conv2d")
    assert "S(0),R,R->S(0)" in names  # data parallel
    assert "R,S(0),S(0)->S(1)" in names  # output channels: the weight's rows
    assert "S(1),S(1),P->P" in names  # input channels contracted, the bias added once
    assert not any(f"S({d})" in name for name in names for d in (2, 3))


def test_a_grouped_convolution_splits_whole_groups() -> None:
    names = _names("conv2d-grouped", (4,))
    assert "S(1),S(0),S(0)->S(1)" in names  # 12 groups, 3 a device
    assert "R,S(0),S(0)->S(1)" not in names  # output channels alone would cut groups
    assert _names("convolution-transposed") == {"R,R,R->R", "S(0),R,R->S(0)"}
