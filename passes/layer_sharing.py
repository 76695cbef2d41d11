"""Find structurally identical layers, so the solver decides one layer and the rest follow.

Transformers repeat one block; planning each copy separately makes the ILP grow with depth.
Two layers are identical when their nodes, in graph order, have the same ops, output shapes,
non-tensor arguments and wiring: each tensor input comes from the same position in the same
layer, from the same position in the previous layer, or from the same node outside the
layers. Every node of a layer then maps to its *representative*, the node at the same
position in the first layer of its class.

Reads ``node.meta["autopar"].layer``; returns ``{node name: representative name}`` for nodes
inside layers (nodes outside map to nothing).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from autopar_passes.annotation import META_KEY

if TYPE_CHECKING:
    from autopar_passes.trace import TracedModel


def traced_representatives(traced: TracedModel) -> dict[str, str]:
    """``layer_representatives`` of a traced model's graph, found once per trace (every
    solve of the pipeline search asks)."""
    return traced.derived(("representatives",), lambda: layer_representatives(traced.graph))


def layer_representatives(graph: torch.fx.Graph) -> dict[str, str]:
    """Node name -> representative node name, for nodes of repeated, identical layers."""
    by_layer: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        layer = node.meta[META_KEY].layer
        if layer is not None and node.op in ("placeholder", "call_function"):
            by_layer[layer].append(node)
    position = {
        node: (layer, i) for layer, nodes in by_layer.items() for i, node in enumerate(nodes)
    }
    first_of_class: dict[tuple[Hashable, ...], int] = {}
    representatives: dict[str, str] = {}
    for layer in sorted(by_layer):
        nodes = by_layer[layer]
        signature = tuple(_signature(node, layer, position) for node in nodes)
        rep_layer = first_of_class.setdefault(signature, layer)
        for i, node in enumerate(nodes):
            representatives[node.name] = by_layer[rep_layer][i].name
    return representatives


def _signature(
    node: torch.fx.Node, layer: int, position: dict[torch.fx.Node, tuple[int, int]]
) -> Hashable:
    note = node.meta[META_KEY]

    def arg(value: Any) -> Hashable:
        if isinstance(value, torch.fx.Node):
            where = position.get(value)
            if where is None:
                return ("outside", value.name)
            if where[0] == layer:
                return ("here", where[1])
            if where[0] == layer - 1:
                return ("previous", where[1])
            return ("layer", where[0] - layer, where[1])
        if isinstance(value, list | tuple):
            return tuple(arg(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, arg(v)) for k, v in value.items()))
        return repr(value)

    if node.op == "placeholder":  # names differ per layer (p_layers_3_...); shapes must not
        return (node.op, note.kind, note.outputs)
    return (node.op, str(node.target), note.kind, note.outputs, arg(node.args), arg(node.kwargs))


@dataclass(frozen=True)
class LayerCopies:
    """The ops of layers identical to an earlier one, each with the op it copies (its
    representative, at the same position of the first layer of its class), and how a node
    the representative reads or keeps maps to the node the copy does: at the same position
    of the layer as far from the copy's as it is from the representative's; outside the
    layers, the same node. What a pass computes by running the graph (the autocast runs of
    ``autopar_passes.mixed_precision``) runs the representatives and copies the rest."""

    representative: dict[str, str]  # op of a copied layer -> the op it copies
    where: dict[str, tuple[int, int]]  # node inside the layers -> (layer, position)
    at: dict[tuple[int, int], str]  # the inverse

    def translate(self, name: str, copy: str) -> str | None:
        """What ``copy`` has where its representative has ``name`` (None: no such node)."""
        source = self.where.get(name)
        if source is None:
            return name
        shift = self.where[copy][0] - self.where[self.representative[copy]][0]
        return self.at.get((source[0] + shift, source[1]))


def layer_copies(
    graph: torch.fx.Graph, representatives: dict[str, str] | None = None
) -> LayerCopies:
    """The ops of ``graph``'s copied layers (``LayerCopies``); ``representatives``: its
    ``layer_representatives`` where known."""
    if representatives is None:
        representatives = layer_representatives(graph)
    position: dict[int, int] = defaultdict(int)
    where: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        layer = node.meta[META_KEY].layer
        if layer is not None and node.op in ("placeholder", "call_function"):
            where[node.name] = (layer, position[layer])
            position[layer] += 1
    copied = {
        node.name: representatives[node.name]
        for node in graph.nodes
        if node.op == "call_function" and representatives.get(node.name, node.name) != node.name
    }
    return LayerCopies(copied, where, {spot: name for name, spot in where.items()})
