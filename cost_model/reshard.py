"""Resharding: the collectives that turn one layout of a tensor into another, and their time.

Per mesh axis, from the source placement to the destination one (DESIGN.md, "Lower"):

==========  ==========================  ============================================
from -> to  what runs                   bytes (the tensor as it stands on that axis)
==========  ==========================  ============================================
same        nothing
R -> S(d)   local slice (free)
R -> P      local: keep it on one rank, zeros elsewhere (free)
P -> S(d)   reduce-scatter              the array before: S_axis
S(d) -> S(e) all-to-all                 each device's buffer: S_axis / n
P -> R      all-reduce                  S_axis
S(d) -> R   all-gather                  the array after: S_axis
S(d) -> P   local: zero-pad the shard to  (free; the adjoint of R -> S(d), so a
            the full shape               sliced tensor's gradient costs nothing)
==========  ==========================  ============================================

``S_axis`` is the global size divided by the shard factors of the *other* mesh axes at that
moment. The steps run in the order that keeps the tensor smallest while it moves:

1. the free local steps (R -> S, R -> P, S -> P);
2. reduce-scatters (P -> S), which shrink it too;
3. all-to-alls (S(d) -> S(e)), which keep its size;
4. all-reduces (P -> R), while the other axes are still sharded;
5. all-gathers (S -> R), which grow it.

When a dim involved in the change is split by more than one mesh axis along the way
(``plans.reshard_axiswise``), the per-axis order would nest pieces wrongly; the lowering
then makes the tensor whole and cuts it again, and the cost is that of those two reshards.

Axes that need the same collective in the same phase run it as one multi-axis collective, so
``MeshCost.collective`` may pick its hierarchical form (e.g. ``[P, P] -> [R, R]`` is one
all-reduce over both axes). All-to-alls go one axis at a time.

Compare torch DTensor's ``redistribute_cost``, which charges an all-to-all as an all-gather
plus a penalty and has no notion of grouping. What this leaves out: the copies that make a
local slice contiguous, and uneven splits (bytes are divided exactly).

>>> from cost_model import MeshCost
>>> from plans import MeshSpec
>>> cost = MeshCost(MeshSpec((4,), ("tp",), device="h100-sxm"))
>>> r = cost.reshard(Layout(Partial()), Layout(Shard(0)), (1024, 1024), 4)
>>> [(s.kind, s.axes, s.nbytes) for s in r.steps]
[('reduce_scatter', (0,), 4194304.0)]
"""

from __future__ import annotations

import functools
import math
from types import UnionType
from typing import TYPE_CHECKING, NamedTuple

from plans.errors import UsageError
from plans.placement import Layout, Partial, Placement, Replicate, Shard, reshard_axiswise

if TYPE_CHECKING:
    from cost_model.collectives import MeshCost


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
    if not reshard_axiswise(src, dst):
        # the lowering makes the tensor whole and then cuts it (plans.reshard_axiswise)
        whole = Layout.replicated(len(mesh_shape))
        first = reshard_cost(cost, src, whole, shape, itemsize)
        second = reshard_cost(cost, whole, dst, shape, itemsize)
        return Reshard(first.time + second.time, first.steps + second.steps)
    total = float(math.prod(shape) * itemsize)
    now: list[Placement] = list(src.placements)
    target = dst.placements
    steps: list[ReshardStep] = []

    def size_on(axes: tuple[int, ...]) -> float:
        """Bytes of the tensor as it stands on ``axes``: the other axes' shards divide it."""
        factor = math.prod(
            mesh_shape[a] for a, p in enumerate(now) if isinstance(p, Shard) and a not in axes
        )
        return total / factor

    def run(kind: str, axes: tuple[int, ...], nbytes: float) -> None:
        result = cost.collective(kind, nbytes, axes)
        steps.append(ReshardStep(kind, axes, nbytes, result.time, result.form, result.sent))

    def pending(test: type | UnionType, goal: type | UnionType) -> tuple[int, ...]:
        """Axes whose placement is now a ``test`` and must become a different ``goal``."""
        return tuple(
            a
            for a, p in enumerate(now)
            if isinstance(p, test) and isinstance(target[a], goal) and p != target[a]
        )

    # 1. free local steps: R -> S(d) slices, R -> P zeroes all but one rank, S(d) -> P pads
    for axis in pending(Replicate, Shard | Partial):
        steps.append(
            ReshardStep("slice" if isinstance(target[axis], Shard) else "zero", (axis,), 0.0, 0.0)
        )
        now[axis] = target[axis]
    for axis in pending(Shard, Partial):
        steps.append(ReshardStep("pad", (axis,), 0.0, 0.0))
        now[axis] = target[axis]
    # 2. P -> S(d): one reduce-scatter over every such axis
    axes = pending(Partial, Shard)
    if axes:
        run("reduce_scatter", axes, size_on(axes))
        for axis in axes:
            now[axis] = target[axis]
    # 3. S(d) -> S(e): an all-to-all per axis; each device's buffer is 1/n of the tensor
    for axis in pending(Shard, Shard):
        run("all_to_all", (axis,), size_on((axis,)) / mesh_shape[axis])
        now[axis] = target[axis]
    # 4. P -> R (and P(sum) -> P(avg), reduced then zeroed): all-reduce while still small
    reduced = pending(Partial, Replicate) + pending(Partial, Partial)
    if reduced:
        axes = tuple(sorted(reduced))
        run("all_reduce", axes, size_on(axes))
        for axis in axes:
            now[axis] = Replicate()
    # 5. S(d) -> R: all-gather, last, when the tensor grows
    axes = pending(Shard, Replicate)
    if axes:
        run("all_gather", axes, size_on(axes))
        for axis in axes:
            now[axis] = Replicate()
    for axis in pending(Replicate, Partial):  # what was gathered or reduced on its way to P
        steps.append(ReshardStep("zero", (axis,), 0.0, 0.0))
        now[axis] = target[axis]
    return Reshard(sum(s.time for s in steps), tuple(steps))
