"""Process groups per mesh axis, made again for gradient synchronisation.

The lowered graph's collectives run on the ``DeviceMesh``'s groups, in graph order on
every rank. Gradient synchronisation runs asynchronously from autograd hooks, whose timing
relative to the graph's own backward collectives may differ between ranks; on one shared
group the two streams of collectives could interleave differently on different ranks (a
deadlock, or gloo's "collective mismatch"). So gradient sync gets groups of its own.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from autopar.runtime.comm import AxisGroup, CommLog
from autopar_plans.mesh import MeshSpec


def axis_groups(mesh: MeshSpec, log: CommLog) -> list[AxisGroup | None]:
    """For each mesh axis, a new group holding this rank and the ranks along that axis,
    recording its collectives in ``log``.

    Every rank creates every group (``new_group`` is collective), in the same order.
    """
    rank = dist.get_rank()
    mine: list[AxisGroup | None] = [None] * mesh.ndim
    strides = [1] * mesh.ndim
    for axis in reversed(range(mesh.ndim - 1)):
        strides[axis] = strides[axis + 1] * mesh.shape[axis + 1]
    for axis in range(mesh.ndim):
        others = [range(size) for a, size in enumerate(mesh.shape) if a != axis]
        for fixed in itertools.product(*others):
            ranks = []
            for i in range(mesh.shape[axis]):
                coords = list(fixed)
                coords.insert(axis, i)
                ranks.append(sum(c * s for c, s in zip(coords, strides, strict=True)))
            group = dist.new_group(ranks, timeout=log.faults.timeout if log.faults else None)
            if rank in ranks:
                mine[axis] = AxisGroup(group, (mesh.axis_names[axis],), log)
    return mine
