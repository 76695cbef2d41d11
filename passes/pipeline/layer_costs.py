"""Per-layer costs of an intra-op solution, for cutting the model into pipeline stages.

Reads a ``Solved`` (strategies on one stage's mesh) and the annotated graph; writes one
``Part`` per layer plus the parts before the first layer (``pre``: embeddings) and after the
last (``post``: final norm, head). Every number is for one microbatch of the traced batch,
per device of a stage: forward and backward compute, resharding inside the part (forward
and backward), saved activations; and, per step, parameter state bytes, gradient sync and
the optimizer's step.
A node belongs to its layer; a node outside the layers goes to ``pre`` when it comes before
the first layer's first node in graph order, else to ``post``. A parameter used on both
sides (a tied embedding and head) is counted on both: both stages hold a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import torch

from autopar_cost_model.offload import (
    FETCHES_IN_FLIGHT,
    activation_offload_time,
    parameter_offload_time,
)
from autopar_passes.annotation import META_KEY, NodeAnnotation, TensorInfo, dtype_itemsize
from autopar_passes.costs import CallKey, CostModel, SyncCall
from autopar_passes.mixed_precision import autocast_dtypes
from autopar_passes.problem import (
    copy_bytes,
    first_keepers,
    is_regathered,
    param_readers,
    sole_keepers,
)
from autopar_passes.recompute import chosen_layers
from autopar_passes.solve import Solved
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel
from autopar_plans.placement import Layout


@dataclass(eq=False)  # parts are told apart by identity
class Part:
    """Costs of one layer (or the part before or after the layers) on one stage's mesh."""

    compute_s: float = 0.0  # forward + backward, one microbatch
    forward_s: float = 0.0
    comm_s: float = 0.0  # resharding inside the part, forward + backward, one microbatch
    # the ops and reshards behind compute_s and comm_s, to cost a smaller microbatch as it
    # runs (``at``): each op issued and each call launched again per microbatch, small
    # matmuls at their measured rate
    ops: list[tuple[NodeAnnotation, Strategy]] = field(default_factory=list)
    # (tensor, from, to, requires grad, regathered, a model output)
    edges: list[tuple[TensorInfo, Layout, Layout, bool, bool, bool]] = field(default_factory=list)
    cost: CostModel | None = None
    _at: dict[float, tuple[float, float, float]] = field(default_factory=dict)
    # parameter gathers (FSDP) and their adjoints, one microbatch: the same bytes whatever
    # its size, whole (``chain_time`` takes off what the prefetch hides)
    gather_s: float = 0.0
    # of those, the FSDP groups' gathers the runtime prefetches behind the part before
    # (forward) and their regathers behind the part after (backward), with the calls'
    # fixed costs (``CostModel.prefetched``, ``GroupCallCost.gather``, ``.regather``)
    prefetched: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # the FSDP group calls it runs (``CostModel.group_call``; in ``gather_s``, once a
    # group a microbatch): key -> (pass, fixed seconds, of which the prefetch hides)
    calls: dict[CallKey, tuple[int, float, float]] = field(default_factory=dict)
    overlap: float = 0.0  # the share of communication compute hides (``comm_overlap``)
    activations: float = 0.0  # saved bytes, one microbatch
    # autocast's 16-bit copies of fp32 weights the part's matmuls keep: cast once a step,
    # whatever the microbatches in flight (one autocast context around the schedule caches
    # them, ``autopar.runtime.compiled``), and held to its end
    casts: float = 0.0
    # those autocast casts anew at each call (a view of the weight), one microbatch
    call_casts: float = 0.0
    states: float = 0.0  # parameters + gradients + optimizer states
    # the three apart, as ``autopar_plans.MemoryBreakdown`` reports them: (params, grads, optimizer)
    state_terms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    sync_s: float = 0.0  # gradient synchronisation, one pass (``CostModel.sync_passes``)
    step_s: float = 0.0  # after the optimizer step: ZeRO's gathers of the masters
    optimizer_s: float = 0.0  # the optimizer's step of the part's parameters
    boundary_bytes: float = 0.0  # what the part hands to the next, per device
    recompute_s: float = 0.0  # forward run again in backward, one microbatch
    # offload (``autopar_plans.offload``): bytes in host memory (states; one microbatch's
    # saved activations), and the host link's exposed seconds, one microbatch (activations:
    # in ``compute_s`` too; the optimizer's copies are in ``optimizer_s``)
    host_of: dict[str, float] = field(default_factory=dict)  # name -> its host bytes
    host_activations: float = 0.0
    offload_s: float = 0.0
    # offloaded parameters: their fetches' exposed seconds, one microbatch (in
    # ``compute_s`` too, the same whatever the microbatch's size), and the local working
    # copies' bytes, of which a stage holds its largest part's twice (``fetch_transient``)
    fetch_s: float = 0.0
    working: float = 0.0
    params: dict[str, float] = field(default_factory=dict)  # name -> state bytes
    optimizer_of: dict[str, float] = field(default_factory=dict)  # name -> its step's seconds
    sync_of: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> sync, step
    # the bucket keys its parameters' gradient sync joins, each key's first call paid once
    # by the stage that holds it, however many of its parts join (``costs.SyncCall``)
    sync_calls: dict[tuple[object, ...], SyncCall] = field(default_factory=dict)

    def time_at(self, scale: float) -> float:
        """Per microbatch of ``scale`` times the traced batch: compute and resharding as
        they run at that size (``at``), parameter gathers as traced (the same bytes), whole:
        run alone, nothing before it hides them (``chain_time``)."""
        return self.compute_at(scale) + self.at(scale)[2] + self.gather_s

    def ops_at(self, scale: float) -> tuple[float, float]:
        """(forward, backward) seconds of the part's ops alone at ``scale``, without what
        recomputation and offload add: the compute the ledger hides a prefetched gather
        behind (``autopar_passes.ledger.op_compute``)."""
        forward, backward, _ = self.at(scale)
        extra = (self.recompute_s + self.offload_s) * scale + self.fetch_s
        return forward, backward - extra

    def compute_at(self, scale: float) -> float:
        """Forward and backward compute of a microbatch of ``scale`` times the traced batch."""
        forward, backward, _ = self.at(scale)
        return forward + backward

    def forward_at(self, scale: float) -> float:
        return self.at(scale)[0]

    def backward_at(self, scale: float) -> float:
        return self.at(scale)[1]

    def at(self, scale: float) -> tuple[float, float, float]:
        """(forward, backward, resharding) seconds of a microbatch of ``scale`` times the
        traced batch: every op and reshard costed at that size (``CostModel.op_time``,
        ``edge_time`` with ``batch``: an op's issue and a call's launch are paid whatever
        its size, a small matmul runs at its own rate), recomputation scaled. At ``1``,
        ``forward_s``, ``compute_s - forward_s`` and ``comm_s``."""
        if scale == 1.0 or self.cost is None:
            return (
                self.forward_s * scale,
                (self.compute_s - self.forward_s) * scale,
                self.comm_s * scale,
            )
        if scale not in self._at:
            cost = self.cost
            forward = backward = comm = 0.0
            for note, strategy in self.ops:
                f, b = cost.op_time(note, strategy, batch=scale)
                forward, backward = forward + f, backward + b
            for *reshard, output in self.edges:
                f, b = cost.edge_time(*reshard, output=output, batch=scale)
                comm += f + b
            extra = (self.recompute_s + self.offload_s) * scale + self.fetch_s
            self._at[scale] = (forward, backward + extra, comm)
        return self._at[scale]


def without_calls(part: Part, keys: Iterable[CallKey]) -> Part:
    """``part`` without the group calls of ``keys``: run on the same stage as a part that
    makes them (a tied weight's group, gathered once a microbatch for the embedding and
    the head alike)."""
    gather, hides = part.gather_s, list(part.prefetched)
    calls = dict(part.calls)
    for key in keys:
        side, seconds, hidden = calls.pop(key)
        gather -= seconds
        hides[side] -= hidden
    return replace(part, gather_s=gather, prefetched=hides, calls=calls)


def prefetch_hidden(before: Part, after: Part, scale: float) -> float:
    """Seconds per microbatch that FSDP's prefetch hides of two parts run one after the
    other on a stage: ``after``'s gathers behind ``before``'s forward, where ``before``
    gathers too (its gathers launch them: ``runtime.param_groups`` chains groups), and
    ``before``'s regathers behind ``after``'s backward, where ``after`` regathers. Each
    is ``f min(g, c)``, with ``f`` the share compute hides: the ledger's wait
    ``(1 - f) g + f max(0, g - c)`` (``autopar_cost_model.step.prefetch_waits``), taken
    off the whole ``g`` in ``time_at``. A gather whose chain skips a part that gathers
    nothing is taken as launched by nothing (the ledger hides it behind the group before)."""
    hidden = 0.0
    if before.prefetched[0] > 0:
        hidden += min(after.prefetched[0], before.ops_at(scale)[0])
    if after.prefetched[1] > 0:
        hidden += min(before.prefetched[1], after.ops_at(scale)[1])
    return before.overlap * hidden


def chain_time(parts: Sequence[Part], scale: float) -> float:
    """Per microbatch of ``scale`` times the traced batch, the time of ``parts`` run on one
    stage in this order (what runs before the layers first, what runs after last): each
    part's ``time_at``, less what each prefetch hides behind its neighbour
    (``prefetch_hidden``); the first part's gathers, and the last's regathers, wait whole."""
    total = sum(part.time_at(scale) for part in parts)
    return total - sum(prefetch_hidden(a, b, scale) for a, b in pairwise(parts))


def held_activations(parts: Sequence[Part], in_flight: float, scale: float) -> float:
    """Device bytes a stage of ``parts`` holds for backward at its peak: ``in_flight``
    microbatches of ``scale`` times the traced batch, autocast's weight copies (once, or
    once per microbatch where it casts them at each call), and offloaded parameters'
    working copies in flight (``fetch_transient``)."""
    per_microbatch = sum(scale * part.activations + part.call_casts for part in parts)
    once = sum(part.casts for part in parts)
    return in_flight * per_microbatch + once + fetch_transient(parts)


def fetch_transient(parts: Iterable[Part]) -> float:
    """Device bytes of offloaded parameters' working copies in flight on a stage of
    ``parts``: the part in use and the one prefetched, taken as twice the largest
    (``autopar_passes.problem.parameter_transient``)."""
    return FETCHES_IN_FLIGHT * max((part.working for part in parts), default=0.0)


def first_calls(parts: Iterable[Part]) -> tuple[float, float]:
    """The fixed costs of the first sync calls of the bucket keys the parts' parameters
    join, once a key (``costs.SyncCall``): those summed in backward (they join the
    gradient sync) and those after the optimizer step (ZeRO's gathers of the masters)."""
    joined: dict[tuple[object, ...], SyncCall] = {}
    for part in parts:
        joined.update(part.sync_calls)
    calls = joined.values()
    return (
        sum(c.seconds for c in calls if c.overlappable),
        sum(c.seconds for c in calls if not c.overlappable),
    )


@dataclass
class LayerCosts:
    pre: Part
    layers: list[Part]
    post: Part
    # the local gradient bytes of the parameters ``pre`` and ``post`` share (a tied
    # embedding), as stored: their gradients are summed across the end stages of a pipeline
    tied_grad_bytes: float = 0.0


def layer_costs(
    traced: TracedModel, solved: Solved, autocast: Mapping[str, str] | None = None
) -> LayerCosts:
    """Split the solution's costs by layer (see the module docstring). ``autocast``: each
    node's dtype under the plan's autocast, when the caller has it
    (``autopar_passes.mixed_precision.autocast_dtypes``)."""
    container = traced.layers
    count = container.count if container else 0
    cost = replace(
        solved.cost, batch_scale=1.0, in_flight=1.0
    )  # per traced microbatch; the search scales
    overlap = cost.mesh_cost.preset.comm_overlap
    parts = [Part(cost=cost, overlap=overlap) for _ in range(count)]
    pre, post = Part(cost=cost, overlap=overlap), Part(cost=cost, overlap=overlap)
    first_layer_seen = False
    part_of: dict[str, Part] = {}
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        if note.layer is not None and node.op != "placeholder":
            first_layer_seen = True
            part = parts[note.layer]
        elif note.layer is not None:
            part = parts[note.layer]
        else:
            part = post if first_layer_seen else pre
        part_of[node.name] = part
    # parameters outside layers go with the nodes that use them (a tied weight: with both)
    tied = 0.0
    for info in traced.params.values():
        users = {part_of[u.name] for n in info.nodes for u in _users(traced, n)}
        owners = users or {pre}
        layout = solved.output_layout(info.nodes[0])
        tensor = (
            traced.graph_module.graph.find_nodes(op="placeholder", target=info.nodes[0])[0]
            .meta[META_KEY]
            .outputs[0]
        )
        param = cost.param_cost(tensor, layout, info.nodes[0])
        if pre in owners and post in owners:
            tied += (
                tensor.numel * cost.stored_itemsize(tensor) / layout.shard_factor(cost.mesh_shape)
            )
        for part in owners:
            if info.name in part.params:
                continue
            part.params[info.name] = param.memory
            # an offloaded optimizer's step includes its copies over the host link
            stepped = param.optimizer_s + param.host_s
            part.optimizer_of[info.name] = stepped
            part.host_of[info.name] = param.host
            part.states += param.memory
            held = part.state_terms
            part.state_terms = (
                held[0] + param.params,
                held[1] + param.grads,
                held[2] + param.optimizer,
            )
            part.sync_of[info.name] = (param.sync_s, param.step_s)
            part.sync_s += param.sync_s
            for call in param.calls:
                part.sync_calls.setdefault(call.key, call)
            part.step_s += param.step_s
            part.optimizer_s += stepped
            if cost.offload.parameters:
                part.working += param.working
    decisions = solved.decisions
    kept: set[tuple[str, int]] = set()  # activations whose resharded copy is counted
    sole = sole_keepers(decisions)
    kept_by = first_keepers(decisions)
    for node in traced.graph.nodes:
        if node.name not in decisions.bindings or node.op not in ("call_function", "output"):
            continue
        binding = decisions.bindings[node.name]
        if binding.source is not None:
            continue
        note = node.meta[META_KEY]
        strategy = solved.strategy(node.name)
        part = part_of[node.name]
        if node.op == "call_function":
            fwd, bwd = cost.op_time(note, strategy)
            part.compute_s += fwd + bwd
            part.forward_s += fwd
            part.ops.append((note, strategy))
            saved = cost.activation_bytes(note, strategy, node.name)
            if cost.offload.activations:
                moved = activation_offload_time(saved, fwd, cost.mesh_cost.preset)
                part.compute_s += moved
                part.offload_s += moved
            internal = (
                cost.saved_bytes(note, strategy, output=False, node=node.name) if saved else 0
            )
            part.activations += internal
            # the value itself is held where the op that keeps it runs (a layer's output by
            # the next layer's norm: in a pipeline, on the stage that received it, while the
            # sender keeps nothing of it)
            keeper = kept_by.get(node.name)
            (part if keeper is None else part_of[keeper]).activations += saved - internal
        # (the output's inputs: the layouts the step returns its results in, as the ILP
        # costs them)
        if binding.mapping is not None:
            continue  # a follower takes its producer's layout as it is
        for i, source in enumerate(decisions.choices[node.name].inputs):
            producer = decisions.choices[source.producer]
            if producer.note is None:
                continue
            src = solved.output_layout(source.producer, source.index)
            reshard = (
                producer.note.outputs[source.index],
                src,
                strategy.inputs[i],
                producer.note.requires_grad,
                is_regathered(decisions, source.producer, node.name, i),
            )
            f, b = cost.edge_time(*reshard, param=source.producer, output=node.op == "output")
            if producer.kind == "param":
                part.gather_s += f + b
                gather, regather = cost.prefetched(*reshard, param=source.producer)
                part.prefetched[0] += gather
                part.prefetched[1] += regather
                call = cost.group_call(*reshard, param=source.producer)
                if call is not None:
                    for key, seconds, side in call.calls():
                        fixed = call.gather if side == 0 else call.regather
                        _, known, hidden = part.calls.get(key, (side, 0.0, 0.0))
                        part.calls[key] = (side, max(known, seconds), max(hidden, fixed))
                found = cost.autocast_saved
                if found is not None and (source.producer, node.name) in found.weight_casts:
                    info = producer.note.outputs[source.index]
                    copy = cost.weight_cast_bytes(info, src, strategy.inputs[i], source.producer)
                    if (source.producer, node.name) in found.call_casts:
                        part.call_casts += copy
                    else:
                        part.casts += copy
                continue
            part.comm_s += f + b
            part.edges.append((*reshard, node.op == "output"))
            if f and i in note.saved_inputs and (source.producer, source.index) not in kept:
                # backward keeps the resharded copy instead of the tensor itself (once
                # per tensor: the lowering makes one reshard per tensor and layout)
                kept.add((source.producer, source.index))
                info = producer.note.outputs[source.index]
                part.activations += copy_bytes(
                    cost, info, src, strategy.inputs[i], sole.get(source.producer) == node.name
                )
    for part in (pre, *parts, post):
        part.gather_s += sum(seconds for _, seconds, _ in part.calls.values())
        for side, _, hidden in part.calls.values():
            part.prefetched[side] += hidden
    if cost.offload.parameters:
        _fetches(traced, solved, cost, part_of)
    for layer, (saving, forward) in recomputed_layers(solved).items():
        parts[layer].activations -= saving
        parts[layer].compute_s += forward
        parts[layer].recompute_s += forward
    if cost.offload.activations:  # what each part saves is held on the host
        for part in (pre, *parts, post):
            part.host_activations = part.activations + part.casts + part.call_casts
            part.activations = part.casts = part.call_casts = 0.0
    if autocast is None:
        autocast = autocast_dtypes(traced, solved.cost.precision)
    for index, part in enumerate(parts):
        part.boundary_bytes = _boundary_bytes(
            traced, solved, part_of, part, parts[index + 1] if index + 1 < count else post, autocast
        )
    pre.boundary_bytes = _boundary_bytes(
        traced, solved, part_of, pre, parts[0] if parts else post, autocast
    )
    return LayerCosts(pre, parts, post, tied)


def _fetches(
    traced: TracedModel, solved: Solved, cost: CostModel, part_of: dict[str, Part]
) -> None:
    """Each offloaded parameter's fetches from the host, exposed beyond its readers'
    compute at their chosen strategies (``parameter_offload_time``), on the parts that
    read it (a tied weight: each fetches its own)."""
    readers = param_readers(solved.decisions)
    preset = cost.mesh_cost.preset
    for info in traced.params.values():
        node = info.nodes[0]
        tensor = _placeholder_info(traced, node)
        working = cost.param_cost(tensor, solved.output_layout(node), node).working
        by_part: dict[int, tuple[Part, float, float]] = {}
        for reader in (r for n in info.nodes for r in readers.get(n, ())):
            note = solved.decisions.choices[reader].note
            if note is None:
                continue
            part = part_of[reader]
            forward, backward = cost.op_time(note, solved.strategy(reader))
            _, f, b = by_part.get(id(part), (part, 0.0, 0.0))
            by_part[id(part)] = (part, f + forward, b + backward)
        for part, forward, backward in by_part.values():
            moved = parameter_offload_time(working, forward, backward, preset)
            part.compute_s += moved
            part.fetch_s += moved


def _placeholder_info(traced: TracedModel, name: str) -> TensorInfo:
    (node,) = traced.graph_module.graph.find_nodes(op="placeholder", target=name)
    return node.meta[META_KEY].outputs[0]


def recomputed_layers(solved: Solved) -> dict[int, tuple[float, float]]:
    """Layer index -> (activation bytes freed, forward seconds added) per traced
    microbatch, for the recompute regions the solver chose, in the layers
    ``autopar_passes.recompute.chosen_layers`` gives them."""
    found: dict[int, tuple[float, float]] = {}
    scale = solved.cost.batch_scale or 1.0
    layers_of = chosen_layers(solved.regions, solved.recompute)
    for region in solved.regions:
        chosen = layers_of.get(region.name, ())
        if not chosen:
            continue
        saving = region.saving_at(solved.choice) / scale
        forward = region.forward_at(solved.choice)
        for layer in chosen:
            old = found.get(layer, (0.0, 0.0))
            found[layer] = (old[0] + saving, old[1] + forward)
    return found


def _users(traced: TracedModel, name: str) -> list[torch.fx.Node]:
    (node,) = traced.graph.find_nodes(op="placeholder", target=name)
    return list(node.users)


def _boundary_bytes(
    traced: TracedModel,
    solved: Solved,
    part_of: dict[str, Part],
    part: Part,
    following: Part,
    autocast: Mapping[str, str],
) -> float:
    """Bytes per device of the tensors ``part`` produces that later parts consume: what a
    pipeline cut after it sends to the next stage (its local shards, in the dtype the run
    makes them: ``autocast``, ``autopar_passes.mixed_precision.autocast_dtypes``)."""
    mesh_shape = solved.cost.mesh_shape
    total = 0.0
    for node in traced.graph.nodes:
        if part_of.get(node.name) is not part or node.op != "call_function":
            continue
        crosses = any(
            part_of.get(user.name) not in (part, None) and user.op != "output"
            for user in node.users
        )
        if not crosses or node.name not in solved.decisions.bindings:
            continue
        note = node.meta[META_KEY]
        if note.kind == "view" and note.alias_of is not None:
            continue  # sent with its base
        layout = solved.output_layout(node.name)
        info = note.outputs[0]
        dtype = autocast.get(node.name)  # as autocast makes it (a residual sum stays fp32)
        itemsize = dtype_itemsize(dtype) if dtype else solved.cost.wire_itemsize(info)
        total += itemsize * info.numel / layout.shard_factor(mesh_shape)
    del following
    return total
