"""The plan's communication ledger (``autopar_plans.ledger``): every collective one training step
issues, read off the plan as the runtime lowers and runs it.

The walk over the graph is the lowering's (``autopar_passes.lower_spmd``): one reshard per
(tensor, layout), shared by its consumers, each the steps of ``autopar_plans.reshard.plan_reshard``;
outputs made whole. Then what the runtime does with the lowered program:

- **forward**, every microbatch: each reshard's collectives, one call per mesh axis;
- **backward**, every microbatch, for tensors that need a gradient: each collective's
  adjoint in reverse order (all-gather <-> reduce-scatter, all-reduce <-> all-reduce,
  all-to-all <-> all-to-all, the same payload), except the output all-reduces whose adjoint
  ``autopar_passes.rewrites.output_boundary`` skips;
- **FSDP groups** (``runtime.param_groups``): a parameter's all-gather straight from its
  shard is gathered with the others of its (mesh axis, dtype, layer) in one call, its
  adjoint one reduce-scatter; a group whose gathered weights an op keeps for backward is
  gathered again there, once (``runtime.regather``);
- **gradient sync**, once per step in the last backward: DDP's buckets
  (``autopar_plans.buckets.ddp_buckets``) of the parameters replicated over mesh axes, one
  all-reduce per bucket and axis (``runtime.grad_sync``);
- **ZeRO-1/2** (``runtime.zero``): per bucket (``autopar_plans.buckets.open_buckets``), the
  gradient sum (reduce-scatter; ZeRO-2: in every microbatch's backward; ZeRO-1: once per
  step, of the gradient accumulated locally) and the all-gather of the stepped masters
  before the next forward.

Payloads follow ``autopar_plans.ledger``; what a call takes and whether compute hides it follow the
cost model: reshards block (overlap ``none``); gradient sync and ZeRO's sums overlap the
backward (``autopar_cost_model.step.exposed_gradient_sync`` says how much stays exposed).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.compute import op_time
from autopar_cost_model.reduction import step_bytes
from autopar_cost_model.step import backward_segments, exposed_gradient_sync, prefetch_waits
from autopar_passes.annotation import META_KEY
from autopar_passes.costs import CostModel, bucket_copy_bytes, trailing_all_reduces, zero_copy_bytes
from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_recompute import region_layers, region_nodes
from autopar_passes.mixed_precision import (
    COMPUTE,
    LOW_PRECISION_OPS,
    autocast_dtypes,
    cast_for_gather,
)
from autopar_passes.strategies.graph import tensor_inputs
from autopar_passes.trace import TracedModel
from autopar_plans.buckets import ddp_buckets, open_buckets
from autopar_plans.compression import compressed_calls, encode_passes
from autopar_plans.ledger import CommEntry, sent
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout, Replicate, Shard, zero_axes
from autopar_plans.plan import Estimate, ParamPlan, Plan
from autopar_plans.reduction import PER_AXIS, GradReduction, reduce_steps
from autopar_plans.reshard import AxisStep, plan_reshard

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
    elements: float  # the payload in elements (bytes: times the dtype's size)


@dataclass
class Reshard:
    """One reshard the lowering emits: its collectives, in order."""

    producer: str
    calls: list[_Call]
    dtype: str  # what it travels as
    requires_grad: bool
    param: str | None  # the parameter it reshards (None: an activation)
    starts_local: bool = False  # a local step (slice, zero, pad) comes before any collective
    saved: bool = False  # a consumer keeps the result for backward
    savers: frozenset[str] = frozenset()  # the consumers that keep it (traced node names)
    users: frozenset[str] = frozenset()  # every consumer (traced node names)
    skipped_adjoints: int = 0  # trailing output all-reduces whose adjoint is skipped
    # inside a recompute region (``recompute_region_of``): made in the checkpoint (not
    # kept, not grouped), and where the region's replay reaches it, made again in backward
    in_region: bool = False
    recomputed: bool = False

    @property
    def gathers_parameter(self) -> bool:
        """A parameter gathered by gathers alone (FSDP's unshard)."""
        return (
            self.param is not None
            and not self.starts_local
            and bool(self.calls)
            and all(c.kind == "all_gather" for c in self.calls)
        )

    @property
    def regathered(self) -> bool:
        """A parameter gathered (by gathers alone) for an op that keeps it: the runtime
        drops the gathered copy and gathers it again in backward (``runtime.regather``);
        inside a recompute region the region's replay gathers it instead."""
        return self.gathers_parameter and self.saved and not self.in_region


@dataclass(frozen=True)
class OpCompute:
    """Each op's compute per microbatch, as the cost model prices it under the plan: behind
    it the FSDP groups' prefetched gathers hide. ``ops``: node name -> (its part, forward,
    backward), in graph order; the parts go by the FSDP groups' names (``_fsdp_groups``):
    ``layer 3``, or ``after 2 layers`` for what runs outside the layers after the first
    two."""

    ops: dict[str, tuple[str, float, float]]

    def forward(self, place: str) -> float:
        """The forward compute of one part."""
        return self._forward.get(place, 0.0)

    @cached_property
    def _forward(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for place, fwd, _ in self.ops.values():
            found[place] = found.get(place, 0.0) + fwd
        return found

    def backward(self, within: Collection[str] | None) -> list[tuple[int, float]]:
        """(graph position, backward seconds) of each op (``within``: of these only)."""
        return [
            (i, bwd)
            for i, (name, (_, _, bwd)) in enumerate(self.ops.items())
            if within is None or name in within
        ]


class Ledger:
    """Entries as they are added: each call priced on its own axis, as the runtime runs it;
    ``stage``: the pipeline stage whose devices issue them (0 without a pipeline);
    ``compute``: each op's compute, behind which the FSDP groups' prefetched gathers hide
    (``op_compute``)."""

    def __init__(
        self,
        mesh: MeshSpec,
        microbatches: int,
        stage: int = 0,
        compute: OpCompute | None = None,
        reduction: GradReduction | None = None,
    ) -> None:
        self.cost = MeshCost(mesh)
        self.reduction = reduction or PER_AXIS
        self.microbatches = microbatches
        self.stage = stage
        self.compute = compute or OpCompute({})
        self.entries: list[CommEntry] = []

    def add(
        self,
        kind: str,
        axis: int,
        dtype: str,
        nbytes: float,
        phase: str,
        what: str,
        *,
        per_step: bool = False,
        overlap: str = "none",
        copied: float = 0.0,
        period: int = 1,
    ) -> None:
        """One call site: every microbatch, or once per step (``per_step``); ``copied``:
        bytes the runtime moves through memory around each call (its buckets' copies);
        ``period``: it runs in one step of every ``period``."""
        mesh = self.cost.mesh
        calls = 1 if per_step else self.microbatches
        time = self.cost.collective(kind, nbytes, (axis,)).time
        time += op_time(0.0, copied, "float32", self.cost.preset)
        self.add_entry(
            kind,
            (mesh.axis_names[axis],),
            dtype,
            nbytes,
            calls,
            phase,
            what,
            time,
            overlap=overlap,
            group=mesh.shape[axis],
            period=period,
        )

    def add_entry(
        self,
        kind: str,
        axes: tuple[str, ...],
        dtype: str,
        nbytes: float,
        calls: int,
        phase: str,
        what: str,
        seconds_per_call: float,
        *,
        overlap: str = "none",
        group: int = 2,
        period: int = 1,
    ) -> None:
        """One call site priced by the caller (``seconds_per_call``) over a group of
        ``group`` devices: a pipeline's point-to-point and its sums across stages."""
        time = seconds_per_call * calls / period
        self.entries.append(
            CommEntry(
                kind=kind,
                axes=axes,
                dtype=dtype,
                bytes_per_call=nbytes,
                calls_per_step=calls,
                phase=phase,  # type: ignore[arg-type]
                what=what,
                overlap=overlap,  # type: ignore[arg-type]
                time_s=time,
                exposed_s=time if overlap == "none" else 0.0,
                sent_per_call=sent(kind, nbytes, group),
                stage=self.stage,
                period=period,
            )
        )

    def reshard(self, reshard: Reshard, calls: list[_Call], dtype: str, what: str) -> None:
        """A reshard's calls forward, their adjoints backward (in reverse, but the output
        all-reduces that skip theirs), and a kept parameter's gathers again in backward."""
        size = itemsize(dtype)
        for call in calls:
            self.add(call.kind, call.axis, dtype, call.elements * size, "forward", what)
        if reshard.requires_grad:
            for call in reversed(calls[: len(calls) - reshard.skipped_adjoints]):
                kind = ADJOINT[call.kind]
                self.add(kind, call.axis, dtype, call.elements * size, "backward", what)
        if reshard.regathered:
            for call in calls:
                nbytes = call.elements * size
                self.add("all_gather", call.axis, dtype, nbytes, "backward", f"{what} (regather)")
        if reshard.recomputed:  # the region runs forward again in backward
            for call in calls:
                nbytes = call.elements * size
                self.add(call.kind, call.axis, dtype, nbytes, "backward", f"{what} (recompute)")


def step_ledger(traced: TracedModel, plan: Plan, *, batch_scale: float = 1.0) -> list[CommEntry]:
    """The ledger of one step of ``plan`` (without pipeline stages: those are
    ``autopar_passes.pipeline.ledger``'s) on ``traced``.

    ``batch_scale``: the microbatch over the traced batch, when the plan runs a microbatch
    of another size than was traced (activations scale, parameters do not)."""
    mesh = plan.stage_mesh or plan.mesh
    walk = Walk(traced, plan, mesh, batch_scale)
    reshards = walk.run()
    ledger = Ledger(
        mesh,
        plan.parallelism.microbatches,
        compute=op_compute(walk),
        reduction=plan.grad_reduction,
    )
    reshard_entries(ledger, traced, plan, reshards, walk.cast)
    order = param_order(traced)
    gradient_sync_entries(order, plan, ledger)
    zero_entries(order, plan, ledger, walk.cast)
    return ledger.entries


def reshard_entries(
    ledger: Ledger,
    traced: TracedModel,
    plan: Plan,
    reshards: list[Reshard],
    cast: frozenset[str],
    ops: Collection[str] | None = None,
) -> None:
    """The entries of one program's ``reshards`` (in its order), every microbatch: FSDP's
    groups of parameter gathers, the others one by one. ``ops``: the traced ops the
    programs run (a pipeline stage's; None: all)."""
    compute = WIRE_DTYPE.get(plan.precision)
    groups, singles = _fsdp_groups(traced, plan, reshards, cast)
    gathers: list[tuple[int, float]] = []  # (entry index, compute behind it) in order
    regathers: list[tuple[int, list[Reshard]]] = []  # (entry index, the group's members)
    for (axis, _, place), members in groups.items():
        # gathered in the compute dtype when its parameters are (autopar_passes.mixed_precision)
        dtype = compute if compute and members[0].param in cast else members[0].dtype
        nbytes = sum(r.calls[0].elements for r in members) * itemsize(dtype)
        what = f"{place}, {len(members)} params"
        gathers.append((len(ledger.entries), ledger.compute.forward(place)))
        ledger.add("all_gather", axis, dtype, nbytes, "forward", f"FSDP gather: {what}")
        if any(r.requires_grad for r in members):
            ledger.add("reduce_scatter", axis, dtype, nbytes, "backward", f"FSDP gather: {what}")
        if any(r.regathered for r in members):  # fetched from the group again, once
            regathers.append((len(ledger.entries), members))
            ledger.add("all_gather", axis, dtype, nbytes, "backward", f"FSDP regather: {what}")
        for reshard in members:  # the steps after the group's gather, on its output
            if len(reshard.calls) > 1:
                ledger.reshard(reshard, reshard.calls[1:], dtype, f"reshard of {reshard.param}")
    hide_prefetched(ledger, gathers)
    hide_prefetched(ledger, _backward_chain(ledger.compute, regathers, ops))
    for reshard in singles:
        ledger.reshard(
            reshard, reshard.calls, reshard.dtype, f"reshard of {reshard.param or reshard.producer}"
        )


def _backward_chain(
    compute: OpCompute, regathers: list[tuple[int, list[Reshard]]], ops: Collection[str] | None
) -> list[tuple[int, float]]:
    """The groups' regathers (entry index, the backward compute behind which the next one
    hides) in the order backward makes them (``runtime.regather.BackwardOrder``): the
    reverse of where each group's weights are last kept in forward, so a tied embedding
    that the head keeps comes first. The next group's regather is launched when backward
    reaches a group and waited for where it reaches the next: it hides behind the backward
    of the ops in between."""
    position = {name: i for i, name in enumerate(compute.ops)}

    def last_kept(members: list[Reshard]) -> int:
        savers = {s for r in members if r.regathered for s in r.savers}
        return max(
            (position[s] for s in savers if s in position and (ops is None or s in ops)),
            default=-1,
        )

    chain = sorted(((last_kept(m), i) for i, m in regathers), reverse=True)
    segments = backward_segments(compute.backward(ops), [last for last, _ in chain])
    return [(i, seconds) for (_, i), seconds in zip(chain, segments, strict=True)]


def hide_prefetched(ledger: Ledger, chain: list[tuple[int, float]]) -> None:
    """The FSDP groups' gathers of ``chain`` (entry index, the compute that runs from the
    group's use until the next group's; in the order the runtime makes them) as
    prefetched (``runtime.param_groups``): each launched where the group before it in the
    chain is used, the first behind nothing (``autopar_cost_model.step.prefetch_waits``,
    with compute hiding the preset's share of what runs beside it). Each entry shows what
    its part waits for it (``prefetch_waits``)."""
    if not chain:
        return
    entries = ledger.entries
    calls = max(entries[chain[0][0]].calls_per_step, 1)
    gather_s = [entries[i].time_s / calls for i, _ in chain]
    compute_s = [seconds for _, seconds in chain]
    overlap = ledger.cost.preset.comm_overlap
    for (i, _), wait in zip(chain, prefetch_waits(gather_s, compute_s, overlap), strict=True):
        entry = entries[i]
        entries[i] = entry.model_copy(
            update={"overlap": "compute", "exposed_s": min(entry.time_s, calls * wait)}
        )


def op_compute(walk: Walk) -> OpCompute:
    """Each op's compute under the plan (``OpCompute``), per microbatch of the walk's."""
    cost = CostModel(walk.cost, precision=walk.plan.precision)
    found: dict[str, tuple[str, float, float]] = {}
    seen: set[int] = set()
    for node in walk.traced.graph.nodes:
        note = node.meta[META_KEY]
        if node.name not in walk.layouts.strategies:
            continue  # an input, a getitem: no work of its own
        if note.layer is not None:
            seen.add(note.layer)
            place = f"layer {note.layer}"
        else:
            place = f"after {len(seen)} layers"
        fwd, bwd = cost.op_time(note, walk.layouts.strategies[node.name])
        found[node.name] = (place, fwd * walk.scale, bwd * walk.scale)
    return OpCompute(found)


class Walk:
    """The lowering's walk (``autopar_passes.lower_spmd``), keeping the reshards instead of
    emitting them."""

    def __init__(self, traced: TracedModel, plan: Plan, mesh: MeshSpec, scale: float) -> None:
        self.traced = traced
        self.layouts = PlanLayouts(traced, plan)
        self.mesh = mesh
        self.scale = scale
        self.plan = plan
        self.nodes = {node.name: node for node in traced.graph.nodes}
        self.param_of = {n: name for name, info in traced.params.items() for n in info.nodes}
        self.cast = cast_for_gather(traced, plan.precision)
        self.autocast = autocast_dtypes(traced, plan.precision)
        self.cost = MeshCost(mesh)
        self.made: dict[tuple[str, Layout], Reshard | None] = {}
        self.reshards: list[Reshard] = []
        self.regions: dict[str, RegionOps] = {}  # op -> its recompute region, once run

    def run(self) -> list[Reshard]:
        # a recompute region's checkpoint keeps what its ops save (nothing is packed)
        self.regions = regions = recompute_region_of(self.traced, self.plan)
        order = {name: i for i, name in enumerate(self.nodes)}
        for node in self.traced.graph.nodes:
            note = node.meta[META_KEY]
            if node.op == "placeholder" or node.target is operator.getitem:
                self.made[(node.name, self.layouts.layout(node.name))] = None
            elif node.op == "output":
                self._outputs(node)
            elif note.outputs:
                strategy = self.layouts.strategy(node.name)
                for index, source in enumerate(tensor_inputs(node)):
                    made = self._value(source.producer, strategy.inputs[index])
                    if made is not None:
                        made.users = made.users | {node.name}
                    if (
                        made is not None
                        and index in note.saved_inputs
                        and node.name not in regions
                        and not self._autocast_copy(made, note.op)
                    ):
                        made.saved = True
                        made.savers = made.savers | {node.name}
                if len(strategy.outputs) == 1:
                    self.made[(node.name, strategy.outputs[0])] = None
        for made in self.reshards:
            made.in_region, made.recomputed = in_region(
                made.users, regions, order, made.gathers_parameter
            )
            if not made.in_region and any(user in regions for user in made.users):
                # a region's input: the checkpoint saves its inputs for the replay, through
                # the hooks outside it (``torch.utils.checkpoint``'s non-reentrant form)
                made.saved = True
                made.savers = made.savers | {u for u in made.users if u in regions}
        return self.reshards

    def _outputs(self, node: torch.fx.Node) -> None:
        """Outputs are made whole; the all-reduces that end an output's reshard skip their
        adjoint (``autopar_passes.rewrites.output_boundary``)."""
        whole = Layout.replicated(self.mesh.ndim)
        for value in _flat_nodes(node.args[0]):
            if not isinstance(value.meta.get("val"), torch.Tensor):
                continue
            fresh = (value.name, whole) not in self.made
            made = self._value(value.name, whole)
            if made is None or not fresh:
                continue
            made.skipped_adjoints = trailing_all_reduces(made.calls)

    def _value(self, producer: str, want: Layout | None) -> Reshard | None:
        """The reshard of ``producer`` to ``want``, one per (tensor, layout) (None: none
        needed, or the layout is the producer's own)."""
        if want is None:
            return None
        key = (producer, want)
        if key in self.made:
            return self.made[key]
        note = self.nodes[producer].meta[META_KEY]
        info = note.outputs[0]
        param = self.param_of.get(producer)
        steps = plan_reshard(self.layouts.layout(producer), want)
        made = Reshard(
            producer,
            list(self._calls(steps, info.numel * (1.0 if param else self.scale))),
            self.dtype_of(info.dtype, param, producer),
            bool(note.requires_grad),
            param,
            starts_local=bool(steps) and steps[0].local,
        )
        self.made[key] = made
        self.reshards.append(made)
        return made

    def _calls(self, steps: tuple[AxisStep, ...], elements: float) -> Iterator[_Call]:
        """Each collective step's payload (``autopar_plans.ledger``): the tensor divided by the
        other axes that split it then; an all-to-all's, by its own axis too."""
        shape = self.mesh.shape
        for step in steps:
            if step.local:
                continue
            others = math.prod(
                shape[a]
                for a, p in enumerate(step.before)
                if isinstance(p, Shard) and a != step.axis
            )
            payload = elements / others
            if step.kind == "all_to_all":
                payload /= shape[step.axis]
            yield _Call(step.kind, step.axis, payload)

    def _autocast_copy(self, made: Reshard, op: str) -> bool:
        """Whether ``op`` keeps autocast's cast copy of ``made`` rather than ``made``: an fp32
        parameter read by a lower-precision op under mixed precision (then nothing is
        gathered again in backward; the copy stays)."""
        return (
            made.param is not None
            and self.plan.precision in COMPUTE
            and made.param not in self.cast
            and op in LOW_PRECISION_OPS
        )

    def dtype_of(self, dtype: str, param: str | None, producer: str) -> str:
        """What a tensor travels as: a parameter as stored (fp32 masters under mixed
        precision; a group may cast it, ``step_ledger``); an activation as autocast makes
        it (``autopar_passes.mixed_precision.autocast_dtypes``), else as the plan's precision
        stores it."""
        if param is not None:
            return "bfloat16" if self.plan.precision == "bf16" and dtype == "float32" else dtype
        return self.autocast.get(producer) or _wire_dtype(self.plan, dtype)


@dataclass(frozen=True)
class RegionOps:
    """The traced ops one recompute region (in one layer) wraps (``lower_recompute``)."""

    ops: frozenset[str]
    first: str  # its first op in graph order
    # the graph position of its last op that keeps a tensor for backward: the replay stops
    # there (``torch.utils.checkpoint``'s early stop, once every saved tensor is made again)
    last_saver: int


def recompute_region_of(traced: TracedModel, plan: Plan) -> dict[str, RegionOps]:
    """Each op the plan's recompute regions wrap, and its region: what
    ``autopar_passes.lower_recompute`` outlines (the named ops but those it keeps out)."""
    order = {node.name: i for i, node in enumerate(traced.graph.nodes)}
    found: dict[str, RegionOps] = {}
    for region in plan.recompute:
        for names in region_layers(region).values():
            nodes = region_nodes(traced.graph, set(names))
            savers = [order[n.name] for n in nodes if n.meta[META_KEY].keeps_tensor]
            if nodes:
                ops = frozenset(n.name for n in nodes)
                wrapped = RegionOps(ops, nodes[0].name, max(savers, default=-1))
                found.update(dict.fromkeys(wrapped.ops, wrapped))
    return found


def in_region(
    users: frozenset[str],
    regions: Mapping[str, RegionOps],
    order: Mapping[str, int],
    gathers_parameter: bool = False,
) -> tuple[bool, bool]:
    """Whether a reshard its ``users`` read lies inside a recompute region, and whether the
    region's replay runs it again. Inside: every user in one region, the first of them not
    the region's first op (the lowering emits a reshard right before its first user, and a
    region starts at its first op). Replayed: not after the region's last op that keeps a
    tensor (where the replay stops)."""
    if not users or gathers_parameter:  # FSDP's gathers stay outside (lower_recompute)
        return False, False
    first = min(users, key=order.__getitem__)
    region = regions.get(first)
    if region is None or first == region.first:
        return False, False
    if any(regions.get(user) is not region for user in users):
        return False, False
    return True, order[first] <= region.last_saver


def _flat_nodes(value: object) -> Iterator[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _flat_nodes(item)


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


GroupKey = tuple[int, str, str]  # (mesh axis, dtype, "layer 3" or "after 2 layers")


def _fsdp_groups(
    traced: TracedModel, plan: Plan, reshards: list[Reshard], cast: frozenset[str]
) -> tuple[dict[GroupKey, list[Reshard]], list[Reshard]]:
    """FSDP's groups (``runtime.param_groups``): a parameter's reshard that starts with an
    all-gather of its own shard joins the group of its (axis, dtype, layer), in the order
    the runtime makes them (parameters outside the layers: per run between layers); the
    other reshards stay single."""
    container = traced.layers
    groups: dict[GroupKey, list[Reshard]] = {}
    singles: list[Reshard] = []
    layers_seen: set[int] = set()
    for reshard in reshards:
        param = reshard.param
        grouped = (
            param is not None
            and bool(reshard.calls)
            and reshard.calls[0].kind == "all_gather"
            and not reshard.starts_local
            and not reshard.in_region  # a region's gathers stay in it, one by one
        )
        if not grouped:
            singles.append(reshard)
            continue
        assert param is not None
        layer = container.index_of(param) if container is not None else None
        if layer is None:
            place = f"after {len(layers_seen)} layers"
        else:
            place = f"layer {layer}"
            layers_seen.add(layer)
        dtype = "compute" if param in cast else reshard.dtype
        groups.setdefault((reshard.calls[0].axis, dtype, place), []).append(reshard)
    return groups, singles


def regathered_params(traced: TracedModel, plan: Plan, reshards: list[Reshard]) -> set[str]:
    """The parameters the runtime fetches again in backward for their gathers (of a walk's
    ``reshards``): those an op keeps gathered (``Reshard.regathered``), and every member of
    an FSDP group one of whose members is (the group is gathered again whole)."""
    groups, singles = _fsdp_groups(traced, plan, reshards, cast_for_gather(traced, plan.precision))
    found = {r.param for r in singles if r.regathered}
    for members in groups.values():
        if any(r.regathered for r in members):
            found |= {r.param for r in members}
    return {name for name in found if name is not None}


def _wire_dtype(plan: Plan, dtype: str) -> str:
    return WIRE_DTYPE.get(plan.precision, dtype) if dtype == "float32" else dtype


def grad_dtype(plan: Plan, dtype: str) -> str:
    """The dtype a gradient held in ``dtype`` is summed in: the plan's policy's
    (``GradReduction.wire_dtype``: mixed precision's compute dtype, or a casting
    compression's)."""
    compute = WIRE_DTYPE.get(plan.precision)
    return plan.grad_reduction.wire_dtype(dtype, compute)


def _local_numel(param: ParamPlan, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(param.param.local_shape(param.shape, mesh_shape))


def param_order(traced: TracedModel) -> list[str]:
    """Parameters in the order the lowering first reads them (``LoweredGraph.params``)."""
    order: dict[str, None] = {}
    by_node = {n: name for name, info in traced.params.items() for n in info.nodes}
    for node in traced.graph.nodes:
        if node.op == "placeholder" and node.name in by_node:
            order.setdefault(by_node[node.name], None)
    return list(order)


def stored_dtype(plan: Plan, param: ParamPlan) -> str:
    """The dtype a parameter (and its gradient) is held in on the device."""
    return "bfloat16" if plan.precision == "bf16" and param.dtype == "float32" else param.dtype


def working_dtype(plan: Plan, param: ParamPlan, cast: bool) -> str:
    """The dtype of a ZeRO parameter's working copy (``runtime.zero``): the compute dtype
    under mixed precision when ``cast``, else as stored."""
    stored = stored_dtype(plan, param)
    return _wire_dtype(plan, stored) if cast else stored


def gradient_sync_entries(
    order: list[str],
    plan: Plan,
    ledger: Ledger,
    part_of: Mapping[str, int] | None = None,
    *,
    in_backward: bool = True,
) -> None:
    """DDP's buckets over the replicated axes of every parameter ZeRO does not hold, summed
    in the last microbatch's backward as the plan's policy says (``runtime.grad_sync``,
    ``autopar_plans.reduction``): one all-reduce per axis, or the hierarchical form's calls
    on the padded bucket (buckets fill by the stored gradients' bytes; they are summed in
    the policy's dtype). Under compression the gradients it encodes are summed by the
    scheme's calls after backward, exposed (``autopar_plans.compression``); under local SGD
    no gradient is summed and the parameters are averaged every ``period`` steps instead.
    ``part_of``: a pipeline rank's stage of each parameter (buckets keep to one); not
    ``in_backward``: summed after the schedule, exposed."""
    mesh = ledger.cost.mesh
    policy = plan.grad_reduction
    for number, bucket in enumerate(sync_buckets(order, plan, mesh.shape, part_of)):
        axes, stored = bucket.axes, bucket.stored
        sizes = [(mesh.axis_names[a], mesh.shape[a]) for a in axes]
        if policy.sync == "local_sgd":
            _averaging_entries(ledger, bucket, sizes, f"local SGD: bucket {number}")
            continue
        what = f"gradient sync: bucket {number}, {len(bucket.shapes)} params"
        encoded = [s for s in bucket.shapes if policy.compression.compresses(s)]
        plain = sum(math.prod(s) for s in bucket.shapes if not policy.compression.compresses(s))
        phase = "backward" if in_backward else "step"
        overlap = "backward" if in_backward else "none"
        if plain:
            dtype = grad_dtype(plan, stored)
            copied = bucket_copy_bytes(plain, itemsize(stored), itemsize(dtype))
            _steps_entries(ledger, plain, dtype, sizes, phase, what, overlap, copied)
        if encoded:
            _compressed_entries(
                ledger, policy, encoded, sizes, f"{what}, {policy.compression.scheme}"
            )


class SyncBucket(NamedTuple):
    """One DDP bucket as the runtime fills it: its axes, stored dtype, members' local shapes."""

    axes: tuple[int, ...]
    stored: str
    shapes: list[tuple[int, ...]]


def sync_buckets(
    order: list[str],
    plan: Plan,
    mesh_shape: tuple[int, ...],
    part_of: Mapping[str, int] | None = None,
) -> list[SyncBucket]:
    """DDP's buckets (``autopar_plans.buckets.ddp_buckets``) of the parameters replicated over
    some mesh axes that ZeRO does not hold, in the order backward makes their gradients."""
    parts = part_of or {}
    synced = []
    for name in reversed(order):
        param = plan.params[name]
        if plan.holds_master(name, mesh_shape):
            continue
        axes = tuple(
            a for a, p in enumerate(param.param) if isinstance(p, Replicate) and mesh_shape[a] > 1
        )
        if axes:
            shape = tuple(param.param.local_shape(param.shape, mesh_shape))
            synced.append((axes, stored_dtype(plan, param), shape, parts.get(name, 0)))
    items = [
        ((part, axes, stored), math.prod(shape) * itemsize(stored))
        for axes, stored, shape, part in synced
    ]
    return [
        SyncBucket(synced[b[0]][0], synced[b[0]][1], [synced[i][2] for i in b])
        for b in ddp_buckets(items)
    ]


def _steps_entries(
    ledger: Ledger,
    numel: int,
    dtype: str,
    sizes: list[tuple[str, int]],
    phase: str,
    what: str,
    overlap: str,
    copied: float = 0.0,
    period: int = 1,
) -> None:
    """The calls of one bucket's sum under the plan's form (``reduce_steps``), as
    ``runtime.reduction.BucketSum`` runs them on the padded bucket."""
    mesh = ledger.cost.mesh
    index = {name: a for a, name in enumerate(mesh.axis_names)}
    steps = reduce_steps(ledger.reduction, sizes)
    for position, (step, nbytes) in enumerate(step_bytes(steps, numel, itemsize(dtype), sizes)):
        ledger.add(
            step.kind,
            index[step.axis],
            dtype,
            nbytes,
            phase,
            what,
            per_step=True,
            overlap=overlap,
            copied=copied if position == 0 else 0.0,
            period=period,
        )


def _compressed_entries(
    ledger: Ledger,
    policy: GradReduction,
    shapes: list[tuple[int, ...]],
    sizes: list[tuple[str, int]],
    what: str,
) -> None:
    """A compressed sum's calls (``compressed_calls``), after backward and not hidden by it
    (the runtime encodes once every gradient of the bucket is in), with the encoding's
    passes over memory on the first."""
    index = {name: a for a, name in enumerate(ledger.cost.mesh.axis_names)}
    scheme = policy.compression
    encode = encode_passes(scheme) * 4.0 * sum(math.prod(s) for s in shapes)
    for position, call in enumerate(compressed_calls(scheme, shapes, [n for _, n in sizes])):
        ledger.add(
            call.kind,
            index[sizes[call.position][0]],
            call.dtype,
            call.nbytes,
            "step",
            f"{what} {call.what}",
            per_step=True,
            copied=encode if position == 0 else 0.0,
        )


def _averaging_entries(
    ledger: Ledger, bucket: SyncBucket, sizes: list[tuple[str, int]], what: str
) -> None:
    """Local SGD's averaging of a bucket's parameters (as stored), once every ``period``
    optimizer steps, after the step."""
    numel = sum(math.prod(s) for s in bucket.shapes)
    period = ledger.reduction.period
    _steps_entries(ledger, numel, bucket.stored, sizes, "step", what, "none", period=period)


def zero_entries(
    order: list[str],
    plan: Plan,
    ledger: Ledger,
    cast: frozenset[str],
    part_of: Mapping[str, int] | None = None,
) -> None:
    """ZeRO-1/2's buckets (``runtime.zero``, filled by the working copies' bytes): the
    gradient sum, in the compute dtype under mixed precision, over the other replicated axes
    (all-reduce) and the ZeRO axes (reduce-scatter; ZeRO-2: in every microbatch's backward;
    ZeRO-1: once per step, in the last), and the masters gathered back before the next
    forward, in the working copy's dtype: the compute dtype under mixed precision for
    ``cast`` (parameters only matmuls read, ``autopar_passes.mixed_precision``)."""
    mesh_shape = ledger.cost.mesh.shape
    parts = part_of or {}
    members, names = [], []
    for name in order:
        param = plan.params[name]
        found = zero_axes(param.param, param.optimizer, mesh_shape)
        if not plan.holds_master(name, mesh_shape):
            continue
        axes = tuple(a for a, _ in found)
        others = tuple(
            a
            for a, p in enumerate(param.param)
            if isinstance(p, Replicate) and mesh_shape[a] > 1 and a not in axes
        )
        local = list(param.param.local_shape(param.shape, mesh_shape))
        even = True
        for axis, dim in found:
            even = even and local[dim] % mesh_shape[axis] == 0
            local[dim] //= mesh_shape[axis]
        working, stage2 = working_dtype(plan, param, name in cast), param.grad != param.param
        numel = _local_numel(param, mesh_shape)
        key = (parts.get(name, 0), axes, others, stage2, working) if even else None
        members.append((key, numel * itemsize(working), numel, axes, others, stage2, working))
        names.append(name)
    for number, bucket in enumerate(open_buckets([(m[0], m[1]) for m in members])):
        _, _, _, axes, others, stage2, working = members[bucket[0]]
        numel = sum(members[i][2] for i in bucket)
        kind = f"ZeRO-{2 if stage2 else 1}" if axes else "offloaded optimizer"
        what = f"{kind}: bucket {number}, {len(bucket)} params"
        wire = grad_dtype(plan, working)
        size = float(numel * itemsize(wire))
        pieces = math.prod(mesh_shape[a] for a in axes)
        master = itemsize(stored_dtype(plan, plan.params[names[bucket[0]]]))
        reduce_b, gather_b = zero_copy_bytes(
            numel, pieces, itemsize(working), itemsize(wire), master, bool(others)
        )
        sums = [("all_reduce", a) for a in others] + [("reduce_scatter", a) for a in axes]
        for index, (kind, axis) in enumerate(sums):
            ledger.add(
                kind,
                axis,
                wire,
                size,
                "backward",
                what,
                per_step=not stage2,
                overlap="backward",
                copied=reduce_b if index == 0 else 0.0,
            )
            if kind == "reduce_scatter":
                size /= mesh_shape[axis]
        gathered = numel * itemsize(working) / pieces
        for index, axis in enumerate(reversed(axes)):
            gathered *= mesh_shape[axis]
            ledger.add(
                "all_gather",
                axis,
                working,
                gathered,
                "step",
                f"{what}, masters",
                per_step=True,
                copied=gather_b if index == 0 else 0.0,
            )


def hide_overlapped(
    entries: list[CommEntry],
    microbatches: int,
    backward_s: float,
    slack_s: float = 0.0,
    overlap: float = 1.0,
) -> list[CommEntry]:
    """``entries`` with the exposed seconds of those backward may hide (gradient sync,
    ZeRO's sums), as the runtime runs them: each microbatch's backward hides what it
    launches, bucket by bucket (``autopar_cost_model.step.exposed_gradient_sync``, ``backward_s``
    one microbatch's backward): every microbatch, the sums paid per microbatch (ZeRO-2);
    the last, those paid once a step as well (DDP's sync, ZeRO-1's). ``slack_s``: idle
    time after the last backward that hides the rest (a pipeline stage that finishes
    before the first); ``overlap``: the share of it compute really hides
    (``DevicePreset.comm_overlap``). The exposed time is shared in proportion to time."""
    overlapped = [e for e in entries if e.overlap == "backward"]
    every = [e for e in overlapped if e.calls_per_step == microbatches and microbatches > 1]
    once = [e for e in overlapped if e not in every]
    per_pass = sum(e.time_s for e in every) / microbatches
    last = per_pass + sum(e.time_s for e in once)
    exposed = (microbatches - 1) * exposed_gradient_sync(
        per_pass, backward_s, _buckets(every), overlap
    )
    if last > 0:
        buckets = _buckets(overlapped)
        exposed += max(
            exposed_gradient_sync(last, backward_s, buckets, overlap) - overlap * slack_s, 0.0
        )
    total = sum(e.time_s for e in overlapped)
    share = exposed / total if total > 0 else 0.0
    return [
        e.model_copy(update={"exposed_s": e.time_s * share}) if e.overlap == "backward" else e
        for e in entries
    ]


def _buckets(entries: list[CommEntry]) -> int:
    """How many buckets ``entries`` sum: a bucket's calls (one per mesh axis) share its
    ``what`` and start together, once it is full, so they hide as one (counted per call,
    one bucket over two axes was taken for two, half of it hidden)."""
    return max(len({e.what for e in entries}), 1)


def by_kind(entries: list[CommEntry]) -> dict[str, float]:
    """Bytes sent per step by collective kind; what backward hides or the step runs after
    the passes as ``gradient_sync``."""
    found: dict[str, float] = {}
    for e in entries:
        kind = "gradient_sync" if e.overlap == "backward" or e.phase == "step" else e.kind
        found[kind] = found.get(kind, 0.0) + e.sent_per_step
    return {k: v for k, v in found.items() if v}


def with_ledger(
    estimate: Estimate,
    entries: list[CommEntry],
    microbatches: int,
    backward_s: float,
    overlap: float = 1.0,
) -> Estimate:
    """``estimate`` (without a pipeline) with its communication figures summed over
    ``entries``: every entry's exposed seconds (what blocks: all of it; what backward may
    hide: ``hide_overlapped``, ``backward_s`` one microbatch's backward), the bytes sent,
    all communication time, and the step time (compute and bubble as before, plus the
    exposed communication)."""
    priced = hide_overlapped(entries, microbatches, backward_s, overlap=overlap)
    exposed = sum(e.exposed_s for e in priced)
    return estimate.model_copy(
        update={
            "comm": tuple(priced),
            "comm_bytes_per_step": sum(e.sent_per_step for e in priced),
            "comm_bytes_by_kind": by_kind(priced),
            "comm_s": sum(e.time_s for e in priced),
            "exposed_comm_s": exposed,
            "step_time_s": estimate.step_time_s - estimate.exposed_comm_s + exposed,
        }
    )
