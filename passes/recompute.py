"""Recompute candidates: regions of a layer whose activations backward can rebuild.

Activation memory is where a plan first stops fitting. A region of a layer can give up the
tensors autograd would save for it and run its forward again during backward
(``torch.utils.checkpoint``). Candidates, per repeated layer (``autopar_passes.layer_sharing``):

- ``full``: the whole layer (Megatron's full recompute); it keeps only its input, which the
  layer before it produced and which stays anyway.
- ``selective``: the parts that are large to store and cheap to rebuild (Korthikanti et
  al. 2022): a run of element-wise ops between two matmuls (the MLP activation: GELU, or
  SiLU and its product; an explicit softmax) together with the matmul that consumes it,
  since that matmul keeps the run's output for its backward. (With flash attention, the
  attention core keeps only q, k, v, its output and a small log-sum-exp, all kept by other
  ops too, so it frees nothing and is not a candidate; an explicit softmax is caught by the
  element-wise rule.)

A checkpointed region frees what its ops keep that is made inside it and kept by nobody
outside it; its inputs are kept by the checkpoint, and ops outside keep theirs. What a
region saves and costs depends on the strategies chosen (its tensors shrink with
their layouts), so each is given as coefficients per decision choice, for one layer:
``saving[d][k]`` bytes per device and ``forward[d][k]`` seconds. ``ilp.solve_ilp`` adds, per
region, how many of its layer copies to recompute (an integer in binary digits) and
linearises its products with the choices (see ``ilp.RecomputeTerm``); regions that cannot
share a layer share its copies (``recompute_budgets``), and ``chosen_layers`` says which
copies each takes. The tensor a region hands to the rest of the layer is
not saved by it (it is saved by its consumer, or kept as the next layer's input): only
what stays inside the region is.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from autopar_passes.annotation import META_KEY
from autopar_passes.costs import CostModel
from autopar_passes.decisions import Decisions
from autopar_passes.ilp import Matrix, RecomputeBudget, RecomputeTerm
from autopar_passes.problem import PairTerm
from autopar_plans.errors import HintError

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
    # resharded copies its consumers keep between two decisions (``problem.PairTerm``)
    kept: list[PairTerm] = field(default_factory=list)
    # the reshards between two decisions its replay makes again (forward seconds)
    replayed: list[PairTerm] = field(default_factory=list)
    saving_bound: float = 0.0
    forced: bool | None = None  # a hint's: True recompute every copy, False none

    def saving_at(self, choice: dict[str, int]) -> float:
        """Bytes per device one recomputed copy frees under ``choice``."""
        nodes = sum(row[choice[d]] for d, row in self.saving.items())
        return nodes + sum(copy.at(choice) for copy in self.kept)

    def forward_at(self, choice: dict[str, int]) -> float:
        """Forward seconds one recomputed copy adds under ``choice``."""
        nodes = sum(row[choice[d]] for d, row in self.forward.items())
        return nodes + sum(term.at(choice) for term in self.replayed)


def find_regions(
    graph: torch.fx.Graph,
    decisions: Decisions,
    cost: CostModel,
    representatives: dict[str, str],
    kept_copies: dict[tuple[str, int, str, int], PairTerm],
    reshard_forward: dict[tuple[str, int, str, int], PairTerm],
) -> list[Region]:
    """The recompute candidates of every repeated layer class, with their coefficients.
    ``kept_copies``: the resharded copies consumers keep (``ProblemParts.kept_copies``);
    ``reshard_forward``: the reshards' forward seconds (``ProblemParts.reshard_forward``)."""
    layer_nodes: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        note = node.meta[META_KEY]
        if note.layer is not None and node.op == "call_function" and note.outputs:
            layer_nodes[note.layer].append(node)
    savers = _savers(graph)
    classes: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for layer, nodes in sorted(layer_nodes.items()):
        signature = tuple(representatives.get(n.name, n.name) for n in nodes)
        classes[signature].append(layer)
    regions = []
    for layers in classes.values():
        first = layers[0]
        nodes = layer_nodes[first]
        candidates = [(f"layers[{first}] full", "full", nodes)]
        groups = _selective_groups(nodes)
        for index, group in enumerate(groups):
            if index % 2 and not _leaves_unkept(groups[index - 1], savers):
                continue  # the run's input is kept anyway: no need to recompute its matmul
            name = f"{_module(group[0])} {group[0].target} .. {group[-1].target}"
            if any(name == taken for taken, _, _ in candidates):  # names key the ILP's rows
                name = f"{name} #{len(candidates)}"
            candidates.append((name, "selective", group))
        for name, kind, members in candidates:
            region = Region(name, kind, tuple(n.name for n in members), {})
            by_position = {n.name: i for i, n in enumerate(nodes)}
            for layer in layers:
                others = layer_nodes[layer]
                region.copies[layer] = tuple(others[by_position[n.name]].name for n in members)
            _coefficients(region, members, decisions, cost, savers)
            _kept_copies(region, members, decisions, representatives, kept_copies)
            _replayed(region, members, decisions, representatives, reshard_forward)
            if region.saving_bound > 0:
                regions.append(region)
    return regions


def _savers(graph: torch.fx.Graph) -> dict[str, set[str]]:
    """Owner of a storage -> the nodes whose backward keeps it (directly or through views)."""
    savers: dict[str, set[str]] = defaultdict(set)
    for node in graph.nodes:
        note = node.meta[META_KEY]
        if not note.saved_inputs:
            continue
        tensors = [a for a in _flat_inputs(node) if isinstance(a.meta.get("val"), torch.Tensor)]
        for position in note.saved_inputs:
            if position < len(tensors):
                source = tensors[position]
                owner = source.meta[META_KEY].alias_of or source.name
                savers[owner].add(node.name)
    return savers


def _flat_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []

    def visit(value: object) -> None:
        if isinstance(value, torch.fx.Node):
            found.append(value)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(node.args)
    visit(node.kwargs)
    return found


def _selective_groups(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Runs of element-wise ops between two matmuls (an MLP's activation, an explicit
    softmax), each with the matmul that consumes it: that matmul keeps the run's output
    for its backward, so only with it inside does recomputing the run free anything.

    Each run comes twice (``find_regions`` keeps the second only when the first would keep
    an input nothing else keeps): as above, and with the matmul that made the run's input
    (and the views between): when nothing else keeps that input (attention's scores ``q k^T``,
    which the softmax reads but does not keep), the first form's checkpoint would keep it
    instead and free nothing; the second keeps the matmul's inputs (q and k, small) and
    recomputes it too, as Megatron's selective recomputation of the core attention does.
    The costs decide between them (``_coefficients``)."""
    groups: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    producer: list[torch.fx.Node] = []  # the last matmul and the views after it
    after_matmul = False
    constant: set[torch.fx.Node] = set()  # made from no tensor at all (a causal mask)
    for node in nodes:
        op = str(node.target)
        note = node.meta[META_KEY]
        if all(a in constant for a in node.all_input_nodes):
            constant.add(node)  # not part of a run, nor does it end one
            continue
        if op in MATMULS:
            if current and after_matmul:
                groups.append([*current, node])
                groups.append([*producer, *current, node])
            current, producer, after_matmul = [], [node], True
        elif op in SELECTIVE_OPS and note.fwd_flops == 0:
            current.append(node)
        elif note.kind == "view":
            if current:
                current.append(node)
            elif after_matmul:
                producer.append(node)
        else:
            current, producer, after_matmul = [], [], False
    return groups


def _module(node: torch.fx.Node) -> str:
    return node.meta[META_KEY].module or node.name


def _coefficients(
    region: Region,
    members: list[torch.fx.Node],
    decisions: Decisions,
    cost: CostModel,
    savers: dict[str, set[str]],
) -> None:
    """Per decision choice, for one copy of the layer: the bytes per device a checkpoint of
    the region frees, and the forward time it adds.

    It frees what its ops keep that is made inside it and kept by nobody outside it (ops
    outside still keep theirs; the region's inputs are kept by the checkpoint), and what its
    ops keep that is no tensor of the graph (statistics, masks)."""
    inside = {n.name for n in members}
    for node in members:
        binding = decisions.bindings.get(node.name)
        if binding is None or binding.source is not None:
            continue
        note = node.meta[META_KEY]
        keepers = savers.get(node.name, set())
        owns_freed = note.alias_of is None and bool(keepers) and keepers <= inside
        count = len(decisions.decisions[binding.decision].strategies)
        saving = region.saving.setdefault(binding.decision, [0.0] * count)
        forward = region.forward.setdefault(binding.decision, [0.0] * count)
        for k in range(count):
            strategy = decisions.strategy(node.name, k)
            saving[k] += cost.saved_bytes(note, strategy, output=owns_freed, node=node.name)
            forward[k] += cost.op_time(note, strategy)[0]
    _kept_boundary(region, members, decisions, cost, savers)


def _kept_copies(
    region: Region,
    members: list[torch.fx.Node],
    decisions: Decisions,
    representatives: dict[str, str],
    kept_copies: dict[tuple[str, int, str, int], PairTerm],
) -> None:
    """Add the resharded copies the region's ops keep, then bound the saving.

    Where a consumer's input is resharded, backward keeps the consumer's copy instead of
    the tensor (``problem._edge_costs`` counts the difference on the edge). A checkpoint
    keeps neither: the copy is made again when the region is replayed, so recomputing frees
    that difference as well. Counting only the tensor would free its bytes twice when the
    copy is smaller (a replicated output split for a matmul that keeps it), and let the
    solver buy memory that does not exist."""
    for copy in _reshard_terms(members, decisions, representatives, kept_copies):
        if copy.edge is not None:
            region.kept.append(copy)
        else:
            _add_own(region.saving, copy)
    region.saving_bound = sum(max(v) for v in region.saving.values()) + sum(
        max(0.0, *copy.values.values()) for copy in region.kept
    )


def _replayed(
    region: Region,
    members: list[torch.fx.Node],
    decisions: Decisions,
    representatives: dict[str, str],
    reshard_forward: dict[tuple[str, int, str, int], PairTerm],
) -> None:
    """Add the reshards the region's replay makes again to its forward time: those of its
    ops after the first (a reshard for the first op is made before the checkpoint, its
    input) up to the last op that keeps a tensor, where ``torch.utils.checkpoint`` stops
    replaying (the ledger's rule, ``autopar_passes.ledger.in_region``)."""
    keeping = [i for i, node in enumerate(members) if node.meta[META_KEY].keeps_tensor]
    replayed = members[1 : keeping[-1] + 1] if keeping else []
    for term in _reshard_terms(replayed, decisions, representatives, reshard_forward):
        if term.edge is not None:
            region.replayed.append(term)
        else:
            _add_own(region.forward, term)


def _reshard_terms(
    members: list[torch.fx.Node],
    decisions: Decisions,
    representatives: dict[str, str],
    terms: dict[tuple[str, int, str, int], PairTerm],
) -> list[PairTerm]:
    """The terms of the reshards into ``members``' inputs (by representative keys)."""
    found = []
    for node in members:
        binding = decisions.bindings.get(node.name)
        if binding is None or binding.source is not None or binding.mapping is not None:
            continue  # followers take their producer's layout: nothing is resharded
        for i, source in enumerate(decisions.choices[node.name].inputs):
            key = (
                representatives.get(source.producer, source.producer),
                source.index,
                representatives.get(node.name, node.name),
                i,
            )
            term = terms.get(key)
            if term is not None:
                found.append(term)
    return found


def _add_own(rows: dict[str, list[float]], term: PairTerm) -> None:
    """A term between choices of one decision, as that decision's per-choice row."""
    row = rows.setdefault(term.left, [0.0] * len(term.left_class))
    for k, pair in enumerate(zip(term.left_class, term.right_class, strict=True)):
        row[k] += term.values.get(pair, 0.0)


def _leaves_unkept(members: list[torch.fx.Node], savers: dict[str, set[str]]) -> bool:
    """Whether a checkpoint of ``members`` would keep an input that no op keeps."""
    inside = {n.name for n in members}
    return any(
        source.name not in inside
        and source.op == "call_function"
        and not savers.get(source.meta[META_KEY].alias_of or source.name)
        for node in members
        for source in _flat_inputs(node)
    )


def _kept_boundary(
    region: Region,
    members: list[torch.fx.Node],
    decisions: Decisions,
    cost: CostModel,
    savers: dict[str, set[str]],
) -> None:
    """Subtract the region's inputs that the checkpoint keeps and nothing kept before.

    A checkpoint keeps every tensor its region reads from outside. Most are kept anyway
    (the layer's input, a norm's input, a matmul's input); one that no op saved (say the
    bias-free output of the QKV projection that a selective region starts from) now stays
    until backward: the region's boundary, as Megatron's selective recompute keeps q, k, v.
    Parameters and the model's inputs live anyway."""
    inside = {n.name for n in members}
    seen: set[str] = set()
    for node in members:
        for source in _flat_inputs(node):
            if source.name in inside or source.op != "call_function" or source.name in seen:
                continue
            seen.add(source.name)
            note = source.meta[META_KEY]
            owner = note.alias_of or source.name
            binding = decisions.bindings.get(source.name)
            if savers.get(owner) or binding is None or not note.outputs:
                continue
            index = binding.item if binding.source is not None else 0
            producer = source.name if binding.source is None else binding.source
            info = decisions.choices[producer].note.outputs[index]  # type: ignore[union-attr]
            count = len(decisions.decisions[binding.decision].strategies)
            saving = region.saving.setdefault(binding.decision, [0.0] * count)
            for k in range(count):
                layout = decisions.output_layout(source.name, k)
                saving[k] -= cost.tensor_bytes(info, layout)


def _clash(a: Region, b: Region) -> bool:
    """Whether ``a`` and ``b`` cannot both be recomputed in a layer: one is the whole
    layer, or they share an op (checkpoints cannot nest or overlap)."""
    if a is b or sorted(a.copies) != sorted(b.copies):
        return False
    return "full" in (a.kind, b.kind) or bool(set(a.nodes) & set(b.nodes))


def recompute_terms(regions: list[Region], microbatches: int) -> list[RecomputeTerm]:
    """The ILP's view of the regions: one term per region."""
    return [
        RecomputeTerm(
            name=r.name,
            kind=r.kind,
            copies=len(r.copies),
            saving=r.saving,
            forward=r.forward,
            edge_saving=_by_edge(r.kept),
            edge_forward=_by_edge(r.replayed),
            weight=float(microbatches),
            forced=r.forced,
        )
        for r in regions
    ]


def _by_edge(terms: list[PairTerm]) -> dict[int, Matrix]:
    """The terms' values summed by edge (two on one edge: two inputs of one op)."""
    by_edge: dict[int, Matrix] = {}
    for term in terms:
        assert term.edge is not None
        matrix = by_edge.setdefault(term.edge, {})
        for pair, value in term.values.items():
            matrix[pair] = matrix.get(pair, 0.0) + value
    return by_edge


def recompute_budgets(regions: list[Region]) -> list[RecomputeBudget]:
    """Per layer class, the regions that share its copies: the full layer with each group
    of selective regions linked by shared ops (``_exclusive_groups``)."""
    budgets = []
    for members in _classes(regions).values():
        full = tuple(r.name for r in members if r.kind == "full")
        for group in _exclusive_groups(members):
            names = full + tuple(r.name for r in group)
            if len(names) > 1:
                budgets.append(RecomputeBudget(names, len(members[0].copies)))
    return budgets


def chosen_layers(regions: list[Region], counts: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Which layers each region recomputes, given how many (the ILP's counts): all at the
    front of the class, where a 1F1B pipeline's first stage holds the most microbatches in
    flight (``min(p - s, m)`` at stage ``s``; without a pipeline every layer holds the same,
    so the place is free). The full layer takes the first layers of its class; each group
    of selective regions sharing ops the layers after those, one region after another, so
    that no two regions that cannot share a layer meet (their counts fit the copies:
    ``recompute_budgets``)."""
    chosen: dict[str, tuple[int, ...]] = {}
    for members in _classes(regions).values():
        layers = sorted(members[0].copies)
        start = 0
        for region in members:
            if region.kind == "full":
                start = counts.get(region.name, 0)
                chosen[region.name] = tuple(layers[:start])
        for group in _exclusive_groups(members):
            first = start
            for region in group:
                count = counts.get(region.name, 0)
                chosen[region.name] = tuple(layers[first : first + count])
                first += count
    return {name: layers for name, layers in chosen.items() if layers}


def _classes(regions: list[Region]) -> dict[tuple[int, ...], list[Region]]:
    """Regions by the layers they repeat in (one layer class each)."""
    classes: dict[tuple[int, ...], list[Region]] = defaultdict(list)
    for region in regions:
        classes[tuple(sorted(region.copies))].append(region)
    return classes


def _exclusive_groups(members: list[Region]) -> list[list[Region]]:
    """The selective regions of one class in groups connected by shared ops (a run of
    element-wise ops, and the same run with the matmul that makes its input); the order
    is deterministic (``chosen_layers`` and ``recompute_budgets`` must agree on it)."""
    selective = [r for r in members if r.kind == "selective"]
    groups: list[list[Region]] = []
    for region in selective:
        linked = [g for g in groups if any(_clash(region, other) for other in g)]
        merged = [region]
        for group in linked:
            groups.remove(group)
            merged = group + merged
        groups.append(merged)
    return groups


@dataclass(frozen=True)
class RecomputeHint:
    """``recompute`` (``force``) or ``no_recompute`` of the modules a hint matched."""

    modules: tuple[str, ...]
    force: bool
    label: str  # the hint as the user wrote it, with its file and line


def apply_recompute_hints(
    regions: list[Region], hints: Sequence[RecomputeHint], graph: torch.fx.Graph
) -> None:
    """Set ``Region.forced`` from the hints (constraints of the ILP, ``RecomputeTerm``).

    ``recompute: [M]`` forces, in every layer class whose copies lie inside a module of
    ``M``, the largest candidate inside it (the whole layer if ``M`` is a layer, the
    selective region if ``M`` is, say, an MLP); ``no_recompute: [M]`` forbids every
    candidate that touches a module of ``M``. Identical layers share one set of variables
    (``autopar_passes.layer_sharing``), so a hint must take all copies of a class or none."""
    module_of = {n.name: n.meta[META_KEY].module or "" for n in graph.nodes}

    def inside(name: str, modules: tuple[str, ...]) -> bool:
        module = module_of.get(name, "")
        return any(module == m or module.startswith(m + ".") for m in modules)

    for hint in hints:
        affected: list[Region] = []
        for region in regions:
            test = all if hint.force else any
            hit = [test(inside(n, hint.modules) for n in names) for names in region.copies.values()]
            if any(hit) and not all(hit):
                raise HintError(
                    f"{hint.label}: it takes {sum(hit)} of the {len(hit)} identical layers of "
                    f"{region.name}, which are planned together; name them all (a glob such "
                    "as layers.*) or none"
                )
            if all(hit):
                affected.append(region)
        if hint.force:  # the largest candidates inside, none sharing an op with another
            kept: list[Region] = []
            for region in sorted(affected, key=lambda r: (-len(r.nodes), -r.saving_bound)):
                if not any(_clash(region, k) for k in kept):
                    kept.append(region)
            affected = kept
        if not affected:
            raise HintError(
                f"{hint.label}: no recompute candidate (a layer, or a run of "
                "cheap element-wise ops with the matmul after it) lies inside it"
            )
        for region in affected:
            if region.forced is not None and region.forced != hint.force:
                raise HintError(
                    f"{hint.label}: it contradicts another recompute hint on {region.name}"
                )
            region.forced = hint.force
