"""Batch normalization in training, written out so that a batch split over devices
normalizes as one device does (SyncBatchNorm's statistics, found by the rules).

``batch_norm(x, weight, bias, running_mean, running_var, training=True, momentum, eps)``
takes each channel's mean and variance over the batch and every spatial position. On a
batch split over devices each device sees a slice of that; written as sums, the rules make
them ``Partial`` and the lowering sums them over the devices (one all-reduce of a
``[C]`` vector each), so every device normalizes with the whole batch's statistics::

    s1 = sum(x, dims, dtype=fp32)     # dims: all but the channels (dim 1)
    mean = s1 / n                     # n: the elements per channel
    centered = x - mean[channel]      # [channel]: as [1, C, 1, ...], in x's dtype
    var = sum(centered * centered, dims, dtype=fp32) / n    # biased, as normalization uses
    out = centered * rsqrt(var + eps)[channel] (* weight[channel]) (+ bias[channel])
    running_mean.copy_(running_mean * (1 - momentum) + detach(mean) * momentum)
    running_var.copy_(running_var * (1 - momentum) + detach(var) * n / (n - 1) * momentum)

The running statistics are updated from the same whole-batch values on every device, so a
replicated buffer stays the same everywhere.

Per-device statistics (``groups`` > 1, the plan option ``batch_norm="per_device"``) are
DDP's default: each device normalizes its slice of the batch with that slice's statistics,
and before each forward DDP copies rank 0's running statistics over the others'. Written
out, the batch is viewed as ``groups`` consecutive slices, ``[G, N/G, C, ...]``, and the
sums run over all but the slice and the channel, giving ``[G, C]`` statistics; when the
plan splits the batch over G devices each device holds its slice and its statistics, and
nothing crosses devices. The running statistics are updated from slice 0's, which is what
DDP's buffers hold once rank 0's are copied over. On one device the same graph is "ghost"
batch normalization (Hoffer et al. 2017), so the plan stays equal to single-device
training of that graph.

Two passes over ``x`` (the mean, then the centered squares), as the reference kernels
take, not ``E[x^2] - E[x]^2``, which loses precision when the mean is large. Runs with the
other decompositions (``autopar_passes.decompose``), before annotation; the rewritten
node keeps its name and becomes the output.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autopar_passes.graph_edit import copy_meta, set_val
from autopar_plans.errors import UsageError

aten = torch.ops.aten


def decompose_batch_norms(graph_module: GraphModule, groups: int = 1) -> int:
    """Write out every training-mode ``batch_norm`` (see the module docstring), its
    statistics over each of ``groups`` consecutive slices of the batch; returns how many
    were."""
    count = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target == aten.batch_norm.default:
            bound = _bound(node)
            if bound["training"] and _writable(bound):
                _write_out(graph_module, node, bound, groups)
                count += 1
    return count


def _bound(node: Node) -> dict[str, Any]:
    names = [argument.name for argument in node.target._schema.arguments]  # type: ignore[union-attr]
    bound = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def _writable(bound: dict[str, Any]) -> bool:
    x = bound["input"].meta.get("val")
    momentum = bound.get("momentum")
    tracked = bound.get("running_mean") is not None
    return (
        isinstance(x, torch.Tensor)
        and x.dim() >= 2
        and x.is_floating_point()
        and (not tracked or isinstance(momentum, float | int))
    )


def _write_out(graph_module: GraphModule, node: Node, bound: dict[str, Any], groups: int) -> None:
    graph = graph_module.graph
    x: Node = bound["input"]
    value: torch.Tensor = x.meta["val"]
    shape = [int(size) for size in value.shape]
    if shape[0] % groups:
        raise UsageError(
            f"batch norm {node.name}: per-device statistics take the batch in {groups} "
            f"slices, one a device, but its batch is {shape[0]}; pass a batch that is a "
            f"multiple of {groups}, or batch_norm='sync'"
        )
    channels = shape[1]
    n = math.prod(shape) // channels // groups
    affine = [1, channels] + [1] * (len(shape) - 2)
    # statistics of each slice: the batch viewed as [G, N/G, C, ...], sums over all dims
    # but the slice and the channel; one slice (SyncBatchNorm's whole batch) needs no view
    sliced = [groups, shape[0] // groups, *shape[1:]] if groups > 1 else shape
    dims = [int(groups > 1), *range(2 + int(groups > 1), len(sliced))]
    broadcast = [groups, *affine] if groups > 1 else affine

    def add(op: Any, *args: Any, name: str = "", **kwargs: Any) -> Node:
        new = graph.create_node("call_function", op, args, kwargs, name=name or None)
        copy_meta(node, new)
        set_val(new)
        return new

    def per_channel(vector: Node, like: Node, to: list[int]) -> Node:
        """``vector`` ([G, C] or [C]) viewed ``to`` broadcast, in ``like``'s dtype."""
        return add(aten.view.default, add(aten.type_as.default, vector, like), to)

    with graph.inserting_before(node):
        # statistics accumulate in fp32 whatever the input's dtype at run time (bf16 under
        # autocast), as the reference kernels do; per-channel tensors are cast to the
        # input's dtype where they meet it (``type_as``), so the output keeps that dtype
        acc = torch.float64 if value.dtype == torch.float64 else torch.float32
        # x's dtype at run time, carried by an empty scalar: ``type_as(v, x)`` would need x
        # itself whole on every device (a rule cannot know that only its dtype is read),
        # while ``new_empty`` takes x in any layout
        dtype_of_x = add(aten.new_empty.default, x, [])
        xs = add(aten.view.default, x, sliced) if groups > 1 else x
        total = add(aten.sum.dim_IntList, xs, dims, name=f"{node.name}_sum", dtype=acc)
        mean = add(aten.div.Scalar, total, n, name=f"{node.name}_mean")  # [G, C]
        centered = add(aten.sub.Tensor, xs, per_channel(mean, dtype_of_x, broadcast))
        squares = add(aten.mul.Tensor, centered, centered)
        var = add(aten.div.Scalar, add(aten.sum.dim_IntList, squares, dims, dtype=acc), n)
        invstd = add(aten.rsqrt.default, add(aten.add.Scalar, var, float(bound["eps"])))
        # the last step is the node itself: it keeps its name, which the signature may hold
        last: tuple[Any, ...] = (
            aten.mul.Tensor,
            centered,
            per_channel(invstd, dtype_of_x, broadcast),
        )
        if groups > 1:
            last = (aten.view.default, add(*last), shape)
        for op, role in ((aten.mul.Tensor, "weight"), (aten.add.Tensor, "bias")):
            if bound.get(role) is not None:
                last = (op, add(*last), per_channel(bound[role], dtype_of_x, affine))
        running_mean, running_var = bound.get("running_mean"), bound.get("running_var")
        if running_mean is not None and running_var is not None:
            momentum = float(bound["momentum"])
            unbiased = n / max(n - 1, 1)
            for running, batch, scale in ((running_mean, mean, 1.0), (running_var, var, unbiased)):
                first = add(aten.detach.default, batch)
                if groups > 1:
                    first = add(aten.select.int, first, 0, 0)  # slice 0's, as DDP keeps
                kept = add(aten.mul.Scalar, running, 1.0 - momentum)
                fresh = add(aten.mul.Scalar, first, momentum * scale)
                add(aten.copy_.default, running, add(aten.add.Tensor, kept, fresh))
    node.target, node.args, node.kwargs = last[0], last[1:], {}
    set_val(node)
