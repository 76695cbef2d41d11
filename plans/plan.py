"""``Plan``: what autopar decided for one model on one mesh, and what it should cost.

The plan is the contract between the planner (``passes``) and everything that reads a
decision: the lowering, the runtime, the CLI, a user's diff in code review. It is versioned;
a file from another version is refused with a message rather than misread (``autopar_plans.io``).

Layouts use DTensor's placements (one per mesh axis, see ``autopar_plans.placement``); the CLI shows
them in the JAX spelling as well.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from autopar_plans.ledger import CommEntry
from autopar_plans.mesh import MeshSpec
from autopar_plans.offload import NO_OFFLOAD, HostCopy, Offload
from autopar_plans.placement import Layout, zero_axes
from autopar_plans.reduction import PER_AXIS, GradReduction

PLAN_VERSION = 1

Schedule = Literal["none", "gpipe", "1f1b", "interleaved"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Parallelism(_Frozen):
    """The degrees of each kind of parallelism the plan uses (1: not used)."""

    dp: int = Field(1, ge=1, description="Data-parallel degree (batch split).")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (weights split within an op).")
    pp: int = Field(1, ge=1, description="Pipeline stages.")
    sp: int = Field(1, ge=1, description="Sequence-parallel degree between tensor-parallel ops.")
    ep: int = Field(1, ge=1, description="Expert-parallel degree (experts split).")
    mixed: int = Field(
        1,
        ge=1,
        description="Degree of the mesh axes that split the matmuls in no one way (some by "
        "tokens, some by weights, neither for most): no single label above is true of them.",
    )
    zero: int = Field(0, ge=0, le=3, description="ZeRO stage: 1 optimizer, 2 +grads, 3 +params.")
    microbatches: int = Field(1, ge=1)
    schedule: Schedule = "none"
    chunks: int = Field(1, ge=1, description="Stages per device (interleaved 1F1B's v).")
    sequence_split_ops: int = Field(
        0,
        ge=0,
        description="Ops whose [batch, sequence, ...] output the plan splits on the "
        "sequence over some mesh axis (sequence parallelism, or a sequence's tokens spread).",
    )
    axis_roles: tuple[str, ...] = Field(
        (),
        description="What each axis of the mesh (a pipeline stage's) does to the matmuls, in "
        "mesh order: 'data', 'tensor', 'expert', 'mixed' (joined by '+' where one axis "
        "does two, as data and expert), '' where it splits none; empty in older plans.",
    )


class MemoryBreakdown(_Frozen):
    """Bytes per device at the peak of a training step."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    total: float = 0.0
    host: float = Field(
        0.0,
        description="Bytes this device keeps in its host's memory (offloaded optimizer "
        "states, master weights, their gradients and saved activations): not in total.",
    )


class StageEstimate(_Frozen):
    """Per pipeline stage: its time per microbatch and memory per device."""

    stage: int
    forward_s: float = Field(description="Forward compute per microbatch.")
    backward_s: float = Field(
        description="The rest of the stage's work per microbatch: backward compute and "
        "resharding, both ways."
    )
    handoff_s: float = Field(
        0.0,
        description="Point-to-point per microbatch with the neighbouring stages: "
        "activations in and out on the way forward, their gradients on the way back.",
    )
    memory_per_device_bytes: MemoryBreakdown


class Estimate(_Frozen):
    """What the cost model predicts for one training step (one optimizer update)."""

    step_time_s: float
    flops_per_step: float = Field(description="Model FLOPs per step (fwd + bwd, no recompute).")
    mfu: float = Field(description="flops_per_step / (step_time_s x peak x devices).")
    comm_bytes_per_step: float = Field(description="Bytes each device sends per step.")
    memory_per_device_bytes: MemoryBreakdown
    compute_s: float = 0.0
    comm_s: float = Field(0.0, description="All communication per step, hidden or not.")
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0
    recompute_s: float = 0.0
    optimizer_s: float = Field(
        0.0,
        description="The optimizer's step (on the busiest stage), part of step_time_s; "
        "offloaded, on the CPU, with its copies over the host link.",
    )
    offload_s: float = Field(
        0.0,
        description="Of step_time_s, the host link's exposed copies under offload (the "
        "optimizer's, also in optimizer_s; the activations', also in compute_s).",
    )
    stages: tuple[StageEstimate, ...] = ()
    collectives: dict[str, int] = Field(
        default_factory=dict,
        description="Collectives the forward pass of one microbatch runs, by kind.",
    )
    comm_bytes_by_kind: dict[str, float] = Field(
        default_factory=dict,
        description="comm_bytes_per_step by kind: each collective kind's bytes (forward and "
        "backward reshards), and 'gradient_sync'.",
    )
    comm: tuple[CommEntry, ...] = Field(
        (),
        description="The ledger: every collective a step issues (autopar_plans.ledger), which the "
        "runtime's own count (CompiledModel.observed_collectives) is held to.",
    )
    host: tuple[HostCopy, ...] = Field(
        (),
        description="Copies between this device and its host per step under offload "
        "(autopar_plans.offload), which the runtime's HostLog is held to.",
    )


class ParamPlan(_Frozen):
    """How one parameter, its gradient and its optimizer state lie on the mesh.

    ZeRO falls out of these three: stage 1 shards ``optimizer``, stage 2 also ``grad``,
    stage 3 (FSDP) also ``param``.
    """

    shape: tuple[int, ...]
    dtype: str
    param: Layout
    grad: Layout
    optimizer: Layout
    aliases: tuple[str, ...] = Field((), description="Other names of a tied parameter.")
    stage: int = 0


class OpPlan(_Frozen):
    """The strategy chosen for one op of the traced graph."""

    op: str = Field(description="The ATen op, such as 'aten.linear.default'.")
    strategy: str = Field(description="Name of the chosen strategy, such as 'S(0)xR->S(0)'.")
    output: Layout
    inputs: tuple[Layout | None, ...] = Field(description="Required layout per tensor input.")
    module: str = ""
    layer: int | None = None


class Stage(_Frozen):
    """One pipeline stage: the layers it runs and the devices that run it.

    With interleaving (``Parallelism.chunks`` = v > 1) there are ``pp * v`` stages and the
    devices of physical stage ``index % pp`` run stage ``index``. The first stage also runs
    what comes before the layers (embeddings), the last what comes after (head, loss).
    """

    index: int
    layers: tuple[int, int] = Field(description="First and last layer index, inclusive.")
    modules: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()


class RecomputeRegion(_Frozen):
    """A region whose activations are recomputed in backward instead of stored."""

    name: str
    kind: Literal["full", "selective"]
    modules: tuple[str, ...] = ()
    nodes: tuple[str, ...] = Field((), description="The graph's nodes it recomputes.")
    layers: tuple[int, ...] = Field((), description="The layers it is applied in.")
    saved_bytes: float = Field(0.0, description="Activation bytes per device it frees.")
    recompute_s: float = Field(0.0, description="Forward time it adds per step.")


class SolverReport(_Frozen):
    """How the ILP went: never hidden, so a time-out or a gap is visible to the user."""

    backend: str = "none"
    status: str = "not solved"
    time_s: float = 0.0
    time_limit_s: float | None = None
    variables: int = 0
    constraints: int = 0
    objective: float | None = None
    gap: float | None = None
    variables_before_merging: int | None = None


class Alternative(_Frozen):
    """A runner-up configuration, so the user sees the trade-off the planner made."""

    parallelism: Parallelism
    step_time_s: float
    memory_per_device_bytes: float
    note: str = ""


class Plan(_Frozen):
    """Everything decided for one model on one mesh. Round-trips through JSON and YAML."""

    version: int = PLAN_VERSION
    model: str = Field(description="Where the model came from, such as 'gpt:gpt2_124m'.")
    mesh: MeshSpec
    global_batch: int = Field(ge=1)
    microbatch_size: int = Field(ge=1)
    dtype: str = "float32"
    optimizer: str = "adamw"
    precision: str = "fp32"
    memory_limit_bytes: float | None = None
    batch_norm_groups: int = Field(
        1,
        ge=1,
        description="Training batch norms take their statistics over each of this many "
        "slices of the batch: 1 the whole batch (SyncBatchNorm), the devices' count each "
        "device's slice (DDP's default; the option batch_norm='per_device').",
    )
    grad_reduction: GradReduction = Field(
        PER_AXIS,
        description="How gradients cross the mesh axes that replicate them: the form of "
        "a sum over several axes, compression, local SGD (autopar_plans.reduction).",
    )
    offload: Offload = Field(
        NO_OFFLOAD,
        description="What lives in host memory instead of the device's: optimizer states "
        "and master weights (stepped on the CPU), saved activations (autopar_plans.offload).",
    )
    parallelism: Parallelism
    estimate: Estimate
    stage_mesh: MeshSpec | None = Field(
        None,
        description="With pipeline stages: the mesh of one stage, a block of "
        "size / pp consecutive devices (MeshSpec.stage_mesh); every layout of the plan "
        "is on it.",
    )
    params: dict[str, ParamPlan]
    ops: dict[str, OpPlan]
    stages: tuple[Stage, ...] = ()
    recompute: tuple[RecomputeRegion, ...] = ()
    solver: SolverReport = SolverReport()
    alternatives: tuple[Alternative, ...] = ()
    warnings: tuple[str, ...] = ()

    def holds_master(self, name: str, mesh_shape: tuple[int, ...]) -> bool:
        """Whether parameter ``name`` is held as a working copy the graph reads beside a
        master piece the optimizer steps (``runtime.zero``): its optimizer state sharded
        beyond it (ZeRO-1/2), or the optimizer offloaded to the host."""
        param = self.params[name]
        return self.offload.optimizer or bool(zero_axes(param.param, param.optimizer, mesh_shape))
