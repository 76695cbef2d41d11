"""Autograd-aware collectives on one mesh axis, as modules the lowered graph calls.

Each collective's backward is its adjoint, so that the local backward of the lowered graph
computes each device's summand of every gradient (``autopar_passes.lower_spmd``):

==================  ===================  ==============================
module              forward              backward (adjoint)
==================  ===================  ==============================
AllGather(dim)      Shard(dim) -> R      reduce-scatter of the gradient
ReduceScatter(dim)  P -> Shard(dim)      all-gather of the gradient
AllReduce           P -> R               all-reduce of the gradient
AllToAll(src, dst)  Shard(src) -> (dst)  all-to-all back
==================  ===================  ==============================

At the module's outputs every device receives the same gradient (``autopar_passes.lower_spmd``, the
output boundary), so an all-reduce there may skip its adjoint (``AllReduce(adjoint=False)``:
the gradient passes through, and the n equal summands the adjoint would add are counted
in the boundary's scale instead; ``autopar_passes.rewrites.output_boundary``).

gloo has no reduce-scatter, and its all-to-all wants lists; on gloo both are built from
the collectives it has (all-reduce then a local slice; all-gather then a local slice). They
move more bytes but give the same values, which is what CPU tests need.

Every function here runs on an ``AxisGroup`` (``runtime.comm``) and records the collective
it stands for once, in the plan's terms, whatever gloo runs in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.comm import AxisGroup
from autopar.runtime.faults import Waitable
from autopar.runtime.pending import DeferredAllReduce

Group = AxisGroup


def all_gather(x: torch.Tensor, dim: int, group: Group, phase: str | None = None) -> torch.Tensor:
    n = group.size
    x = x.contiguous()
    if group.gloo:
        parts = [torch.empty_like(x) for _ in range(n)]
        group.call(dist.all_gather, parts, x, group=group.pg)
        out = torch.cat(parts, dim=dim)
        group.record("all_gather", out, phase)
        return out
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    group.record("all_gather", out, phase)
    group.call(dist.all_gather_into_tensor, out, moved, group=group.pg)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n, rank = group.size, group.rank
    group.record("reduce_scatter", x)
    if group.gloo:
        total = x.contiguous().clone()
        group.call(dist.all_reduce, total, group=group.pg)
        return total.chunk(n, dim=dim)[rank].contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    group.call(dist.reduce_scatter_tensor, out, moved, group=group.pg)
    return out.movedim(0, dim)


def all_gather_rows(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """Every device's 1-D ``flat`` as the rows of one ``[n, numel]`` tensor (row i from
    device i): one collective for many parameters' shards laid end to end (FSDP)."""
    work, out = start_all_gather_rows(flat, group)
    work.wait()
    return out


def start_all_gather_rows(flat: torch.Tensor, group: Group) -> tuple[Waitable, torch.Tensor]:
    """``all_gather_rows`` launched without waiting (FSDP's prefetch): the work to wait on,
    and the rows it fills."""
    out = torch.empty((group.size, flat.numel()), dtype=flat.dtype, device=flat.device)
    group.record("all_gather", out)
    if group.gloo:
        work = group.call(dist.all_gather, list(out.unbind(0)), flat, group=group.pg, async_op=True)
    else:
        work = group.call(dist.all_gather_into_tensor, out, flat, group=group.pg, async_op=True)
    assert work is not None
    return work, out


def reduce_scatter_rows(rows: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over devices of row ``rank`` of every device's ``[n, numel]`` ``rows``, a
    fresh 1-D tensor (``rows`` may be overwritten): the adjoint of ``all_gather_rows``."""
    work, result = start_reduce_scatter_rows(rows, group)
    work.wait()
    return result()


def start_reduce_scatter_rows(
    rows: torch.Tensor, group: Group
) -> tuple[Waitable, Callable[[], torch.Tensor]]:
    """``reduce_scatter_rows`` launched without waiting: the work to wait on, and what
    gives the result once it is done."""
    group.record("reduce_scatter", rows)
    if group.gloo:
        work = group.call(dist.all_reduce, rows, group=group.pg, async_op=True)
        # cloned once done, not a view: it must not keep all rows
        return work, rows[group.rank].clone
    out = torch.empty(rows.shape[1:], dtype=rows.dtype, device=rows.device)
    work = group.call(dist.reduce_scatter_tensor, out, rows, group=group.pg, async_op=True)
    return work, lambda: out


def unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat`` as tensors of ``shapes`` laid end to end (a bucket's members)."""
    out, offset = [], 0
    for shape in shapes:
        numel = shape.numel()
        out.append(flat[offset : offset + numel].view(shape))
        offset += numel
    return out


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()
    group.all_reduce(out)
    return out


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: Group) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim): split ``dst_dim`` into n pieces, send piece j to
    device j, concatenate what arrives along ``src_dim``."""
    n, rank = group.size, group.rank
    group.record("all_to_all", x)
    if group.gloo:
        parts = [torch.empty_like(x.contiguous()) for _ in range(n)]
        group.call(dist.all_gather, parts, x.contiguous(), group=group.pg)
        whole = torch.cat(parts, dim=src_dim)
        return whole.chunk(n, dim=dst_dim)[rank].contiguous()
    sends = [p.contiguous() for p in x.chunk(n, dim=dst_dim)]
    receives = [torch.empty_like(sends[0]) for _ in range(n)]
    group.call(dist.all_to_all, receives, sends, group=group.pg)
    return torch.cat(receives, dim=src_dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.group), None


class _AllReduceNoAdjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: int, dst: int, group: Group) -> torch.Tensor:
        ctx.src, ctx.dst, ctx.group = src, dst, group
        return all_to_all(x, src, dst, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_to_all(grad, ctx.dst, ctx.src, ctx.group), None, None, None


class Collective(nn.Module):
    """A collective over one mesh axis; the lowered graph calls it as a submodule."""

    def __init__(self, group: Group, axis_name: str) -> None:
        super().__init__()
        self.group = group
        self.axis_name = axis_name

    def extra_repr(self) -> str:
        return f"axis={self.axis_name!r}, devices={self.group.size}"


class AllGather(Collective):
    # set by the runtime when parameters are gathered (FSDP): see runtime.regather
    gathers: Any = None

    def forward(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = _AllGather.apply(x, dim, self.group)
        if self.gathers is not None:
            self.gathers.record(out, x, dim, self.group)
        return out


def to_param_dtype(shard: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A parameter's shard as it is gathered: cast to ``dtype`` (autograd carries the
    gradient back to the fp32 shard), so the gather and its adjoint's reduce-scatter move
    compute-dtype bytes and autocast finds the weight already cast."""
    if dtype is None or not shard.is_floating_point() or shard.dtype == dtype:
        return shard
    return shard.to(dtype)


class ReduceScatter(Collective):
    def forward(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _ReduceScatter.apply(x, dim, self.group)


class AllReduce(Collective):
    def forward(
        self, x: torch.Tensor, adjoint: bool = True, deferred: bool = False
    ) -> torch.Tensor:
        """Sum ``x`` over the group. ``adjoint=False`` (only where every device's gradient
        is the same, see the module docstring): backward passes the gradient through
        instead of all-reducing it. ``deferred`` (with ``adjoint=False``, for a module
        output): return at once, the sum waited for when first read (``runtime.pending``)."""
        if deferred:
            return DeferredAllReduce.apply(x, self.group)
        if not adjoint:
            return _AllReduceNoAdjoint.apply(x, self.group)
        return _AllReduce.apply(x, self.group)


class AllToAll(Collective):
    def forward(self, x: torch.Tensor, src_dim: int, dst_dim: int) -> torch.Tensor:
        return _AllToAll.apply(x, src_dim, dst_dim, self.group)


MODULES: dict[str, type[Collective]] = {
    "all_gather": AllGather,
    "reduce_scatter": ReduceScatter,
    "all_reduce": AllReduce,
    "all_to_all": AllToAll,
}
