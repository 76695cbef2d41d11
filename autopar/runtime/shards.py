"""Where a whole tensor's pieces lie: this rank's slice, the gathered whole, DTensor's words.

A ``autopar_plans.Layout`` holds one placement per mesh axis; a dim split by several axes is split
by the first axis, then each piece by the next (the order of ``autopar_passes.lower_spmd``'s
``local_shard`` and of DTensor). For a (4, 16) tensor in ``Layout(S(0), R)`` on a (2, 2)
mesh, the rank at coordinates (1, 0) holds rows 2..3:

>>> from autopar_plans.placement import Layout, Replicate, Shard
>>> local_slices((4, 16), Layout(Shard(0), Replicate()), (1, 0), (2, 2))
(slice(2, 4, None), slice(0, 16, None))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.runtime.comm import AxisGroup
from autopar_plans.errors import UsageError
from autopar_plans.placement import Layout, Replicate, Shard


def local_slices(
    shape: Sequence[int], layout: Layout, coords: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[slice, ...]:
    """This rank's piece of a tensor of ``shape`` in ``layout``, one slice per tensor dim.

    Pieces are equal, as the lowering cuts them (``local_ops.shard_slice``); a dim that the
    mesh does not divide is refused (the planner shards only dims it divides).
    """
    starts = [0] * len(shape)
    sizes = list(shape)
    for axis, placement in enumerate(layout):
        if not isinstance(placement, Shard):
            continue
        dim, pieces = placement.dim, mesh_shape[axis]
        if sizes[dim] % pieces:
            raise UsageError(
                f"dim {dim} of a tensor of shape {tuple(shape)} is split {pieces} ways by "
                f"mesh axis {axis}, which does not divide it; use a size divisible by {pieces}"
            )
        sizes[dim] //= pieces
        starts[dim] += coords[axis] * sizes[dim]
    return tuple(slice(start, start + size) for start, size in zip(starts, sizes, strict=True))


def gather_full(local: torch.Tensor, layout: Layout, groups: Sequence[AxisGroup]) -> torch.Tensor:
    """All-gather a local shard back to the whole tensor (no autograd).

    Inner axes first, so a dim split over several axes comes back in order. A tensor
    sharded on no axis comes back as ``local`` itself (as torch's ``state_dict`` shares
    storage with the parameters): clone it to keep a snapshot.
    """
    from autopar.runtime.collectives import all_gather

    value = local
    for axis in reversed(range(len(layout))):
        placement = layout[axis]
        if isinstance(placement, Shard):
            value = all_gather(value, placement.dim, groups[axis], phase="state")
    return value


def torch_placements(
    layout: Layout, mesh_shape: Sequence[int] = (), param: Layout | None = None
) -> tuple[Placement, ...]:
    """DTensor's placements for a storage layout: ``Shard(d)`` and ``Replicate()``.

    ``param``: for a ZeRO master piece (``layout`` its optimizer-state layout), the
    parameter's own layout. The master is cut from the local parameter after the
    parameter's own shards (``runtime.zero.master_piece``), while DTensor nests shards in
    mesh-axis order; so a ZeRO axis outside a parameter axis that shards the same dim is
    DTensor's ``_StridedShard`` over the inner axes' pieces (what FSDP2 records for a
    tensor-parallel shard sharded again over data parallelism).

    A stored tensor (parameter, optimizer state) is never ``Partial``; one that is would be
    a bug in the planner, not a user error.
    """
    placements: list[Placement] = []
    for axis, placement in enumerate(layout):
        if isinstance(placement, Shard):
            inner = 1
            if param is not None and not isinstance(param[axis], Shard):
                inner = math.prod(
                    mesh_shape[b]
                    for b in range(axis + 1, len(param))
                    if isinstance(param[b], Shard) and param[b].dim == placement.dim
                )
            placements.append(
                _StridedShard(placement.dim, split_factor=inner)
                if inner > 1
                else TorchShard(placement.dim)
            )
        elif isinstance(placement, Replicate):
            placements.append(TorchReplicate())
        else:
            raise AssertionError(f"a stored tensor cannot be {placement} (layout {layout})")
    return tuple(placements)


def to_dtensor(
    local: torch.Tensor,
    layout: Layout,
    device_mesh: Any,
    shape: Sequence[int],
    param: Layout | None = None,
) -> DTensor:
    """Wrap this rank's shard as a DTensor of the whole ``shape`` (sharing its storage);
    ``param`` as in ``torch_placements``.

    The global shape and stride are given, not inferred, so DTensor does not assume even
    pieces nor run a check that communicates.
    """
    strides = [1] * len(shape)
    for dim in reversed(range(len(shape) - 1)):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return DTensor.from_local(
        local.detach(),
        device_mesh,
        torch_placements(layout, device_mesh.shape, param),
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(strides),
    )


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: a DTensor's local shard (not a differentiable view of it), any
    other tensor itself."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def as_dtensor_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The DTensor whose local shard is ``local``, on ``param``'s mesh and in its placements,
    shape and strides (``local`` itself when ``param`` is no DTensor). Not differentiable;
    built from ``param``'s spec directly, as FSDP2 builds its sharded gradients, since
    ``DTensor.from_local`` costs tens of microseconds a call in argument handling."""
    if not isinstance(param, DTensor):
        return local
    return DTensor(local, param._spec, requires_grad=False)  # type: ignore[call-arg]


def set_local_grad(param: torch.Tensor, local: torch.Tensor | None) -> None:
    """Give ``param`` the gradient whose local shard is ``local`` (a DTensor for a DTensor
    parameter, on its mesh and in its placements; ``local`` itself otherwise)."""
    param.grad = None if local is None else as_dtensor_like(param, local)
