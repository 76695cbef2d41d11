"""The communication ledger of a pipeline plan (``autopar_plans.ledger``): every collective and
point-to-point transfer one step issues, stage by stage, read off the plan as the runtime
lowers, splits and runs it (``autopar_passes.lower_spmd``, ``autopar_passes.lower_stages``,
``autopar.runtime.pipeline``).

Each physical stage ``s`` (its entries carry ``stage=s``) runs the pipeline stages
``c = s, s + p, ...`` (interleaved: several chunks) and, per microbatch:

- the reshards of its chunks' programs, as ``autopar_passes.ledger`` prices them (a reshard of a
  parameter that depends on nothing else runs in every chunk that reads it: a tied
  embedding's gathers run on the first stage and the last);
- a ``send`` of each value its chunks hand on and a ``recv`` of each it is handed, forward;
  the gradients of those that need one the other way, backward. Bytes: the value's local
  piece on its stage mesh, in the dtype it travels as; time: ``MeshCost.p2p`` on the link
  between the two stages (``MeshSpec.handoff_axis``), charged to both ends as the search's
  stage times charge it. A device sends a ``send``'s bytes and no ``recv``'s.

and per step:

- the gradient sync and ZeRO of the parameters its chunks read (``autopar_passes.ledger``), in its
  last microbatch's backward; a parameter two of its chunks share is summed after the
  schedule instead, exposed (``local_parts``: its gradient is whole only then);
- a parameter several stages hold (a tied embedding and head) has its gradient summed
  across them after the schedule: one all-reduce over the pipeline axis per parameter;
- the loss, broadcast from the last stage over the pipeline axis.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.hardware import SharedCores
from autopar_cost_model.schedule import schedule_time
from autopar_passes.annotation import META_KEY
from autopar_passes.ledger import (
    Ledger,
    Reshard,
    Walk,
    by_kind,
    gradient_sync_entries,
    hide_overlapped,
    itemsize,
    op_compute,
    param_order,
    reshard_entries,
    stored_dtype,
    zero_entries,
)
from autopar_passes.lower_spmd import lower_spmd
from autopar_passes.lower_stages import (
    StageProgram,
    holders,
    local_parts,
    pipeline_axis_name,
    split_stages,
)
from autopar_passes.trace import TracedModel
from autopar_plans.ledger import CommEntry, sent
from autopar_plans.placement import Replicate, Shard
from autopar_plans.plan import Estimate, Plan

LOSS_DTYPE = "float32"  # the loss each rank returns, as autocast leaves a reduction


def pipeline_ledger(
    traced: TracedModel, plan: Plan, *, batch_scale: float = 1.0
) -> list[CommEntry]:
    """The ledger of one step of the pipeline ``plan`` on ``traced``, every stage's entries
    (``CommEntry.stage``). ``batch_scale``: the microbatch over the traced batch."""
    return _PipelineLedger(traced, plan, batch_scale).run()


class _PipelineLedger:
    def __init__(self, traced: TracedModel, plan: Plan, scale: float) -> None:
        self.traced = traced
        self.plan = plan
        self.mesh = plan.stage_mesh or plan.mesh
        self.pp = plan.parallelism.pp
        self.axis = pipeline_axis_name(self.mesh.axis_names)
        self.whole_cost = MeshCost(plan.mesh)
        self.walk = Walk(traced, plan, self.mesh, scale)
        self.walk.run()
        self.compute = op_compute(self.walk)
        layouts = self.walk.layouts
        self.lowered = lower_spmd(
            traced,
            layouts.strategy,
            layouts.layout,
            self.mesh,
            (0,) * self.mesh.ndim,
            torch.device("meta"),
        )
        self.programs = split_stages(traced, self.lowered, plan)
        self.sources = {node.name: source for node, source in self.lowered.sources.items()}

    def run(self) -> list[CommEntry]:
        order = param_order(self.traced)
        shared = holders(self.programs, self.pp)
        entries: list[CommEntry] = []
        for stage in range(self.pp):
            ledger = Ledger(
                self.mesh,
                self.plan.parallelism.microbatches,
                stage,
                self.compute,
                reduction=self.plan.grad_reduction,
            )
            mine = [p for p in self.programs if p.index % self.pp == stage]
            reshards = [r for program in mine for r in self._reshards(program)]
            ops = set().union(*(self._traced_ops(program) for program in mine))
            reshard_entries(ledger, self.traced, self.plan, reshards, self.walk.cast, ops)
            for program in mine:
                self._handoffs(ledger, program)
            part_of = {
                program.params[target]: part
                for target, part in local_parts(mine).items()
                for program in mine
                if target in program.params
            }
            held = [name for name in order if name in part_of]
            in_backward = [name for name in held if part_of[name] >= 0]
            gradient_sync_entries(in_backward, self.plan, ledger, part_of)
            after = [name for name in held if part_of[name] < 0]
            gradient_sync_entries(after, self.plan, ledger, part_of, in_backward=False)
            zero_entries(held, self.plan, ledger, self.walk.cast, part_of)
            for name in sorted(n for n in held if len(shared.get(n, ())) > 1):
                self._tied_sum(ledger, name, len(shared[name]))
            self._step_p2p(ledger, "broadcast", LOSS_DTYPE, 4.0, "the loss, from the last stage")
            entries.extend(ledger.entries)
        return entries

    def _reshards(self, program: StageProgram) -> list[Reshard]:
        """The reshards ``program`` runs, in its order; kept for backward when one of its own
        consumers keeps them (a tied weight's gather on the first stage serves only the
        embedding, which keeps no weight, though the head on the last keeps its own)."""
        made = self.walk.made
        names = self._traced_ops(program)
        found = []
        for node in program.graph.nodes:
            key = self.lowered.reshards.get(node.name)
            reshard = made.get(key) if key is not None else None
            if reshard is not None:
                found.append(dataclasses.replace(reshard, saved=bool(reshard.savers & names)))
        return found

    def _traced_ops(self, program: StageProgram) -> set[str]:
        """The traced graph's nodes whose work ``program`` runs."""
        return {self.sources.get(node.name, node.name) for node in program.graph.nodes}

    def _handoffs(self, ledger: Ledger, program: StageProgram) -> None:
        """The values ``program`` receives and sends, forward and (their gradients) back."""
        last = len(self.programs) - 1
        for name in program.receives:
            self._p2p(ledger, "recv", "forward", name, program.index - 1)
        for name in program.sends:
            self._p2p(ledger, "send", "forward", name, program.index)
        if program.index < last:
            for name in program.sends:
                if self._needs_grad(name):
                    self._p2p(ledger, "recv", "backward", name, program.index)
        for name in program.receives:
            if self._needs_grad(name):
                self._p2p(ledger, "send", "backward", name, program.index - 1)

    def _p2p(self, ledger: Ledger, kind: str, phase: str, name: str, chunk: int) -> None:
        """One transfer per microbatch across the boundary after pipeline stage ``chunk``."""
        dtype, nbytes = self._value(name)
        axis = self.plan.mesh.handoff_axis(self.pp, chunk % self.pp)
        ledger.add_entry(
            kind,
            (self.axis,),
            dtype,
            nbytes,
            ledger.microbatches,
            phase,
            f"hand-off of {name}",
            self.whole_cost.p2p(nbytes, axis),
            group=2,
        )

    def _value(self, name: str) -> tuple[str, float]:
        """What a handed-off value of the lowered program travels as, and its bytes on a
        device: its local piece in the layout it is in there."""
        producer, layout = self._producer(name)
        info = self.walk.nodes[producer].meta[META_KEY].outputs[0]
        dtype = self.walk.dtype_of(info.dtype, self.walk.param_of.get(producer), producer)
        local = math.prod(layout.local_shape(info.shape, self.mesh.shape))
        scale = 1.0 if producer in self.walk.param_of else self.walk.scale
        return dtype, local * scale * itemsize(dtype)

    def _producer(self, name: str) -> tuple[str, object]:
        if name in self.lowered.reshards:
            return self.lowered.reshards[name]
        source = self.sources.get(name)
        if source is None:
            raise AssertionError(f"the lowered value {name} has no traced source")
        return source, self.walk.layouts.layout(source)

    def _needs_grad(self, name: str) -> bool:
        producer, _ = self._producer(name)
        note = self.walk.nodes[producer].meta[META_KEY]
        return bool(note.requires_grad) and note.outputs[0].dtype.startswith(("float", "bfloat"))

    def _tied_sum(self, ledger: Ledger, name: str, stages: int) -> None:
        """The gradient of a parameter ``stages`` stages hold, summed across them (the
        optimizer's: ZeRO's master piece)."""
        param = self.plan.params[name]
        shape = self.mesh.shape
        numel = math.prod(param.param.local_shape(param.shape, shape))
        # ZeRO: the optimizer steps the master piece, whose gradient is what is summed
        numel //= math.prod(
            size
            for p, o, size in zip(param.param, param.optimizer, shape, strict=True)
            if isinstance(p, Replicate) and isinstance(o, Shard)
        )
        dtype = stored_dtype(self.plan, param)
        nbytes = numel * itemsize(dtype)
        seconds = self._between_stages("all_reduce", nbytes, stages)
        ledger.add_entry(
            "all_reduce",
            (self.axis,),
            dtype,
            nbytes,
            1,
            "step",
            f"tied gradient: {name}",
            seconds,
            group=stages,
        )

    def _step_p2p(self, ledger: Ledger, kind: str, dtype: str, nbytes: float, what: str) -> None:
        seconds = self._between_stages(kind, nbytes, self.pp)
        ledger.add_entry(kind, (self.axis,), dtype, nbytes, 1, "step", what, seconds, group=self.pp)

    def _between_stages(self, kind: str, nbytes: float, stages: int) -> float:
        """A collective over ranks of ``stages`` stages: what each sends, over the slowest
        link between stages."""
        axis = self.plan.mesh.handoff_axis(self.pp, self.pp - 1)
        return self.whole_cost.p2p(sent(kind, nbytes, stages), axis)


def with_pipeline_ledger(
    estimate: Estimate,
    entries: list[CommEntry],
    compute_s: list[float],
    backward_s: list[float],
    microbatches: int,
    chunks: int,
    optimizer_s: list[float] | None = None,
    overlap: float = 1.0,
    schedule: str = "1f1b",
    cores: SharedCores | None = None,
    replicas: int = 1,
) -> Estimate:
    """``estimate`` with its step and communication figures read off a pipeline ledger.

    Stage ``s`` takes ``T_s = compute_s[s]`` (one microbatch, fwd + bwd) plus its blocking
    communication per microbatch (reshards, hand-offs); the schedule takes
    ``autopar_cost_model.step.pipeline_time(T, m, v)``, or where the devices share cores
    (``cores``) the simulated schedule's span (``autopar_cost_model.schedule.schedule_time``; a
    stage's ``replicas`` devices compute together). Each stage then adds what stays exposed of
    its gradient sync (in its last microbatch's backward, ``hide_overlapped``; the stages
    before it still run theirs, which hides the rest) and of what runs after the schedule
    (ZeRO's gathers, shared and tied gradient sums, the loss) and its optimizer's step
    (``optimizer_s``); the slowest stage sets the step. Bytes are the busiest stage's (a
    device of it sends the most)."""
    m = microbatches
    stages = len(compute_s)
    optimizers = optimizer_s or [0.0] * stages
    priced: list[CommEntry] = []
    times, waits, after, sent_of = [], [], [], []
    for s in range(stages):
        mine = [e for e in entries if e.stage == s]
        mine = hide_overlapped(mine, m, backward_s[s], sum(backward_s[:s]), overlap)
        priced += mine
        # what blocks each microbatch: reshards and hand-offs whole, FSDP's prefetched
        # gathers their exposed part (``autopar_passes.ledger.hide_prefetched``)
        blocking = sum(
            e.time_s if e.overlap == "none" else e.exposed_s
            for e in mine
            if e.overlap in ("none", "compute") and e.phase != "step"
        )
        times.append(compute_s[s] + blocking / m)
        waits.append(blocking / m)
        after.append(sum(e.exposed_s for e in mine if e.overlap == "backward" or e.phase == "step"))
        sent_of.append(sum(e.sent_per_step for e in mine))
    forward_s = [c - b for c, b in zip(compute_s, backward_s, strict=True)]
    pipeline = schedule_time(schedule, m, chunks, forward_s, backward_s, waits, cores, replicas)
    last = max(range(stages), key=lambda s: after[s] + optimizers[s])
    step = pipeline + after[last] + optimizers[last]
    busiest = max(range(stages), key=lambda s: sent_of[s])
    compute = m * max(compute_s)
    bubble = max(pipeline - m * max(times), 0.0)
    handoffs = [
        sum(e.time_s for e in priced if e.stage == s and e.kind in ("send", "recv")) / m
        for s in range(stages)
    ]
    per_stage = tuple(
        stage.model_copy(update={"handoff_s": handoffs[stage.stage]}) for stage in estimate.stages
    )
    return estimate.model_copy(
        update={
            "comm": tuple(priced),
            "comm_bytes_per_step": sent_of[busiest],
            "comm_bytes_by_kind": by_kind([e for e in priced if e.stage == busiest]),
            "comm_s": max(sum(e.time_s for e in priced if e.stage == s) for s in range(stages)),
            "step_time_s": step,
            "compute_s": compute,
            "bubble_s": bubble,
            "optimizer_s": optimizers[last],
            "exposed_comm_s": max(step - compute - bubble - optimizers[last], 0.0),
            "stages": per_stage,
        }
    )
