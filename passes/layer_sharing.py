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
from typing import Any

import torch

from autopar_passes.annotation import META_KEY


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
