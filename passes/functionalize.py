"""Writes through a view into an intermediate tensor, made functional.

``torch.export`` keeps in-place ops. A write straight into a tensor (``h.add_(1)``) is
threaded through the graph: later readers of ``h`` read the in-place op's node, so the
plan's dataflow holds even when the op runs on a copy in another layout. A write through a
view (``h[:, :4].mul_(2)``, ``h[:, 0] = y``) is not: later readers of ``h`` read ``h``'s
node, which the view aliases, and a reshard anywhere on the way would leave them reading
a tensor the write never reached. So such a write is rewritten as the functional graph
torch's own functionalization would make::

    v = slice(h, 1, 0, 4);  mul_(v, 2);  use(h)
    ->  v = slice(h, 1, 0, 4);  y = mul(v, 2);  h2 = slice_scatter(h, y, 1, 0, 4);  use(h2)

(``select`` is put back with ``select_scatter``), one scatter per view on the way down to
the written tensor, whose later readers then read the scattered result. Views other than
slices and selects on the way are refused with what to do. Writes into a placeholder (a
buffer: replicated, ``autopar_passes.strategies.graph``) are left as they are; writes into
a user input are refused at trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from autopar_passes.graph_edit import copy_meta, set_val
from autopar_passes.layers import module_path
from autopar_passes.strategies.inplace import mutates_first_input
from autopar_plans.errors import UsageError

aten = torch.ops.aten

SCATTERS = {
    aten.slice.Tensor: aten.slice_scatter.default,
    aten.select.int: aten.select_scatter.default,
}


def functionalize_view_writes(graph_module: GraphModule) -> int:
    """Rewrite every in-place write through slices and selects of an intermediate tensor
    (see the module docstring); returns how many were."""
    graph = graph_module.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not mutates_first_input(node.target) or not node.args:
            continue
        chain = view_chain(node.args[0])
        if not chain or chain[-1].args[0].op == "placeholder":
            continue
        blocked = next((view for view in chain if view.target not in SCATTERS), None)
        if blocked is not None:
            raise UsageError(
                f"the model writes in place through the view {blocked.target} into an "
                f"intermediate tensor ({node.target} in {module_path(node) or 'forward'}); "
                "autopar handles such writes through slices and selects (x[:, :4].mul_(2), "
                "x[:, 0] = y) only: write this one out of place"
            )
        _rewrite(graph, node, chain, order)
        count += 1
    if count:
        graph.lint()
        graph_module.recompile()
    return count


def view_chain(value: Any) -> list[Node]:
    """The views from ``value`` down to the tensor they alias (empty: no view)."""
    chain: list[Node] = []
    while isinstance(value, Node) and value.op == "call_function":
        schema = getattr(value.target, "_schema", None)
        returns = schema.returns if schema is not None else ()
        written = schema is not None and schema.arguments and schema.arguments[0].alias_info
        if not returns or returns[0].alias_info is None or not value.args:
            break
        if written and written.is_write:  # an earlier in-place op: its result is a tensor
            break
        chain.append(value)
        value = value.args[0]
    return chain


def _rewrite(graph: Any, node: Node, chain: list[Node], order: dict[Node, int]) -> None:
    after = order[node]
    bases = [view.args[0] for view in chain]  # what each view aliases, innermost first
    readers = {
        id(tensor): [user for user in tensor.users if order.get(user, -1) > after]
        for tensor in (*chain, *bases)
    }

    anchor = node

    def added(op: Any, *args: Any, **kwargs: Any) -> Node:
        nonlocal anchor
        with graph.inserting_after(anchor):
            anchor = graph.create_node("call_function", op, args, kwargs)
        copy_meta(node, anchor)
        set_val(anchor)
        return anchor

    # the write, out of place, kept in the written view's dtype; copy_'s out-of-place op has
    # no derivative, so its source is broadcast to the view's shape instead
    if node.target == aten.copy_.default:
        shape = list(chain[0].meta["val"].shape)
        written = added(aten.expand.default, node.args[1], shape)
    else:
        written = added(_out_of_place(node.target), *node.args, **node.kwargs)
    written = added(aten.type_as.default, written, chain[0])
    for user in list(node.users):
        user.replace_input_with(node, written)
    new_value = written
    for view, base in zip(chain, bases, strict=True):
        for user in readers[id(view)]:
            user.replace_input_with(view, new_value)
        new_value = added(SCATTERS[view.target], base, new_value, *_scatter_args(view))
        for user in readers[id(base)]:
            user.replace_input_with(base, new_value)
    graph.erase_node(node)


def _out_of_place(target: Any) -> Any:
    """``aten.mul_.Tensor`` -> ``aten.mul.Tensor``."""
    name = target._schema.name.removeprefix("aten::").removesuffix("_")
    return getattr(getattr(aten, name), target._overloadname)


def _scatter_args(view: Node) -> tuple[Any, ...]:
    """A view's own arguments, defaults filled in, as its scatter takes them."""
    names = list(view.target._schema.arguments)[1:]  # type: ignore[union-attr]
    given = list(view.args[1:])
    values = []
    for index, argument in enumerate(names):
        if index < len(given):
            values.append(given[index])
        elif argument.name in view.kwargs:
            values.append(view.kwargs[argument.name])
        else:
            values.append(argument.default_value)
    return tuple(values)
