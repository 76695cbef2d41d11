"""The recompute lowering: wrap a plan's recompute regions in activation checkpoints.

Reads a lowered program (``autopar_passes.lower_spmd``: its op nodes keep the traced graph's names)
and the plan's ``RecomputeRegion``s; writes the program with each region (in each layer the
plan applies it to) moved into a submodule that runs under non-reentrant
``torch.utils.checkpoint`` (``Recompute``): its forward keeps only the region's inputs, and
backward runs the region again. The random state is saved and restored by the checkpoint,
so dropout draws the same masks the second time; collectives inside a region run again in
backward, in the same order on every rank.

A region's nodes are the traced ops the plan names plus what the lowering added for them
only (reshards, collectives, local steps whose every user is in the region), but the
all-gathers of parameters, which stay outside with their layer's group.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.utils.checkpoint
from torch import nn

from autopar_passes.strategies.inplace import mutates_first_input
from autopar_plans.plan import RecomputeRegion


class Recompute(nn.Module):
    """Run ``body`` under non-reentrant activation checkpointing."""

    def __init__(self, body: torch.fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args: torch.Tensor) -> object:
        return torch.utils.checkpoint.checkpoint(
            self.body, *args, use_reentrant=False, preserve_rng_state=True
        )


def wrap_recompute(program: torch.fx.GraphModule, regions: Iterable[RecomputeRegion]) -> int:
    """Move every region's nodes (per layer) into a ``Recompute`` submodule of ``program``;
    returns how many were wrapped."""
    wrapped = 0
    for region in regions:
        per_layer = region_layers(region)
        for layer, names in per_layer.items():
            nodes = region_nodes(program.graph, set(names))
            if not nodes:
                continue
            base = f"recompute_{_slug(region.kind)}_{layer}_{wrapped}"
            _outline(program, nodes, free_name(program, base))
            wrapped += 1
    if wrapped:
        program.graph.lint()
        program.recompile()
    return wrapped


def region_layers(region: RecomputeRegion) -> dict[int, list[str]]:
    """The region's node names per layer (a region lists the same nodes in each layer)."""
    if not region.layers:
        return {0: list(region.nodes)}
    per = len(region.nodes) // len(region.layers)
    return {
        layer: list(region.nodes[i * per : (i + 1) * per]) for i, layer in enumerate(region.layers)
    }


def free_name(program: torch.nn.Module, base: str) -> str:
    """``base``, or ``base_2``, ...: unique in the module tree, which the programs of one
    rank share (pipeline stages, and the programs of other call shapes)."""
    name, suffix = base, 2
    while hasattr(program, name):
        name, suffix = f"{base}_{suffix}", suffix + 1
    return name


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def region_nodes(graph: torch.fx.Graph, names: set[str]) -> list[torch.fx.Node]:
    """The region's nodes in graph order: the named ops but those that write into an input
    or read a tensor that is written, and the nodes made only for them."""
    # an op that writes into its input (a batch norm's running statistics) runs once, in
    # the forward, with what computes only what it writes: recomputed in backward, it would
    # write twice. The checkpoint keeps a region's inputs and refuses one changed in place by
    # the time backward runs it again, so a region that reads a written tensor otherwise is
    # not recomputed at all
    writes = {n for n in graph.nodes if mutates_first_input(n.target)}
    kept_out = writes | _feeding_only(graph, writes)
    written = {w.args[0] for w in writes}
    # ops only: a pipeline stage's input is a placeholder named after the op that made it
    # on the stage before (the last op of a region there)
    inside = {
        n for n in graph.nodes if n.name in names and n.op == "call_function" and n not in kept_out
    }
    if any(arg in written for n in inside for arg in n.all_input_nodes):
        return []
    if not inside:
        return []
    changed = True
    while changed:  # helpers whose every user is inside join, back to front
        changed = False
        for node in reversed(list(graph.nodes)):
            if node in inside or node.op not in ("call_function", "call_module"):
                continue
            if node.name in names or node in kept_out or _gathers_parameter(node):
                continue
            if (
                node.users
                and all(user in inside for user in node.users)
                and not _is_traced_op(node)
            ):
                inside.add(node)
                changed = True
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(order[n] for n in inside if n.name in names)
    return [n for n in graph.nodes if n in inside and order[n] >= first]


def _feeding_only(graph: torch.fx.Graph, writes: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes whose every use leads only to ``writes``."""
    feeding: set[torch.fx.Node] = set()
    for node in reversed(list(graph.nodes)):
        if node.users and all(user in writes or user in feeding for user in node.users):
            feeding.add(node)
    return feeding


def _hoist(graph: torch.fx.Graph, inputs: list[torch.fx.Node], start: torch.fx.Node) -> None:
    """Move the region's inputs made after its start (its parameters' gathers, emitted
    before their users inside it), with what they read, to just before the start."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    late: set[torch.fx.Node] = set()
    pending = [arg for arg in inputs if order[arg] > order[start]]
    while pending:
        node = pending.pop()
        if node not in late:
            late.add(node)
            pending += [arg for arg in node.all_input_nodes if order[arg] > order[start]]
    for node in sorted(late, key=order.__getitem__):
        start.prepend(node)


def _gathers_parameter(node: torch.fx.Node) -> bool:
    """An all-gather of a parameter's shard (or of such a gather): it stays outside the
    region, as FSDP2 unshards a block before its checkpointed forward. The layer's group
    gathers it with the others, prefetched (``runtime.param_groups``), and the checkpoint
    saves the gathered weight as an input through the hooks outside it, which keep a
    recipe and gather it again in backward (``runtime.regather``), not the weight."""
    if node.op != "call_module" or not str(node.target).startswith("all_gather"):
        return False
    source = node.args[0] if node.args else None
    return isinstance(source, torch.fx.Node) and (
        source.op == "get_attr" or _gathers_parameter(source)
    )


def _is_traced_op(node: torch.fx.Node) -> bool:
    """Ops of the traced model (as opposed to what the lowering added) are aten ops."""
    return node.op == "call_function" and str(node.target).startswith("aten.")


def _outline(program: torch.fx.GraphModule, nodes: list[torch.fx.Node], name: str) -> None:
    """Replace ``nodes`` by one call of a ``Recompute`` submodule holding them."""
    members = set(nodes)
    inputs: list[torch.fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in inputs:
        env[arg] = body.placeholder(arg.name)
    for node in nodes:
        env[node] = body.node_copy(node, lambda n: env[n])
    body.output(tuple(env[n] for n in outputs) if len(outputs) != 1 else env[outputs[0]])
    module = torch.fx.GraphModule(program, body)  # takes the submodules the nodes call
    program.add_submodule(name, Recompute(module))
    graph = program.graph
    _hoist(graph, inputs, nodes[0])
    with graph.inserting_before(nodes[0]):
        call = graph.call_module(name, tuple(inputs))
    if len(outputs) == 1:
        outputs[0].replace_all_uses_with(call)
    else:
        anchor = call
        for index, node in enumerate(outputs):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (call, index))
            node.replace_all_uses_with(anchor)
    for node in reversed(nodes):
        graph.erase_node(node)
