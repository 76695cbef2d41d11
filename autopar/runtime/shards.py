"""Where a whole tensor's pieces lie: this rank's slice, the gathered whole, DTensor's words.

A ``plans.Layout`` holds one placement per mesh axis; a dim split by several axes is split
by the first axis, then each piece by the next (the order of ``passes.lower_spmd``'s
``local_shard`` and of DTensor). For a (4, 16) tensor in ``Layout(S(0), R)`` on a (2, 2)
mesh, the rank at coordinates (1, 0) holds rows 2..3:

>>> from plans.placement import Layout, Replicate, Shard
>>> local_slices((4, 16), Layout(Shard(0), Replicate()), (1, 0), (2, 2))
(slice(2, 4, None), slice(0, 16, None))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from autopar.runtime.comm import AxisGroup
from plans.errors import UsageError
from plans.placement import Layout, Replicate, Shard


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


def torch_placements(layout: Layout) -> tuple[TorchShard | TorchReplicate, ...]:
    """DTensor's placements for a storage layout: ``Shard(d)`` and ``Replicate()``.

    A stored tensor (parameter, optimizer state) is never ``Partial``; one that is would be
    a bug in the planner, not a user error.
    """
    placements: list[TorchShard | TorchReplicate] = []
    for placement in layout:
        if isinstance(placement, Shard):
            placements.append(TorchShard(placement.dim))
        elif isinstance(placement, Replicate):
            placements.append(TorchReplicate())
        else:
            raise AssertionError(f"a stored tensor cannot be {placement} (layout {layout})")
    return tuple(placements)


def to_dtensor(
    local: torch.Tensor, layout: Layout, device_mesh: Any, shape: Sequence[int]
) -> DTensor:
    """Wrap this rank's shard as a DTensor of the whole ``shape`` (sharing its storage).

    The global shape and stride are given, not inferred, so DTensor does not assume even
    pieces nor run a check that communicates.
    """
    strides = [1] * len(shape)
    for dim in reversed(range(len(shape) - 1)):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return DTensor.from_local(
        local.detach(),
        device_mesh,
        torch_placements(layout),
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(strides),
    )
