"""ZeRO-1 and ZeRO-2: optimizer state (and gradients) sharded beyond the parameter.

When the plan stores a parameter replicated over some mesh axes but its optimizer state
sharded over them (``ParamPlan.optimizer`` against ``ParamPlan.param``), the optimizer
must only ever see this device's piece. So, as DeepSpeed's ZeRO does:

- the ``nn.Parameter`` the optimizer steps is the *master* piece: the device's local
  parameter, cut further along the ZeRO dims over the ZeRO axes (a DTensor in the
  optimizer state's layout, ``shards.torch_placements``);
- the lowered graph reads a *working* copy in the parameter's own layout, all-gathered from
  the masters before a forward whenever a master changed (after an optimizer step). Under
  mixed precision a parameter that only matmuls read (``autopar_passes.mixed_precision``) has its
  working copy, and so its working gradient, in the compute dtype: the values autocast
  would cast it to, half the bytes held and gathered (DeepSpeed's 16-bit working weights
  beside fp32 masters; FSDP2's ``param_dtype``);
- after backward, the working copy's gradient (a summand over the replicated axes) is
  summed: over the other replicated axes by all-reduce, over the ZeRO axes by
  reduce-scatter straight into the master's piece.

Values equal a plain data-parallel run; memory for optimizer state (and, for ZeRO-2, the
gradient kept for the step) is divided by the ZeRO axes' size. Communication is one
reduce-scatter and one all-gather per step, what an all-reduce costs. Over several
microbatches (``CompiledModel.train_step``) ZeRO-1 accumulates its whole working gradient
locally and reduce-scatters it once, in the last backward (Megatron's distributed
optimizer; DeepSpeed's stage 1 at the accumulation boundary); ZeRO-2
sums every microbatch's gradient into its piece (what keeps its gradient memory divided),
so it pays the sum once per microbatch, and the plan's ledger charges it so.

Parameters on the same groups are summed and gathered together, as DDP buckets and FSDP
flattens them: up to ``bucket_bytes`` of them in one collective (``_Bucket``), each
parameter's pieces laid end to end in the rows of ``runtime.collectives``'
``reduce_scatter_rows`` and ``all_gather_rows`` (row ``r``: every parameter's ``r``-th
piece), so a step of a 32-layer model makes a few collectives instead of one per tensor.
A bucket's sum starts as soon as backward has produced its gradients, overlapping the rest
of backward, and the end of backward waits for it. A parameter whose dims do not split
evenly keeps a bucket of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from autopar.runtime.collectives import start_reduce_scatter_rows, unflatten
from autopar.runtime.comm import AxisGroup
from autopar.runtime.faults import Waitable
from autopar.runtime.offload import HostLog, device_copy, host_copy
from autopar.runtime.param_groups import gather_group, reduce_scatter_group, scatter_rows
from autopar.runtime.reduction import sum_flat
from autopar.runtime.shards import local_of, set_local_grad
from autopar_plans.buckets import open_buckets
from autopar_plans.reduction import PER_AXIS, GradReduction


@dataclass(frozen=True)
class HostSide:
    """Where offloaded masters live and what counts the copies to and from them."""

    device: torch.device  # the host's (cpu)
    log: HostLog


@dataclass
class ZeroParam:
    """One parameter whose optimizer state is sharded beyond its layout."""

    name: str
    master: nn.Parameter
    working: torch.Tensor
    axes: tuple[int, ...]  # mesh axes that shard the optimizer state only
    dims: tuple[int, ...]  # the dim of the local parameter each of them splits
    coords: tuple[int, ...]  # this device's coordinate on each of them
    zero_groups: tuple[AxisGroup, ...]
    other_groups: tuple[AxisGroup, ...]  # replicated axes that shard nothing
    shard_gradient: bool  # ZeRO-2
    # offload (``autopar_plans.offload``): the master, its gradient and the optimizer's
    # states live in host memory; gradients go down and masters come up through ``host``
    host: HostSide | None = None
    # parameter offload (``runtime.param_offload``): ``working`` owns no memory and the
    # programs fetch the working copy from the host: the master itself, or ``host_cast``,
    # the master cast to the working dtype on the host after each step
    fetched: bool = False
    host_cast: torch.Tensor | None = None
    seen_version: tuple[int, int] = (-1, -1)
    # the pipeline stage (of this rank's) whose backward makes its gradient: buckets keep
    # to one, so each is summed in its own stage's backward
    part: int = 0

    @property
    def master_local(self) -> torch.Tensor:
        """This device's master piece as a plain tensor (no autograd)."""
        return local_of(self.master)

    def host_working(self) -> torch.Tensor:
        """The working copy in host memory that a fetch copies up (parameter offload)."""
        return self.host_cast if self.host_cast is not None else self.master_local

    @property
    def version(self) -> tuple[int, int]:
        """Changes when the master is written: an in-place op on the DTensor bumps its
        version counter (its local shard's is not, below autograd), a write into the local
        shard (``ZeroShards.assign``) the shard's. Foreach and fused optimizer kernels bump
        neither: ``ZeroShards.note_step`` covers them."""
        return self.master._version, self.master_local._version


def master_piece(
    local: torch.Tensor, dims: tuple[int, ...], coords: tuple[int, ...], sizes: tuple[int, ...]
) -> torch.Tensor:
    """This device's piece of its local parameter: cut along each ZeRO dim in axis order."""
    piece = local
    for dim, index, size in zip(dims, coords, sizes, strict=True):
        piece = piece.chunk(size, dim=dim)[index]
    return piece.contiguous()


@dataclass
class _Started:
    """A bucket's first collective, launched while backward goes on."""

    params: list[ZeroParam]  # those whose gradient it sums
    work: Waitable
    result: Callable[[], torch.Tensor]  # the flat result once ``work`` is done
    shapes: list[torch.Size]


@dataclass
class _Bucket:
    """ZeRO parameters on the same groups, summed and gathered in one collective per step.

    As DDP's buckets, the sum starts (``start``) as soon as backward has produced every
    gradient of the bucket, and the end of backward waits for it (``finish``)."""

    params: list[ZeroParam]
    ready: int = 0
    started: _Started | None = None
    reduce_dtype: torch.dtype | None = None  # mixed precision: the sums run in bf16 / fp16
    # the form of the all-reduce over the other replicated axes (``runtime.reduction``)
    policy: GradReduction = PER_AXIS

    @property
    def first(self) -> ZeroParam:
        return self.params[0]

    def gather(self) -> None:
        """Every master gathered back into its working copy, in the working copy's dtype
        (the compute dtype under mixed precision for a matmul's weight: half the bytes on
        the wire, as FSDP2 gathers in its ``param_dtype``); the last gather writes into the
        working copies themselves. An offloaded master is cast on the host and copied up
        first (into the working copy itself where no ZeRO axis splits it)."""
        params = self.params
        if self.first.fetched:  # offloaded parameters: only the host's cast copies
            for p in params:
                if p.host_cast is not None:
                    p.host_cast.copy_(p.master_local)
            return
        pieces = [p.master_local.to(p.working.dtype) for p in params]
        host = self.first.host
        if host is not None:
            device = params[0].working.device
            into = [p.working if not p.zero_groups else None for p in params]
            copies = [
                device_copy(piece, device, host.log, "optimizer", out=out)
                for piece, out in zip(pieces, into, strict=True)
            ]
            pieces = [copy.wait() for copy in copies]
        if self.first.zero_groups:
            _gather_back(params, pieces, into=[p.working for p in params])
        elif host is None:
            for p, piece in zip(params, pieces, strict=True):
                p.working.copy_(piece)

    def start(self) -> None:
        """Launch the first collective of the sum over the first ZeRO axis, not waiting;
        a bucket also replicated on other axes is summed whole in ``finish``."""
        first = self.first
        ready, grads = self._ready()
        if first.other_groups or not ready or not first.zero_groups:
            return
        group = first.zero_groups[0]
        dims = [p.dims[0] for p in ready]
        shapes = _piece_shapes(grads, dims, group)
        rows = scatter_rows(grads, shapes, dims, group, grads[0])
        work, result = start_reduce_scatter_rows(rows, group)
        self.started = _Started(ready, work, result, shapes)

    def finish(self) -> None:
        """Sum each working gradient into its master's piece (waiting for what ``start``
        launched); free the working gradient."""
        started, self.started, self.ready = self.started, None, 0
        if started is not None:
            started.work.wait()
            ready = started.params
            grads = self._sum(ready, unflatten(started.result(), started.shapes), done=1)
        else:
            ready, grads = self._ready()
            if not ready:
                return
            if self.first.other_groups:
                grads = _all_reduce_each(grads, self.first.other_groups, self.policy)
            grads = self._sum(ready, grads, done=0)
        host = self.first.host
        if host is not None:  # down to the host in the dtype summed in, cast there
            copies = [host_copy(g, host.device, host.log, "optimizer") for g in grads]
            grads = [copy.wait() for copy in copies]
        for p, grad in zip(ready, grads, strict=True):
            if p.master.grad is None:  # a copy: not a view of the bucket's buffer
                set_local_grad(p.master, grad.to(p.master.dtype, copy=True))
            else:
                local_of(p.master.grad).add_(grad)
            p.working.grad = None

    def _ready(self) -> tuple[list[ZeroParam], list[torch.Tensor]]:
        """The parameters whose working gradient backward made, and those gradients."""
        ready = [p for p in self.params if p.working.grad is not None]
        grads = [p.working.grad for p in ready]
        dtype = self.reduce_dtype
        if dtype is not None:
            grads = [g.to(dtype) if g.is_floating_point() else g for g in grads]  # type: ignore[union-attr]
        return ready, grads  # type: ignore[return-value]

    def _sum(
        self, ready: list[ZeroParam], grads: list[torch.Tensor], done: int
    ) -> list[torch.Tensor]:
        """The rest of the sum over the ZeRO axes after the first ``done``: each
        gradient's piece for this device's master."""
        first = self.first
        for step in range(done, len(first.zero_groups)):
            dims, group = [p.dims[step] for p in ready], first.zero_groups[step]
            shapes = _piece_shapes(grads, dims, group)
            grads = reduce_scatter_group(grads, shapes, dims, group, grads[0])
        return grads


def make_buckets(
    params: list[ZeroParam],
    bucket_bytes: int = 25 * 2**20,
    reduce_dtype: torch.dtype | None = None,
    policy: GradReduction | None = None,
) -> list[_Bucket]:
    """Group ``params`` by pipeline stage, groups and ZeRO stage into buckets of about
    ``bucket_bytes`` (local size), in order; a parameter that does not split evenly at
    every step gets a bucket of its own (its pieces differ in size across devices)."""
    items = [
        (
            (
                p.part,
                tuple(id(g) for g in p.zero_groups),
                tuple(id(g) for g in p.other_groups),
                p.shard_gradient,
                p.working.dtype,
            )
            if _splits_evenly(p)
            else None,
            p.working.numel() * p.working.element_size(),
        )
        for p in params
    ]
    return [
        _Bucket(
            [params[i] for i in bucket],
            reduce_dtype=reduce_dtype,
            policy=policy or PER_AXIS,
        )
        for bucket in open_buckets(items, bucket_bytes)
    ]


def _splits_evenly(p: ZeroParam) -> bool:
    shape = list(p.working.shape)
    for dim, group in zip(p.dims, p.zero_groups, strict=True):
        n = group.size
        if shape[dim] % n:
            return False
        shape[dim] //= n
    return True


def _all_reduce_each(
    tensors: list[torch.Tensor], groups: tuple[AxisGroup, ...], policy: GradReduction
) -> list[torch.Tensor]:
    """Each tensor summed over ``groups``, laid end to end in one bucket (``policy``: in
    one all-reduce per axis, or the hierarchical form)."""
    flat = sum_flat(torch.cat([t.reshape(-1) for t in tensors]), policy, groups)
    return unflatten(flat, [t.shape for t in tensors])


def _piece_shapes(
    tensors: list[torch.Tensor], dims: list[int], group: AxisGroup
) -> list[torch.Size]:
    """The shape of this device's piece of each tensor, split along its dim over ``group``."""
    n = group.size
    shapes = []
    for t, dim in zip(tensors, dims, strict=True):
        shape = list(t.shape)
        shape[dim] //= n
        shapes.append(torch.Size(shape))
    return shapes


def _gather_back(
    params: list[ZeroParam],
    pieces: list[torch.Tensor],
    into: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Master-shaped ``pieces`` of ``params`` (on the same groups) gathered back to their
    local parameters' shapes, the last ZeRO axis first; the last gather into ``into``."""
    values = pieces
    steps = list(reversed(range(len(params[0].zero_groups))))
    for step in steps:
        dims = [p.dims[step] for p in params]
        last = into if step == steps[-1] else None
        values = gather_group(values, dims, params[0].zero_groups[step], into=last)
    return values


class ZeroShards:
    """The ZeRO parameters of one compiled model: gathers before forward, sums after."""

    def __init__(
        self,
        params: list[ZeroParam],
        reduce_dtype: torch.dtype | None = None,
        policy: GradReduction | None = None,
    ) -> None:
        """``reduce_dtype``: sum gradients in this dtype (mixed precision: the compute
        dtype, as the gradient sync); masters and their gradients stay as they are.
        ``policy``: the form of the sum over replicated axes ZeRO does not shard."""
        self.params = {p.name: p for p in params}
        self.buckets = make_buckets(params, reduce_dtype=reduce_dtype, policy=policy)
        self._bucket_of = {id(p.working): b for b in self.buckets for p in b.params}
        self._queued = False
        # on while train_step runs a microbatch other than the last: ZeRO-1's working
        # gradients accumulate locally and are summed once per step (Megatron's distributed
        # optimizer); ZeRO-2 sums each microbatch's into its piece, keeping no whole gradient
        self.accumulating = False
        self._hooks = [p.working.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        # an optimizer's foreach and fused kernels step a DTensor master without bumping
        # any version counter: a step of an optimizer holding masters marks them changed
        self._masters = frozenset(id(p.master) for p in params)
        self._stepped: set[int] = set()
        if params:
            handle = register_optimizer_step_post_hook(partial(_note_step, weakref.ref(self)))
            weakref.finalize(self, handle.remove)

    def __bool__(self) -> bool:
        return bool(self.params)

    def gather(self) -> None:
        """Refresh every working copy whose master changed since it was last gathered (and
        its ``requires_grad``, which the user sets on the master)."""
        with torch.no_grad():
            for p in self.params.values():
                if p.working.requires_grad != p.master.requires_grad:
                    p.working.requires_grad_(p.master.requires_grad)
            for bucket in self.buckets:
                if all(
                    p.version == p.seen_version and id(p.master) not in self._stepped
                    for p in bucket.params
                ):
                    continue
                bucket.gather()
                for p in bucket.params:
                    p.seen_version = p.version
            self._stepped.clear()

    def note_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` stepped: its masters changed, whatever their version counters say."""
        for group in optimizer.param_groups:
            self._stepped.update(id(t) for t in group["params"] if id(t) in self._masters)

    def whole(self, p: ZeroParam, piece: torch.Tensor) -> torch.Tensor:
        """A master-shaped tensor gathered back to the local parameter's shape (on the
        device: an offloaded piece is brought up first, outside the step's copies)."""
        return _gather_back([p], [piece.to(p.working.device)])[0]

    def _held(self, bucket: _Bucket) -> bool:
        """Whether ``bucket`` keeps accumulating instead of summing now."""
        return self.accumulating and not bucket.first.shard_gradient

    def _on_grad(self, working: torch.Tensor) -> None:
        bucket = self._bucket_of[id(working)]
        if self._held(bucket):
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
            self._queued = True
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            with torch.no_grad():
                bucket.start()

    def _reduce(self) -> None:
        """Sum each working gradient into its master's piece, bucket by bucket (those this
        backward reached: another pipeline stage's keep accumulating until theirs)."""
        with torch.no_grad():
            for bucket in self.buckets:
                if not self._held(bucket) and (bucket.ready or bucket.started):
                    bucket.finish()
        self._queued = False

    def assign(self, name: str, local: torch.Tensor) -> None:
        """Set a parameter from its local value in the parameter's layout."""
        p = self.params[name]
        sizes = tuple(g.size for g in p.zero_groups)
        with torch.no_grad():
            p.master_local.copy_(master_piece(local, p.dims, p.coords, sizes))

    def local_value(self, name: str) -> torch.Tensor:
        """The parameter's local value at full precision: its working copy, or the masters
        gathered where the working copy is cast."""
        p = self.params[name]
        if p.working.dtype != p.master.dtype or p.fetched:
            return self.whole(p, p.master_local)
        self.gather()
        return p.working.detach()

    def local_grad(self, name: str) -> torch.Tensor | None:
        p = self.params[name]
        if p.master.grad is None:
            return None
        return self.whole(p, local_of(p.master.grad))


def _note_step(shards: weakref.ref[ZeroShards], optimizer: torch.optim.Optimizer, *_: Any) -> None:
    alive = shards()
    if alive is not None:
        alive.note_step(optimizer)
