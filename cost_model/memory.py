"""Memory per device at the peak of a training step: model states and saved activations.

**Model states.** A parameter of ``N`` values costs ``N`` times a width for its weights,
its gradient and its optimizer state (the optimizer's state values, plus an fp32 master
copy where the weights the graph reads are not the ones the optimizer steps). The widths
are those the runtime holds (``runtime.precision``, ``runtime.zero``):

==============  ===============================  =================  ====================
precision       weights (param bytes)            gradient bytes     optimizer bytes
==============  ===============================  =================  ====================
fp32            4                                4                  states x 4
bf16_mixed      4: the fp32 parameter is its     4                  states x 4
fp16_mixed      own master (torch.autocast;
                FSDP2's MixedPrecisionPolicy
                keeps the sharded fp32 one)
bf16            2                                2                  states x 2
==============  ===============================  =================  ====================

A ZeRO-1/2 parameter (optimizer state sharded beyond the parameter) is held as a *working
copy* the graph reads and a *master* piece the optimizer steps (``runtime.zero``): weights
``w``, the working copy's width (under mixed precision the compute dtype's 2 when every op
that reads it casts it anyway, a matmul's weight, ``autopar_passes.mixed_precision``; else the
stored width); gradient ``w`` for ZeRO-1 (the working gradient, accumulated whole over
the microbatches), the master's width for ZeRO-2 (each microbatch's sum lands in the
master's piece; torch steps a parameter with a gradient of its own dtype); optimizer the
master piece plus the states, all in the master's width (4, or 2 under pure bf16).

==============  ==========================================================================
optimizer       state values for a parameter of shape ``(..., r, c)`` with ``N`` values
==============  ==========================================================================
sgd             0
sgd_momentum    N (momentum buffer)
adam, adamw     2 N (first and second moments)
lars            N (momentum buffer; ``autopar.optim.LARS``, You et al. 2017)
lamb            2 N (first and second moments; ``autopar.optim.LAMB``, You et al. 2019)
adafactor       ``N / (r c) * (r + c)`` for ``ndim >= 2`` (row and column second-moment
                factors), ``N`` for vectors; no first moment (Shazeer & Stern 2018; as
                ``torch.optim.Adafactor``, which factors the last two dims)
==============  ==========================================================================

So mixed-precision Adam is 4 + 4 + 8 = 16 bytes per parameter, and a ZeRO matmul weight
2 + 2 + (4 + 4 + 4): ZeRO's K = 12 (Rajbhandari et al. 2019, Sec. 3.1), except that a
ZeRO-2 gradient piece is 4 bytes where DeepSpeed keeps 2.

Each of the three terms is divided by the shard factor of *its own* layout
(``Layout.shard_factor``), so ZeRO falls out of layouts: replicate all three over the data
axis for plain DP; shard the optimizer layout for ZeRO-1, also the gradient for ZeRO-2, also
the parameter for ZeRO-3/FSDP. (Adafactor's factors are divided the same way, an
approximation: a row factor is split only by a layout that splits rows.)

**Activations.** Saved-for-backward bytes of one microbatch, each tensor divided by its
layout's shard factor; a pipeline stage holds several microbatches' worth at its peak
(``microbatches_in_flight``). The peak is the saved bytes held when the last forward in
flight ends, plus the largest transient working set (``transient``): not the sum of every
tensor the step ever allocates.

What it leaves out: allocator fragmentation and caching, CUDA context and NCCL buffers,
communication buffers of in-flight collectives (FSDP's prefetched all-gathers), gradient
buckets (ZeRO-2's whole working gradients of one microbatch among them), and the
parameter copies that ZeRO-3 gathers for the layer it is running.

>>> param_state_bytes((4096, 4096), "adam", "bf16_mixed")
(67108864, 67108864, 134217728)
>>> param_state_bytes((4096, 4096), "adam", "bf16_mixed", zero=1, working_cast=True)
(33554432, 33554432, 201326592)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple, Protocol, get_args

from autopar_plans.errors import UsageError
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout
from autopar_plans.plan import MemoryBreakdown

Optimizer = Literal["sgd", "sgd_momentum", "adam", "adamw", "adafactor", "lars", "lamb"]
Precision = Literal["fp32", "bf16_mixed", "fp16_mixed", "bf16"]
PipelineSchedule = Literal["none", "gpipe", "1f1b", "interleaved"]

OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)


class PrecisionPolicy(NamedTuple):
    """Bytes per value: ``param`` of a 16-bit (or fp32) copy the forward reads and of an
    activation stored in the compute dtype, ``grad`` of a gradient on the wire (summed in
    the compute dtype under mixed precision), ``master`` of the weights the optimizer steps,
    ``state`` of an optimizer state value."""

    param: int
    grad: int
    master: int
    state: int


PRECISIONS: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy(param=4, grad=4, master=4, state=4),
    "bf16_mixed": PrecisionPolicy(param=2, grad=2, master=4, state=4),
    "fp16_mixed": PrecisionPolicy(param=2, grad=2, master=4, state=4),
    "bf16": PrecisionPolicy(param=2, grad=2, master=2, state=2),
}


class ParamLayoutsLike(Protocol):
    """What ``model_state_memory`` reads from a parameter (``autopar_plans.ParamPlan`` has it)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def param(self) -> Layout: ...
    @property
    def grad(self) -> Layout: ...
    @property
    def optimizer(self) -> Layout: ...


class ParamLayouts(NamedTuple):
    """A parameter's shape and the layouts of its value, gradient and optimizer state."""

    shape: tuple[int, ...]
    param: Layout
    grad: Layout
    optimizer: Layout


def precision_policy(precision: str) -> PrecisionPolicy:
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def optimizer_state_values(shape: Sequence[int], optimizer: str) -> int:
    """How many state values ``optimizer`` keeps for a parameter of ``shape`` (table above)."""
    numel = math.prod(shape)
    if optimizer == "sgd":
        return 0
    if optimizer in ("sgd_momentum", "lars"):
        return numel
    if optimizer in ("adam", "adamw", "lamb"):
        return 2 * numel
    if optimizer == "adafactor":
        if len(shape) < 2:
            return numel
        *lead, rows, cols = shape
        return math.prod(lead) * (rows + cols)
    raise UsageError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZERS)}")


def param_state_bytes(
    shape: Sequence[int],
    optimizer: str,
    precision: str,
    *,
    zero: int = 0,
    working_cast: bool = False,
) -> tuple[int, int, int]:
    """Unsharded ``(params, grads, optimizer)`` bytes of one parameter as the runtime holds
    it (the tables above). ``zero``: 1 or 2 for a parameter whose optimizer state (and, for
    2, gradient) is sharded beyond it; ``working_cast``: its working copy is in the compute
    dtype (mixed precision, a parameter only matmuls read).

    >>> param_state_bytes((10,), "adam", "fp32")
    (40, 40, 80)
    >>> param_state_bytes((10,), "adam", "fp32", zero=1)  # + the master piece
    (40, 40, 120)
    """
    policy = precision_policy(precision)
    numel = math.prod(shape)
    states = policy.state * optimizer_state_values(shape, optimizer)
    if not zero:
        return policy.master * numel, policy.master * numel, states
    working = policy.param if working_cast else policy.master
    grad = working if zero == 1 else policy.master
    return working * numel, grad * numel, policy.master * numel + states


def _mesh_shape(mesh: MeshSpec | Sequence[int]) -> tuple[int, ...]:
    return mesh.shape if isinstance(mesh, MeshSpec) else tuple(mesh)


def model_state_memory(
    params: Iterable[ParamLayoutsLike],
    mesh: MeshSpec | Sequence[int],
    optimizer: str = "adamw",
    precision: str = "fp32",
    *,
    working_cast: bool = True,
) -> MemoryBreakdown:
    """Parameter, gradient and optimizer bytes per device; each divided by its layout's shards.

    ``params``: anything with ``shape``, ``param``, ``grad`` and ``optimizer`` layouts, such
    as ``autopar_plans.ParamPlan`` or ``ParamLayouts``; a parameter whose optimizer layout shards
    more than its parameter layout is held as ZeRO holds it, its working copy in the compute
    dtype under mixed precision when ``working_cast`` (matmul weights).
    ``activations`` is left at 0.
    """
    mesh_shape = _mesh_shape(mesh)
    totals = [0.0, 0.0, 0.0]
    for p in params:
        param_shards = p.param.shard_factor(mesh_shape)
        zero = 0
        if p.optimizer.shard_factor(mesh_shape) > param_shards:
            zero = 2 if p.grad.shard_factor(mesh_shape) > param_shards else 1
        sizes = param_state_bytes(
            p.shape, optimizer, precision, zero=zero, working_cast=working_cast
        )
        for i, (nbytes, layout) in enumerate(
            zip(sizes, (p.param, p.grad, p.optimizer), strict=True)
        ):
            totals[i] += nbytes / layout.shard_factor(mesh_shape)
    params_b, grads_b, optim_b = totals
    return MemoryBreakdown(
        params=params_b, grads=grads_b, optimizer=optim_b, total=params_b + grads_b + optim_b
    )


def saved_activation_bytes(
    saved: Iterable[tuple[float, Layout]], mesh: MeshSpec | Sequence[int]
) -> float:
    """Bytes per device of one microbatch's saved tensors: ``sum(nbytes / shard_factor)``."""
    mesh_shape = _mesh_shape(mesh)
    return sum(nbytes / layout.shard_factor(mesh_shape) for nbytes, layout in saved)


def microbatches_in_flight(
    schedule: str, stages: int, stage: int, microbatches: int, chunks: int = 1
) -> float:
    """Microbatches whose activations stage ``stage`` (0-based) holds at its peak.

    In units of one microbatch through the stage's whole share of layers:

    - ``none`` (no pipeline, or gradient accumulation): 1;
    - ``gpipe``: ``m``, every forward runs before the first backward (Huang et al. 2019);
    - ``1f1b``: ``min(p - i, m)``: stage ``i`` runs ``p - i - 1`` warm-up forwards and one
      more before its first backward (Narayanan et al. 2021, Sec. 2.2.1);
    - ``interleaved`` with ``v`` chunks per device: Megatron-LM's warm-up count
      (``megatron/core/pipeline_parallel/schedules.py``,
      ``forward_backward_pipelining_with_interleaving``), ``w = 2 (p - i - 1) + (v - 1) p``
      chunk-forwards, plus the one in progress, each ``1/v`` of the stage:
      ``min(w + 1, m v) / v``. For stage 0 that is ``p (1 + (p - 1) / (p v))``, the factor of
      Korthikanti et al. 2022, Sec. 4.2.3.
    """
    p, m, v, i = stages, microbatches, chunks, stage
    if min(p, m, v) < 1 or not 0 <= i < p:
        raise UsageError(f"pipeline of {p} stages, {m} microbatches, {v} chunks has no stage {i}")
    if schedule == "none":
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or (schedule == "interleaved" and v == 1):
        return float(min(p - i, m))
    if schedule == "interleaved":
        warmup = 2 * (p - i - 1) + (v - 1) * p
        return min(warmup + 1, m * v) / v
    raise UsageError(
        f"unknown pipeline schedule {schedule!r}; one of none, gpipe, 1f1b, interleaved"
    )


def activation_memory(
    per_microbatch: float,
    *,
    schedule: str = "none",
    stages: int = 1,
    stage: int = 0,
    microbatches: int = 1,
    chunks: int = 1,
    transient: float = 0.0,
) -> float:
    """Peak activation bytes of a stage: ``per_microbatch x in-flight + transient``."""
    held = microbatches_in_flight(schedule, stages, stage, microbatches, chunks)
    return per_microbatch * held + transient


def device_memory(model_states: MemoryBreakdown, activations: float) -> MemoryBreakdown:
    """``model_states`` plus ``activations``, with the total filled in."""
    return MemoryBreakdown(
        params=model_states.params,
        grads=model_states.grads,
        optimizer=model_states.optimizer,
        activations=activations,
        total=model_states.params + model_states.grads + model_states.optimizer + activations,
    )
