"""Sharding rules: pooling, adaptive pooling and resampling of images.

===========================================  =========================================
op                                           what a mesh axis may shard
===========================================  =========================================
max_pool{1,2,3}d, max_pool2d_with_indices,   the batch or the channels, in the input
avg_pool{1,2,3}d, adaptive_avg_pool{1,2,3}d, and in every output (indices included)
adaptive_max_pool{1,2}d, upsample_* (nearest,
bilinear, bicubic, linear, trilinear), im2col
===========================================  =========================================

Each of these works on every (sample, channel) image alone and mixes only its spatial dims
(a window, or an interpolation), so the batch and channel dims shard freely and the spatial
ones never (a window at a slice's edge needs its neighbour's pixels). An input without a
batch dim (``[C, *spatial]``) shards its channels.
"""

from __future__ import annotations

import torch

from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.reduction import input_roles, role_choice
from autopar_passes.strategies.types import OpCall, Rule, Strategy
from autopar_plans.placement import Shard

aten = torch.ops.aten


def image_rule(spatial: int) -> Rule:
    """The rule of an op over images with ``spatial`` spatial dims."""

    def rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
        roles = input_roles(call)
        n_out = len(call.outputs)
        kept = len(call.inputs[0].shape) - spatial  # the batch and channel dims, or channels
        choices: list[AxisChoice] = [replicate_choice(len(roles), n_out)]
        for dim in range(kept):
            choices.append(role_choice(roles, {roles[0]: Shard(dim)}, (Shard(dim),) * n_out))
        return combine(choices, call, mesh_shape)

    return rule


_SPATIAL = {
    1: [
        aten.max_pool1d.default,
        aten.avg_pool1d.default,
        aten.adaptive_avg_pool1d.default,
        aten.adaptive_max_pool1d.default,
        aten.upsample_nearest1d.vec,
        aten.upsample_nearest1d.default,
        aten.upsample_linear1d.vec,
        aten.upsample_linear1d.default,
        aten._upsample_nearest_exact1d.vec,
    ],
    2: [
        aten.max_pool2d.default,
        aten.max_pool2d_with_indices.default,
        aten.avg_pool2d.default,
        aten.adaptive_avg_pool2d.default,
        aten._adaptive_avg_pool2d.default,
        aten.adaptive_max_pool2d.default,
        aten.upsample_nearest2d.vec,
        aten.upsample_nearest2d.default,
        aten.upsample_bilinear2d.vec,
        aten.upsample_bilinear2d.default,
        aten.upsample_bicubic2d.vec,
        aten.upsample_bicubic2d.default,
        aten._upsample_nearest_exact2d.vec,
        aten._upsample_bilinear2d_aa.vec,
    ],
    3: [
        aten.max_pool3d.default,
        aten.avg_pool3d.default,
        aten.adaptive_avg_pool3d.default,
        aten.upsample_nearest3d.vec,
        aten.upsample_nearest3d.default,
        aten.upsample_trilinear3d.vec,
        aten.upsample_trilinear3d.default,
        aten._upsample_nearest_exact3d.vec,
    ],
}

RULES: dict[object, Rule] = {
    **{op: image_rule(k) for k, ops in _SPATIAL.items() for op in ops},
    # im2col (unfold): each channel's windows, channel-major in the output's dim 1, so a
    # split of the channels is a split of that dim into whole channels' blocks
    aten.im2col.default: image_rule(2),
}
