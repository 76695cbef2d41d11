"""Recompute candidates: regions of a layer whose activations backward can rebuild.

Activation memory is where a plan first stops fitting. A region of a layer can give up the
tensors autograd would save for it and run its forward again during backward
(``torch.utils.checkpoint``). Candidates, per repeated layer (``passes.layer_sharing``):

- ``full``: the whole layer (Megatron's full recompute); it keeps only its input, which the
  layer before it produced and which stays anyway.
- ``selective``: the parts that are large to store and cheap to rebuild (Korthikanti et
  al. 2022): the element-wise ops between a layer's matmuls that hold wide tensors (the MLP
  activation: GELU, SiLU and its product; a softmax; dropout), each a region of its own
  kind. (With flash attention, attention itself keeps only q, k, v, its output and a
  small log-sum-exp, so there is little to gain there; an explicit softmax is caught by the
  element-wise rule.)

What a region saves and costs depends on the strategies chosen (its tensors shrink with
their layouts), so each is given as coefficients per decision choice, for one layer:
``saving[d][k]`` bytes per device and ``forward[d][k]`` seconds. ``ilp.solve_ilp`` adds, per
region and per layer copy ``l``, a binary ``r[l]`` (recompute it) and linearises the products
with the choices (see ``ilp.py``). The tensor a region hands to the rest of the layer is
not saved by it (it is saved by its consumer, or kept as the next layer's input): only
what stays inside the region is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from passes.annotation import META_KEY
from passes.costs import CostModel
from passes.decisions import Decisions
from passes.ilp import RecomputeTerm

# element-wise ops that make wide activations cheaply
SELECTIVE_OPS = {
    "aten.gelu.default",
    "aten.silu.default",
    "aten.relu.default",
    "aten.tanh.default",
    "aten.mul.Tensor",
    "aten.sigmoid.default",
    "aten.softmax.int",
    "aten._softmax.default",
    "aten.dropout.default",
    "aten.pow.Tensor_Scalar",
    "aten.add.Tensor",
}
MATMULS = {
    "aten.linear.default",
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.matmul.default",
    "aten.einsum.default",
    "aten.baddbmm.default",
    "aten.scaled_dot_product_attention.default",
}


@dataclass
class Region:
    """One recompute candidate in every copy of a layer class."""

    name: str
    kind: str  # "full" or "selective"
    nodes: tuple[str, ...]  # in the representative layer
    copies: dict[int, tuple[str, ...]]  # layer index -> the same nodes in that layer
    saving: dict[str, list[float]] = field(default_factory=dict)  # decision -> per choice
    forward: dict[str, list[float]] = field(default_factory=dict)
    saving_bound: float = 0.0
    forward_bound: float = 0.0


def find_regions(
    graph: torch.fx.Graph, decisions: Decisions, cost: CostModel, representatives: dict[str, str]
) -> list[Region]:
    """The recompute candidates of every repeated layer class, with their coefficients."""
    layer_nodes: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        note = node.meta[META_KEY]
        if note.layer is not None and node.op == "call_function" and note.outputs:
            layer_nodes[note.layer].append(node)
    classes: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for layer, nodes in sorted(layer_nodes.items()):
        signature = tuple(representatives.get(n.name, n.name) for n in nodes)
        classes[signature].append(layer)
    regions = []
    for layers in classes.values():
        first = layers[0]
        nodes = layer_nodes[first]
        inside = {n.name for n in nodes}
        kept = _internal(nodes, inside)
        candidates = [(f"layers[{first}] full", "full", kept)]
        for group in _selective_groups(nodes, inside):
            candidates.append(
                (
                    f"{_module(group[0])} {group[0].target}",
                    "selective",
                    [n for n in group if n.name in {k.name for k in kept}],
                )
            )
        for name, kind, members in candidates:
            if not members:
                continue
            region = Region(name, kind, tuple(n.name for n in members), {})
            by_position = {n.name: i for i, n in enumerate(nodes)}
            for layer in layers:
                others = layer_nodes[layer]
                region.copies[layer] = tuple(others[by_position[n.name]].name for n in members)
            _coefficients(region, members, decisions, cost)
            if region.saving_bound > 0:
                regions.append(region)
    return regions


def _internal(nodes: list[torch.fx.Node], inside: set[str]) -> list[torch.fx.Node]:
    """Nodes whose output is used only inside the layer: what a checkpoint of the layer
    drops (the layer's output is the next layer's input and stays)."""
    return [n for n in nodes if n.users and all(u.name in inside for u in n.users)]


def _selective_groups(nodes: list[torch.fx.Node], inside: set[str]) -> list[list[torch.fx.Node]]:
    """Runs of element-wise ops between matmuls (an MLP's activation, a softmax)."""
    groups: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    for node in nodes:
        op = str(node.target)
        if op in SELECTIVE_OPS and node.meta[META_KEY].fwd_flops == 0:
            current.append(node)
            continue
        if op in MATMULS or node.meta[META_KEY].kind == "op":
            if current and any(node.meta[META_KEY].saved_bytes for node in current):
                groups.append(current)
            current = []
    if current and any(n.meta[META_KEY].saved_bytes for n in current):
        groups.append(current)
    # only runs that sit between two matmuls of the layer (the MLP activation), not the
    # residual adds at the layer's edges
    return [g for g in groups if _between_matmuls(g, nodes)]


def _between_matmuls(group: list[torch.fx.Node], nodes: list[torch.fx.Node]) -> bool:
    names = {n.name for n in group}
    producers = {a.name for n in group for a in n.all_input_nodes if a.name not in names}
    consumers = {u.name for n in group for u in n.users if u.name not in names}
    by_name = {n.name: n for n in nodes}
    return any(str(by_name[p].target) in MATMULS for p in producers if p in by_name) and any(
        str(by_name[c].target) in MATMULS for c in consumers if c in by_name
    )


def _module(node: torch.fx.Node) -> str:
    return node.meta[META_KEY].module or node.name


def _coefficients(
    region: Region, members: list[torch.fx.Node], decisions: Decisions, cost: CostModel
) -> None:
    """Per decision choice: the activation bytes the region's nodes hold and their forward
    time, for one copy of the layer."""
    for node in members:
        binding = decisions.bindings.get(node.name)
        if binding is None or binding.source is not None:
            continue
        note = node.meta[META_KEY]
        count = len(decisions.decisions[binding.decision].strategies)
        saving = region.saving.setdefault(binding.decision, [0.0] * count)
        forward = region.forward.setdefault(binding.decision, [0.0] * count)
        for k in range(count):
            strategy = decisions.strategy(node.name, k)
            saving[k] += cost.activation_bytes(note, strategy)
            forward[k] += cost.op_time(note, strategy)[0]
    region.saving_bound = sum(max(v) for v in region.saving.values())
    region.forward_bound = sum(max(v) for v in region.forward.values())


def recompute_terms(regions: list[Region], microbatches: int) -> list[RecomputeTerm]:
    """The ILP's view of the regions: one term per region, full ones excluding selective
    ones of the same layers."""
    full = {tuple(sorted(r.copies)): r.name for r in regions if r.kind == "full"}
    return [
        RecomputeTerm(
            name=r.name,
            kind=r.kind,
            copies=len(r.copies),
            saving=r.saving,
            forward=r.forward,
            saving_bound=r.saving_bound,
            forward_bound=r.forward_bound,
            weight=float(microbatches),
            excludes=None if r.kind == "full" else full.get(tuple(sorted(r.copies))),
        )
        for r in regions
    ]
