"""Run a rank's pipeline stages on ``torch.distributed.pipelining``.

A pipeline plan runs on a device mesh of shape ``(pp, *stage mesh)``, the pipeline axis
first (``pipeline_mesh``): a stage's collectives run on the stage-mesh axes, the point-to-
point between stages on the pipeline axis, whose process group joins the ranks with the
same stage-mesh coordinates. Each rank sends its *local* tensors, in the producer's layout,
to its counterpart in the next stage (``autopar_passes.lower_stages`` explains why the layouts
agree).

Each stage program (a ``GraphModule``) is wrapped in a ``PipelineStage`` and run by
``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (the plan's schedule),
with the plan's microbatch count. The stages are given the local shapes of what crosses
each cut up front (``boundary_metas``: one run of the rank's lowered program on fake
tensors), so torch's *static* mode is used: no shape-inference pass on uninitialised
tensors, no extra forward and backward on the first step.

Gradients. The loss of each microbatch is the user's loss divided by the microbatch count
(torch's own ``scale_grads`` would divide every parameter of the shared module tree once per
stage on this rank, twice for a parameter two local stages share), so backward leaves the
gradient of the mean over the global batch. Sums over the stage-mesh axes that replicate a
parameter run in the last microbatch's backward of the stage that owns it, as DDP's
``no_sync`` leaves the last microbatch to sum: the schedule calls
``backward_maybe_with_nosync`` with ``last_backward`` set, and the runner's
``backward_hook`` turns the hooks on for that call only (hooks in every microbatch's backward
would sum partial sums again). The sync then overlaps the other stages' remaining backward
work, as the plan's ledger charges it. A parameter several local stages share syncs after the
schedule; a parameter held by several stages (a tied embedding and head) then has its
gradient summed across them (``TiedGradients``). Every send and receive of the schedule is
recorded on the pipeline axis's group, so a step's traffic can be counted against the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from autopar.mesh import with_timeout
from autopar.runtime.comm import AxisGroup, CommLog
from autopar_passes.lower_spmd import LoweredGraph, local_shard
from autopar_passes.lower_stages import StageProgram, pipeline_mesh_spec, stage_mesh
from autopar_passes.trace import TracedModel
from autopar_plans.errors import UsageError
from autopar_plans.plan import Parallelism, Plan

Loss = Callable[[Any, torch.Tensor], torch.Tensor]


def pipeline_mesh(plan: Plan, device_type: str, timeout_s: float | None = None) -> DeviceMesh:
    """The process groups of a pipeline plan (collective: every rank calls it), their
    collectives waiting at most ``timeout_s`` (``runtime.faults``)."""
    spec = pipeline_mesh_spec(plan)
    return init_device_mesh(
        device_type,
        spec.shape,
        mesh_dim_names=spec.axis_names,
        backend_override=with_timeout(device_type, spec.ndim, timeout_s),
    )


def schedule_to_run(parallelism: Parallelism) -> str:
    """The torch schedule that runs the plan's: its own, but 1F1B with fewer microbatches
    than stages runs as GPipe (every microbatch is in flight at once either way, in the
    same order; torch's ``Schedule1F1B`` refuses it). ``UsageError`` for an interleaved
    schedule whose microbatches are not a whole number of rounds, which torch cannot
    run."""
    pp, m = parallelism.pp, parallelism.microbatches
    if parallelism.schedule == "1f1b" and m < pp:
        return "gpipe"
    if parallelism.schedule == "interleaved" and m % max(1, m // pp):
        raise UsageError(
            f"interleaved 1F1B runs microbatches in rounds of {pp} (the stages); {m} "
            f"microbatches are not a whole number of rounds: plan with a multiple of {pp}"
        )
    return parallelism.schedule


def boundary_metas(
    traced: TracedModel,
    lowered: LoweredGraph,
    plan: Plan,
    coords: tuple[int, ...],
    device: torch.device,
    params_dtype: torch.dtype | None,
    autocast: Callable[[], Any],
) -> dict[str, torch.Tensor]:
    """Every value of the rank's lowered program as a ``meta`` tensor (shape, dtype, whether
    it needs a gradient), from one run on fake tensors.

    The program is run whole (all stages, not just this rank's): a stage's inputs are the
    outputs of a stage on another rank. Parameters are made in their planned shape and cut
    to this rank's piece, collectives change shapes as theirs do, and the run happens under
    the autocast of the plan's precision, so dtypes are those of the real run.
    """
    mesh = stage_mesh(plan)
    run = _LocalShapes(lowered, mesh.shape, coords)
    constants = traced.exported.constants
    buffers = {n.name: n for n in traced.graph.nodes if n.name in traced.buffers}
    buffer_values = {traced.buffers[name]: node.meta["val"] for name, node in buffers.items()}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        attrs: dict[str, torch.Tensor] = {}
        for target, name in lowered.params.items():
            info = plan.params[name]
            whole = torch.empty(info.shape, dtype=getattr(torch, info.dtype), device=device)
            piece = local_shard(whole, info.param, coords, mesh.shape)
            attrs[target] = _leaf(piece, device, params_dtype, requires_grad=True)
        for target, name in lowered.buffers.items():
            value = buffer_values[name]
            attrs[target] = _leaf(value, device, params_dtype, requires_grad=False)
        for target, name in lowered.constants.items():
            value = mode.from_tensor(constants[name])
            attrs[target] = _leaf(value, device, None, requires_grad=False)
        run.attrs = attrs
        placeholders = []
        for node in lowered.graph.nodes:
            if node.op == "placeholder":
                val = traced.graph.find_nodes(op="placeholder", target=node.target)[0].meta["val"]
                placeholders.append(
                    torch.empty(val.shape, dtype=val.dtype, device=device)
                    if isinstance(val, torch.Tensor)
                    else val
                )
        with torch.enable_grad(), autocast():
            run.run(*placeholders)
    return {
        name: torch.empty(v.shape, dtype=v.dtype, device="meta").requires_grad_(
            v.requires_grad and (v.is_floating_point() or v.is_complex())
        )
        for name, v in run.values.items()
        if isinstance(v, torch.Tensor)
    }


def _leaf(
    value: torch.Tensor, device: torch.device, cast: torch.dtype | None, *, requires_grad: bool
) -> torch.Tensor:
    """A fresh (fake) leaf shaped like ``value``, on ``device``, in the run's dtype."""
    dtype = cast if cast is not None and value.is_floating_point() else value.dtype
    leaf = torch.empty(value.shape, dtype=dtype, device=device)
    return leaf.requires_grad_(requires_grad and leaf.is_floating_point())


class _LocalShapes(torch.fx.Interpreter):
    """Runs a lowered program on fake tensors; collectives change shapes as theirs do."""

    def __init__(
        self, lowered: LoweredGraph, mesh_shape: tuple[int, ...], coords: tuple[int, ...]
    ) -> None:
        super().__init__(nn.Module(), garbage_collect_values=False, graph=lowered.graph)
        self.collectives = lowered.collectives
        self.mesh_shape = mesh_shape
        self.coords = coords
        self.attrs: dict[str, torch.Tensor] = {}
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        self.values[n.name] = value
        return value

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.attrs[target]

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        kind, axis = self.collectives[target]
        n, index = self.mesh_shape[axis], self.coords[axis]
        x = args[0]
        if kind == "all_reduce":
            return x.clone()
        if kind == "all_gather":
            return torch.cat([x] * n, dim=args[1])
        if kind == "reduce_scatter":
            return x.chunk(n, dim=args[1])[index].contiguous()
        if kind == "all_to_all":
            src, dst = args[1], args[2]
            return torch.cat([x] * n, dim=src).chunk(n, dim=dst)[index].contiguous()
        raise AssertionError(f"unknown collective {kind}")


class _RecordedStage(PipelineStage):
    """torch's ``PipelineStage``, recording its point-to-point in the model's ``CommLog``
    (one ``send`` or ``recv`` per tensor, on the pipeline axis) and telling the data-parallel
    side which backward is a stage's last (``backward_hook(last)``), as torch's own stage
    tells DDP and FSDP: gradient sync and ZeRO-1's sum run in the last microbatch's
    backward, overlapping it, instead of after the schedule."""

    def __init__(
        self,
        *args: Any,
        wire: AxisGroup,
        backward_hook: Callable[[bool], AbstractContextManager[None]],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.wire = wire
        self.backward_hook = backward_hook

    def _recorded(self, ops: list[dist.P2POp], kind: str, phase: str) -> list[dist.P2POp]:
        for op in ops:
            self.wire.record(kind, op.tensor, phase)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._recorded(super().get_fwd_send_ops(fwd_chunk_id), "send", "forward")

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._recorded(super().get_fwd_recv_ops(fwd_chunk_id), "recv", "forward")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._recorded(super().get_bwd_send_ops(bwd_chunk_id), "send", "backward")

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._recorded(super().get_bwd_recv_ops(bwd_chunk_id), "recv", "backward")

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        with self.backward_hook(last_backward):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class PipelineRunner:
    """This rank's stages, wrapped for torch, and the schedule that runs them."""

    def __init__(
        self,
        plan: Plan,
        programs: Sequence[tuple[StageProgram, nn.Module]],
        metas: dict[str, torch.Tensor],
        wire: AxisGroup,
        device: torch.device,
        loss: Loss,
        backward_hook: Callable[[bool], AbstractContextManager[None]],
    ) -> None:
        """``wire``: the pipeline axis's group; ``backward_hook(last)``: entered around
        each backward of a stage, ``last`` for its last microbatch's."""
        par = plan.parallelism
        count = max(len(plan.stages), par.pp)
        self.microbatches = par.microbatches
        self.stages = [
            _RecordedStage(
                module,
                program.index,
                count,
                device,
                input_args=tuple(metas[name] for name in program.receives),
                output_args=_outputs(program, metas),
                group=wire.pg,
                wire=wire,
                backward_hook=backward_hook,
            )
            for program, module in programs
        ]
        kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        schedule = schedule_to_run(par)
        if schedule == "interleaved":
            self.schedule: Any = ScheduleInterleaved1F1B(
                self.stages, par.microbatches, loss_fn=loss, scale_grads=False
            )
        else:
            self.schedule = kinds[schedule](
                self.stages[0], par.microbatches, loss_fn=loss, scale_grads=False
            )
        self.holds_last = any(stage.is_last for stage in self.stages)

    def step(self, inputs: dict[str, Any], target: torch.Tensor) -> torch.Tensor | None:
        """One pass over the microbatches, forward and backward; on the rank holding the
        last stage, the sum of the microbatches' (scaled) losses, else None."""
        losses: list[torch.Tensor] = []
        self.schedule.step(target=target, losses=losses, return_outputs=False, **inputs)
        if not self.holds_last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).sum()


def _outputs(program: StageProgram, metas: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """What the stage sends; for the last stage, what it returns (to the loss)."""
    return tuple(metas[name] for name in program.sends or program.returns if name in metas)


class TiedGradients:
    """Sums the gradient of each parameter held by several stages across them.

    The stages holding a parameter hold it in the same layout (one plan), so the ranks with
    the same stage-mesh coordinates hold the same piece: one all-reduce over a group of
    those ranks per parameter. Every rank creates every group, in the same order.
    """

    def __init__(
        self,
        holders: dict[str, tuple[int, ...]],
        stage: int,
        per_stage: int,
        local_rank: int,
        axis: str,
        log: CommLog,
    ) -> None:
        """``axis``: the pipeline axis's name, ``log`` where the sums are recorded."""
        self.groups: dict[str, AxisGroup] = {}
        made: dict[tuple[int, ...], list[dist.ProcessGroup | None]] = {}
        for stages in sorted({h for h in holders.values() if len(h) > 1}):
            made[stages] = []
            for coordinate in range(per_stage):
                ranks = [s * per_stage + coordinate for s in stages]
                group = dist.new_group(ranks)
                made[stages].append(group if coordinate == local_rank else None)
        for name, stages in holders.items():
            if len(stages) > 1 and stage in stages:
                group = made[stages][local_rank]
                assert group is not None
                self.groups[name] = AxisGroup(group, (axis,), log)

    def sum(self, grad_of: Callable[[str], torch.Tensor | None]) -> None:
        for name in sorted(self.groups):
            grad = grad_of(name)
            if grad is not None:
                self.groups[name].all_reduce(grad, phase="step")


def microbatch_loss(
    loss_fn: Loss, unflatten: Callable[[list[Any]], Any], microbatches: int
) -> Loss:
    """The schedule's loss: the user's, on the model's outputs in their structure, divided
    by the microbatch count (so gradients add up to those of the mean)."""

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        flat = list(output) if isinstance(output, list | tuple) else [output]
        return loss_fn(unflatten(flat), target) / microbatches

    return loss
