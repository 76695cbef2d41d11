"""The expose pass: make a fused projection's parts visible to the sharding rules.

GPT-2 style attention computes q, k and v with one linear whose output is split in three::

    qkv = linear(x, W, b)                  # W: [3C, Cin], qkv: [B, T, 3C]
    q, k, v = split(qkv, C, dim=-1)

Megatron shards W by rows so each device gets *its* heads of q, k and v: rows
``[r C/n, (r+1) C/n)`` of each of the three blocks. That is not an even split of W's 3C
rows (it would mix q and k on one device), so no plain ``Shard`` of W can say it, and the
split after the linear could not run on a sharded dim. Written with the block as a dim of
its own, it is a plain shard::

    W3 = W viewed as [3, C, Cin]           # the parameter is planned in this shape
    qkv = einsum("abi,kci->abkc", x, W3) + b3        # [B, T, 3, C]
    q, k, v = unbind(qkv, dim=-2)

Now the output dim C (and W3's dim 1) can be sharded like any column-parallel linear, and
the unbind runs on an unsharded dim. The pass rewrites the graph so; the parameter's shape
in the plan becomes ``[3, C, Cin]`` (the runtime reshapes the user's tensor, and back in
``state_dict``). It applies when the linear's output has one user, a split (or chunk) into
``k > 1`` equal parts along the last dim, and weight and bias are parameters used only
there. Whether to shard is still the solver's decision.

Returns the parameters reshaped: ``{name: (original shape, planned shape)}``.
"""

from __future__ import annotations

import operator
import string

import torch
from torch.fx import GraphModule, Node

from passes.graph_edit import copy_meta, set_val

aten = torch.ops.aten


def expose_fused_projections(
    graph_module: GraphModule, params_of: dict[str, str]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rewrite fused linear-then-split projections (see the module docstring).

    ``params_of`` maps placeholder names to parameter names (the graph signature's)."""
    reshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    graph = graph_module.graph
    for node in list(graph.nodes):
        match = _match(node, params_of)
        if match is None:
            continue
        split, parts = match
        weight, bias = node.args[1], node.args[2] if len(node.args) > 2 else None
        assert isinstance(weight, Node)
        out_features, in_features = weight.meta["val"].shape
        block = out_features // parts
        reshaped[params_of[weight.name]] = (
            (out_features, in_features),
            (parts, block, in_features),
        )
        _reshape_placeholder(weight, (parts, block, in_features))
        if isinstance(bias, Node):
            reshaped[params_of[bias.name]] = ((out_features,), (parts, block))
            _reshape_placeholder(bias, (parts, block))
        x = node.args[0]
        assert isinstance(x, Node)
        lead = string.ascii_lowercase[: x.meta["val"].dim() - 1]
        equation = f"{lead}i,kci->{lead}kc"
        with graph.inserting_after(node):
            product = graph.call_function(aten.einsum.default, (equation, [x, weight]))
            copy_meta(node, product)
            set_val(product)
            last = product
            if isinstance(bias, Node):
                with graph.inserting_after(product):
                    last = graph.call_function(aten.add.Tensor, (product, bias))
                copy_meta(node, last)
                set_val(last)
            with graph.inserting_after(last):
                pieces = graph.call_function(aten.unbind.int, (last, -2))
            copy_meta(split, pieces)
            set_val(pieces)
        for user in list(split.users):
            assert user.target is operator.getitem
            with graph.inserting_before(user):
                piece = graph.call_function(operator.getitem, (pieces, user.args[1]))
            copy_meta(user, piece)
            piece.meta["val"] = pieces.meta["val"][user.args[1]]
            old_storage = user.meta["val"].untyped_storage()._cdata
            user.replace_all_uses_with(piece)
            graph.erase_node(user)
            _refresh_views(piece, old_storage)
        graph.erase_node(split)
        graph.erase_node(node)
    if reshaped:
        graph.lint()
        graph_module.recompile()
    return reshaped


def _match(node: Node, params_of: dict[str, str]) -> tuple[Node, int] | None:
    """(the split, number of parts) when ``node`` is a fused projection, else None."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return None
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    if not isinstance(weight, Node) or weight.name not in params_of or len(weight.users) != 1:
        return None
    if bias is not None and (
        not isinstance(bias, Node) or bias.name not in params_of or len(bias.users) != 1
    ):
        return None
    if len(node.users) != 1:
        return None
    (split,) = node.users
    out = node.meta["val"]
    if split.op != "call_function" or not all(u.target is operator.getitem for u in split.users):
        return None
    features = out.shape[-1]
    if split.target is aten.split.Tensor:
        size = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        parts = features // size if isinstance(size, int) and size and features % size == 0 else 0
    elif split.target is aten.chunk.default:
        parts = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        parts = parts if isinstance(parts, int) and features % parts == 0 else 0
    else:
        return None
    if dim not in (-1, out.dim() - 1) or parts < 2:
        return None
    return split, parts


def _refresh_views(start: Node, old_storage: int) -> None:
    """Recompute the fake values of the views downstream of ``start`` that read the storage
    it replaced: annotation tells which tensors alias which by their fake values' storage,
    so those views must now share the new tensor's."""
    pending = list(start.users)
    done: set[Node] = set()
    while pending:
        node = pending.pop(0)
        val = node.meta.get("val")
        if (
            node in done
            or not isinstance(val, torch.Tensor)
            or val.untyped_storage()._cdata != old_storage
        ):
            continue
        done.add(node)
        set_val(node)
        pending.extend(node.users)


def _reshape_placeholder(node: Node, shape: tuple[int, ...]) -> None:
    val = node.meta["val"]
    with val.fake_mode:
        node.meta["val"] = torch.empty(
            shape, dtype=val.dtype, device=val.device, requires_grad=val.requires_grad
        )
