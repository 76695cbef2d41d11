"""Sharding rules: convolutions.

==================================  ================================================
op                                  what a mesh axis may shard
==================================  ================================================
conv1d, conv2d, conv3d (.default,   the batch (data parallelism); the output channels
.padding), convolution (not         (weight rows: tensor parallelism); the input
transposed)                         channels (contracted: a ``Partial`` output, the
                                    bias added once); a ``Partial`` input or weight
grouped (``groups`` > 1)            the batch; the groups, input and output channels
                                    together, each device running its groups
                                    (``conv_groups``)
convolution (transposed)            the batch
==================================  ================================================

A convolution is an einsum over its channels (``nc...,oc...(,o) -> no...``) whose spatial
dims mix through the kernel window: a slice of the image would need its neighbours' edges
(a halo exchange), so no spatial or kernel dim is ever sharded. The channel choices come
from the einsum algebra (``autopar_passes.strategies.einsum``), kept to the channel letters.

With ``groups`` > 1 the input's channels are ``groups`` blocks, each convolved with its own
rows of the weight: splitting the input and output channels and the weight rows together
gives each device whole groups, so it runs the convolution with ``groups / p`` groups,
``p`` the product of the sizes of the axes that split them.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.einsum import Operand, einsum_choices
from autopar_passes.strategies.reduction import input_roles, role_choice, schema_args
from autopar_passes.strategies.types import SAME, Local, LocalKind, OpCall, Rule, Strategy
from autopar_plans.placement import Shard

aten = torch.ops.aten

CHANNEL_TAGS = ("shard:n", "shard:o", "shard:c")  # the einsum choices a convolution keeps
GROUPS = "groups"  # tag of the choice that splits the groups


def conv_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """conv1d/2d/3d and convolution: batch, output channels, input channels (Partial), or
    the groups of a grouped convolution; never a spatial dim."""
    bound = schema_args(call)
    x, weight = call.inputs[0], call.inputs[1]
    window = len(weight.shape) - 2  # spatial dims
    batched = len(x.shape) == window + 2
    n = "n" if batched else ""
    if bound.get("transposed"):
        return _batch_only(call, mesh_shape, batched)
    groups = int(bound["groups"])
    image, kernel, out_image = "HWD"[:window], "xyz"[:window], "PQR"[:window]
    # grouped: the weight's input channels are one group's, another dim than the input's
    operands: list[Operand] = [
        (n + "c" + image, "mul"),
        ("o" + ("c" if groups == 1 else "g") + kernel, "mul"),
    ]
    if bound.get("bias") is not None:
        operands.append(("o", "add"))
    choices = [
        choice
        for choice in einsum_choices(operands, n + "o" + out_image)
        if choice.tag in ("", *CHANNEL_TAGS) or choice.tag.startswith("partial:")
    ]
    if groups > 1:
        choices = [c for c in choices if c.tag in ("", "shard:n")]
        channel = Shard(1 if batched else 0)
        roles = input_roles(call)
        split = {"input": channel, "weight": Shard(0), "bias": Shard(0)}
        choices.append(role_choice(roles, split, (channel,), tag=GROUPS))
    return combine(
        choices,
        call,
        mesh_shape,
        local_of=_local_groups,
        valid=lambda s: _divides_groups(s, call, groups, mesh_shape),
    )


def _batch_only(call: OpCall, mesh_shape: tuple[int, ...], batched: bool) -> list[Strategy]:
    roles = input_roles(call)
    choices: list[AxisChoice] = [replicate_choice(len(roles), 1)]
    if batched:
        choices.append(role_choice(roles, {"input": Shard(0)}, (Shard(0),)))
    return combine(choices, call, mesh_shape)


def _local_groups(picks: tuple[AxisChoice, ...], mesh_shape: tuple[int, ...]) -> Local:
    factor = _groups_factor(picks, mesh_shape)
    return Local("conv_groups", (factor,)) if factor > 1 else SAME


def _groups_factor(picks: tuple[AxisChoice, ...], mesh_shape: tuple[int, ...]) -> int:
    factor = 1
    for pick, size in zip(picks, mesh_shape, strict=True):
        if pick.tag == GROUPS:
            factor *= size
    return factor


def _divides_groups(
    strategy: Strategy, call: OpCall, groups: int, mesh_shape: tuple[int, ...]
) -> bool:
    local = strategy.local
    return local.kind != "conv_groups" or groups % int(local.params[0]) == 0


def _conv_groups(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The convolution of this device's groups: ``groups`` divided by the split."""
    (factor,) = strategy.local.params
    names = [argument.name for argument in call.target._schema.arguments]
    position = names.index("groups")
    groups = int(schema_args(call)["groups"]) // int(factor)
    if position < len(args):
        args = (*args[:position], groups, *args[position + 1 :])
    else:
        kwargs = {**kwargs, "groups": groups}
    return call.target, args, kwargs


RULES: dict[object, Rule] = {
    aten.conv1d.default: conv_rule,
    aten.conv2d.default: conv_rule,
    aten.conv3d.default: conv_rule,
    aten.conv1d.padding: conv_rule,
    aten.conv2d.padding: conv_rule,
    aten.conv3d.padding: conv_rule,
    aten.convolution.default: conv_rule,
}
LOCALS: dict[str, LocalKind] = {"conv_groups": _conv_groups}
