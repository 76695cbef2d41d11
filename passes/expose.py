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
the unbind runs on an unsharded dim. Hugging Face's GPT-2 writes the same with a Conv1D,
``addmm(b, x2d, W)`` with ``W: [Cin, 3C]``, then a view back to ``[B, T, 3C]`` and the
split; its weight is planned as ``[Cin, 3, C]``. The pass rewrites the graph so; the
parameter's shape
in the plan becomes ``[3, C, Cin]`` (the runtime reshapes the user's tensor, and back in
``state_dict``). It applies when the projection's output has one user (for the Conv1D, one
view that keeps the last dim), a split (or chunk) into ``k > 1`` equal parts along the last
dim, and weight and bias are parameters used only there. Whether to shard is still the
solver's decision.

Returns the parameters reshaped: ``{name: (original shape, planned shape)}``.
"""

from __future__ import annotations

import operator
import string
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autopar_passes.graph_edit import copy_meta, set_val

aten = torch.ops.aten


@dataclass(frozen=True)
class Fused:
    """A fused projection found in the graph."""

    node: Node  # the linear (weight [F, Cin]) or addmm (GPT-2's Conv1D: weight [Cin, F])
    x: Node
    weight: Node
    bias: Node | None
    reshape: Node | None  # Conv1D: the view from [N, F] back to [B, T, F]
    split: Node
    parts: int

    @property
    def conv1d(self) -> bool:
        return self.node.target is aten.addmm.default


def expose_fused_projections(
    graph_module: GraphModule, params_of: dict[str, str]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rewrite fused projection-then-split patterns (see the module docstring).

    ``params_of`` maps placeholder names to parameter names (the graph signature's)."""
    reshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    graph = graph_module.graph
    for node in list(graph.nodes):
        fused = _match(node, params_of)
        if fused is None:
            continue
        weight, bias, parts = fused.weight, fused.bias, fused.parts
        rows, cols = weight.meta["val"].shape
        features = cols if fused.conv1d else rows
        block = features // parts
        planned = (rows, parts, block) if fused.conv1d else (parts, block, cols)
        reshaped[params_of[weight.name]] = ((rows, cols), planned)
        _reshape_placeholder(weight, planned)
        if bias is not None:
            reshaped[params_of[bias.name]] = ((features,), (parts, block))
            _reshape_placeholder(bias, (parts, block))
        lead = string.ascii_lowercase[: fused.x.meta["val"].dim() - 1]
        equation = f"{lead}i,ikc->{lead}kc" if fused.conv1d else f"{lead}i,kci->{lead}kc"
        last = _append(graph, fused.node, aten.einsum.default, (equation, [fused.x, weight]))
        if bias is not None:
            last = _append(graph, last, aten.add.Tensor, (last, bias), meta_from=fused.node)
        if fused.reshape is not None:
            shape = [*fused.reshape.meta["val"].shape[:-1], parts, block]
            last = _append(graph, last, aten.view.default, (last, shape), meta_from=fused.reshape)
        pieces = _append(graph, last, aten.unbind.int, (last, -2), meta_from=fused.split)
        for user in list(fused.split.users):
            assert user.target is operator.getitem
            with graph.inserting_before(user):
                piece = graph.call_function(operator.getitem, (pieces, user.args[1]))
            copy_meta(user, piece)
            piece.meta["val"] = pieces.meta["val"][user.args[1]]
            old_storage = user.meta["val"].untyped_storage()._cdata
            user.replace_all_uses_with(piece)
            graph.erase_node(user)
            _refresh_views(piece, old_storage)
        graph.erase_node(fused.split)
        if fused.reshape is not None:
            graph.erase_node(fused.reshape)
        graph.erase_node(fused.node)
    if reshaped:
        graph.lint()
        graph_module.recompile()
    return reshaped


def _append(
    graph: torch.fx.Graph,
    after: Node,
    target: Any,
    args: tuple[Any, ...],
    meta_from: Node | None = None,
) -> Node:
    """A new node right after ``after``, with the module path of ``meta_from`` (default
    ``after``) and its fake value."""
    with graph.inserting_after(after):
        node = graph.call_function(target, args)
    copy_meta(meta_from or after, node)
    set_val(node)
    return node


def _match(node: Node, params_of: dict[str, str]) -> Fused | None:
    """The fused projection ``node`` starts, or None."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
    elif node.target is aten.addmm.default and not node.kwargs:
        bias, x, weight = node.args[0], node.args[1], node.args[2]
    else:
        return None
    if not _only_used_here(weight, params_of) or not isinstance(x, Node):
        return None
    if bias is not None and not _only_used_here(bias, params_of):
        return None
    if len(node.users) != 1:
        return None
    (user,) = node.users
    reshape = None
    if node.target is aten.addmm.default:
        # Conv1D: [N, F] viewed back to [B, T, F] before the split; the view keeps F last
        if (
            user.target not in (aten.view.default, aten._unsafe_view.default)
            or len(user.users) != 1
            or user.meta["val"].shape[-1] != node.meta["val"].shape[-1]
        ):
            return None
        reshape, (user,) = user, tuple(user.users)
    parts = _equal_parts_on_last_dim(user, (reshape or node).meta["val"])
    if parts is None:
        return None
    assert isinstance(weight, Node)
    return Fused(node, x, weight, bias if isinstance(bias, Node) else None, reshape, user, parts)


def _only_used_here(value: Any, params_of: dict[str, str]) -> bool:
    return isinstance(value, Node) and value.name in params_of and len(value.users) == 1


def _equal_parts_on_last_dim(split: Node, out: torch.Tensor) -> int | None:
    """How many equal parts ``split`` cuts ``out``'s last dim into (None: not such a split)."""
    if (
        split.op != "call_function"
        or not split.users
        or not all(u.target is operator.getitem for u in split.users)
    ):
        return None
    features = out.shape[-1]
    if split.target is aten.split.Tensor:
        size = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        parts = features // size if isinstance(size, int) and size and features % size == 0 else 0
    elif split.target is aten.chunk.default:
        count = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        parts = count if isinstance(count, int) and features % count == 0 else 0
    else:
        return None
    if dim not in (-1, out.dim() - 1) or parts < 2:
        return None
    return parts


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
