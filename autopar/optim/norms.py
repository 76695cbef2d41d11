"""Whole-tensor L2 norms of sharded tensors: one small all-reduce per mesh axis.

A layer-wise optimizer needs ``||w||`` of each *whole* parameter, while each rank holds a
shard. The squared norm is a sum over the values, so it is the sum of the shards' squared
norms over the mesh axes that split the tensor, and nothing over the axes that replicate it
(summing there would count each value once per replica):

    ||w||^2 = sum over the shards s on the sharding axes of ||w_s||^2

A DTensor's placements say which axes split it: ``Shard`` and ``_StridedShard`` (a ZeRO
master cut inside a tensor-parallel shard; its ``is_shard()`` is False, so every
placement that is not ``Replicate`` counts). The squared norms of all tensors on a mesh
travel in one stacked vector: a step of a model makes at most one small all-reduce per
mesh axis, not one per parameter (DTensor's own ``vector_norm`` would issue one per
call). Plain tensors need no communication, so single-device training
runs the same code.

>>> [round(float(n), 3) for n in global_norms([torch.ones(4), torch.zeros(2, 2)])]
[2.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.runtime.shards import local_of


def sharding_axes(tensor: torch.Tensor) -> tuple[int, ...]:
    """The mesh axes whose ranks hold different values of ``tensor`` (none for a plain
    tensor). A ``Partial`` tensor's shards are summands, not pieces: refused, the caller
    must reduce it first (``matching``)."""
    if not isinstance(tensor, DTensor):
        return ()
    if any(p.is_partial() for p in tensor.placements):
        raise ValueError(f"the norm of a Partial DTensor ({tensor.placements}) needs its sum")
    return tuple(axis for axis, p in enumerate(tensor.placements) if not p.is_replicate())


def matching(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out as ``param`` is, so their local shards line up value for value
    (a no-op for plain tensors and for the gradients autopar's runtime gives)."""
    if (
        isinstance(grad, DTensor)
        and isinstance(param, DTensor)
        and grad.placements != param.placements
    ):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def global_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each whole tensor, as a plain fp32 scalar on its local device, equal
    on every rank that holds it. Collective: every rank of each tensor's mesh calls it
    with the same list.

    One foreach norm over the local shards (accumulated in fp32: a bf16 sum of squares
    loses the small terms); then, per mesh, the squares of the sharded tensors stacked,
    summed over each mesh axis by those it shards (``_sum_over_shards``), and rooted."""
    if not tensors:
        return []
    norms = list(torch._foreach_norm([local_of(t) for t in tensors], 2, dtype=torch.float32))
    by_mesh: dict[Hashable, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if sharding_axes(tensor):
            assert isinstance(tensor, DTensor)
            by_mesh.setdefault(tensor.device_mesh, []).append(index)
    for mesh, indices in by_mesh.items():
        squares = torch.stack([norms[i] for i in indices]).square()
        _sum_over_shards(squares, [sharding_axes(tensors[i]) for i in indices], mesh)
        for index, value in zip(indices, squares.sqrt().unbind(), strict=True):
            norms[index] = value
    return norms


def _sum_over_shards(squares: torch.Tensor, axes: list[tuple[int, ...]], mesh: Any) -> None:
    """Sum, in place, each entry of ``squares`` over the mesh axes in its ``axes``: per
    mesh axis, one all-reduce of the entries it shards. A sum over several axes is the
    sums over each in turn; every rank adds in the same order, so gets the same bits. The
    axes that replicate a tensor take no part, which keeps replicas from counting twice."""
    for axis in range(mesh.ndim):
        rows = [row for row, sharded in enumerate(axes) if axis in sharded]
        if not rows:
            continue
        index = torch.tensor(rows, device=squares.device)
        part = squares.index_select(0, index)
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(axis))
        squares.index_copy_(0, index, part)
