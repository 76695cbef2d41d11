"""Pooling and resampling: every strategy brute-forced against the unsharded op; the batch
and channels shard, the spatial dims never."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar_passes.strategies.pool import RULES
from autopar_passes.strategies.validate import check_rule, describe_failures

aten = torch.ops.aten
MESHES = [(2,), (2, 3)]


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


X2 = r(4, 6, 8, 8)
CASES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "max_pool2d": (aten.max_pool2d.default, (X2, [3, 3], [2, 2], [1, 1])),
    "max_pool2d_with_indices": (aten.max_pool2d_with_indices.default, (X2, [2, 2])),
    "avg_pool2d": (aten.avg_pool2d.default, (X2, [2, 2])),
    "adaptive_avg_pool2d": (aten.adaptive_avg_pool2d.default, (X2, [1, 1])),
    "adaptive_avg_pool2d-3x3": (aten.adaptive_avg_pool2d.default, (X2, [3, 3])),
    "adaptive_max_pool2d": (aten.adaptive_max_pool2d.default, (X2, [2, 2])),
    "upsample_nearest2d": (aten.upsample_nearest2d.vec, (X2, None, [2.0, 2.0])),
    "upsample_bilinear2d": (aten.upsample_bilinear2d.vec, (X2, [12, 12], False, None)),
    "max_pool1d": (aten.max_pool1d.default, (r(4, 6, 9), [3])),
    "avg_pool3d": (aten.avg_pool3d.default, (r(4, 6, 4, 4, 4), [2, 2, 2])),
    "unbatched": (aten.max_pool2d.default, (r(6, 8, 8), [2, 2])),
    "im2col": (aten.im2col.default, (X2, [3, 3], [1, 1], [1, 1], [2, 2])),
    "im2col-unbatched": (aten.im2col.default, (r(6, 8, 8), [2, 2], [1, 1], [0, 0], [1, 1])),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_matches_the_unsharded_op(case: str, mesh: tuple[int, ...]) -> None:
    target, args = CASES[case]
    strategies, failures = check_rule(RULES[target], target, args, mesh_shape=mesh)
    assert len(strategies) > 1
    assert not failures, describe_failures(failures)


def test_batch_and_channels_shard_and_space_does_not() -> None:
    target, args = CASES["max_pool2d"]
    names = {s.name for s in check_rule(RULES[target], target, args, mesh_shape=(2,))[0]}
    assert names == {"R->R", "S(0)->S(0)", "S(1)->S(1)"}
