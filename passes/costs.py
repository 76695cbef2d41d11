"""Costs of strategies, edges and parameter layouts: what the ILP's coefficients are.

Reads the node annotations and a ``MeshCost`` (mesh + preset); every number is seconds per
training step per device, or bytes per device.

- **Op compute** (fwd, bwd): roofline time of the annotated FLOPs and bytes divided by the
  strategy's ``split`` (the devices that share the work), in the policy's compute dtype.
- **Edge** (producer layout -> layout the consumer needs): the reshard's collectives forward,
  and for tensors that need a gradient, the adjoint collectives backward. The gradient of a
  replicated value is partial and vice versa (each device's local backward produces its
  summand), so the adjoint of ``src -> dst`` is ``dual(dst) -> dual(src)`` with R and P
  swapped: an all-gather's adjoint is a reduce-scatter, an all-reduce's an all-reduce, a
  slice's a free zero-pad.
- **Activation memory** of an op: its saved-for-backward bytes divided by its output
  layout's shard factor (owner attribution, see ``autopar_passes.annotate``).
- **Parameters**: value, gradient and optimizer-state bytes under the optimizer and
  precision policy, each divided by its layout; the optimizer's step of the piece the
  device steps (``autopar_cost_model.optimizer``); gradient synchronisation: the gradient of
  a parameter replicated over mesh axes is partial over them and is all-reduced there
  (reduce-scattered under ZeRO-1/2, plus an all-gather of the updated shard after the step).
  Under offload (``autopar_plans.offload``) the host's share: an offloaded optimizer's
  states and step; offloaded parameters' working copies off the device (``ParamCost.working``
  is what each fetch moves, ``autopar_passes.problem`` prices the fetches).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import torch

from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.compute import op_time
from autopar_cost_model.host import host_copy_time
from autopar_cost_model.memory import param_state_bytes, precision_policy
from autopar_cost_model.offload import optimizer_offload
from autopar_cost_model.optimizer import optimizer_step_time
from autopar_cost_model.reshard import ReshardStep
from autopar_passes.annotation import META_KEY, NodeAnnotation, TensorInfo, dtype_itemsize
from autopar_passes.mixed_precision import AutocastSaved
from autopar_passes.strategies.types import Strategy
from autopar_plans.buckets import BUCKET_BYTES, ddp_buckets
from autopar_plans.compression import compressed_calls, encode_passes, state_values
from autopar_plans.offload import NO_OFFLOAD, Offload
from autopar_plans.placement import PARTIAL, REPLICATE, Layout, Partial, Replicate, Shard
from autopar_plans.reduction import PER_AXIS, GradReduction, reduce_steps
from autopar_plans.reshard import LOCAL_KINDS

if TYPE_CHECKING:
    from autopar_passes.trace import TracedModel


# ATen ops by the family whose measured rate they run at (``DevicePreset.op_rates``)
MATMUL_OPS = frozenset(
    ("linear", "mm", "bmm", "addmm", "matmul", "einsum", "baddbmm", "addbmm", "_grouped_mm")
)


def op_family(op: str) -> str:
    """``matmul``, ``attention`` or ``""`` for an ATen op name (``aten.linear.default``)."""
    name = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 1 else op
    if name in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    return ""


@functools.lru_cache(maxsize=1 << 16)
def dual(layout: Layout) -> Layout:
    """The layout of the gradient of a tensor in ``layout``: R and P swap, S stays."""
    return Layout(
        *(
            PARTIAL if isinstance(p, Replicate) else REPLICATE if isinstance(p, Partial) else p
            for p in layout
        )
    )


@dataclass(frozen=True)
class ParamCost:
    """What one storage layout of one parameter costs."""

    params: float
    grads: float
    optimizer: float
    # gradient synchronisation, overlappable with backward: once per step (DDP's sum,
    # ZeRO-1's), or once per microbatch (ZeRO-2's reduce-scatter; ``CostModel.sync_passes``)
    sync_s: float
    step_s: float = 0.0  # after the optimizer step, exposed: ZeRO's gather of the masters
    optimizer_s: float = 0.0  # the optimizer's step of the piece this device steps
    host: float = 0.0  # bytes in host memory: an offloaded master, its gradient and states
    host_s: float = 0.0  # an offloaded optimizer's copies over the host link, exposed
    # the local working copy's bytes (what the graph reads): what an offloaded parameter
    # fetches from the host every microbatch, in forward and again in backward
    working: float = 0.0
    # the bucketed calls it joins, whose fixed cost is paid once whoever joins (``SyncCall``)
    calls: tuple[SyncCall, ...] = ()

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class SyncCall:
    """The fixed cost (launch and hop latencies) of the first call of a bucket key on one
    mesh axis: the runtime fills buckets per key (``autopar_plans.buckets``: the parameters of one
    process group and dtype), so it pays a call for every key any parameter joins, however
    few bytes it holds. Priced as a share of one model-wide bucket's call instead, the few
    parameters a tensor-parallel plan leaves replicated paid a fraction of the calls the
    runtime runs whole (the solver's sync on llama-tiny, forced tp on 2x2: 4.5 us against
    the ledger's three calls, 24 us). The calls after a key's first are shared by bytes
    (``CostModel.bucketed``). ``overlappable``: a gradient sum in backward, else a gather
    after the optimizer step (ZeRO's masters)."""

    key: tuple[object, ...]
    seconds: float
    overlappable: bool = True


def compute_dtype_of(precision: str) -> str:
    """The dtype matmuls run in under ``precision``."""
    mixed = {"bf16_mixed": "bfloat16", "fp16_mixed": "float16", "bf16": "bfloat16"}
    return mixed.get(precision, "float32")


@dataclass
class CostModel:
    """Coefficients for the ILP under one mesh, preset and training policy."""

    mesh_cost: MeshCost
    optimizer: str = "adamw"
    precision: str = "fp32"
    zero: int = 0  # ZeRO stage applied to replicated axes of parameters: 0, 1 or 2
    # activations of a microbatch of (batch_scale x) the traced batch: what memory needs
    # when the search runs smaller microbatches than were traced (autopar_passes.pipeline.search)
    batch_scale: float = 1.0
    # of those, the microbatches in flight: what is kept once per microbatch whatever its
    # size (autocast's copies of a weight it casts anew each call, ``weight_copies``)
    in_flight: float = 1.0
    # what fills one gradient-sync bucket: DDP's 25 MiB, or the whole model's gradients
    # when they are fewer (``bucketed``)
    bucket_bytes: float = BUCKET_BYTES
    # the runtime's bucket cap in those bytes (DDP's 25 MiB): how many calls a key's bytes
    # fill after its first (``bucketed``)
    bucket_cap: float = BUCKET_BYTES
    # parameter placeholders whose ZeRO working copy is in the compute dtype (mixed
    # precision: those only matmuls read, ``autopar_passes.mixed_precision.cast_for_gather``)
    working_cast: frozenset[str] = frozenset()
    # what autograd keeps under the mixed precision's autocast (None: the traced dtypes, fp32
    # scaled to the compute dtype); ``autopar_passes.mixed_precision.autocast_saved``
    autocast_saved: AutocastSaved | None = None
    # parameter placeholder -> its FSDP group (its layer's parameters, or those before or
    # after the layers), whose gathers the runtime runs as one call, and its share of the
    # group's bytes (``runtime.param_groups``; ``fsdp_group_shares``)
    gather_share: Mapping[str, GroupShare] = field(default_factory=dict)
    # how gradients cross replicated axes (``autopar_plans.reduction``): the form of a sum
    # over several axes, its dtype, compression
    reduction: GradReduction = PER_AXIS
    # what lives in host memory (``autopar_plans.offload``, priced by
    # ``autopar_cost_model.offload``)
    offload: Offload = NO_OFFLOAD
    _edge_cache: dict[object, tuple[float, float]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.mesh_cost.mesh.shape

    @cached_property
    def compute_dtype(self) -> str:
        return compute_dtype_of(self.precision)

    @cached_property
    def activation_scale(self) -> float:
        """Float activations traced in fp32 shrink to the compute dtype's size."""
        return precision_policy(self.precision).param / 4

    def _bytes(self, info_dtype: str, nbytes: float) -> float:
        return nbytes * self.activation_scale if info_dtype == "float32" else nbytes

    def op_time(
        self, note: NodeAnnotation, strategy: Strategy, batch: float = 1.0
    ) -> tuple[float, float]:
        """(forward, backward) seconds of an op under ``strategy``: the roofline time of its
        share of the work, with the host's time to issue it (``DevicePreset.op_overhead``;
        a view launches no kernel, and costs only where the host's time adds). ``batch``:
        for a microbatch of that many times the traced batch (the pipeline search's
        smaller microbatches), its FLOPs and bytes scaled alike and each call's measured
        rate (``op_rates``) and issue time as for that call."""
        preset = self.mesh_cost.preset
        host = preset.op_overhead
        if note.kind == "view":
            if host.asynchronous:
                return 0.0, 0.0
            return host.forward, host.backward if note.requires_grad else 0.0
        dtype = self.compute_dtype
        scale = self.activation_scale
        split = max(strategy.split, 1) / batch
        moved = (note.bytes_read + note.bytes_written) * scale / split
        family, call = op_family(note.op), note.fwd_flops / split
        fwd = host.time(op_time(call, moved, dtype, preset, family))
        if not note.requires_grad:
            return fwd, 0.0
        backward = op_time(note.bwd_flops / split, 2 * moved, dtype, preset, family, call)
        return fwd, host.time(backward, backward=True)

    def saved_bytes(
        self, note: NodeAnnotation, strategy: Strategy, output: bool = True, node: str = ""
    ) -> float:
        """Bytes per device that ``note``'s op (``node``) keeps for backward under
        ``strategy``: its output when ``output`` (split as the output is) and what the op
        keeps internally (a norm's statistics, a loss's log-probabilities), split as the
        op's work is: a loss's output is one replicated scalar, but its log-softmax is as
        large as its logits, and shrinks as they are split. Under autocast, what
        ``autocast_saved`` found: the output in its autocast dtype and the 16-bit copies
        consumers keep of it."""
        if not strategy.outputs:
            return 0.0
        if self.autocast_saved is not None and node:
            found = self.autocast_saved
            kept = found.internal_bytes.get(node, 0) / max(strategy.split, 1)
            if output:
                held = found.output_bytes.get(node, 0) + found.cast_bytes.get(node, 0)
                kept += held / strategy.outputs[0].shard_factor(self.mesh_shape)
            return self.batch_scale * kept
        dtype = note.outputs[0].dtype if note.outputs else "float32"
        internal = note.internal_saved_bytes
        kept = self._bytes(dtype, internal) / max(strategy.split, 1)
        if output and note.saved_bytes > internal:
            factor = strategy.outputs[0].shard_factor(self.mesh_shape)
            kept += self._bytes(dtype, note.saved_bytes - internal) / factor
        return self.batch_scale * kept

    def tensor_bytes(self, info: TensorInfo, layout: Layout) -> float:
        """Bytes per device of a tensor in ``layout`` (activations in the compute dtype)."""
        return (
            self.batch_scale
            * self._bytes(info.dtype, info.nbytes)
            / layout.shard_factor(self.mesh_shape)
        )

    def activation_bytes(self, note: NodeAnnotation, strategy: Strategy, node: str = "") -> float:
        """Saved-for-backward bytes per device of an op (``node``) under ``strategy``."""
        if self.autocast_saved is None and not note.saved_bytes:
            return 0.0
        return self.saved_bytes(note, strategy, node=node)

    def weight_cast_bytes(self, info: TensorInfo, src: Layout, dst: Layout, param: str) -> float:
        """Bytes per device of autocast's 16-bit copy of fp32 parameter ``param`` (stored in
        ``src``) that an op reading it in ``dst`` keeps (``AutocastSaved.weight_casts``).
        The runtime makes none where it holds the weight in the compute dtype already: a
        parameter only matmuls read (``working_cast``) is gathered in it (FSDP) and held in
        it as ZeRO's working copy; read as stored, it is the fp32 parameter, cast by
        autocast. One copy: how many are held at once is ``weight_copies``."""
        if param in self.working_cast:
            # (an axis of one device gathers nothing: a stage of one device reads the fp32
            # weight as stored, and autocast casts it)
            gathered = any(
                isinstance(s, Shard) and s != d and size > 1
                for s, d, size in zip(src, dst, self.mesh_shape, strict=True)
            )
            zero_layout = zero_layout_of(src, info.shape, self.mesh_shape)
            held_cast = self.zero and zero_layout.shard_factor(self.mesh_shape) > src.shard_factor(
                self.mesh_shape
            )
            if gathered or held_cast:
                return 0.0
        return info.numel * self.compute_itemsize / dst.shard_factor(self.mesh_shape)

    def weight_copies(self, param: str, op: str) -> float:
        """How many of autocast's copies of ``param`` kept by ``op`` are held at once: one
        where autocast caches the cast (of the parameter itself, once a step: one autocast
        context runs a step's microbatches), one per microbatch in flight where it casts a
        view of it anew at each call (``AutocastSaved.call_casts``: an einsum's operand)."""
        found = self.autocast_saved
        return self.in_flight if found is not None and (param, op) in found.call_casts else 1.0

    def edge_time(
        self,
        info: TensorInfo,
        src: Layout,
        dst: Layout,
        requires_grad: bool,
        regathered: bool = False,
        param: str = "",
        output: bool = False,
        batch: float = 1.0,
    ) -> tuple[float, float]:
        """(forward, backward) seconds to bring a tensor from ``src`` to ``dst`` (cached).

        ``regathered``: a parameter gathered for an op that keeps it for backward; the
        runtime drops the gathered copy after the forward and gathers it again in the
        backward (``autopar.runtime.regather``, as FSDP does), so the backward pays the
        forward's collectives once more. ``param``: the parameter's placeholder, whose
        gather from its own shard the runtime runs with the rest of its FSDP group
        (``gather_share``). ``output``: the reshard makes a model output whole, and the
        all-reduces that end it skip their adjoint (``autopar_passes.rewrites.output_boundary``:
        priced, the logits' all-reduce of a tensor-parallel head was paid twice). ``batch``:
        an activation of a microbatch of that many times the traced batch (the pipeline
        search's smaller microbatches), each call timed for its bytes so scaled."""
        if src == dst:
            return 0.0, 0.0
        found = self.gather_share.get(param)
        share = 1.0 if found is None else found.share
        itemsize = self.wire_itemsize(info, param)
        key = (info, src, dst, requires_grad, share, itemsize, output, batch)
        known = self._edge_cache.get(key)
        if known is None:
            known = self._edge_time(info, src, dst, requires_grad, share, itemsize, output, batch)
            self._edge_cache[key] = known
        if regathered:
            return known[0], known[1] + known[0]
        return known

    def wire_itemsize(self, info: TensorInfo, producer: str = "") -> int:
        """Bytes per element a collective moves of ``info``, made by ``producer``: a
        parameter's as the runtime gathers it (``gathered_itemsize``: the solver had priced
        a norm's gather in bf16, in its cast weights' call); under autocast, the dtype
        autocast gives it (``AutocastSaved.output_dtypes``: a residual sum stays fp32, as
        the runtime moves it); else traced fp32 travels in the compute dtype."""
        if producer in self.gather_share:  # a parameter, moved as the runtime gathers it
            return gathered_itemsize(self.precision, info.dtype, producer in self.working_cast)
        found = self.autocast_saved
        if found is not None and info.dtype.startswith(("float", "bfloat")):
            dtype = found.output_dtypes.get(producer)
            if dtype is not None:
                return dtype_itemsize(dtype)
        itemsize = info.nbytes // max(info.numel, 1)
        if info.dtype == "float32":
            itemsize = max(1, round(itemsize * self.activation_scale))
        return itemsize

    def _edge_time(
        self,
        info: TensorInfo,
        src: Layout,
        dst: Layout,
        requires_grad: bool,
        share: float,
        itemsize: int,
        output: bool = False,
        batch: float = 1.0,
    ) -> tuple[float, float]:
        forward, backward = self._reshard_steps(info, src, dst, requires_grad, itemsize)
        if output:  # the adjoints of the trailing all-reduces, first in backward, are skipped
            skipped = min(trailing_all_reduces(forward), trailing_all_reduces(backward[::-1]))
            backward = backward[skipped:]
        if batch != 1.0:
            forward, backward = self._scaled(forward, batch), self._scaled(backward, batch)
        fwd = self._steps_time(forward, share, 0, "all_gather")
        if not requires_grad:
            return fwd, 0.0
        return fwd, self._steps_time(backward, share, len(backward) - 1, "reduce_scatter")

    def _scaled(self, steps: tuple[ReshardStep, ...], batch: float) -> tuple[ReshardStep, ...]:
        """``steps`` moving ``batch`` times their bytes, each call timed anew (its fixed cost
        paid whatever its bytes)."""
        scaled = []
        for step in steps:
            if step.kind in LOCAL_KINDS:
                scaled.append(step)
                continue
            result = self.mesh_cost.collective(step.kind, step.nbytes * batch, step.axes)
            nbytes = step.nbytes * batch
            scaled.append(
                ReshardStep(step.kind, step.axes, nbytes, result.time, result.form, result.sent)
            )
        return tuple(scaled)

    def _reshard_steps(
        self, info: TensorInfo, src: Layout, dst: Layout, requires_grad: bool, itemsize: int
    ) -> tuple[tuple[ReshardStep, ...], tuple[ReshardStep, ...]]:
        forward = self.mesh_cost.reshard(src, dst, info.shape, itemsize).steps
        if not requires_grad:
            return forward, ()
        return forward, self.mesh_cost.reshard(dual(dst), dual(src), info.shape, itemsize).steps

    def _steps_time(
        self, steps: tuple[ReshardStep, ...], share: float, grouped: int, kind: str
    ) -> float:
        """A reshard's seconds, its step ``grouped`` run as ``share`` of a group's call when
        it is the all-gather from a parameter's shard (forward: the first step) or the
        reduce-scatter back into it (backward: the last), as ``runtime.param_groups`` runs
        a layer's: one call for the group, its bytes paid in proportion at the bandwidth
        of the group's bytes, its fixed cost (``call_fixed``) left to the group's call
        (``group_call``), which the solver pays once for the group."""
        total = 0.0
        for index, step in enumerate(steps):
            if index == grouped and 0.0 < share < 1.0 and step.kind == kind:  # 0: no bytes
                call = self.mesh_cost.collective(step.kind, step.nbytes / share, step.axes)
                total += (call.time - self.call_fixed(kind, step.axes)) * share
            else:
                total += step.time
        return total

    def call_fixed(self, kind: str, axes: tuple[int, ...]) -> float:
        """Seconds a call of ``kind`` over ``axes`` costs whatever its bytes (launch and hop
        latencies): its time on one byte."""
        return self.mesh_cost.collective(kind, 1.0, axes).time

    def prefetched(
        self,
        info: TensorInfo,
        src: Layout,
        dst: Layout,
        requires_grad: bool,
        regathered: bool = False,
        param: str = "",
    ) -> tuple[float, float]:
        """(forward, backward) seconds of ``edge_time`` that are ``param``'s FSDP group
        gather, which the runtime prefetches behind the group before
        (``runtime.param_groups``): the gather from the parameter's shard, and its regather
        in backward. 0 for what joins no group."""
        joined = self._joined_gather(info, src, dst, requires_grad, param)
        if joined is None:
            return 0.0, 0.0
        found, forward, _ = joined
        gather = self._steps_time(forward[:1], found.share, 0, "all_gather")
        return gather, gather if regathered else 0.0

    def _joined_gather(
        self, info: TensorInfo, src: Layout, dst: Layout, requires_grad: bool, param: str
    ) -> tuple[GroupShare, tuple[ReshardStep, ...], tuple[ReshardStep, ...]] | None:
        """``param``'s FSDP group and the reshard's (forward, backward) steps, when its first
        step is the gather from the parameter's shard that joins the group's call."""
        found = self.gather_share.get(param)
        if src == dst or found is None:
            return None
        itemsize = self.wire_itemsize(info, param)
        forward, backward = self._reshard_steps(info, src, dst, requires_grad, itemsize)
        if not forward or forward[0].kind != "all_gather":
            return None
        return found, forward, backward

    def group_call(
        self,
        info: TensorInfo,
        src: Layout,
        dst: Layout,
        requires_grad: bool,
        regathered: bool = False,
        param: str = "",
    ) -> GroupCallCost | None:
        """The FSDP group call that the reshard of ``param`` from ``src`` to ``dst`` joins
        (``edge_time`` priced its bytes), with the fixed cost of the group's gather, its
        regather and its reduce-scatter, paid once a microbatch for the whole group however
        many of its members join. None when it joins none."""
        joined = self._joined_gather(info, src, dst, requires_grad, param)
        if joined is None or joined[0].share >= 1.0:
            return None
        found, forward, backward = joined
        axes = forward[0].axes
        gather = self.call_fixed("all_gather", axes)
        reduce = 0.0
        if backward and backward[-1].kind == "reduce_scatter":
            reduce = self.call_fixed("reduce_scatter", backward[-1].axes)
        itemsize = self.wire_itemsize(info, param)
        regather = gather if regathered else 0.0
        return GroupCallCost(found.group, axes, itemsize, gather, regather, reduce)

    @cached_property
    def compute_itemsize(self) -> int:
        return precision_policy(self.precision).param

    def stored_itemsize(self, info: TensorInfo) -> int:
        """Bytes per value of a parameter as the device holds it (and its gradient, and
        ZeRO's master): as traced, but bf16 under pure ``bf16``."""
        return 2 if self.precision == "bf16" else dtype_itemsize(info.dtype)

    def sync_passes(self, microbatches: int) -> int:
        """How often a step runs the overlappable gradient sync, each pass hidden behind one
        microbatch's backward: every microbatch under ZeRO-2, else once (the last
        microbatch's backward; DDP's ``no_sync`` in the others)."""
        return microbatches if self.zero >= 2 else 1

    def bucketed(
        self, kind: str, nbytes: float, axes: tuple[int, ...], whole: float | None = None
    ) -> float:
        """Seconds of one parameter's share of a bucketed collective (gradient sync, ZeRO),
        but the first call's fixed cost of its key (``SyncCall``). The runtime sums
        gradients in DDP's 25 MiB buckets (``autopar_plans.buckets``): the bytes move at a whole
        bucket's speed (``bucket_bytes``; ``Link.bandwidth_by_kind``), not a small
        tensor's, and the fixed cost of the calls after a key's first is the parameter's
        share of a full bucket (``bucket_cap``), at most one call: a parameter larger than
        a bucket is a bucket of its own (a model of small tensors paid the fixed cost
        hundreds of times in the ILP when each paid its own). ``whole``: the parameter's
        bytes in the bucket as filled, where a call moves less of it (ZeRO's piece
        shrinking axis by axis: the bucket shrinks alike, so the parameter's share of the
        call stays ``whole / bucket_bytes``; priced by the piece's bytes instead, the
        second axis's call was paid an eighth of on 8x8)."""
        whole = nbytes if whole is None else whole
        if nbytes <= 0:
            return 0.0
        fixed = self.call_fixed(kind, axes)
        if whole >= self.bucket_bytes:
            moving = self.mesh_cost.collective(kind, nbytes, axes).time - fixed
        else:
            share = whole / self.bucket_bytes
            moving = (self.mesh_cost.collective(kind, nbytes / share, axes).time - fixed) * share
        return moving + fixed * min(whole / self.bucket_cap, 1.0)

    def _sync_calls(
        self,
        info: TensorInfo,
        node: str,
        replicated: tuple[int, ...],
        zero_axes: tuple[int, ...],
        working: int,
        even: bool,
        local_shape: tuple[int, ...],
    ) -> tuple[SyncCall, ...]:
        """The bucket keys' first calls a parameter joins, keyed as the runtime fills its
        buckets (``autopar_passes.ledger.gradient_sync_entries``, ``zero_entries``): DDP by the
        replicated axes and the stored dtype; ZeRO by its axes, the other replicated axes
        and the working copy's dtype, a parameter that does not split evenly in a bucket of
        its own."""

        def fixed(kind: str, axis: int) -> float:
            return self.call_fixed(kind, (axis,))

        if not zero_axes:
            key = ("ddp", replicated, self.stored_itemsize(info))
            if self.reduction.sync == "local_sgd":
                return ()
            if self.reduction.compression.compresses(local_shape):
                calls = compressed_calls(
                    self.reduction.compression,
                    [local_shape],
                    [self.mesh_shape[a] for a in replicated],
                )
                return tuple(
                    SyncCall(
                        (*key, c.kind, c.what, replicated[c.position]),
                        fixed(c.kind, replicated[c.position]),
                        overlappable=False,
                    )
                    for c in calls
                )
            return tuple(
                SyncCall((*key, kind, a), fixed(kind, a))
                for kind, a, _ in self._sum_steps(replicated)
            )
        others = tuple(a for a in replicated if a not in zero_axes)
        key = ("zero", zero_axes, others, working) if even else ("zero", node)
        return (
            *(SyncCall((*key, kind, a), fixed(kind, a)) for kind, a, _ in self._sum_steps(others)),
            *(SyncCall((*key, "reduce_scatter", a), fixed("reduce_scatter", a)) for a in zero_axes),
            *(
                SyncCall((*key, "all_gather", a), fixed("all_gather", a), overlappable=False)
                for a in zero_axes
            ),
        )

    def grad_itemsize(self, info: TensorInfo) -> int:
        """Bytes per value a gradient is summed in over replicated axes: the policy's dtype
        (``GradReduction.wire_dtype``: mixed precision's compute dtype, or a casting
        compression's), as ``runtime.grad_sync`` and ``runtime.zero`` cast their buckets."""
        stored = "bfloat16" if self.precision == "bf16" else info.dtype
        compute = self.compute_dtype if self.precision != "fp32" else None
        return dtype_itemsize(self.reduction.wire_dtype(stored, compute))

    def _sum_steps(self, axes: tuple[int, ...]) -> list[tuple[str, int, int]]:
        """(kind, mesh axis, divisor of the bucket) of each call that sums a bucket over
        ``axes`` under the policy (``autopar_plans.reduction.reduce_steps``)."""
        names = self.mesh_cost.mesh.axis_names
        index = {name: a for a, name in enumerate(names)}
        sizes = [(names[a], self.mesh_shape[a]) for a in axes]
        return [(s.kind, index[s.axis], s.divisor) for s in reduce_steps(self.reduction, sizes)]

    def _compressed_time(self, shape: tuple[int, ...], axes: tuple[int, ...]) -> float:
        """Seconds of a compressed sum of one gradient of local ``shape`` over ``axes``: the
        scheme's calls (``compressed_calls``; priced as a share of a bucket's) and its
        encoding's passes over memory. Not hidden by backward: the runtime encodes once
        the bucket's gradients are all in."""
        scheme = self.reduction.compression
        calls = compressed_calls(scheme, [shape], [self.mesh_shape[a] for a in axes])
        moving = sum(self.bucketed(c.kind, c.nbytes, (axes[c.position],)) for c in calls)
        encode = encode_passes(scheme) * 4.0 * math.prod(shape)
        return moving + op_time(0.0, encode, "float32", self.mesh_cost.preset)

    def param_cost(self, info: TensorInfo, layout: Layout, node: str = "") -> ParamCost:
        """Memory and gradient-sync time of a parameter stored in ``layout`` (``node``: its
        placeholder, which says whether a ZeRO working copy is cast, ``working_cast``)."""
        shard = layout.shard_factor(self.mesh_shape)
        replicated = tuple(
            a for a, p in enumerate(layout) if isinstance(p, Replicate) and self.mesh_shape[a] > 1
        )
        zero_shard = 1
        zero_axes: tuple[int, ...] = ()
        even = True
        if self.zero and replicated:
            zero_layout = zero_layout_of(layout, info.shape, self.mesh_shape)
            zero_shard = zero_layout.shard_factor(self.mesh_shape) // shard
            zero_axes = tuple(a for a in replicated if isinstance(zero_layout[a], Shard))
            even = zero_layout.divides(info.shape, self.mesh_shape)
        zero = self.zero if zero_shard > 1 else 0
        cast = node in self.working_cast
        # an offloaded optimizer holds every parameter as ZeRO does (a working copy on the
        # device, a master piece on the host), whatever the axes shard
        mastered = bool(zero_axes) or self.offload.optimizer
        params, grads, optimizer = param_state_bytes(
            info.shape,
            self.optimizer,
            self.precision,
            zero=max(zero, 1) if mastered else 0,
            working_cast=cast,
        )
        # as the runtime sums them (``runtime.grad_sync``, ``runtime.zero``), in the policy's
        # form and dtype (``autopar_plans.reduction``): DDP sums the accumulated gradient
        # over the replicated axes (compressed: by the scheme's calls, after backward; local
        # SGD: no gradient, the parameters averaged once a period); ZeRO sums it over the
        # axes it does not shard and reduce-scatters it over those it does, the piece
        # shrinking axis by axis (ZeRO-1: once, ZeRO-2: every microbatch's), and gathers
        # the stepped masters back after the step, in the working copy's dtype
        wire = info.numel * self.grad_itemsize(info) / shard
        sync = step = 0.0
        others = tuple(axis for axis in replicated if axis not in zero_axes)
        local_shape = layout.local_shape(info.shape, self.mesh_shape)
        compressed = (
            bool(others) and not mastered and self.reduction.compression.compresses(local_shape)
        )
        if mastered or (others and self.reduction.sync == "every_step" and not compressed):
            for kind, axis, divisor in self._sum_steps(others):
                sync += self.bucketed(kind, wire / divisor, (axis,), whole=wire)
        elif others and self.reduction.sync == "local_sgd":
            # the parameters (as stored) averaged once a period, after the step
            stored = info.numel * self.stored_itemsize(info) / shard
            for kind, axis, divisor in self._sum_steps(others):
                step += self.bucketed(kind, stored / divisor, (axis,), whole=stored)
            step /= self.reduction.period
        elif compressed:
            step += self._compressed_time(local_shape, others)
            optimizer += 4.0 * state_values(self.reduction.compression, local_shape) * shard
        piece = wire
        for axis in zero_axes:
            sync += self.bucketed("reduce_scatter", piece, (axis,), whole=wire)
            piece /= self.mesh_shape[axis]
        working = self.compute_itemsize if cast else self.stored_itemsize(info)
        gathered = info.numel * working / shard / zero_shard
        for axis in reversed(zero_axes):
            gathered *= self.mesh_shape[axis]
            step += self.bucketed("all_gather", gathered, (axis,), whole=wire)
        stepped = info.numel / shard / zero_shard
        master = self.stored_itemsize(info)  # the weights the optimizer steps
        preset = self.mesh_cost.preset
        # the runtime's copies into and out of its buckets (``bucket_copy_bytes``)
        local, wire_size = info.numel / shard, self.grad_itemsize(info)
        if mastered:
            reduce_b, gather_b = zero_copy_bytes(
                local, zero_shard, working, wire_size, master, bool(others)
            )
            sync += op_time(0.0, reduce_b, "float32", preset)
            step += op_time(0.0, gather_b if zero_axes else 0.0, "float32", preset)
        elif others and sync:
            sync += op_time(0.0, bucket_copy_bytes(local, master, wire_size), "float32", preset)
        optimizer_s = optimizer_step_time(stepped, self.optimizer, master, preset)
        host = host_s = 0.0
        optimizer_b = optimizer / shard / zero_shard
        if self.offload.optimizer:
            offloaded = optimizer_offload(
                stepped,
                grad=wire_size,
                working=working,
                master=master,
                optimizer=self.optimizer,
                preset=preset,
            )
            # the master's gradient piece lives beside it, in the master's width
            host = optimizer_b + info.numel * master / shard / zero_shard
            optimizer_b = 0.0
            host_s, optimizer_s = offloaded.copy_s, offloaded.host_s
            if self.offload.parameters:  # the stepped master stays up there: fetched
                host_s -= host_copy_time(offloaded.to_device, preset, "to_device")
        params_b = params / shard
        held = params_b
        if self.offload.parameters:
            # no working copy stays on the device (``autopar_cost_model.offload``); the
            # host keeps one beside the master only where the dtypes differ (a matmul's
            # weight cast to the compute dtype), else the runtime copies up the master
            host += params_b if working != master else 0.0
            params_b = 0.0
        return ParamCost(
            params=params_b,
            grads=grads / shard / (zero_shard if zero >= 2 else 1),
            optimizer=optimizer_b,
            sync_s=sync,
            step_s=step,
            optimizer_s=optimizer_s,
            host=host,
            host_s=host_s,
            working=held,
            calls=self._sync_calls(
                info, node, replicated, zero_axes, working, even, tuple(local_shape)
            ),
        )


def bucket_copy_bytes(numel: float, stored: int, wire: int) -> float:
    """Bytes a DDP bucket's gradient of ``numel`` values moves through memory per sync, as
    ``runtime.grad_sync`` does: flattened into the bucket (read and write), and under mixed
    precision cast to the wire dtype and back (``stored``, ``wire``: bytes per value)."""
    moved = 2.0 * numel * stored
    if wire != stored:
        moved += 2.0 * numel * (stored + wire)
    return moved


def zero_copy_bytes(
    numel: float, pieces: int, working: int, wire: int, master: int, others: bool
) -> tuple[float, float]:
    """Bytes a ZeRO bucket of ``numel`` local values moves through memory, as
    ``runtime.zero`` does: per sum (the working gradient cast to the wire dtype, laid into
    the reduce-scatter's rows, flattened for an all-reduce over ``others`` axes first; this
    device's piece of ``numel / pieces`` taken out and added into the master's gradient),
    and per gather of the stepped masters (cast to the working dtype, flattened, the
    gathered rows copied into the working copies)."""
    piece = numel / pieces
    reduce = 2.0 * numel * wire + piece * (3 * wire + master)
    if working != wire:
        reduce += numel * (working + wire)
    if others:
        reduce += 2.0 * numel * wire
    gather = 2.0 * numel * working + 2.0 * piece * working
    if master != working:
        gather += piece * (master + working)
    return reduce, gather


def zero_layout_of(layout: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Layout:
    """The optimizer-state (ZeRO) layout of a parameter stored in ``layout``: every axis of
    size > 1 that replicates it shards the largest dim that still divides evenly, preferring
    dims no other axis shards (so each device's state is a piece of its own parameter shard,
    whichever axis is outer)."""
    placements = list(layout)
    for axis, placement in enumerate(placements):
        if not isinstance(placement, Replicate) or mesh_shape[axis] == 1:
            continue
        local = Layout(*placements).local_shape(shape, mesh_shape)
        taken = {p.dim for p in placements if isinstance(p, Shard)}
        dims = sorted(range(len(shape)), key=lambda d: (d in taken, -local[d]))
        for dim in dims:
            if local[dim] % mesh_shape[axis] == 0:
                placements[axis] = Shard(dim)
                break
    return Layout(*placements)


def gradient_bytes(params: list[tuple[tuple[int, ...], int]]) -> int:
    """The whole model's gradient bytes, for ``(shape, bytes per value)`` of every parameter."""
    return sum(math.prod(shape) * itemsize for shape, itemsize in params)


def sync_buckets(params: list[tuple[tuple[int, ...], int]]) -> int:
    """How many buckets the runtime sums gradients in, for ``(shape, bytes per value)`` of
    every parameter, whole (``autopar_plans.buckets.ddp_buckets``): the ``k`` of the exposed
    gradient-sync rule (``autopar_cost_model.step.exposed_gradient_sync``). Sharded parameters
    make fewer; counting them whole errs toward more hiding."""
    items = [(0, math.prod(shape) * itemsize) for shape, itemsize in reversed(params)]
    return max(len(ddp_buckets(items)), 1)


class _Step(Protocol):
    kind: str


def trailing_all_reduces(steps: Sequence[_Step]) -> int:
    """How many all-reduces end ``steps`` (a reshard's steps or calls): those whose adjoint
    the output boundary skips (``autopar_passes.rewrites.output_boundary``)."""
    count = 0
    for step in reversed(steps):
        if step.kind != "all_reduce":
            break
        count += 1
    return count


# an FSDP group's call: (group, mesh axes, bytes per gathered value, pass: 0 the forward's
# gather with the backward's reduce-scatter, 1 the backward's regather)
CallKey = tuple[str, tuple[int, ...], int, int]


@dataclass(frozen=True)
class GroupCallCost:
    """The fixed seconds of an FSDP group's calls (``CostModel.group_call``): its forward
    gather, its regather in backward, its reduce-scatter, on ``axes``, of the members
    gathered ``itemsize`` bytes a value. The runtime gathers a group's members of each
    dtype in a call of their own (under mixed precision: the cast weights in bf16, the
    norms in fp32: two calls a layer, which the solver priced as one)."""

    group: str
    axes: tuple[int, ...]
    itemsize: int
    gather: float
    regather: float
    reduce: float

    def calls(self) -> list[tuple[CallKey, float, int]]:
        """``(key, seconds, pass)`` of each call a member joins: the gather and its
        reduce-scatter; the regather apart, since the runtime runs it only where a member
        it gathers is kept for backward (one call for both, a group whose embedding
        joined it paid the regather of a weight gathered in another layout)."""
        key = (self.group, self.axes, self.itemsize)
        found = [((*key, 0), self.gather + self.reduce, 0)]
        if self.regather:
            found.append(((*key, 1), self.regather, 1))
        return found


@dataclass(frozen=True)
class GroupShare:
    """A parameter's FSDP group and its share of the group's bytes."""

    group: str
    share: float


def fsdp_group_shares(
    traced: TracedModel, precision: str = "fp32", cast: frozenset[str] = frozenset()
) -> dict[str, GroupShare]:
    """Each parameter placeholder's share of its FSDP group's bytes, as
    ``runtime.param_groups`` groups a rank's gathers: a layer's parameters together; those
    outside the layers by whether they are first read before the layers or after. The
    share prices a member's bytes at the bandwidth of the whole group's, as if its other
    members were sharded alike; the group's call's fixed cost is not shared but paid once
    by whichever members join it (``CostModel.group_call``; the runtime's group holds
    only those gathered over the same mesh axes), among the members gathered in the same
    dtype (``gathered_itemsize``; ``cast``: the placeholders whose working copy is in the
    compute dtype), which the runtime gathers in a call of their own."""
    container = traced.layers
    order = {node.name: i for i, node in enumerate(traced.graph.nodes)}
    first_layer = min(
        (order[n.name] for n in traced.graph.nodes if _layer_of(n) is not None), default=0
    )
    groups: dict[tuple[str, int], list[tuple[str, float]]] = {}
    for name, info in traced.params.items():
        layer = container.index_of(name) if container is not None else None
        if layer is not None:
            key = f"layer{layer}"
        else:
            users = [u for n in info.nodes for u in _placeholder(traced, n).users]
            first = min((order[u.name] for u in users), default=0)
            key = "before" if first < first_layer else "after"
        itemsize = gathered_itemsize(precision, info.dtype, info.nodes[0] in cast)
        nbytes = float(math.prod(info.shape)) * itemsize
        groups.setdefault((key, itemsize), []).extend((node, nbytes) for node in info.nodes)
    shares = {}
    for (key, _), members in groups.items():
        total = sum(nbytes for _, nbytes in members)
        for node, nbytes in members:
            shares[node] = GroupShare(key, nbytes / total if total else 1.0)
    return shares


def gathered_itemsize(precision: str, dtype: str, cast: bool) -> int:
    """Bytes per value of a parameter as the runtime gathers it: in the compute dtype where
    its working copy is cast (a weight only matmuls read, ``autopar_passes.mixed_precision``), else
    as stored (fp32 under mixed precision: norms and embeddings)."""
    if cast:
        return precision_policy(precision).param
    return 2 if precision == "bf16" else dtype_itemsize(dtype)


def _layer_of(node: object) -> int | None:
    note = getattr(node, "meta", {}).get(META_KEY)
    return None if note is None or getattr(node, "op", "") == "placeholder" else note.layer


def _placeholder(traced: TracedModel, name: str) -> torch.fx.Node:
    (node,) = traced.graph.find_nodes(op="placeholder", target=name)
    return node
