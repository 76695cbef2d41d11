"""Resharding time: the price of the steps ``plans.reshard.plan_reshard`` plans.

The planner gives the steps, one mesh axis each, in the order the lowering runs them
(``passes.lower_spmd`` emits the same list); this module only prices them. Bytes per step,
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
moment. Steps of one kind that the planner puts in one group (the same phase of a round) are
priced as one collective over their axes, so ``MeshCost.collective`` may pick its
hierarchical form (``[P, P] -> [R, R]`` is one all-reduce over both axes); all-to-alls are
priced one axis at a time.

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

from plans.errors import UsageError
from plans.placement import Layout, Shard
from plans.reshard import LOCAL_KINDS, AxisStep, plan_reshard

if TYPE_CHECKING:
    from cost_model.collectives import MeshCost


GROUPED = ("reduce_scatter", "all_reduce", "all_gather")


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
    for kind, axes, before in _collectives(plan_reshard(src, dst)):
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


def _collectives(steps: tuple[AxisStep, ...]) -> list[tuple[str, tuple[int, ...], Layout]]:
    """The planner's steps as priced: (kind, axes, layout before); a group's reduce-scatters,
    all-reduces or all-gathers become one collective over their axes."""
    out: list[tuple[str, tuple[int, ...], Layout]] = []
    for index, step in enumerate(steps):
        previous = steps[index - 1] if index else None
        if (
            previous is not None
            and step.kind in GROUPED
            and (previous.kind, previous.group) == (step.kind, step.group)
        ):
            kind, axes, before = out[-1]
            out[-1] = (kind, (*axes, step.axis), before)
        else:
            out.append((step.kind, (step.axis,), step.before))
    return out
