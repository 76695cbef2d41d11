"""The decompose pass: rewrite ops whose sharding needs a data-dependent count.

A mean-reduced cross-entropy over class-index targets divides the summed loss by the number
of targets that are not ``ignore_index`` (with a class ``weight``: by the summed weights of
those targets). That count depends on the data, so the loss cannot be sharded over the
batch as a mean; split into a sum and a count, both are sums over the batch (``Partial``
once sharded) and only the final scalar division needs them whole::

    loss = cross_entropy_loss(x, t, w, 1, ignore, smoothing)        # before
    loss_sum = cross_entropy_loss(x, t, w, 2, ignore, smoothing)    # after
    valid = ne(t, ignore)
    count = sum(valid)                       # without weight
    count = sum(mul(index(w, [mul(t, valid)]), valid))   # with weight: sum of w[t] kept
    count = to(count, loss dtype)            # when the dtypes differ
    loss = div(loss_sum, count)

Exact: torch's mean divides the nll term and the label-smoothing term by that same count
(``cross_entropy_loss_label_smoothing`` in ATen's ``LossNLL.cpp``), so the sum-reduced loss
over the count is the mean-reduced one, smoothing or not. ``nll_loss`` and ``nll_loss_nd``
are rewritten alike. Probability targets divide by a static count and are left alone.

Runs between ``torch.export`` and annotation. The rewritten node keeps its name and its
place (it becomes the division), so the exported program's signature, which names the
graph's outputs, stays right. Every node it adds gets ``meta["val"]`` (the op run on the
fake inputs in their fake mode), ``nn_module_stack`` and ``stack_trace`` from the original.

>>> exported = torch.export.export(model, (logits, targets), strict=False)  # doctest: +SKIP
>>> decompose_for_sharding(exported.graph_module)                           # doctest: +SKIP
1
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from autopar_passes.batch_norm import decompose_batch_norms
from autopar_passes.functionalize import functionalize_writes, inline_grad_mode_regions
from autopar_passes.graph_edit import copy_meta as _copy_meta
from autopar_passes.graph_edit import set_val as _set_val

aten = torch.ops.aten

MEAN, SUM = 1, 2  # torch's Reduction enum

# ops whose schema starts (self, target, weight, reduction, ignore_index); cross_entropy's
# label_smoothing follows and is passed through
_CLASS_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)


def decompose_for_sharding(graph_module: GraphModule, batch_norm_groups: int = 1) -> int:
    """Inline ``no_grad`` blocks and make in-place writes into intermediate tensors
    functional (``autopar_passes.functionalize``); rewrite every mean-reduced class-index
    cross-entropy (and nll_loss) in place into a sum-reduced loss divided by the count of
    targets kept; write out every training-mode batch norm (``autopar_passes.batch_norm``,
    statistics over each of ``batch_norm_groups`` slices of the batch). Returns how many
    were rewritten."""
    count = inline_grad_mode_regions(graph_module)
    count += _canonical_names(graph_module)
    count += functionalize_writes(graph_module)
    count += decompose_batch_norms(graph_module, batch_norm_groups)
    for node in list(graph_module.graph.nodes):
        if (
            node.op == "call_function"
            and node.target in _CLASS_LOSSES
            and _is_mean_of_indices(node)
        ):
            _rewrite_mean(graph_module, node)
            count += 1
    if count:
        graph_module.graph.lint()
        graph_module.recompile()
    return count


_AS = {aten.view_as.default: aten.view.default, aten.expand_as.default: aten.expand.default}


def _canonical_names(graph_module: GraphModule) -> int:
    """Ops that are another op under a second name, renamed so that one rule serves:
    ``multiply`` is ``mul``; ``view_as(x, y)`` is ``view(x, y's shape)`` and ``expand_as``
    an ``expand`` (shapes are static)."""
    count = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.multiply.Tensor:
            node.target = aten.mul.Tensor
            count += 1
        elif node.target in _AS:
            x, other = node.args[:2]
            node.target, node.args = _AS[node.target], (x, list(other.meta["val"].shape))
            count += 1
    return count


def _bound(node: Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    for index, argument in enumerate(node.target._schema.arguments):  # type: ignore[union-attr]
        if index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _is_mean_of_indices(node: Node) -> bool:
    """A mean reduction over class-index targets (integer, one dim fewer than the input)."""
    bound = _bound(node)
    target, weight = bound["target"], bound.get("weight")
    if bound["reduction"] != MEAN or not isinstance(target, Node):
        return False
    if weight is not None and not isinstance(weight, Node):
        return False
    target_val = target.meta.get("val")
    input_val = bound["self"].meta.get("val") if isinstance(bound["self"], Node) else None
    if not isinstance(target_val, torch.Tensor) or not isinstance(input_val, torch.Tensor):
        return False
    if target_val.dtype.is_floating_point or target_val.dtype == torch.bool:
        return False
    return target_val.dim() == max(input_val.dim() - 1, 0)


def _rewrite_mean(graph_module: GraphModule, node: Node) -> None:
    """Insert the sum-reduced loss and the count before ``node``; turn ``node`` into their
    division."""
    graph = graph_module.graph
    bound = _bound(node)
    target, weight, ignore_index = bound["target"], bound.get("weight"), bound["ignore_index"]
    loss_dtype = node.meta["val"].dtype

    def add(op: Any, *args: Any, name: str = "", **kwargs: Any) -> Node:
        new = graph.create_node("call_function", op, args, kwargs, name=name or None)
        _copy_meta(node, new)
        _set_val(new)
        return new

    with graph.inserting_before(node):
        sum_args = list(node.args)
        sum_kwargs = dict(node.kwargs)
        if len(sum_args) > 3:
            sum_args[3] = SUM
        else:
            sum_kwargs["reduction"] = SUM
        loss_sum = add(node.target, *sum_args, name=f"{node.name}_sum", **sum_kwargs)
        valid = add(aten.ne.Scalar, target, ignore_index, name=f"{node.name}_valid")
        if weight is None:
            count = add(aten.sum.default, valid, name=f"{node.name}_count")
        else:
            kept_target = add(aten.mul.Tensor, target, valid)  # ignored targets -> class 0
            target_weight = add(aten.index.Tensor, weight, [kept_target])
            kept_weight = add(aten.mul.Tensor, target_weight, valid)
            count = add(aten.sum.default, kept_weight, name=f"{node.name}_count")
        if count.meta["val"].dtype != loss_dtype:
            count = add(
                aten.to.dtype, count, loss_dtype, name=f"{node.name}_count_{_short(loss_dtype)}"
            )
    node.target = aten.div.Tensor
    node.args = (loss_sum, count)
    node.kwargs = {}
    _set_val(node)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
