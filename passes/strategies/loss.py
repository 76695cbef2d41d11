"""Sharding rules: losses.

=================================  ==========================================================
op                                 what a mesh axis may shard
=================================  ==========================================================
cross_entropy_loss                 batch dim N and extra dims d1..., input and target alike
nll_loss, nll_loss_nd              as cross_entropy_loss (class-index targets)
nll_loss_forward,                  as nll_loss; ``total_weight`` follows the loss
nll_loss2d_forward
mse_loss, l1_loss,                 any dim, input and target alike (elementwise losses)
smooth_l1_loss, huber_loss
=================================  ==========================================================

The class dim (dim 1, or dim 0 of a 1-d input) is never sharded: the log-softmax normalises
over it. ``weight`` (one per class) arrives ``Replicate``. What the output does with a
sharded dim depends on ``reduction``:

- 0 (none): the per-element loss keeps the shard;
- 2 (sum): each device sums its elements, the output is ``Partial``;
- 1 (mean): elementwise losses and probability targets divide by a static count, so each
  device scales its partial sum (``Local("scale", (1 / p,))``, ``p`` the pieces the
  elements are cut into). With class-index targets the count is the number of targets not
  equal to ``ignore_index`` (or their summed weights), known only from the data: nothing is
  sharded. ``autopar_passes.decompose`` rewrites those calls into a sum-reduced loss divided by
  that count before strategies are made.
"""

from __future__ import annotations

import torch

from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.reduction import (
    REDUCED,
    input_roles,
    mean_local,
    role_choice,
    schema_args,
)
from autopar_passes.strategies.types import LocalKind, OpCall, Rule, Strategy
from autopar_plans.placement import PARTIAL, REPLICATE, Shard

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2  # torch's Reduction enum


def _loss_strategies(
    call: OpCall,
    mesh_shape: tuple[int, ...],
    dims: list[tuple[int, int, int]],
    *,
    static_count: bool,
) -> list[Strategy]:
    """Strategies of a loss whose shardable dims are ``dims``: triples (input dim, target
    dim, dim of the unreduced loss). Every output follows the loss (``total_weight`` is a
    sum over the elements like a summed loss, and a constant zero for reduction none)."""
    roles = input_roles(call)
    reduction = int(schema_args(call)["reduction"])
    n_out = len(call.outputs)
    choices: list[AxisChoice] = [replicate_choice(len(roles), n_out)]
    if reduction == MEAN and not static_count:
        return combine(choices, call, mesh_shape)
    for input_dim, target_dim, loss_dim in dims:
        inputs = {"self": Shard(input_dim), "target": Shard(target_dim)}
        if reduction == NONE:
            # total_weight is a constant zero here: every device computes it whole
            outputs = (Shard(loss_dim),) + (REPLICATE,) * (n_out - 1)
            choices.append(role_choice(roles, inputs, outputs))
        else:
            choices.append(role_choice(roles, inputs, (PARTIAL,) * n_out, tag=REDUCED))
    local_of = mean_local if reduction == MEAN else None
    return combine(choices, call, mesh_shape, local_of=local_of)


def _class_dims(call: OpCall) -> tuple[list[tuple[int, int, int]], bool]:
    """Shardable (input, target, loss) dims of a classification loss, and whether its
    targets are probabilities (same shape as the input) rather than class indices."""
    ndim = len(call.inputs[0].shape)
    target_ndim = len(call.inputs[1].shape)
    probabilities = target_ndim == ndim
    if ndim < 2:
        return [], probabilities
    dims = []
    for dim in [0, *range(2, ndim)]:
        loss_dim = 0 if dim == 0 else dim - 1
        dims.append((dim, dim if probabilities else loss_dim, loss_dim))
    return dims, probabilities


def cross_entropy_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """cross_entropy_loss(input [N, C, d1...] or [C], target, weight, reduction,
    ignore_index, label_smoothing): N and d1... may be sharded, in input and target alike;
    never the class dim. A mean over class-index targets divides by a data-dependent count,
    so it is not sharded (see ``autopar_passes.decompose``); over probability targets it divides by
    the number of positions, so it is."""
    dims, probabilities = _class_dims(call)
    return _loss_strategies(call, mesh_shape, dims, static_count=probabilities)


def nll_loss_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """nll_loss, nll_loss_nd, nll_loss_forward, nll_loss2d_forward (input [N, C, d1...] or
    [C], class-index target): N and d1... may be sharded; never the class dim; a mean is not
    sharded (its count depends on which targets are ``ignore_index``)."""
    dims, _ = _class_dims(call)
    return _loss_strategies(call, mesh_shape, dims, static_count=False)


def elementwise_loss_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """mse_loss, l1_loss, smooth_l1_loss, huber_loss (input and target of one shape): any
    dim, input and target alike; a mean divides by the static element count."""
    shape = call.inputs[0].shape
    if len(call.inputs) != 2 or call.inputs[1].shape != shape:
        return []
    dims = [(dim, dim, dim) for dim in range(len(shape))]
    return _loss_strategies(call, mesh_shape, dims, static_count=True)


RULES: dict[object, Rule] = {
    aten.cross_entropy_loss.default: cross_entropy_rule,
    aten.nll_loss.default: nll_loss_rule,
    aten.nll_loss_nd.default: nll_loss_rule,
    aten.nll_loss_forward.default: nll_loss_rule,
    aten.nll_loss2d_forward.default: nll_loss_rule,
    aten.mse_loss.default: elementwise_loss_rule,
    aten.l1_loss.default: elementwise_loss_rule,
    aten.smooth_l1_loss.default: elementwise_loss_rule,
    aten.huber_loss.default: elementwise_loss_rule,
}
LOCALS: dict[str, LocalKind] = {}
