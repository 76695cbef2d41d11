"""The one layer every collective of a compiled model goes through, and the log it keeps.

A compiled model's collectives come from several places: the lowered graph's reshards and
their adjoints (``runtime.collectives``), FSDP's flat gathers (``runtime.param_groups``),
gradient sync (``runtime.grad_sync``), ZeRO's sums and gathers (``runtime.zero``), the
deferred loss sum (``runtime.pending``), the tied-weight sums and loss broadcast of a
pipeline. Each of them runs on an ``AxisGroup``: a process group that knows which mesh
axes it spans and which ``CommLog`` to tell. So every call is recorded once, at the level
the plan speaks of (a logical reduce-scatter, even where gloo runs it as an all-reduce),
with its kind, axes, dtype, bytes and phase: what ``CompiledModel.observed_collectives``
returns, to be compared with the plan's ledger (``autopar_plans.ledger``).

Bytes per call are the payload as ``autopar_cost_model.reshard`` prices it: the whole array for an
all-gather (its output) and a reduce-scatter (its input), the tensor for an all-reduce and
a broadcast, each device's buffer for an all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.faults import Faults, guarded_call
from autopar_plans.ledger import CommCount, CommKey, tally


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, the plan's spelling."""
    return str(dtype).removeprefix("torch.")


def current_phase() -> str:
    """``backward`` inside an autograd graph task (hooks, adjoints), else ``forward``."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@dataclass(frozen=True)
class Call:
    """One collective as the runtime issued it."""

    kind: str
    axes: tuple[str, ...]
    dtype: str
    nbytes: int
    phase: str


@dataclass
class CommLog:
    """The collectives issued since the log was last cleared.

    ``CompiledModel.train_step`` clears it when a step starts; a user's own loop clears it
    with ``CompiledModel.reset_observed()``."""

    calls: list[Call] = field(default_factory=list)
    # the job's fault reports (``runtime.faults``): every collective of the groups that
    # record here fails with a message naming the rank that failed
    faults: Faults | None = None

    def record(
        self, kind: str, axes: tuple[str, ...], tensor: torch.Tensor, phase: str | None = None
    ) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.calls.append(
            Call(kind, axes, dtype_name(tensor.dtype), nbytes, phase or current_phase())
        )

    def clear(self) -> None:
        self.calls.clear()

    def counts(
        self, phases: tuple[str, ...] = ("forward", "backward", "step")
    ) -> dict[CommKey, CommCount]:
        """Calls and bytes per (kind, axes, dtype), over the calls of ``phases`` (by default
        the step's: not state-dict gathers, nor ``clip_grad_norm_``'s sum, which the user's
        script adds to a step)."""
        return tally(
            (c.kind, c.axes, c.dtype, 1, c.nbytes) for c in self.calls if c.phase in phases
        )


@dataclass(frozen=True)
class AxisGroup:
    """A process group over some mesh axes, whose collectives are recorded in ``log``."""

    pg: dist.ProcessGroup
    axes: tuple[str, ...]
    log: CommLog

    @property
    def size(self) -> int:
        return dist.get_world_size(self.pg)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.pg)

    @property
    def gloo(self) -> bool:
        return dist.get_backend(self.pg) == "gloo"

    def all_reduce(
        self,
        tensor: torch.Tensor,
        async_op: bool = False,
        phase: str | None = None,
        op: Any = dist.ReduceOp.SUM,
    ) -> Any:
        """In-place sum (or ``op``) over the group (``dist.all_reduce``), recorded."""
        self.log.record("all_reduce", self.axes, tensor, phase)
        return self.call(dist.all_reduce, tensor, op=op, group=self.pg, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, group_src: int, phase: str | None = None) -> None:
        """``dist.broadcast`` from the group's rank ``group_src``, recorded."""
        self.log.record("broadcast", self.axes, tensor, phase)
        self.call(dist.broadcast, tensor, group=self.pg, group_src=group_src)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a ``torch.distributed`` collective on this group: a
        failure (a peer gone or stuck) raises ``runtime.faults.RankFailedError`` naming
        the rank and its error, here or at the returned work's ``wait``."""
        what = f"{fn.__name__} over {' x '.join(self.axes)}"
        return guarded_call(self.log.faults, what, fn, *args, **kwargs)

    def record(self, kind: str, tensor: torch.Tensor, phase: str | None = None) -> None:
        """Record a collective that ``runtime.collectives`` runs by its own means (gloo has
        no reduce-scatter: it is built there from an all-reduce)."""
        self.log.record(kind, self.axes, tensor, phase)
