"""Resharding time: the price of the steps ``autopar_plans.reshard.plan_reshard`` plans.

The planner gives the steps, one mesh axis each, in the order the lowering runs them
(``autopar_passes.lower_spmd`` emits the same list); this module only prices them. Bytes per step,
the tensor as it stands before the step:

==============  ===============================================================
kind            bytes
==============  ===============================================================
slice, zero,    free (local)
pad
reduce_scatter  the array before: S_axis
all_to_all      each device's buffer: S_axis / n
all_reduce      S_axis
all_gather      the array after: S_axis
==============  ===============================================================

``S_axis`` is the global size divided by the shard factors of the *other* mesh axes at that
moment. Each step is priced on its own axis, in order, because that is how the runtime runs
it (``autopar_passes.lower_spmd`` emits one collective per axis): ``[P, P] -> [R, R]`` is two
all-reduces, one per axis. Pricing a phase's steps as one collective over their axes, in
the hierarchical form ``MeshCost.collective`` may pick, charged a form the runtime does
not run: on a cluster mesh, gathering gpt-tiny's logits over ``(node, gpu)`` priced the
slow inter-node link for an eighth of the bytes that the runtime's inner-first order sends
over it.

Compare torch DTensor's ``redistribute_cost``, which charges an all-to-all as an all-gather
plus a penalty and has no notion of grouping. What this leaves out: the copies that make a
local slice contiguous, and uneven splits (bytes are divided exactly).

>>> from cost_model import MeshCost
>>> from plans import MeshSpec, Partial
>>> cost = MeshCost(MeshSpec((4,), ("tp",), device="h100-sxm"))
>>> r = cost.reshard(Layout(Partial()), Layout(Shard(0)), (1024, 1024), 4)
>>> [(s.kind, s.axes, s.nbytes) for s in r.steps]
[('reduce_scatter', (0,), 4194304.0)]
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

from autopar_plans.errors import UsageError
from autopar_plans.placement import Layout, Shard
from autopar_plans.reshard import LOCAL_KINDS, plan_reshard

if TYPE_CHECKING:
    from autopar_cost_model.collectives import MeshCost


class ReshardStep(NamedTuple):
    """One step of a reshard: a collective name, or a free local ``slice``, ``zero`` or ``pad``."""

    kind: str
    axes: tuple[int, ...]
    nbytes: float
    time: float
    form: str = "none"
    sent: float = 0.0


class Reshard(NamedTuple):
    """The time and the steps that turn one layout into another."""

    time: float
    steps: tuple[ReshardStep, ...]

    @property
    def sent(self) -> float:
        """Bytes each device sends."""
        return sum(s.sent for s in self.steps)

    @property
    def collectives(self) -> tuple[ReshardStep, ...]:
        """The steps that communicate (not the free local ones)."""
        return tuple(s for s in self.steps if s.kind not in ("slice", "zero", "pad"))


def _check(src: Layout, dst: Layout, shape: tuple[int, ...], ndim: int) -> None:
    for layout in (src, dst):
        if len(layout) != ndim:
            raise UsageError(f"{layout!r} has {len(layout)} placements for a {ndim}-axis mesh")
        for placement in layout:
            if isinstance(placement, Shard) and placement.dim >= len(shape):
                raise UsageError(
                    f"{layout!r} shards dim {placement.dim} of a tensor of shape {shape}"
                )


@functools.lru_cache(maxsize=1 << 16)
def reshard_cost(
    cost: MeshCost, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int
) -> Reshard:
    """Steps and time to turn ``src`` into ``dst`` for a tensor of ``shape`` (cached)."""
    mesh_shape = cost.mesh.shape
    _check(src, dst, shape, len(mesh_shape))
    total = float(math.prod(shape) * itemsize)
    priced: list[ReshardStep] = []
    for step in plan_reshard(src, dst):
        kind, axes, before = step.kind, (step.axis,), step.before
        if kind in LOCAL_KINDS:
            priced.append(ReshardStep(kind, axes, 0.0, 0.0))
            continue
        factor = math.prod(
            mesh_shape[a] for a, p in enumerate(before) if isinstance(p, Shard) and a not in axes
        )
        nbytes = total / factor
        if kind == "all_to_all":
            nbytes /= mesh_shape[axes[0]]
        result = cost.collective(kind, nbytes, axes)
        priced.append(ReshardStep(kind, axes, nbytes, result.time, result.form, result.sent))
    return Reshard(sum(s.time for s in priced), tuple(priced))
