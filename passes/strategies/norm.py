"""Sharding rules: normalization layers.

=========================  ==========================================================
op                         what a mesh axis may shard
=========================  ==========================================================
layer_norm                 the leading dims (not the ``normalized_shape`` ones)
native_layer_norm          the leading dims, in ``out`` and in ``mean``/``rstd``
                           (shaped ``leading + (1,) * len(normalized_shape)``)
rms_norm                   the leading dims
_fused_rms_norm            the leading dims, in ``out`` and ``rstd``
group_norm                 the batch dim 0 (a group's statistics span channels and
                           every spatial position)
batch_norm (eval)          any dim: each channel is scaled and shifted by its running
                           statistics; the channels (dim 1) with the affine parameters
                           and statistics split alike
batch_norm (training)      nothing: ``autopar_passes.batch_norm`` writes it out as sums
                           first, which shard over the batch
=========================  ==========================================================

The statistics are taken over the normalized dims, so those must be whole on every device;
each leading position is normalized on its own, so the leading dims shard freely. The affine
``weight`` and ``bias`` span the normalized dims and arrive ``Replicate``. Never ``Partial``:
a normalization is not linear.
"""

from __future__ import annotations

import torch

from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.reduction import input_roles, role_choice, schema_args
from autopar_passes.strategies.types import LocalKind, OpCall, Rule, Strategy
from autopar_plans.placement import Shard

aten = torch.ops.aten


def _leading_dims_strategies(
    call: OpCall, mesh_shape: tuple[int, ...], leading: range
) -> list[Strategy]:
    """Shard any of ``leading`` in the input and in every output at the same position;
    every other tensor input (weight, bias) replicated."""
    roles = input_roles(call)
    n_out = len(call.outputs)
    choices: list[AxisChoice] = [replicate_choice(len(roles), n_out)]
    for dim in leading:
        choices.append(role_choice(roles, {"input": Shard(dim)}, (Shard(dim),) * n_out))
    return combine(choices, call, mesh_shape)


def layer_norm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """layer_norm, native_layer_norm, rms_norm, _fused_rms_norm: the dims before the
    trailing ``normalized_shape`` ones may be sharded (each row is normalized alone); the
    normalized dims, weight and bias stay whole."""
    ndim = len(call.inputs[0].shape)
    normalized = len(schema_args(call)["normalized_shape"])
    return _leading_dims_strategies(call, mesh_shape, range(ndim - normalized))


def group_norm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """group_norm(input [N, C, *], num_groups, weight, bias): only the batch dim N may be
    sharded (a group's statistics span its channels and all spatial positions)."""
    return _leading_dims_strategies(call, mesh_shape, range(min(1, len(call.inputs[0].shape))))


def batch_norm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """batch_norm(input [N, C, *], weight, bias, running_mean, running_var, training, ...):
    in eval mode an affine map per channel, so any dim shards (the per-channel tensors
    replicated), or the channels with every per-channel tensor split alike. In training
    the statistics span the batch and space; the trace writes that case out as sums
    (``autopar_passes.batch_norm``), and what is left here is replicated."""
    roles = input_roles(call)
    choices: list[AxisChoice] = [replicate_choice(len(roles), 1)]
    if schema_args(call)["training"]:
        return combine(choices, call, mesh_shape)
    for dim in range(len(call.inputs[0].shape)):
        if dim != 1:
            choices.append(role_choice(roles, {"input": Shard(dim)}, (Shard(dim),)))
    per_channel = {role: Shard(0) for role in roles if role != "input"}
    choices.append(role_choice(roles, {"input": Shard(1), **per_channel}, (Shard(1),)))
    return combine(choices, call, mesh_shape)


RULES: dict[object, Rule] = {
    aten.batch_norm.default: batch_norm_rule,
    aten.layer_norm.default: layer_norm_rule,
    aten.native_layer_norm.default: layer_norm_rule,
    aten.rms_norm.default: layer_norm_rule,
    aten._fused_rms_norm.default: layer_norm_rule,
    aten.group_norm.default: group_norm_rule,
}
LOCALS: dict[str, LocalKind] = {}
