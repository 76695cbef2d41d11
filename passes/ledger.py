"""The plan's communication ledger (``plans.ledger``): every collective one training step
issues, read off the plan as the runtime lowers and runs it.

The walk over the graph is the lowering's (``passes.lower_spmd``): one reshard per
(tensor, layout), shared by its consumers, each the steps of ``plans.reshard.plan_reshard``;
outputs made whole. Then what the runtime does with the lowered program:

- **forward**, every microbatch: each reshard's collectives, one call per mesh axis;
- **backward**, every microbatch, for tensors that need a gradient: each collective's
  adjoint in reverse order (all-gather <-> reduce-scatter, all-reduce <-> all-reduce,
  all-to-all <-> all-to-all, the same payload), except the output all-reduces whose adjoint
  ``runtime.output_boundary`` skips;
- **FSDP groups** (``runtime.param_groups``): a parameter's all-gather straight from its
  shard is gathered with the others of its (mesh axis, dtype, layer) in one call, its
  adjoint one reduce-scatter; a group whose gathered weights an op keeps for backward is
  gathered again there, once (``runtime.regather``);
- **gradient sync**, once per step in the last backward: DDP's buckets
  (``plans.buckets.ddp_buckets``) of the parameters replicated over mesh axes, one
  all-reduce per bucket and axis (``runtime.grad_sync``);
- **ZeRO-1/2** (``runtime.zero``): per bucket (``plans.buckets.open_buckets``), the
  gradient sum (ZeRO-2: reduce-scatter in every microbatch's backward; ZeRO-1: all-reduce
  once per step, of the gradient accumulated locally) and the all-gather of the stepped
  masters before the next forward.

Payloads follow ``plans.ledger``; what a call takes and whether compute hides it follow the
cost model: reshards block (overlap ``none``); gradient sync and ZeRO's sums overlap the
backward (``cost_model.step.exposed_gradient_sync`` says how much stays exposed).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cost_model.collectives import MeshCost
from cost_model.step import exposed_gradient_sync
from passes.annotation import META_KEY, TensorInfo
from passes.from_plan import PlanLayouts
from passes.strategies.graph import tensor_inputs
from passes.trace import TracedModel
from plans.buckets import ddp_buckets, open_buckets
from plans.ledger import CommEntry, sent
from plans.mesh import MeshSpec
from plans.placement import Layout, Replicate, Shard
from plans.plan import Estimate, ParamPlan, Plan
from plans.reshard import AxisStep, plan_reshard

ADJOINT = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
}
# what a float32 tensor travels as under each precision, as the cost model prices it
WIRE_DTYPE = {"bf16_mixed": "bfloat16", "fp16_mixed": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class _Call:
    kind: str
    axis: int
    nbytes: float


@dataclass
class _Reshard:
    """One reshard the lowering emits: its collectives, in order."""

    producer: str
    calls: list[_Call]
    dtype: str
    requires_grad: bool
    param: str | None  # the parameter it reshards (None: an activation)
    starts_local: bool = False  # a local step (slice, zero, pad) comes before any collective
    saved: bool = False  # a consumer keeps the result for backward
    skipped_adjoints: int = 0  # trailing output all-reduces whose adjoint is skipped


def step_ledger(traced: TracedModel, plan: Plan, *, batch_scale: float = 1.0) -> list[CommEntry]:
    """The ledger of one step of ``plan`` (without pipeline stages) on ``traced``.

    ``batch_scale``: the microbatch over the traced batch, when the plan runs a microbatch
    of another size than was traced (activations scale, parameters do not)."""
    mesh = plan.stage_mesh or plan.mesh
    cost = MeshCost(mesh)
    walk = _Walk(traced, plan, mesh, batch_scale)
    reshards = walk.run()
    m = plan.parallelism.microbatches
    entries: list[CommEntry] = []
    grouped, singles = _fsdp_groups(traced, plan, reshards)
    for key, members in grouped.items():
        axis, dtype, place = key
        nbytes = sum(r.calls[0].nbytes for r in members)
        what = f"FSDP gather of {len(members)} parameter(s), {place}"
        entries.append(_entry(cost, "all_gather", axis, dtype, nbytes, m, "forward", what))
        if any(r.requires_grad for r in members):
            entries.append(_entry(cost, "reduce_scatter", axis, dtype, nbytes, m, "backward", what))
        # a kept weight gathered by these calls alone is fetched from the group again
        if any(r.saved and all(c.kind == "all_gather" for c in r.calls) for r in members):
            entries.append(
                _entry(cost, "all_gather", axis, dtype, nbytes, m, "backward", f"{what}, again")
            )
    for reshard, calls in singles:
        what = f"reshard of {reshard.param or reshard.producer}"
        for call in calls:
            entries.append(
                _entry(cost, call.kind, call.axis, reshard.dtype, call.nbytes, m, "forward", what)
            )
        if reshard.requires_grad:
            adjoints = calls[: len(calls) - reshard.skipped_adjoints]
            for call in reversed(adjoints):
                kind = ADJOINT[call.kind]
                entries.append(
                    _entry(cost, kind, call.axis, reshard.dtype, call.nbytes, m, "backward", what)
                )
        regathered = reshard.param is not None and reshard.saved and calls
        if regathered and all(c.kind == "all_gather" for c in calls):
            for call in calls:
                entries.append(
                    _entry(
                        cost,
                        "all_gather",
                        call.axis,
                        reshard.dtype,
                        call.nbytes,
                        m,
                        "backward",
                        f"{what}, again",
                    )
                )
    entries += _gradient_sync(traced, plan, cost)
    entries += _zero(traced, plan, cost)
    return entries


def _entry(
    cost: MeshCost,
    kind: str,
    axis: int,
    dtype: str,
    nbytes: float,
    calls: int,
    phase: str,
    what: str,
    overlap: str = "none",
) -> CommEntry:
    mesh = cost.mesh
    devices = mesh.shape[axis]
    time = cost.collective(kind, nbytes, (axis,)).time * calls
    return CommEntry(
        kind=kind,
        axes=(mesh.axis_names[axis],),
        dtype=dtype,
        bytes_per_call=nbytes,
        calls_per_step=calls,
        phase=phase,  # type: ignore[arg-type]
        what=what,
        overlap=overlap,  # type: ignore[arg-type]
        time_s=time,
        exposed_s=time if overlap == "none" else 0.0,
        sent_per_call=sent(kind, nbytes, devices),
    )


class _Walk:
    """The lowering's walk, keeping the reshards instead of emitting them."""

    def __init__(self, traced: TracedModel, plan: Plan, mesh: MeshSpec, scale: float) -> None:
        self.traced = traced
        self.layouts = PlanLayouts(traced, plan)
        self.mesh = mesh
        self.scale = scale
        self.wire = WIRE_DTYPE.get(plan.precision)
        self.param_of = {n: name for name, info in traced.params.items() for n in info.nodes}
        self.made: dict[tuple[str, Layout], _Reshard | None] = {}
        self.reshards: list[_Reshard] = []

    def run(self) -> list[_Reshard]:
        for node in self.traced.graph.nodes:
            note = node.meta[META_KEY]
            if node.op == "placeholder":
                self.made[(node.name, self.layouts.layout(node.name))] = None
            elif node.op == "output":
                self._outputs(node)
            elif node.target is operator.getitem:
                self.made[(node.name, self.layouts.layout(node.name))] = None
            elif note.outputs:
                strategy = self.layouts.strategy(node.name)
                for index, source in enumerate(tensor_inputs(node)):
                    want = strategy.inputs[index]
                    made = self._value(source.producer, want)
                    if made is not None and index in note.saved_inputs:
                        made.saved = True
                if len(strategy.outputs) == 1:
                    self.made[(node.name, strategy.outputs[0])] = None
        return self.reshards

    def _outputs(self, node: torch.fx.Node) -> None:
        whole = Layout.replicated(self.mesh.ndim)
        for value in _flat_nodes(node.args[0]):
            if not isinstance(value.meta.get("val"), torch.Tensor):
                continue
            fresh = (value.name, whole) not in self.made
            made = self._value(value.name, whole)
            if made is None or not fresh:
                continue
            trailing = 0
            for call in reversed(made.calls):
                if call.kind != "all_reduce":
                    break
                trailing += 1
            made.skipped_adjoints = trailing

    def _value(self, producer: str, want: Layout | None) -> _Reshard | None:
        if want is None:
            return None
        key = (producer, want)
        if key in self.made:
            return self.made[key]
        have = self.layouts.layout(producer)
        info = self._info(producer)
        steps = plan_reshard(have, want)
        made = _Reshard(
            producer,
            list(self._calls(steps, info, producer in self.param_of)),
            self._dtype(info),
            self._requires_grad(producer),
            self.param_of.get(producer),
            starts_local=bool(steps) and steps[0].local,
        )
        self.made[key] = made
        self.reshards.append(made)
        return made

    def _calls(self, steps: tuple[AxisStep, ...], info: TensorInfo, param: bool) -> Iterator[_Call]:
        total = info.numel * _itemsize(self._dtype(info)) * (1.0 if param else self.scale)
        shape = self.mesh.shape
        for step in steps:
            if step.local:
                continue
            others = math.prod(
                shape[a]
                for a, p in enumerate(step.before)
                if isinstance(p, Shard) and a != step.axis
            )
            nbytes = total / others
            if step.kind == "all_to_all":
                nbytes /= shape[step.axis]
            yield _Call(step.kind, step.axis, nbytes)

    def _info(self, name: str) -> TensorInfo:
        node = self._node(name)
        return node.meta[META_KEY].outputs[0]

    def _node(self, name: str) -> torch.fx.Node:
        if not hasattr(self, "_nodes"):
            self._nodes = {n.name: n for n in self.traced.graph.nodes}
        return self._nodes[name]

    def _requires_grad(self, name: str) -> bool:
        return bool(self._node(name).meta[META_KEY].requires_grad)

    def _dtype(self, info: TensorInfo) -> str:
        if info.dtype == "float32" and self.wire is not None:
            return self.wire
        return info.dtype


def _flat_nodes(value: object) -> Iterator[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _flat_nodes(item)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


GroupKey = tuple[int, str, str]  # (mesh axis, dtype, "layer 3" or "outside the layers, 1")


def _fsdp_groups(
    traced: TracedModel, plan: Plan, reshards: list[_Reshard]
) -> tuple[dict[GroupKey, list[_Reshard]], list[tuple[_Reshard, list[_Call]]]]:
    """FSDP's groups of parameter gathers (``runtime.param_groups``), in the order the
    runtime makes them, and every reshard's calls left outside a group."""
    container = traced.layers
    groups: dict[GroupKey, list[_Reshard]] = {}
    singles: list[tuple[_Reshard, list[_Call]]] = []
    layers_seen: set[int] = set()
    mesh_shape = (plan.stage_mesh or plan.mesh).shape
    for reshard in reshards:
        calls = reshard.calls
        first = calls[0] if calls else None
        steps_start_with_gather = (
            first is not None
            and first.kind == "all_gather"
            and reshard.param is not None
            and not reshard.starts_local
            and not _is_zero(plan.params[reshard.param], mesh_shape)
        )
        if not steps_start_with_gather:
            singles.append((reshard, calls))
            continue
        assert reshard.param is not None and first is not None
        layer = container.index_of(reshard.param) if container is not None else None
        if layer is None:
            place = f"outside the layers, {len(layers_seen)}"
        else:
            place = f"layer {layer}"
            layers_seen.add(layer)
        groups.setdefault((first.axis, reshard.dtype, place), []).append(reshard)
        if len(calls) > 1:
            rest = _Reshard(
                reshard.producer,
                calls[1:],
                reshard.dtype,
                reshard.requires_grad,
                reshard.param,
                saved=reshard.saved,
                skipped_adjoints=reshard.skipped_adjoints,
            )
            singles.append((rest, calls[1:]))
    return groups, singles


def _is_zero(param: ParamPlan, mesh_shape: tuple[int, ...]) -> bool:
    """ZeRO-1/2: the optimizer state sharded beyond the parameter on some axis."""
    return any(
        isinstance(p, Replicate) and isinstance(o, Shard) and size > 1
        for p, o, size in zip(param.param, param.optimizer, mesh_shape, strict=True)
    )


def _wire_dtype(plan: Plan, dtype: str) -> str:
    return WIRE_DTYPE.get(plan.precision, dtype) if dtype == "float32" else dtype


def _local_numel(param: ParamPlan, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(param.param.local_shape(param.shape, mesh_shape))


def _param_order(traced: TracedModel) -> list[str]:
    """Parameters in the order the lowering first reads them (``LoweredGraph.params``)."""
    order: dict[str, None] = {}
    by_node = {n: name for name, info in traced.params.items() for n in info.nodes}
    for node in traced.graph.nodes:
        if node.op == "placeholder" and node.name in by_node:
            order.setdefault(by_node[node.name], None)
    return list(order)


def _gradient_sync(traced: TracedModel, plan: Plan, cost: MeshCost) -> list[CommEntry]:
    """DDP's buckets over the replicated axes of every parameter ZeRO does not hold: one
    all-reduce per bucket and axis, in the last microbatch's backward."""
    mesh_shape = cost.mesh.shape
    synced = []
    for name in reversed(_param_order(traced)):
        param = plan.params[name]
        if _is_zero(param, mesh_shape):
            continue
        axes = tuple(
            a for a, p in enumerate(param.param) if isinstance(p, Replicate) and mesh_shape[a] > 1
        )
        if axes:
            dtype = _wire_dtype(plan, param.dtype)
            synced.append((axes, dtype, _local_numel(param, mesh_shape) * _itemsize(dtype)))
    entries = []
    items = [((axes, dtype), nbytes) for axes, dtype, nbytes in synced]
    for number, bucket in enumerate(ddp_buckets(items)):
        axes, dtype, _ = synced[bucket[0]]
        nbytes = sum(synced[i][2] for i in bucket)
        what = f"gradient sync, bucket {number} ({len(bucket)} parameter(s))"
        for axis in axes:
            entries.append(
                _entry(cost, "all_reduce", axis, dtype, nbytes, 1, "backward", what, "backward")
            )
    return entries


def _zero(traced: TracedModel, plan: Plan, cost: MeshCost) -> list[CommEntry]:
    """ZeRO-1/2's buckets (``runtime.zero``): the gradient sum over the other replicated axes
    (all-reduce) and the ZeRO axes (ZeRO-2: reduce-scatter, in every microbatch's backward;
    ZeRO-1: all-reduce, once), and the masters gathered back before the next forward."""
    mesh_shape = cost.mesh.shape
    members = []
    for name in _param_order(traced):
        param = plan.params[name]
        if not _is_zero(param, mesh_shape):
            continue
        found = [
            (a, o.dim)
            for a, (p, o) in enumerate(zip(param.param, param.optimizer, strict=True))
            if isinstance(p, Replicate) and isinstance(o, Shard) and mesh_shape[a] > 1
        ]
        zero_axes = tuple(a for a, _ in found)
        others = tuple(
            a
            for a, p in enumerate(param.param)
            if isinstance(p, Replicate) and mesh_shape[a] > 1 and a not in zero_axes
        )
        local = list(param.param.local_shape(param.shape, mesh_shape))
        even = True
        for axis, dim in found:
            even = even and local[dim] % mesh_shape[axis] == 0
            local[dim] //= mesh_shape[axis]
        dtype = _wire_dtype(plan, param.dtype)
        nbytes = _local_numel(param, mesh_shape) * _itemsize(dtype)
        key = (zero_axes, others, param.grad != param.param, dtype) if even else None
        members.append((key, nbytes, zero_axes, others, param.grad != param.param, dtype))
    entries = []
    m = plan.parallelism.microbatches
    for number, bucket in enumerate(open_buckets([(k, b) for k, b, *_ in members])):
        _, _, zero_axes, others, stage2, dtype = members[bucket[0]]
        nbytes = sum(members[i][1] for i in bucket)
        what = f"ZeRO-{2 if stage2 else 1} bucket {number} ({len(bucket)} parameter(s))"
        calls, phase = (m, "backward") if stage2 else (1, "backward")
        for axis in others:
            entries.append(
                _entry(cost, "all_reduce", axis, dtype, nbytes, calls, phase, what, "backward")
            )
        size = float(nbytes)
        for axis in zero_axes:
            kind = "reduce_scatter" if stage2 else "all_reduce"
            entries.append(_entry(cost, kind, axis, dtype, size, calls, phase, what, "backward"))
            if stage2:
                size /= mesh_shape[axis]
        gathered = nbytes / math.prod(mesh_shape[a] for a in zero_axes)
        for axis in reversed(zero_axes):
            gathered *= mesh_shape[axis]
            entries.append(
                _entry(cost, "all_gather", axis, dtype, gathered, 1, "step", f"{what}, masters")
            )
    return entries


def with_ledger(estimate: Estimate, entries: list[CommEntry], backward_s: float) -> Estimate:
    """``estimate`` with its communication figures summed over ``entries``: every entry's
    exposed seconds (what blocks: all of it; what backward may hide: gradient sync and
    ZeRO's sums, bucket by bucket, ``cost_model.step.exposed_gradient_sync`` with the
    ledger's own bucket count, shared in proportion to time), the bytes sent, all
    communication time, and the step time (compute and bubble as before, plus the
    exposed communication)."""
    overlapped = [e for e in entries if e.overlap == "backward"]
    hidden_total = sum(e.time_s for e in overlapped)
    exposed_total = (
        exposed_gradient_sync(hidden_total, backward_s, len(overlapped)) if overlapped else 0.0
    )
    share = exposed_total / hidden_total if hidden_total > 0 else 0.0
    priced = [
        e.model_copy(update={"exposed_s": e.time_s * share}) if e.overlap == "backward" else e
        for e in entries
    ]
    by_kind: dict[str, float] = {}
    for e in priced:
        kind = "gradient_sync" if e.overlap == "backward" or e.phase == "step" else e.kind
        by_kind[kind] = by_kind.get(kind, 0.0) + e.sent_per_step
    exposed = sum(e.exposed_s for e in priced)
    return estimate.model_copy(
        update={
            "comm": tuple(priced),
            "comm_bytes_per_step": sum(e.sent_per_step for e in priced),
            "comm_bytes_by_kind": {k: v for k, v in by_kind.items() if v},
            "comm_s": sum(e.time_s for e in priced),
            "exposed_comm_s": exposed,
            "step_time_s": estimate.step_time_s - estimate.exposed_comm_s + exposed,
        }
    )
