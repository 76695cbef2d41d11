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
  layout's shard factor (owner attribution, see ``passes.annotate``).
- **Parameters**: value, gradient and optimizer-state bytes under the optimizer and
  precision policy, each divided by its layout; gradient synchronisation: the gradient of
  a parameter replicated over mesh axes is partial over them and is all-reduced there
  (reduce-scattered under ZeRO-1/2, plus an all-gather of the updated shard after the step).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from functools import cached_property

from cost_model.collectives import MeshCost
from cost_model.compute import op_time
from cost_model.memory import param_state_bytes, precision_policy
from passes.annotation import NodeAnnotation, TensorInfo, dtype_itemsize
from passes.mixed_precision import AutocastSaved
from passes.strategies.types import Strategy
from plans.buckets import BUCKET_BYTES, ddp_buckets
from plans.placement import PARTIAL, REPLICATE, Layout, Partial, Replicate, Shard


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

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass
class CostModel:
    """Coefficients for the ILP under one mesh, preset and training policy."""

    mesh_cost: MeshCost
    optimizer: str = "adamw"
    precision: str = "fp32"
    zero: int = 0  # ZeRO stage applied to replicated axes of parameters: 0, 1 or 2
    # activations of a microbatch of (batch_scale x) the traced batch: what memory needs
    # when the search runs smaller microbatches than were traced (passes.pipeline.search)
    batch_scale: float = 1.0
    # what fills one gradient-sync bucket: DDP's 25 MiB, or the whole model's gradients
    # when they are fewer (``bucketed``)
    bucket_bytes: float = BUCKET_BYTES
    # parameter placeholders whose ZeRO working copy is in the compute dtype (mixed
    # precision: those only matmuls read, ``passes.mixed_precision.cast_for_gather``)
    working_cast: frozenset[str] = frozenset()
    # what autograd keeps under the mixed precision's autocast (None: the traced dtypes, fp32
    # scaled to the compute dtype); ``passes.mixed_precision.autocast_saved``
    autocast_saved: AutocastSaved | None = None
    _edge_cache: dict[object, tuple[float, float]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.mesh_cost.mesh.shape

    @cached_property
    def compute_dtype(self) -> str:
        return {
            "fp32": "float32",
            "bf16_mixed": "bfloat16",
            "fp16_mixed": "float16",
            "bf16": "bfloat16",
        }[self.precision]

    @cached_property
    def activation_scale(self) -> float:
        """Float activations traced in fp32 shrink to the compute dtype's size."""
        return precision_policy(self.precision).param / 4

    def _bytes(self, info_dtype: str, nbytes: float) -> float:
        return nbytes * self.activation_scale if info_dtype == "float32" else nbytes

    def op_time(self, note: NodeAnnotation, strategy: Strategy) -> tuple[float, float]:
        """(forward, backward) seconds of an op under ``strategy``."""
        if note.kind == "view":
            return 0.0, 0.0
        dtype = self.compute_dtype
        scale = self.activation_scale
        split = max(strategy.split, 1)
        fwd = op_time(
            note.fwd_flops / split,
            (note.bytes_read + note.bytes_written) * scale / split,
            dtype,
            self.mesh_cost.preset,
        )
        if not note.requires_grad:
            return fwd, 0.0
        bwd = op_time(
            note.bwd_flops / split,
            2 * (note.bytes_read + note.bytes_written) * scale / split,
            dtype,
            self.mesh_cost.preset,
        )
        return fwd, bwd

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
        autocast."""
        if param in self.working_cast:
            gathered = any(isinstance(s, Shard) and s != d for s, d in zip(src, dst, strict=True))
            zero_layout = zero_layout_of(src, info.shape, self.mesh_shape)
            held_cast = self.zero and zero_layout.shard_factor(self.mesh_shape) > src.shard_factor(
                self.mesh_shape
            )
            if gathered or held_cast:
                return 0.0
        return info.numel * self.compute_itemsize / dst.shard_factor(self.mesh_shape)

    def edge_time(
        self,
        info: TensorInfo,
        src: Layout,
        dst: Layout,
        requires_grad: bool,
        regathered: bool = False,
    ) -> tuple[float, float]:
        """(forward, backward) seconds to bring a tensor from ``src`` to ``dst`` (cached).

        ``regathered``: a parameter gathered for an op that keeps it for backward; the
        runtime drops the gathered copy after the forward and gathers it again in the
        backward (``autopar.runtime.regather``, as FSDP does), so the backward pays the
        forward's collectives once more."""
        if src == dst:
            return 0.0, 0.0
        key = (info, src, dst, requires_grad)
        known = self._edge_cache.get(key)
        if known is None:
            known = self._edge_cache[key] = self._edge_time(info, src, dst, requires_grad)
        if regathered:
            return known[0], known[1] + known[0]
        return known

    def wire_itemsize(self, info: TensorInfo) -> int:
        """Bytes per element a collective moves of ``info``: traced fp32 travels in the
        compute dtype."""
        itemsize = info.nbytes // max(info.numel, 1)
        if info.dtype == "float32":
            itemsize = max(1, round(itemsize * self.activation_scale))
        return itemsize

    def _edge_time(
        self, info: TensorInfo, src: Layout, dst: Layout, requires_grad: bool
    ) -> tuple[float, float]:
        itemsize = self.wire_itemsize(info)
        fwd = self.mesh_cost.reshard(src, dst, info.shape, itemsize).time
        if not requires_grad:
            return fwd, 0.0
        bwd = self.mesh_cost.reshard(dual(dst), dual(src), info.shape, itemsize).time
        return fwd, bwd

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

    def bucketed(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds of one parameter's share of a bucketed collective (gradient sync, ZeRO):
        its bytes' time, and of the fixed cost of a call (launch and hop latencies) the
        share its bytes take of a bucket (``bucket_bytes``). The runtime sums gradients in
        DDP's 25 MiB buckets (``plans.buckets``), so it pays that cost once a bucket, not
        once a parameter (a model of small tensors paid it hundreds of times in the ILP);
        a model smaller than a bucket pays it once in all."""
        whole = self.mesh_cost.collective(kind, nbytes, axes).time
        if nbytes <= 0:
            return whole
        fixed = self.mesh_cost.collective(kind, 1.0, axes).time  # a byte: the fixed cost
        return whole - fixed + fixed * min(1.0, nbytes / self.bucket_bytes)

    def param_cost(self, info: TensorInfo, layout: Layout, node: str = "") -> ParamCost:
        """Memory and gradient-sync time of a parameter stored in ``layout`` (``node``: its
        placeholder, which says whether a ZeRO working copy is cast, ``working_cast``)."""
        shard = layout.shard_factor(self.mesh_shape)
        replicated = tuple(
            a for a, p in enumerate(layout) if isinstance(p, Replicate) and self.mesh_shape[a] > 1
        )
        zero_shard = 1
        zero_axes: tuple[int, ...] = ()
        if self.zero and replicated:
            zero_layout = zero_layout_of(layout, info.shape, self.mesh_shape)
            zero_shard = zero_layout.shard_factor(self.mesh_shape) // shard
            zero_axes = tuple(a for a in replicated if isinstance(zero_layout[a], Shard))
        zero = self.zero if zero_shard > 1 else 0
        cast = node in self.working_cast
        params, grads, optimizer = param_state_bytes(
            info.shape, self.optimizer, self.precision, zero=zero, working_cast=cast
        )
        # as the runtime sums them (``runtime.grad_sync``, ``runtime.zero``), one call per
        # mesh axis, in the compute dtype under mixed precision: DDP all-reduces the
        # accumulated gradient over each replicated axis; ZeRO all-reduces it over the axes
        # it does not shard and reduce-scatters it over those it does, the piece shrinking
        # axis by axis (ZeRO-1: once, ZeRO-2: every microbatch's), and gathers the stepped
        # masters back after the step, in the working copy's dtype
        wire = info.numel * self.wire_itemsize(info) / shard
        sync = step = 0.0
        for axis in replicated:
            if axis not in zero_axes:
                sync += self.bucketed("all_reduce", wire, (axis,))
        piece = wire
        for axis in zero_axes:
            sync += self.bucketed("reduce_scatter", piece, (axis,))
            piece /= self.mesh_shape[axis]
        working = self.compute_itemsize if cast else self.stored_itemsize(info)
        gathered = info.numel * working / shard / zero_shard
        for axis in reversed(zero_axes):
            gathered *= self.mesh_shape[axis]
            step += self.bucketed("all_gather", gathered, (axis,))
        return ParamCost(
            params=params / shard,
            grads=grads / shard / (zero_shard if zero >= 2 else 1),
            optimizer=optimizer / shard / zero_shard,
            sync_s=sync,
            step_s=step,
        )


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
    every parameter, whole (``plans.buckets.ddp_buckets``): the ``k`` of the exposed
    gradient-sync rule (``cost_model.step.exposed_gradient_sync``). Sharded parameters
    make fewer; counting them whole errs toward more hiding."""
    items = [(0, math.prod(shape) * itemsize) for shape, itemsize in reversed(params)]
    return max(len(ddp_buckets(items)), 1)
