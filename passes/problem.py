"""Turn decisions and the cost model into the ILP's coefficients (``ilp.IlpProblem``).

For every decision choice: the compute time of its members and followers (forward and
backward), their activation memory, the parameters' memory and gradient synchronisation
(overlappable with one microbatch's backward pass, ``CostModel.sync_passes`` times a step),
the optimizer's step of the piece each device steps, and what runs after it (ZeRO's gathers
of the masters); under offload its host bytes and host-link seconds (offloaded parameters:
their fetches every microbatch, and their working copies in flight per layer group, of
which the memory row holds the largest, ``IlpProblem.transient``). For every edge between
two decisions: the resharding time matrix, forward plus the adjoint backward. Edges out of
a parameter (the all-gather of an FSDP-sharded weight, and its reduce-scatter in backward)
are inline like any other, their bytes priced at the speed of their FSDP group's one call
and the call's fixed cost paid once for the group (``ilp.GroupCall``). The runtime
prefetches each group's gather behind the group before (``runtime.param_groups``): the
edges carry what compute cannot hide of a gather, and ``ilp.PrefetchLink`` the wait the
rest leaves, by the ledger's rule, with the compute that hides it at its least (so the ILP
errs toward gathers costing more than they do).

Costs are computed once per *representative* edge and node and multiplied by how many
identical layers repeat them, so building the problem stays flat in depth.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from autopar_cost_model.offload import (
    FETCHES_IN_FLIGHT,
    activation_offload_time,
    parameter_offload_time,
)
from autopar_cost_model.step import backward_segments
from autopar_passes.annotation import TensorInfo
from autopar_passes.costs import CallKey, CostModel
from autopar_passes.decisions import Decisions
from autopar_passes.ilp import EdgeTerm, GroupCall, IlpProblem, Matrix, PrefetchLink
from autopar_plans.placement import Layout


@dataclass(frozen=True)
class PairTerm:
    """A quantity of one reshard per class pair of its edge, for one layer copy: the bytes
    of the resharded copy a consumer's backward keeps instead of the tensor (consumer's
    copy less the producer's tensor, ``kept_copies``), or the seconds the reshard takes
    forward (``reshard_forward``). ``edge`` is its index in ``IlpProblem.edges``, or None
    when producer and consumer are one decision (then the pair is ``(left_class[k],
    right_class[k])``)."""

    edge: int | None
    left: str
    right: str
    left_class: tuple[int, ...]
    right_class: tuple[int, ...]
    values: Matrix

    def at(self, choice: dict[str, int]) -> float:
        """The quantity under ``choice``."""
        pair = (self.left_class[choice[self.left]], self.right_class[choice[self.right]])
        return self.values.get(pair, 0.0)


@dataclass
class Prefetched:
    """The gathers of one place (``before`` the layers, one ``layer``, ``after``) in one
    pass, as ``PrefetchLink`` members."""

    edges: dict[int, dict[tuple[int, int], float]] = field(default_factory=dict)
    choices: dict[str, list[float]] = field(default_factory=dict)
    calls: dict[CallKey, float] = field(default_factory=dict)  # fixed cost
    # the last op (graph position) that keeps the place's gathered weights: where backward
    # reaches its regather (``runtime.regather.BackwardOrder``); -1: none kept
    kept_until: int = -1


@dataclass
class ProblemParts:
    """The ILP plus the per-choice breakdowns the plan's estimate reads back."""

    problem: IlpProblem
    compute_fwd: dict[str, list[float]] = field(default_factory=dict)
    compute_bwd: dict[str, list[float]] = field(default_factory=dict)
    activations: dict[str, list[float]] = field(default_factory=dict)
    model_states: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    sync: dict[str, list[float]] = field(default_factory=dict)  # one pass (sync_passes)
    after_step: dict[str, list[float]] = field(default_factory=dict)  # once a step, exposed
    optimizer_step: dict[str, list[float]] = field(default_factory=dict)  # once a step
    # offload (``autopar_plans.offload``): bytes kept in host memory (offloaded optimizer
    # state; saved activations, one microbatch's), and the host link's exposed seconds,
    # once a step (the optimizer's copies) and once a microbatch (the activations')
    host_states: dict[str, list[float]] = field(default_factory=dict)
    host_activations: dict[str, list[float]] = field(default_factory=dict)
    offload_step: dict[str, list[float]] = field(default_factory=dict)
    offload_microbatch: dict[str, list[float]] = field(default_factory=dict)
    # offloaded parameters: (group, decision) -> the local working copies' bytes of one
    # copy of the group (``fsdp_group_shares``' groups: a layer, before, after) per choice,
    # and the least any plan holds of them in flight (``parameter_transient``: a floor)
    working: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    transient: float = 0.0
    # each edge with its forward and backward matrices (over class pairs)
    edge_terms: list[tuple[EdgeTerm, Matrix, Matrix]] = field(default_factory=list)
    self_edge: dict[str, list[float]] = field(default_factory=dict)
    self_memory: dict[str, list[float]] = field(default_factory=dict)
    # (producer, output, consumer, input) of representatives -> the resharded copy that
    # consumer keeps for backward, per layer copy (what recomputing the consumer frees)
    kept_copies: dict[tuple[str, int, str, int], PairTerm] = field(default_factory=dict)
    # the same keys -> the reshard's forward seconds per layer copy, where a recompute
    # region's replay would make it again (not a parameter's: FSDP's gathers stay outside
    # the regions, ``lower_recompute``)
    reshard_forward: dict[tuple[str, int, str, int], PairTerm] = field(default_factory=dict)
    # (FSDP group, mesh axes) -> the fixed cost of its calls, once a microbatch
    group_calls: dict[CallKey, GroupCall] = field(default_factory=dict)
    # bucket key and axis -> its first call's fixed cost, once a sync (``costs.SyncCall``)
    sync_calls: dict[tuple[object, ...], GroupCall] = field(default_factory=dict)
    # what the runtime prefetches (FSDP groups' gathers, ``PrefetchLink``): per (place,
    # pass) the seconds of one copy of the place (``before`` the layers, ``layer3``,
    # ``after``), per edge pair, per choice or per group call; those seconds per edge pair
    # and per choice over all copies; each place's compute at its least (forward,
    # backward) for one copy; how many identical copies a place stands for
    prefetch: dict[tuple[str, int], Prefetched] = field(default_factory=dict)
    prefetchable: dict[int, Matrix] = field(default_factory=dict)
    self_prefetchable: dict[str, list[float]] = field(default_factory=dict)
    least_compute: dict[str, list[float]] = field(default_factory=dict)
    # each op's backward at its least, (graph position, seconds), one copy of a layer
    least_backward: list[tuple[int, float]] = field(default_factory=list)
    copies: dict[str, int] = field(default_factory=dict)

    def edge_memory(self, choice: dict[str, int]) -> float:
        """Bytes per device of the resharded copies the chosen strategies keep."""
        total = sum(self.self_memory[d][k] for d, k in choice.items())
        for term, _, _ in self.edge_terms:
            p = term.left_class[choice[term.left]]
            q = term.right_class[choice[term.right]]
            total += term.memory.get((p, q), 0.0)
        return total

    def edge_time(self, choice: dict[str, int]) -> float:
        """Resharding seconds of the chosen strategies (all inline: nothing prefetches)."""
        inline = sum(self.self_edge[d][k] for d, k in choice.items())
        for term, _, _ in self.edge_terms:
            p = term.left_class[choice[term.left]]
            q = term.right_class[choice[term.right]]
            inline += term.cost.get((p, q), 0.0)
        calls = self.group_calls.values()
        return inline + sum(c.cost for c in calls if c.runs(self.problem, choice))


def build_problem(
    decisions: Decisions,
    cost: CostModel,
    representatives: dict[str, str],
    memory_limit: float | None,
    allowed: dict[str, set[int]] | None = None,
    microbatches: int = 1,
    edges_of: ProblemParts | None = None,
) -> ProblemParts:
    """The ILP's coefficients. ``microbatches``: a step runs that many forward and backward
    passes (gradient accumulation, pipelines) but synchronises gradients once (ZeRO-2:
    every microbatch), so the objective weighs per-microbatch time (compute, resharding,
    parameter gathers) by it, and the sync is hidden behind one microbatch's backward per
    pass, as the runtime runs it (DDP's ``no_sync`` until the last backward); the returned
    breakdowns stay per microbatch. ``edges_of``: a problem of the same decisions and cost
    model but another ZeRO stage, whose resharding terms this one shares (they do not
    depend on the stage, unless a weight autocast copies is held cast by ZeRO: the caller
    knows, ``reuses_edges``)."""
    choices = {name: len(d.strategies) for name, d in decisions.decisions.items()}
    parts = ProblemParts(
        IlpProblem(choices=choices, memory_limit=memory_limit, allowed=dict(allowed or {}))
    )
    for name, count in choices.items():
        parts.compute_fwd[name] = [0.0] * count
        parts.compute_bwd[name] = [0.0] * count
        parts.activations[name] = [0.0] * count
        parts.model_states[name] = [(0.0, 0.0, 0.0)] * count
        parts.sync[name] = [0.0] * count
        parts.after_step[name] = [0.0] * count
        parts.optimizer_step[name] = [0.0] * count
        for row in (
            parts.host_states,
            parts.host_activations,
            parts.offload_step,
            parts.offload_microbatch,
        ):
            row[name] = [0.0] * count
        parts.self_edge[name] = [0.0] * count
        parts.self_memory[name] = [0.0] * count
    _node_costs(decisions, cost, representatives, parts)
    if edges_of is None:
        _edge_costs(decisions, cost, representatives, parts)
    else:
        parts.edge_terms = list(edges_of.edge_terms)
        parts.self_edge = {name: list(row) for name, row in edges_of.self_edge.items()}
        parts.self_memory = {name: list(row) for name, row in edges_of.self_memory.items()}
        parts.kept_copies = dict(edges_of.kept_copies)
        parts.reshard_forward = dict(edges_of.reshard_forward)
        parts.group_calls = dict(edges_of.group_calls)
        parts.prefetch = dict(edges_of.prefetch)
        parts.prefetchable = dict(edges_of.prefetchable)
        parts.self_prefetchable = dict(edges_of.self_prefetchable)
        parts.copies = dict(edges_of.copies)
    problem = parts.problem
    offloads_activations = cost.offload.activations
    parts.transient = parameter_transient(parts.working, parts.problem.allowed)
    problem.sync_passes = cost.sync_passes(microbatches)
    problem.overlap = overlap = cost.mesh_cost.preset.comm_overlap
    for name in choices:
        fwd, bwd = parts.compute_fwd[name], parts.compute_bwd[name]
        problem.hidden_by[name] = list(bwd)
        hideable = parts.self_prefetchable.get(name, [0.0] * len(fwd))
        cost_row, once_row = [], []
        for f, b, e, h, after, optimizer, host, host_mb in zip(
            fwd,
            bwd,
            parts.self_edge[name],
            hideable,
            parts.after_step[name],
            parts.optimizer_step[name],
            parts.offload_step[name],
            parts.offload_microbatch[name],
            strict=True,
        ):
            cost_row.append(
                microbatches * (f + b + e - overlap * h + host_mb) + after + optimizer + host
            )
            once_row.append(after + optimizer + host)
        problem.cost[name], problem.once[name] = cost_row, once_row
        problem.overlappable[name] = list(parts.sync[name])
        # offloaded activations (and the resharded copies consumers keep) leave the device
        on_device = 0.0 if offloads_activations else 1.0
        problem.memory[name] = [
            on_device * (a + e) + sum(m)
            for a, m, e in zip(
                parts.activations[name],
                parts.model_states[name],
                parts.self_memory[name],
                strict=True,
            )
        ]
    problem.edges = [
        replace(
            term,
            cost={
                pq: microbatches * (c - overlap * parts.prefetchable.get(e, {}).get(pq, 0.0))
                for pq, c in term.cost.items()
            },
        )
        if microbatches != 1 or e in parts.prefetchable
        else term
        for e, (term, _, _) in enumerate(parts.edge_terms)
    ]
    problem.transient = transient_rows(parts.working)
    if offloads_activations:
        problem.edges = [replace(term, memory={}) for term in problem.edges]
    problem.prefetch = _prefetch_links(parts, microbatches)
    hidden_calls = {
        key: sum(
            parts.copies.get(key[0], 1) * found.calls.get(key, 0.0)
            for (place, _), found in parts.prefetch.items()
            if place == key[0]
        )
        for key in parts.group_calls
    }
    problem.group_calls = [
        replace(call, cost=microbatches * (call.cost - overlap * hidden_calls[key]))
        for key, call in parts.group_calls.items()
    ] + list(parts.sync_calls.values())  # after the FSDP calls: ``PrefetchLink`` indexes them
    return parts


def _node_costs(
    decisions: Decisions, cost: CostModel, representatives: dict[str, str], parts: ProblemParts
) -> None:
    """Compute, memory and gradient sync of every node, per choice of its decision."""
    repeats = Counter(representatives.get(n, n) for n in decisions.bindings)
    # what hides each offloaded parameter's fetches: its readers' compute at its least
    hiding = least_reader_compute(decisions, cost) if cost.offload.parameters else {}
    layers_seen = False
    for node_name, binding in decisions.bindings.items():
        found = decisions.choices[node_name].note
        layer = None if found is None else found.layer
        layers_seen = layers_seen or layer is not None
        place = f"layer{layer}" if layer is not None else "after" if layers_seen else "before"
        rep = representatives.get(node_name, node_name)
        if rep != node_name or node_name in decisions.tied:
            continue  # counted through its representative (times the repeats) or its twin
        times = repeats[rep]
        choices = decisions.choices[node_name]
        if binding.source is not None or choices.kind in ("input", "buffer", "constant", "output"):
            continue
        name = binding.decision
        least: list[tuple[float, float]] = []
        for k in range(len(decisions.decisions[name].strategies)):
            strategy = decisions.strategy(node_name, k)
            note = choices.note
            assert note is not None
            if choices.kind == "param":
                pc = cost.param_cost(note.outputs[0], strategy.outputs[0], node_name)
                old = parts.model_states[name][k]
                parts.model_states[name][k] = (
                    old[0] + times * pc.params,
                    old[1] + times * pc.grads,
                    old[2] + times * pc.optimizer,
                )
                parts.sync[name][k] += times * pc.sync_s
                for call in pc.calls:
                    joined = parts.sync_calls.setdefault(
                        call.key, GroupCall(call.seconds, overlappable=call.overlappable)
                    )
                    joined.choices[name] = joined.choices.get(name, frozenset()) | {k}
                parts.after_step[name][k] += times * pc.step_s
                parts.optimizer_step[name][k] += times * pc.optimizer_s
                parts.host_states[name][k] += times * pc.host
                parts.offload_step[name][k] += times * pc.host_s
                if cost.offload.parameters:
                    _offloaded_param(parts, cost, node_name, name, k, pc.working, hiding, times)
                continue
            fwd, bwd = cost.op_time(note, strategy)
            parts.compute_fwd[name][k] += times * fwd
            parts.compute_bwd[name][k] += times * bwd
            saved = cost.activation_bytes(note, strategy, node_name)
            parts.activations[name][k] += times * saved
            if cost.offload.activations:
                parts.host_activations[name][k] += times * saved
                parts.offload_microbatch[name][k] += times * activation_offload_time(
                    saved, fwd, cost.mesh_cost.preset
                )
            least.append((fwd, bwd))
        if least:  # one copy's compute at its least, each pass apart
            held = parts.least_compute.setdefault(place, [0.0, 0.0])
            held[0] += min(f for f, _ in least)
            held[1] += min(b for _, b in least)
            parts.least_backward.append((decisions.position[node_name], min(b for _, b in least)))


def _edge_costs(
    decisions: Decisions, cost: CostModel, representatives: dict[str, str], parts: ProblemParts
) -> None:
    """Resharding costs between decisions, computed once per representative edge.

    Each edge's choices are grouped into layout classes (``ilp.EdgeTerm``); an edge whose
    two ends are one decision (a node consuming its own kind in the previous identical
    layer) costs ``R[class(k), class(k)]`` for choice ``k`` and joins the node costs.
    """
    counted: Counter[tuple[str, int, str, int]] = Counter()
    example: dict[tuple[str, int, str, int], tuple[str, int, str, int]] = {}
    for node_name, binding in decisions.bindings.items():
        if binding.mapping is not None or binding.source is not None:
            continue  # followers take their producer's layout as it is
        for i, source in enumerate(decisions.choices[node_name].inputs):
            key = (
                representatives.get(source.producer, source.producer),
                source.index,
                representatives.get(node_name, node_name),
                i,
            )
            counted[key] += 1
            example.setdefault(key, (source.producer, source.index, node_name, i))
    keeper = _first_keepers(decisions, example)
    sole = sole_keepers(decisions)
    for key, times in counted.items():
        producer, index, consumer, i = example[key]
        left = decisions.bindings[producer].decision
        right = decisions.bindings[consumer].decision
        note = decisions.choices[producer].note
        assert note is not None
        info = note.outputs[index]
        src_layouts = [
            decisions.output_layout(producer, k, index)
            for k in range(len(decisions.decisions[left].strategies))
        ]
        dst_layouts = [
            decisions.strategy(consumer, m).inputs[i]
            for m in range(len(decisions.decisions[right].strategies))
        ]
        left_classes, left_class = _classes(src_layouts)
        right_classes, right_class = _classes(dst_layouts)
        fwd_m: Matrix = {}
        bwd_m: Matrix = {}
        memory_m: Matrix = {}
        keeps = keeper.get((producer, index)) == (consumer, i)
        regathered = is_regathered(decisions, producer, consumer, i)
        output = decisions.choices[consumer].kind == "output"
        casts = cost.autocast_saved is not None and (
            (producer, consumer) in cost.autocast_saved.weight_casts
        )
        cast_m: Matrix = {}
        joins: dict[CallKey, set[tuple[int, int]]] = {}
        share = cost.gather_share.get(producer)
        place = None if share is None else share.group
        hide_m: dict[tuple[int, int], tuple[float, float]] = {}  # per pair, one copy
        for p, src in enumerate(left_classes):
            for q, dst in enumerate(right_classes):
                fwd, bwd = cost.edge_time(
                    info, src, dst, note.requires_grad, regathered, param=producer, output=output
                )
                call = cost.group_call(
                    info, src, dst, note.requires_grad, regathered, param=producer
                )
                if call is not None:
                    for call_key, seconds, side in call.calls():
                        joined = parts.group_calls.setdefault(call_key, GroupCall(0.0))
                        joined.cost = max(joined.cost, times * seconds)
                        joins.setdefault(call_key, set()).add((p, q))
                        fixed = call.gather if side == 0 else call.regather  # what prefetch hides
                        found = parts.prefetch.setdefault((call.group, side), Prefetched())
                        found.calls[call_key] = max(found.calls.get(call_key, 0.0), fixed)
                        if side == 1 and regathered:
                            found.kept_until = max(found.kept_until, decisions.position[consumer])
                    parts.copies[call.group] = max(parts.copies.get(call.group, 1), times)
                if place is not None:
                    gather, regather = cost.prefetched(
                        info, src, dst, note.requires_grad, regathered, param=producer
                    )
                    if gather or regather:
                        hide_m[(p, q)] = (gather, regather)
                if fwd or bwd:
                    fwd_m[(p, q)] = times * fwd
                    bwd_m[(p, q)] = times * bwd
                if keeps and fwd:
                    memory_m[(p, q)] = times * copy_bytes(
                        cost, info, src, dst, sole.get(producer) == consumer
                    )
                if casts:  # autocast's 16-bit copies of the weight, kept by the consumer
                    copies = cost.weight_copies(producer, consumer)
                    cast_m[(p, q)] = (
                        times * copies * cost.weight_cast_bytes(info, src, dst, producer)
                    )
        if place is not None and regathered and any(r for _, r in hide_m.values()):
            found = parts.prefetch.setdefault((place, 1), Prefetched())
            found.kept_until = max(found.kept_until, decisions.position[consumer])
        edge_index = None if left == right else len(parts.edge_terms)
        if memory_m:
            parts.kept_copies[key] = PairTerm(
                edge_index,
                left,
                right,
                left_class,
                right_class,
                {pq: value / times for pq, value in memory_m.items()},
            )
        if fwd_m and decisions.choices[producer].kind != "param":
            parts.reshard_forward[key] = PairTerm(
                edge_index,
                left,
                right,
                left_class,
                right_class,
                {pq: value / times for pq, value in fwd_m.items()},
            )
        # (not a kept copy: recompute's accounting of what a region frees leaves it out)
        for pq, value in cast_m.items():
            memory_m[pq] = memory_m.get(pq, 0.0) + value
        if left == right:
            for k, (p, q) in enumerate(zip(left_class, right_class, strict=True)):
                parts.self_edge[left][k] += fwd_m.get((p, q), 0.0) + bwd_m.get((p, q), 0.0)
                parts.self_memory[left][k] += memory_m.get((p, q), 0.0)
            for call_key, members in joins.items():
                chosen = parts.group_calls[call_key].choices
                pairs = enumerate(zip(left_class, right_class, strict=True))
                ks = {k for k, pq in pairs if pq in members}
                chosen[left] = chosen.get(left, frozenset()) | ks
            if hide_m and place is not None:
                count = len(left_class)
                row = parts.self_prefetchable.setdefault(left, [0.0] * count)
                for side in (0, 1):
                    seconds = parts.prefetch.setdefault((place, side), Prefetched())
                    mine = seconds.choices.setdefault(left, [0.0] * count)
                    for k, pq in enumerate(zip(left_class, right_class, strict=True)):
                        mine[k] += hide_m.get(pq, (0.0, 0.0))[side]
                for k, pq in enumerate(zip(left_class, right_class, strict=True)):
                    row[k] += times * sum(hide_m.get(pq, (0.0, 0.0)))
                parts.copies[place] = max(parts.copies.get(place, 1), times)
            continue
        edge = len(parts.edge_terms)
        for call_key, members in joins.items():
            parts.group_calls[call_key].edges[edge] = frozenset(members)
        if hide_m and place is not None:
            for side in (0, 1):
                seconds = parts.prefetch.setdefault((place, side), Prefetched())
                seconds.edges[edge] = {pq: pair[side] for pq, pair in hide_m.items() if pair[side]}
            parts.prefetchable[edge] = {pq: times * sum(pair) for pq, pair in hide_m.items()}
            parts.copies[place] = max(parts.copies.get(place, 1), times)
        # a parameter's gather is charged inline too (see the module's docs on prefetch)
        parts.edge_terms.append(
            (
                EdgeTerm(
                    left,
                    right,
                    left_class,
                    right_class,
                    {pq: fwd_m[pq] + bwd_m[pq] for pq in fwd_m},
                    memory_m,
                ),
                fwd_m,
                bwd_m,
            )
        )


def _offloaded_param(
    parts: ProblemParts,
    cost: CostModel,
    node: str,
    name: str,
    k: int,
    working: float,
    hiding: dict[str, tuple[float, float]],
    times: int,
) -> None:
    """An offloaded parameter's fetches per microbatch (exposed beyond its readers'
    compute, ``parameter_offload_time``) and its working copy's bytes for the transient
    term, one copy of its group (``times``: the identical layers it stands for)."""
    forward, backward = hiding.get(node, (0.0, 0.0))
    preset = cost.mesh_cost.preset
    fetched = parameter_offload_time(working, forward, backward, preset)
    parts.offload_microbatch[name][k] += times * fetched
    share = cost.gather_share.get(node)
    group = share.group if share is not None else node
    row = parts.working.setdefault((group, name), [0.0] * len(parts.offload_microbatch[name]))
    row[k] += working


def transient_rows(working: dict[tuple[str, str], list[float]]) -> list[dict[str, list[float]]]:
    """Per group, its decisions' device bytes in flight per choice (``IlpProblem.transient``)."""
    groups: dict[str, dict[str, list[float]]] = {}
    for (group, name), row in working.items():
        groups.setdefault(group, {})[name] = [FETCHES_IN_FLIGHT * b for b in row]
    return list(groups.values())


def parameter_transient(
    working: dict[tuple[str, str], list[float]],
    allowed: dict[str, set[int]],
    choice: dict[str, int] | None = None,
) -> float:
    """Device bytes of offloaded parameters' working copies in flight: the group in use and
    the one prefetched, taken as twice the largest group's (a layer's, or those before or
    after the layers). Under ``choice``, the chosen layouts' local pieces; without, each
    decision at its smallest allowed choice: the least any plan holds (a floor)."""
    groups: dict[str, float] = {}
    for (group, name), row in working.items():
        if choice is not None:
            held = row[choice[name]]
        else:
            held = min((row[k] for k in allowed.get(name, range(len(row)))), default=0.0)
        groups[group] = groups.get(group, 0.0) + held
    return FETCHES_IN_FLIGHT * max(groups.values(), default=0.0)


def param_readers(decisions: Decisions) -> dict[str, list[str]]:
    """Parameter placeholder -> the ops that read it, through views (a weight's transpose):
    the compute its working copy is on the device for."""
    users: dict[str, list[str]] = {}
    for name, choices in decisions.choices.items():
        for source in choices.inputs:
            users.setdefault(source.producer, []).append(name)
    readers: dict[str, list[str]] = {}
    for name, choices in decisions.choices.items():
        if choices.kind != "param":
            continue
        found: list[str] = []
        todo, seen = list(users.get(name, ())), set()
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            note = decisions.choices[node].note
            if note is not None and note.kind == "view":
                todo.extend(users.get(node, ()))
            elif decisions.choices[node].kind not in ("output", "getitem"):
                found.append(node)
        readers[name] = found
    return readers


def least_reader_compute(decisions: Decisions, cost: CostModel) -> dict[str, tuple[float, float]]:
    """Parameter placeholder -> its readers' (forward, backward) seconds, each reader at its
    fastest strategy: what hides its fetches at the least, so the ILP errs toward fetches
    costing more than they do (as it prices FSDP's prefetched gathers)."""
    least: dict[str, tuple[float, float]] = {}
    cache: dict[str, tuple[float, float]] = {}
    for param, readers in param_readers(decisions).items():
        forward = backward = 0.0
        for reader in readers:
            if reader not in cache:
                cache[reader] = _fastest(decisions, cost, reader)
            forward += cache[reader][0]
            backward += cache[reader][1]
        least[param] = (forward, backward)
    return least


def _fastest(decisions: Decisions, cost: CostModel, node: str) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` at its fastest strategy, each pass apart."""
    note = decisions.choices[node].note
    binding = decisions.bindings.get(node)
    if note is None or binding is None:
        return 0.0, 0.0
    count = len(decisions.decisions[binding.decision].strategies)
    times = [cost.op_time(note, decisions.strategy(node, k)) for k in range(count)]
    return min(t[0] for t in times), min(t[1] for t in times)


def _prefetch_links(parts: ProblemParts, microbatches: int) -> list[PrefetchLink]:
    """The runtime's prefetch chains as ``PrefetchLink``s, each pass once a microbatch:
    the forward's gathers in order (what runs before the layers, each layer, what runs
    after), each behind the place before it in the chain, the first behind nothing; the
    backward's regathers in the order backward reaches them (``runtime.regather.
    BackwardOrder``: by the last op that keeps each place's weights, latest first, so a tied
    embedding the head keeps comes first), each behind the backward of the ops between
    (``backward_segments``). A place that stands for ``n`` identical layers is ``n`` links:
    the first behind the place before, the others behind the layer. A place without
    gathers is no link, and one that could gather hides the next only where it does
    (``runtime.param_groups`` chains groups, not parts)."""
    places = {place for place, _ in parts.prefetch}
    layers = sorted((p for p in places if p.startswith("layer")), key=lambda p: int(p[5:]))
    forward = [p for p in ("before", *layers, "after") if p in places]
    calls = {key: i for i, key in enumerate(parts.group_calls)}

    def gathers(place: str, side: int) -> Prefetched | None:
        found = parts.prefetch.get((place, side))
        if found is None or not (found.edges or found.choices or any(found.calls.values())):
            return None
        return found

    backward = [p for p in forward[::-1] if gathers(p, 1) is not None]
    backward.sort(key=lambda p: parts.prefetch[(p, 1)].kept_until, reverse=True)
    reached = [parts.prefetch[(p, 1)].kept_until for p in backward]
    segments = dict(zip(backward, backward_segments(parts.least_backward, reached), strict=True))
    links = []
    for side, order in ((0, forward), (1, backward)):
        before: tuple[float, int] | None = None  # the chain's last place: compute, link
        for place in order:
            found = gathers(place, side)
            if found is None:
                continue
            compute = parts.least_compute.get(place, [0.0, 0.0])[side]
            members = {
                "edges": found.edges,
                "choices": found.choices,
                "calls": {calls[key]: s for key, s in found.calls.items() if s},
            }
            copies = parts.copies.get(place, 1)
            hiding, after = before if before is not None else (0.0, None)
            first = len(links)
            links.append(PrefetchLink(microbatches, hiding, after=after, **members))
            if copies > 1:
                weight = microbatches * (copies - 1)
                links.append(PrefetchLink(weight, compute, **members))
            before = (compute if side == 0 else segments[place], first)
    return links


def reuses_edges(cost: CostModel, other: CostModel) -> bool:
    """Whether two ZeRO stages' problems share their resharding terms: they do but where a
    ZeRO working copy held in the compute dtype spares autocast's copy of a weight (an edge
    memory term, ``CostModel.weight_cast_bytes``), which ZeRO-1 and -2 share and ZeRO-0
    does not."""
    casts = cost.autocast_saved is not None and bool(cost.working_cast)
    return not casts or (cost.zero > 0) == (other.zero > 0)


def is_regathered(decisions: Decisions, producer: str, consumer: str, index: int) -> bool:
    """Whether a parameter gathered for ``consumer``'s input ``index`` is gathered again in
    the backward: the op keeps it, and the runtime keeps no gathered weight
    (``autopar.runtime.regather``)."""
    note = decisions.choices[consumer].note
    return (
        decisions.choices[producer].kind == "param"
        and note is not None
        and index in note.saved_inputs
    )


def copy_bytes(cost: CostModel, info: TensorInfo, src: Layout, dst: Layout, sole: bool) -> float:
    """Bytes per device a consumer's backward adds by keeping a resharded copy (``dst``) of
    a tensor (in ``src``): the copy, less the tensor when this consumer was its ``sole``
    keeper (then the tensor, counted with its producer, is kept by nobody). Where others
    keep the tensor too, or keep it through a view, it stays: nothing comes off, which may
    count it twice but never frees memory that is still held."""
    copy = cost.tensor_bytes(info, dst)
    return copy - cost.tensor_bytes(info, src) if sole else copy


def _saves(decisions: Decisions) -> Iterator[tuple[str, str, bool]]:
    """(owner, consumer, through a view) for each saved input of each consumer, in the
    decisions' (graph) order: the owner is the node whose storage the input is, a view's
    ``alias_of``."""
    for consumer, choices in decisions.choices.items():
        note = choices.note
        if note is None or not note.saved_inputs:
            continue
        for i in note.saved_inputs:
            if i >= len(choices.inputs):
                continue
            producer = choices.inputs[i].producer
            source = decisions.choices[producer].note
            if source is None:
                continue
            owner = source.alias_of or producer
            yield owner, consumer, owner != producer


def first_keepers(decisions: Decisions) -> dict[str, str]:
    """Owner -> the first consumer (graph order) whose backward keeps its value, directly
    or through a view of it."""
    first: dict[str, str] = {}
    for owner, consumer, _ in _saves(decisions):
        first.setdefault(owner, consumer)
    return first


def sole_keepers(decisions: Decisions) -> dict[str, str]:
    """Producer -> the one consumer whose backward keeps its output, where exactly one
    does, directly (not through a view), and the producer's own activation counts that
    output (it owns its storage, has one output, and is no follower)."""
    keepers: dict[str, set[str]] = {}
    through_view: set[str] = set()
    for owner, consumer, viewed in _saves(decisions):
        keepers.setdefault(owner, set()).add(consumer)
        if viewed:
            through_view.add(owner)
    sole = {}
    for producer, kept_by in keepers.items():
        binding = decisions.bindings.get(producer)
        note = decisions.choices[producer].note if producer in decisions.choices else None
        if (
            len(kept_by) == 1
            and producer not in through_view
            and binding is not None
            and binding.source is None
            and note is not None
            and len(note.outputs) == 1
            and note.saved_bytes > note.internal_saved_bytes
        ):
            sole[producer] = next(iter(kept_by))
    return sole


def _first_keepers(
    decisions: Decisions, example: dict[tuple[str, int, str, int], tuple[str, int, str, int]]
) -> dict[tuple[str, int], tuple[str, int]]:
    """For each activation, the first consumer (graph order) whose backward keeps it.

    Consumers that need it in the same layout share one reshard (the lowering makes one per
    tensor and layout), so its copy is counted once, with the first: consumers of one
    tensor (q, k and v projections of the same input) almost always agree on the layout."""
    keepers: dict[tuple[str, int], tuple[str, int]] = {}
    for producer, index, consumer, i in example.values():
        choices = decisions.choices[producer]
        note = decisions.choices[consumer].note
        if choices.kind == "param" or note is None or i not in note.saved_inputs:
            continue
        keepers.setdefault((producer, index), (consumer, i))
    return keepers


def _classes(layouts: list[Layout]) -> tuple[list[Layout], tuple[int, ...]]:
    """Distinct layouts in first-seen order, and each choice's class index."""
    index: dict[Layout, int] = {}
    for layout in layouts:
        index.setdefault(layout, len(index))
    return list(index), tuple(index[layout] for layout in layouts)


def unmerged_size(decisions: Decisions) -> int:
    """Variables the ILP would have without follower merging, layer sharing and layout
    classes: one binary per strategy of every node, one per strategy pair of every edge
    (Alpa's formulation). Reported next to the real size."""
    binaries = sum(
        len(c.strategies)
        for c in decisions.choices.values()
        if c.kind not in ("getitem", "output") and len(c.strategies) > 1
    )
    pairs = 0
    for node in decisions.choices.values():
        if node.kind == "getitem":
            continue
        mine = len(node.strategies)
        for source in node.inputs:
            producer = decisions.choices[source.producer]
            theirs = (
                len(producer.strategies)
                if producer.kind != "getitem"
                else len(decisions.choices[producer.inputs[0].producer].strategies)
            )
            if mine > 1 and theirs > 1:
                pairs += mine * theirs
    return binaries + pairs
