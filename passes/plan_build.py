"""Write the solver's choices down as a ``autopar_plans.Plan``, with the cost model's estimate.

Reads the ``TracedModel`` and the ``Solved`` result; writes per-parameter layouts (value,
gradient, optimizer state), per-op strategies, the parallelism summary read off the chosen
layouts, and the step estimate (compute, communication not hidden, memory per device).
"""

from __future__ import annotations

import math
from collections import Counter

from autopar_cost_model.compute import peak_flops
from autopar_cost_model.reshard import Reshard
from autopar_cost_model.step import exposed_gradient_sync, mfu
from autopar_passes.annotation import META_KEY
from autopar_passes.costs import dual, zero_layout_of
from autopar_passes.experts import expert_matmul
from autopar_passes.problem import is_regathered
from autopar_passes.recompute import chosen_layers
from autopar_passes.solve import Solved
from autopar_passes.strategies.graph import NodeChoices
from autopar_passes.strategies.moe import GROUPED_NAMES
from autopar_passes.trace import TracedModel
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import REPLICATE, Layout, Replicate, Shard
from autopar_plans.plan import (
    Estimate,
    MemoryBreakdown,
    OpPlan,
    Parallelism,
    ParamPlan,
    Plan,
    RecomputeRegion,
)

ADDED_FIRST = {"aten.addmm.default", "aten.baddbmm.default"}  # (bias, activation, weight)
MATMULS = {
    "aten.linear.default",
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.matmul.default",
    "aten.baddbmm.default",
    "aten.einsum.default",
    *GROUPED_NAMES,  # the experts' grouped matmuls (``autopar_passes.strategies.moe``)
}


def expand_layout(
    layout: Layout, groups: tuple[tuple[int, ...], ...], mesh_shape: tuple[int, ...]
) -> Layout:
    """A layout on a grouped mesh as the same layout on the mesh's own axes: each grouped
    axis's placement on every axis of its group (``autopar_passes.solve.group_axes``); on an axis
    of one device every placement is the whole tensor, written ``Replicate`` (a shard of
    one, or a partial sum of one term, would make the lowering split or sum for nothing)."""
    placements = [layout[i] for i, group in enumerate(groups) for _ in group]
    return Layout(
        *(REPLICATE if size == 1 else p for p, size in zip(placements, mesh_shape, strict=True))
    )


def build_plan(
    traced: TracedModel,
    solved: Solved,
    *,
    model: str,
    global_batch: int,
    microbatch_size: int,
    memory_limit: float | None,
    mesh: MeshSpec | None = None,
) -> Plan:
    """The plan, on ``mesh`` (default: the mesh solved on; a grouped mesh's layouts are
    expanded back onto ``mesh``'s axes, see ``expand_layout``)."""
    microbatches = global_batch // microbatch_size
    params = _param_plans(traced, solved)
    ops = _op_plans(traced, solved)
    estimate = _estimate(traced, solved, microbatches, params)
    plan = Plan(
        model=model,
        mesh=solved.cost.mesh_cost.mesh,
        recompute=_recompute_regions(traced, solved, microbatches),
        global_batch=global_batch,
        microbatch_size=microbatch_size,
        optimizer=solved.cost.optimizer,
        precision=solved.cost.precision,
        grad_reduction=solved.cost.reduction,
        offload=solved.cost.offload,
        memory_limit_bytes=memory_limit,
        parallelism=_parallelism(traced, solved, params, microbatches),
        estimate=estimate,
        params=params,
        ops=ops,
        solver=solved.report,
        warnings=tuple(solved.warnings + traced.warnings),
    )
    return _on_mesh(plan, mesh or plan.mesh, solved.axis_groups)


def _recompute_regions(
    traced: TracedModel, solved: Solved, microbatches: int
) -> tuple[RecomputeRegion, ...]:
    """The regions the solver chose to recompute, with the layers they apply in
    (``autopar_passes.recompute.chosen_layers``)."""
    found = []
    module_of = {node.name: node.meta[META_KEY].module for node in traced.graph.nodes}
    layers_of = chosen_layers(solved.regions, solved.recompute)
    for region in solved.regions:
        chosen = layers_of.get(region.name, ())
        copies = len(chosen)
        if not copies:
            continue
        nodes = tuple(n for layer in chosen for n in region.copies[layer])
        modules = tuple(sorted({module_of[n] for n in nodes}))
        # per traced microbatch, as the other figures (the solve may have weighted its
        # activations: a smaller microbatch, or a pipeline stage's in-flight ones)
        saving = region.saving_at(solved.choice) / (solved.cost.batch_scale or 1.0)
        forward = region.forward_at(solved.choice)
        found.append(
            RecomputeRegion(
                name=region.name,
                kind=region.kind,
                modules=modules,
                nodes=nodes,
                layers=tuple(chosen),
                saved_bytes=copies * saving,
                recompute_s=copies * forward * microbatches,
            )
        )
    return tuple(found)


def _on_mesh(plan: Plan, mesh: MeshSpec, groups: tuple[tuple[int, ...], ...]) -> Plan:
    """The same plan with every layout expanded from the grouped mesh onto ``mesh``."""

    def expand(layout: Layout | None) -> Layout | None:
        return None if layout is None else expand_layout(layout, groups, mesh.shape)

    params = {
        name: p.model_copy(
            update={
                "param": expand(p.param),
                "grad": expand(p.grad),
                "optimizer": expand(p.optimizer),
            }
        )
        for name, p in plan.params.items()
    }
    ops = {
        name: o.model_copy(
            update={"output": expand(o.output), "inputs": tuple(expand(i) for i in o.inputs)}
        )
        for name, o in plan.ops.items()
    }
    roles = plan.parallelism.axis_roles
    if roles and len(roles) != mesh.ndim:  # a grouped axis's role is each of its axes'
        spread = [""] * mesh.ndim
        for group, role in zip(groups, roles, strict=True):
            for axis in group:
                spread[axis] = role
        roles = tuple(spread)
    # an axis of one device splits nothing (inside a stage, the pipeline's own axis)
    roles = tuple(role if size > 1 else "" for role, size in zip(roles, mesh.shape, strict=False))
    parallelism = plan.parallelism.model_copy(update={"axis_roles": roles})
    return plan.model_copy(
        update={"mesh": mesh, "params": params, "ops": ops, "parallelism": parallelism}
    )


def _param_plans(traced: TracedModel, solved: Solved) -> dict[str, ParamPlan]:
    mesh_shape = solved.cost.mesh_shape
    plans: dict[str, ParamPlan] = {}
    for name, info in traced.params.items():
        layout = solved.output_layout(info.nodes[0])
        zero = zero_layout_of(layout, info.shape, mesh_shape) if solved.zero else layout
        plans[name] = ParamPlan(
            shape=info.shape,
            dtype=info.dtype,
            param=layout,
            grad=zero if solved.zero >= 2 else layout,
            optimizer=zero,
            aliases=info.aliases,
        )
    return plans


def _op_plans(traced: TracedModel, solved: Solved) -> dict[str, OpPlan]:
    ops: dict[str, OpPlan] = {}
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        if note.kind not in ("op", "view") or node.name not in solved.decisions.bindings:
            continue
        binding = solved.decisions.bindings[node.name]
        if binding.source is not None:
            continue  # getitem: output `item` of its source, recorded there
        strategy = solved.strategy(node.name)
        ops[node.name] = OpPlan(
            op=note.op,
            strategy=strategy.name,
            output=strategy.outputs[0],
            inputs=strategy.inputs,
            module=note.module,
            layer=note.layer,
        )
    return ops


def _parallelism(
    traced: TracedModel, solved: Solved, params: dict[str, ParamPlan], microbatches: int
) -> Parallelism:
    """Read the kinds of parallelism off the layouts, weighting matmuls by their FLOPs.

    An axis is data-parallel when most matmul FLOPs have their activation sharded on a
    token dim (the batch, or the sequence of a single long sample: data parallelism over
    tokens); tensor-parallel when most have their weight sharded on it and the activation
    not; sequence-parallel when, on a tensor-parallel axis, residual adds are sharded on
    dim 1 (the sequence) between the tensor-parallel matmuls. Expert matmuls
    (``autopar_passes.experts``) are counted apart: an axis is expert-parallel when most of their
    FLOPs have the expert weight sharded on its expert dim; dp and tp are read off the
    other matmuls. An axis that splits some matmuls but most in none of these ways is
    ``mixed``.
    """
    mesh_shape = solved.cost.mesh_shape
    batch, weight, total = Counter(), Counter(), 0
    experts, expert_total = Counter(), 0
    expert_dim: dict[str, int] = {}  # expert weight -> its expert dim
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        if note.op not in MATMULS or node.name not in solved.decisions.bindings:
            continue
        strategy = solved.strategy(node.name)
        if len(strategy.inputs) < 2:
            continue
        choices = solved.decisions.choices[node.name]
        found = expert_matmul(choices)
        if found is not None:
            expert_dim[str(choices.params[found.weight])] = found.weight_dim
            expert_total += note.fwd_flops
            for axis in range(len(mesh_shape)):
                if strategy.inputs[found.weight][axis] == Shard(found.weight_dim):
                    experts[axis] += note.fwd_flops
            continue
        # addmm and baddbmm take the added tensor first: (bias, activation, weight)
        act, wgt = (1, 2) if note.op in ADDED_FIRST else (0, 1)
        flops = note.fwd_flops
        total += flops
        tokens = len(note.outputs[0].shape) - 1  # dims before the feature dim
        for axis in range(len(mesh_shape)):
            first = strategy.inputs[act][axis]
            on_tokens = isinstance(first, Shard) and first.dim < tokens
            if on_tokens:
                batch[axis] += flops
            if isinstance(strategy.inputs[wgt][axis], Shard) and not on_tokens:
                weight[axis] += flops
    # an axis of one device parallelises nothing, whatever its placements say
    for counter in (batch, weight, experts):
        for axis, size in enumerate(mesh_shape):
            if size == 1:
                counter.pop(axis, None)
    dp_axes = [a for a in range(len(mesh_shape)) if total and batch[a] * 2 > total]
    tp_axes = [
        a for a in range(len(mesh_shape)) if total and weight[a] * 2 > total and a not in dp_axes
    ]
    ep_axes = [a for a in range(len(mesh_shape)) if expert_total and experts[a] * 2 > expert_total]
    # an axis that splits some matmuls but most in no one way: neither label is true of it
    labelled = {*dp_axes, *tp_axes, *ep_axes}
    mixed_axes = [
        a
        for a in range(len(mesh_shape))
        if a not in labelled and (batch[a] or weight[a] or experts[a])
    ]
    sp = any(_sequence_sharded(traced, solved, a) for a in tp_axes)

    # FSDP when most of the parameters' elements are stored split over a data-parallel
    # axis (a plan that splits only a bias that way is not); experts stored split on their
    # expert dim over an ep axis are not FSDP: used in place
    def fsdp_sharded(name: str, p: ParamPlan) -> bool:
        return any(
            isinstance(p.param[a], Shard)
            and not (name in expert_dim and a in ep_axes and p.param[a] == Shard(expert_dim[name]))
            for a in dp_axes
        )

    elements = sum(math.prod(p.shape) for p in params.values())
    fsdp = 2 * sum(math.prod(p.shape) for n, p in params.items() if fsdp_sharded(n, p)) > elements

    def product(axes: list[int]) -> int:
        size = 1
        for axis in axes:
            size *= mesh_shape[axis]
        return size

    kinds = (("data", dp_axes), ("tensor", tp_axes), ("expert", ep_axes), ("mixed", mixed_axes))
    roles = tuple(
        "+".join(kind for kind, axes in kinds if axis in axes) for axis in range(len(mesh_shape))
    )
    return Parallelism(
        dp=product(dp_axes),
        tp=product(tp_axes),
        sp=product(tp_axes) if sp else 1,
        ep=product(ep_axes),
        mixed=product(mixed_axes),
        zero=3 if fsdp else solved.zero,
        microbatches=microbatches,
        axis_roles=roles,
        sequence_split_ops=_sequence_split_ops(traced, solved),
    )


def _sequence_split_ops(traced: TracedModel, solved: Solved) -> int:
    """Ops whose output has a sequence (3 or more dims, dim 1 longer than 1) and is split on
    it over an axis of more than one device."""
    sizes = solved.cost.mesh_shape
    count = 0
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        if node.op != "call_function" or node.name not in solved.decisions.bindings:
            continue
        shape = note.outputs[0].shape if note.outputs else ()
        if len(shape) < 3 or shape[1] < 2 or solved.decisions.bindings[node.name].source:
            continue
        layout = solved.output_layout(node.name)
        if any(p == Shard(1) and size > 1 for p, size in zip(layout, sizes, strict=True)):
            count += 1
    return count


def is_residual_add(choices: NodeChoices) -> bool:
    """A transformer's residual add: two [batch, sequence, hidden] tensors of one shape, with
    a sequence to split (a bias added to a projection broadcasts, and does not count; nor
    does GShard's running count of the slots taken, (groups, 1, experts))."""
    call = choices.call
    if call is None or str(call.target) != "aten.add.Tensor" or len(call.inputs) != 2:
        return False
    left, right = call.inputs
    return len(left.shape) == 3 and left.shape == right.shape and left.shape[1] > 1


def _sequence_sharded(traced: TracedModel, solved: Solved, axis: int) -> bool:
    """Whether most residual adds are sharded on the sequence (dim 1) over ``axis``."""
    adds = [name for name, choices in solved.decisions.choices.items() if is_residual_add(choices)]
    if not adds:
        return False
    sharded = 0
    for name in adds:
        layout = solved.output_layout(name)
        if isinstance(layout[axis], Shard) and layout[axis].dim == 1:
            sharded += 1
    return sharded * 2 > len(adds)


def _estimate(
    traced: TracedModel, solved: Solved, microbatches: int, params: dict[str, ParamPlan]
) -> Estimate:
    parts = solved.parts
    choice = solved.choice
    compute = sum(parts.compute_fwd[d][k] + parts.compute_bwd[d][k] for d, k in choice.items())
    inline = parts.edge_time(choice)
    # the sync of one pass, hidden behind one microbatch's backward, ``sync_passes`` times
    # a step (``autopar_passes.problem``); ZeRO's gathers after the optimizer step, exposed
    passes = parts.problem.sync_passes
    sync = sum(parts.sync[d][k] for d, k in choice.items()) * passes
    after_step = sum(parts.after_step[d][k] for d, k in choice.items())
    optimizer = sum(parts.optimizer_step[d][k] for d, k in choice.items())
    compute_step = compute * microbatches
    backward = sum(parts.compute_bwd[d][k] for d, k in choice.items())
    overlap = parts.problem.overlap
    hidden = passes * exposed_gradient_sync(sync / passes, backward, parts.problem.buckets, overlap)
    hidden += after_step
    offload_s = sum(
        parts.offload_step[d][k] + microbatches * parts.offload_microbatch[d][k]
        for d, k in choice.items()
    )
    step = compute_step + inline * microbatches + hidden + optimizer + offload_s
    params_b = sum(parts.model_states[d][k][0] for d, k in choice.items())
    grads_b = sum(parts.model_states[d][k][1] for d, k in choice.items())
    optim_b = sum(parts.model_states[d][k][2] for d, k in choice.items())
    acts = sum(parts.activations[d][k] for d, k in choice.items()) + parts.edge_memory(choice)
    if solved.cost.offload.activations:  # held on the host (``Solved.host_memory``)
        acts = 0.0
    acts += solved.transient()  # offloaded parameters' copies in flight, as the search counts
    notes = [n.meta[META_KEY] for n in traced.graph.nodes]
    flops = float(sum(a.fwd_flops + a.bwd_flops for a in notes)) * microbatches
    mesh = solved.cost.mesh_cost.mesh
    peak = peak_flops(solved.cost.mesh_cost.preset, solved.cost.compute_dtype) or 1.0
    sent_edges, collectives, by_kind = _edge_traffic(traced, solved)
    sync_bytes = _sync_bytes(solved, params)
    sent = sent_edges * microbatches + sync_bytes
    sent_by_kind = {kind: nbytes * microbatches for kind, nbytes in by_kind.items()}
    if sync_bytes:
        sent_by_kind["gradient_sync"] = sync_bytes
    return Estimate(
        step_time_s=step,
        flops_per_step=flops,
        mfu=mfu(flops, step, peak, mesh.size) if step > 0 else 0.0,
        comm_bytes_per_step=sent,
        memory_per_device_bytes=MemoryBreakdown(
            params=params_b,
            grads=grads_b,
            optimizer=optim_b,
            activations=acts,
            total=params_b + grads_b + optim_b + acts,
            host=solved.host_memory(),
        ),
        compute_s=compute_step,
        optimizer_s=optimizer + sum(parts.offload_step[d][k] for d, k in choice.items()),
        offload_s=offload_s,
        comm_s=inline * microbatches + sync + after_step,
        exposed_comm_s=inline * microbatches + hidden,
        collectives=collectives,
        comm_bytes_by_kind=sent_by_kind,
    )


def _edge_traffic(
    traced: TracedModel, solved: Solved
) -> tuple[float, dict[str, int], dict[str, float]]:
    """Bytes a device sends per microbatch for resharding (forward and backward), the
    forward collectives by kind, one per (tensor, layout) as the lowering shares them, and
    the bytes by collective kind."""
    mesh_cost = solved.cost.mesh_cost
    total = 0.0
    counts: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    seen: set[tuple[str, int, Layout]] = set()
    for node in traced.graph.nodes:
        if node.name not in solved.decisions.bindings:
            continue
        binding = solved.decisions.bindings[node.name]
        if binding.mapping is not None or binding.source is not None:
            continue
        choices = solved.decisions.choices[node.name]
        strategy = solved.strategy(node.name)
        for i, source in enumerate(choices.inputs):
            note = solved.decisions.choices[source.producer].note
            assert note is not None
            info = note.outputs[source.index]
            src = solved.output_layout(source.producer, source.index)
            dst = strategy.inputs[i]
            if src == dst:
                continue
            if (source.producer, source.index, dst) in seen:
                continue
            seen.add((source.producer, source.index, dst))
            itemsize = solved.cost.wire_itemsize(info)  # as the ILP costs it
            forward = mesh_cost.reshard(src, dst, info.shape, itemsize)
            total += forward.sent
            counts.update(_per_axis_counts(forward))
            steps = list(forward.steps)
            if note.requires_grad:
                backward = mesh_cost.reshard(dual(dst), dual(src), info.shape, itemsize)
                total += backward.sent
                steps += backward.steps
            if is_regathered(solved.decisions, source.producer, node.name, i):
                total += forward.sent  # gathered again for the backward
                steps += forward.steps
            for step in steps:
                if step.sent:
                    by_kind[step.kind] += step.sent
    return total, dict(counts), dict(by_kind)


def _per_axis_counts(reshard: Reshard) -> Counter[str]:
    """The lowering runs a collective over several axes as one call per axis."""
    counts: Counter[str] = Counter()
    for step in reshard.collectives:
        counts[step.kind] += len(step.axes)
    return counts


def _sync_bytes(solved: Solved, params: dict[str, ParamPlan]) -> float:
    """Bytes a device sends per step to synchronise gradients (ring all-reduce: 2(n-1)/n)."""
    mesh_shape = solved.cost.mesh_shape
    total = 0.0
    for plan in params.values():
        axes = [
            a for a, p in enumerate(plan.param) if isinstance(p, Replicate) and mesh_shape[a] > 1
        ]
        if not axes:
            continue
        n = 1
        for axis in axes:
            n *= mesh_shape[axis]
        numel = 1
        for size in plan.param.local_shape(plan.shape, mesh_shape):
            numel *= size
        total += 2 * (n - 1) / n * numel * (4 if solved.cost.precision == "fp32" else 2)
    return total


def layout_of(plan: Plan, name: str) -> Layout:
    return plan.params[name].param
