"""In-place writes into intermediate tensors, made functional.

``torch.export`` keeps in-place ops. A write straight into a tensor (``h.add_(1)``) is
threaded through the graph (later readers of ``h`` read the in-place op's node), but the
op must then write into the very tensor its producer made: autograd refuses an in-place op
on the output of a collective's custom Function (which a reshard on the way gives it). A
write through a view (``h[:, :4].mul_(2)``, ``h[:, 0] = y``) is not threaded at all: later
readers of ``h`` read ``h``'s node, which the view aliases, and a reshard anywhere on the
way leaves them reading a tensor the write never reached. So each such write is rewritten
as the functional graph torch's own functionalization would make::

    h.add_(1)                       ->  h2 = add(h, 1)
    v = slice(h, 1, 0, 4);  mul_(v, 2);  use(h)
    ->  v = slice(h, 1, 0, 4);  y = mul(v, 2);  h2 = slice_scatter(h, y, 1, 0, 4);  use(h2)

(``select`` is put back with ``select_scatter``; a view of every element, a reshape, a
transpose, a permute or a ``detach``, by its inverse; ``copy_`` becomes a broadcast of its
source), one step per view on the way down to the written tensor, whose later readers then
read the result. Other views on the way (``expand``, ``diagonal``, ...), and in-place ops
with no out-of-place form, are refused with what to do; a direct write into a tensor of which a
view taken before it is read after it is left in place (that view must see it). Writes into
a placeholder (a buffer: replicated, ``autopar_passes.strategies.graph``) are left as they
are; writes into a user input are refused at trace.
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

RESHAPES = {  # views of every element in order, another shape
    aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.flatten.using_ints, aten.unflatten.int,
}  # fmt: skip
WHOLE = {  # views of every element: what a write through them writes is the base's
    *RESHAPES, aten.detach.default, aten.alias.default,
    aten.transpose.int, aten.t.default, aten.permute.default,
}  # fmt: skip
SCATTERS = {
    aten.slice.Tensor: aten.slice_scatter.default,
    aten.select.int: aten.select_scatter.default,
}


def functionalize_writes(graph_module: GraphModule) -> int:
    """Rewrite every in-place write into an intermediate tensor, directly or through
    slices and selects (see the module docstring); returns how many were."""
    graph = graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not mutates_first_input(node.target) or not node.args:
            continue
        chain = view_chain(node.args[0])
        written = chain[-1].args[0] if chain else node.args[0]
        if not isinstance(written, Node) or written.op == "placeholder":
            continue
        out_of_place = _out_of_place(node.target)
        blocked = next(
            (view for view in chain if view.target not in SCATTERS and view.target not in WHOLE),
            None,
        )
        if blocked is not None or out_of_place is None:
            what = f"through the view {blocked.target}" if blocked is not None else "with"
            raise UsageError(
                f"the model writes in place {what} into an intermediate tensor "
                f"({node.target} in {module_path(node) or 'forward'}); autopar makes such "
                "writes functional when they go straight into the tensor or through slices, "
                "selects, reshapes and transposes (x.add_(y), x[:, :4].mul_(2), x[:, 0] = y) "
                "with an op that has an out-of-place form: write this one out of place"
            )
        order = {n: index for index, n in enumerate(graph.nodes)}
        if not chain and _read_through_older_views(written, node, order):
            continue  # a view taken before the write sees it: left to run in place
        _rewrite(graph, node, chain, order, out_of_place)
        count += 1
    if count:
        graph.lint()
        graph_module.recompile()
    return count


def _read_through_older_views(tensor: Node, write: Node, order: dict[Node, int]) -> bool:
    """Whether a view of ``tensor`` taken before ``write`` is read after it."""
    for user in tensor.users:
        if user is write or order[user] > order[write] or not view_chain(user):
            continue
        if any(order.get(reader, -1) > order[write] for reader in user.users):
            return True
    return False


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


def _rewrite(
    graph: Any, node: Node, chain: list[Node], order: dict[Node, int], out_of_place: Any
) -> None:
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
    target = chain[0] if chain else node.args[0]
    if node.target == aten.copy_.default:
        shape = list(target.meta["val"].shape)
        written = added(aten.expand.default, node.args[1], shape)
    else:
        written = added(out_of_place, *node.args, **node.kwargs)
    written = added(aten.type_as.default, written, target)
    for user in list(node.users):
        user.replace_input_with(node, written)
    new_value = written
    for view, base in zip(chain, bases, strict=True):
        for user in readers[id(view)]:
            user.replace_input_with(view, new_value)
        new_value = _put_back(view, base, new_value, added)
        for user in readers[id(base)]:
            user.replace_input_with(base, new_value)
    graph.erase_node(node)


def _put_back(view: Node, base: Node, value: Node, added: Any) -> Node:
    """``base`` after ``view``'s elements took ``value``: scattered into it (a slice or a
    select), or ``value`` seen as ``base`` (a view of all its elements: reshaped, or with
    its dims put back in order)."""
    if view.target in SCATTERS:
        return added(SCATTERS[view.target], base, value, *_scatter_args(view))
    if view.target in RESHAPES:
        return added(aten.view.default, value, list(base.meta["val"].shape))
    if view.target in (aten.detach.default, aten.alias.default):
        return value
    dims = view.args[1] if view.target == aten.permute.default else None
    if dims is not None:
        inverse = sorted(range(len(dims)), key=lambda i: dims[i] % len(dims))
        return added(aten.permute.default, value, inverse)
    return added(view.target, value, *view.args[1:])  # transpose and t undo themselves


def _out_of_place(target: Any) -> Any:
    """``aten.mul_.Tensor`` -> ``aten.mul.Tensor``; ``copy_`` -> ``copy_`` (written as a
    broadcast of its source); None when there is none."""
    if target == aten.copy_.default:
        return target
    name = target._schema.name.removeprefix("aten::").removesuffix("_")
    for packet in (name, f"{name}_functional"):  # normal_ -> normal_functional
        found = getattr(getattr(aten, packet, None), target._overloadname, None)
        if found is not None:
            return found
    return None


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


def inline_grad_mode_regions(graph_module: GraphModule) -> int:
    """Inline every ``torch.no_grad()`` / ``torch.enable_grad()`` block that export wrapped
    in a ``wrap_with_set_grad_enabled`` call of a submodule, so its ops get rules like any
    other; what leaves a no-grad block is detached, as it was. Returns how many were."""
    graph = graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SET_GRAD:
            continue
        enabled, holder, *inputs = node.args
        sub = getattr(graph_module, holder.target)
        values = dict(zip(sub.graph.find_nodes(op="placeholder"), inputs, strict=True))
        with graph.inserting_before(node):
            returned = graph.graph_copy(sub.graph, values)
            outputs = list(returned) if isinstance(returned, tuple | list) else [returned]
            if not enabled:
                outputs = [_detached(graph, out) for out in outputs]
        for user in list(node.users):
            user.replace_all_uses_with(outputs[int(user.args[1])])
            graph.erase_node(user)
        graph.erase_node(node)
        if not holder.users:
            graph.erase_node(holder)
            delattr(graph_module, holder.target)
        count += 1
    if count:
        graph.lint()
        graph_module.recompile()
    return count


_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


def _detached(graph: Any, value: Node) -> Node:
    detached = graph.create_node("call_function", aten.detach.default, (value,), {})
    copy_meta(value, detached)
    set_val(detached)
    return detached
