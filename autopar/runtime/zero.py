"""ZeRO-1 and ZeRO-2: optimizer state (and gradients) sharded beyond the parameter.

When the plan stores a parameter replicated over some mesh axes but its optimizer state
sharded over them (``ParamPlan.optimizer`` against ``ParamPlan.param``), the optimizer
must only ever see this device's piece. So, as DeepSpeed's ZeRO does:

- the ``nn.Parameter`` the optimizer steps is the *master* piece: the device's local
  parameter, cut further along the ZeRO dims over the ZeRO axes;
- the lowered graph reads a *working* copy in the parameter's own layout, all-gathered from
  the masters before a forward whenever a master changed (after an optimizer step);
- after backward, the working copy's gradient (a summand over the replicated axes) is
  summed: over the other replicated axes by all-reduce, over the ZeRO axes by
  reduce-scatter straight into the master's piece (ZeRO-2), or by all-reduce and then
  keeping the piece (ZeRO-1, whose gradient is whole until the step).

Values equal a plain data-parallel run; memory for optimizer state (and, for ZeRO-2, the
gradient kept for the step) is divided by the ZeRO axes' size. Communication is one
reduce-scatter and one all-gather per step, what an all-reduce costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.collectives import all_gather, all_reduce, reduce_scatter
from plans.placement import Layout, Replicate, Shard


@dataclass
class ZeroParam:
    """One parameter whose optimizer state is sharded beyond its layout."""

    name: str
    master: nn.Parameter
    working: torch.Tensor
    axes: tuple[int, ...]  # mesh axes that shard the optimizer state only
    dims: tuple[int, ...]  # the dim of the local parameter each of them splits
    coords: tuple[int, ...]  # this device's coordinate on each of them
    zero_groups: tuple[dist.ProcessGroup, ...]
    other_groups: tuple[dist.ProcessGroup, ...]  # replicated axes that shard nothing
    shard_gradient: bool  # ZeRO-2
    seen_version: int = -1


def zero_axes(
    param: Layout, optimizer: Layout, mesh_shape: tuple[int, ...]
) -> list[tuple[int, int]]:
    """(mesh axis, dim) for each axis that replicates the parameter but shards its state."""
    found = []
    for axis, (p, o) in enumerate(zip(param, optimizer, strict=True)):
        if isinstance(p, Replicate) and isinstance(o, Shard) and mesh_shape[axis] > 1:
            found.append((axis, o.dim))
    return found


def master_piece(
    local: torch.Tensor, dims: tuple[int, ...], coords: tuple[int, ...], sizes: tuple[int, ...]
) -> torch.Tensor:
    """This device's piece of its local parameter: cut along each ZeRO dim in axis order."""
    piece = local
    for dim, index, size in zip(dims, coords, sizes, strict=True):
        piece = piece.chunk(size, dim=dim)[index]
    return piece.contiguous()


class ZeroShards:
    """The ZeRO parameters of one compiled model: gathers before forward, sums after."""

    def __init__(self, params: list[ZeroParam]) -> None:
        self.params = {p.name: p for p in params}
        self._queued = False
        self._hooks = [p.working.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def __bool__(self) -> bool:
        return bool(self.params)

    def gather(self) -> None:
        """Refresh every working copy whose master changed since it was last gathered."""
        with torch.no_grad():
            for p in self.params.values():
                if p.master._version == p.seen_version:
                    continue
                p.working.copy_(self.whole(p, p.master.detach()))
                p.seen_version = p.master._version

    def whole(self, p: ZeroParam, piece: torch.Tensor) -> torch.Tensor:
        """A master-shaped tensor gathered back to the local parameter's shape."""
        value = piece
        for dim, group in reversed(list(zip(p.dims, p.zero_groups, strict=True))):
            value = all_gather(value, dim, group)
        return value

    def _on_grad(self, _: torch.Tensor) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
            self._queued = True

    def _reduce(self) -> None:
        """Sum each working gradient into its master's piece; free the working gradient."""
        with torch.no_grad():
            for p in self.params.values():
                grad = p.working.grad
                if grad is None:
                    continue
                for group in p.other_groups:
                    grad = all_reduce(grad, group)
                if p.shard_gradient:
                    for dim, group in zip(p.dims, p.zero_groups, strict=True):
                        grad = reduce_scatter(grad, dim, group)
                else:
                    for group in p.zero_groups:
                        grad = all_reduce(grad, group)
                    sizes = tuple(dist.get_world_size(g) for g in p.zero_groups)
                    grad = master_piece(grad, p.dims, p.coords, sizes)
                if p.master.grad is None:
                    p.master.grad = grad.clone()
                else:
                    p.master.grad += grad
                p.working.grad = None
        self._queued = False

    def assign(self, name: str, local: torch.Tensor) -> None:
        """Set a parameter from its local value in the parameter's layout."""
        p = self.params[name]
        sizes = tuple(dist.get_world_size(g) for g in p.zero_groups)
        with torch.no_grad():
            p.master.copy_(master_piece(local, p.dims, p.coords, sizes))

    def local_value(self, name: str) -> torch.Tensor:
        self.gather()
        return self.params[name].working.detach()

    def local_grad(self, name: str) -> torch.Tensor | None:
        p = self.params[name]
        if p.master.grad is None:
            return None
        return self.whole(p, p.master.grad.detach())
