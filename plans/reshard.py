"""The reshard planner: the steps that turn one layout of a tensor into another.

One function for both sides: the cost model prices these steps (``autopar_cost_model.reshard``) and
the lowering emits them (``autopar_passes.lower_spmd``), so what the plan charges is what runs (as
DTensor's ``redistribute_cost`` and ``redistribute_local_tensor`` share one transform list).

Each step changes one mesh axis:

==========  ==============  =======================================================
from -> to  kind            what runs
==========  ==============  =======================================================
R -> S(d)   slice           local: keep this device's chunk of dim d
R -> P      zero            local: keep the value on the axis's first device, zeros elsewhere
S(d) -> P   pad             local: zero-pad the chunk to the full dim (the adjoint of slice)
P -> S(d)   reduce_scatter  sum over the axis, keep this device's chunk
S(d) -> S(e) all_to_all     re-split: send chunks of dim e, receive chunks of dim d
P -> R      all_reduce      sum over the axis
S(d) -> R   all_gather      concatenate the chunks of dim d
==========  ==============  =======================================================

**Nesting.** A dim split by several mesh axes is split by the outer axis first (DTensor's
order): on a 2 x 2 mesh, ``[S(0), S(0)]`` gives device (i, j) chunk ``2i + j`` of four. A step
on axis ``k`` that cuts or joins dim ``d`` is only right while ``k`` is the innermost axis
splitting ``d``: every axis inside ``k`` must leave ``d`` alone at that moment (an all-to-all
needs that for both of its dims). Zero-padding the outer axis of ``[S(0), S(0)]`` first, on the
way to ``[P, S(1)]``, would put chunk ``2i + j`` at position ``i`` of a half it does not
belong to; the all-to-all on the inner axis must run before it.

**Order.** The steps run in rounds of phases that keep the tensor small while it moves:

1. free local steps: slices and zeroes (outer axis first), pads (inner axis first);
2. reduce-scatters, which shrink it too (outer first);
3. all-to-alls, which keep its size (inner first, one axis at a time);
4. all-reduces, while the other axes are still sharded;
5. all-gathers, which grow it (inner first);
6. zeroes for axes that were reduced or gathered on their way to ``P``.

A step whose nesting is not right yet waits for the next round. When a round makes no
progress (``[S(0), S(1)] -> [S(1), S(0)]``: each all-to-all waits for the other), every
axis splitting a dim that a waiting step needs is gathered, inner axis first, and the rounds
go on from there.

Steps of one phase form a ``group``: the cost model prices a group of reduce-scatters,
all-reduces or all-gathers as one collective over its axes (``MeshCost.collective``), which
the runtime runs axis by axis in the order given.

>>> [(s.kind, s.axis) for s in plan_reshard(Layout(Shard(0), Shard(0)), Layout(Partial(),
...     Shard(1)))]
[('all_to_all', 1), ('pad', 0)]
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from autopar_plans.errors import UsageError
from autopar_plans.placement import REPLICATE, Layout, Partial, Placement, Replicate, Shard

LOCAL_KINDS = ("slice", "zero", "pad")
_MAX_ROUNDS = 16


class AxisStep(NamedTuple):
    """One step on one mesh axis: ``kind`` turns ``before[axis]`` into ``after[axis]``."""

    kind: str
    axis: int
    before: Layout
    after: Layout
    group: int  # steps of one phase share a group (priced as one collective over their axes)

    @property
    def dims(self) -> tuple[int, ...]:
        """The tensor dims the step takes: the dim it cuts (slice, reduce_scatter) or joins
        (pad, all_gather), or both (all_to_all: from, to)."""
        return _dims(self.kind, self.before[self.axis], self.after[self.axis])

    @property
    def local(self) -> bool:
        return self.kind in LOCAL_KINDS


def _dims(kind: str, src: Placement, dst: Placement) -> tuple[int, ...]:
    if kind in ("slice", "reduce_scatter") and isinstance(dst, Shard):
        return (dst.dim,)
    if kind in ("pad", "all_gather") and isinstance(src, Shard):
        return (src.dim,)
    if kind == "all_to_all" and isinstance(src, Shard) and isinstance(dst, Shard):
        return (src.dim, dst.dim)
    return ()


# the phases of a round, in the order that keeps the tensor small: the kinds each runs and
# its axis order (1: outer first, -1: inner first)
_PHASES: tuple[tuple[tuple[str, ...], int], ...] = (
    (("slice", "zero"), 1),
    (("pad",), -1),
    (("reduce_scatter",), 1),
    (("all_to_all",), -1),
    (("all_reduce",), 1),
    (("all_gather",), -1),
)


def _stack(placements: list[Placement] | tuple[Placement, ...], dim: int) -> list[int]:
    """The mesh axes splitting ``dim``, outer first (the order of its nesting)."""
    return [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]


class _Planner:
    """Greedy rounds of phases over a state (module docstring).

    Each dim's axes form a stack, outer at the bottom: a step may only push an axis on top
    (slice, reduce-scatter, the arriving half of an all-to-all) or pop the top one (gather,
    pad, the leaving half). So a dim first pops what it holds above the longest prefix it
    shares with the target, top down, then pushes the target's rest, bottom up."""

    def __init__(self, have: Layout, want: Layout) -> None:
        self.state: list[Placement] = list(have)
        self.target = tuple(want)
        self.steps: list[AxisStep] = []
        self.group = 0

    def apply(self, kind: str, axis: int, placement: Placement) -> None:
        before = Layout(*self.state)
        self.state[axis] = placement
        self.steps.append(AxisStep(kind, axis, before, Layout(*self.state), self.group))

    def _kept(self, dim: int) -> int:
        """How many of ``dim``'s axes, from the bottom, already stand where the target has them."""
        now, goal = _stack(self.state, dim), _stack(self.target, dim)
        kept = 0
        while kept < min(len(now), len(goal)) and now[kept] == goal[kept]:
            kept += 1
        return kept

    def must_leave(self, axis: int) -> bool:
        """``axis`` splits a dim above its kept prefix: it has to come off that dim."""
        placement = self.state[axis]
        if not isinstance(placement, Shard):
            return False
        now = _stack(self.state, placement.dim)
        return now.index(axis) >= self._kept(placement.dim)

    def can_pop(self, axis: int) -> bool:
        placement = self.state[axis]
        assert isinstance(placement, Shard)
        return self.must_leave(axis) and _stack(self.state, placement.dim)[-1] == axis

    def can_push(self, axis: int, dim: int, state: list[Placement] | None = None) -> bool:
        """``axis`` may go on top of ``dim`` now: the dim holds exactly the target's axes
        below it."""
        now = _stack(self.state if state is None else state, dim)
        return now == [a for a in _stack(self.target, dim) if a < axis]

    def step_for(self, axis: int) -> tuple[str, Placement] | None:
        """The step ``axis`` can take now toward its target, if any (deadlocks aside)."""
        src, dst = self.state[axis], self.target[axis]
        if isinstance(src, Shard):
            if not self.must_leave(axis) or not self.can_pop(axis):
                return None
            if isinstance(dst, Partial):
                return "pad", dst
            if isinstance(dst, Shard) and dst.dim != src.dim:
                after = list(self.state)
                after[axis] = REPLICATE
                return ("all_to_all", dst) if self.can_push(axis, dst.dim, after) else None
            if isinstance(dst, Replicate):
                return "all_gather", REPLICATE
            return None  # back onto the same dim, or onto a dim not ready: wait (or unblock)
        if src == dst:
            return None
        if isinstance(dst, Shard):
            if not self.can_push(axis, dst.dim):
                return None
            return ("slice" if isinstance(src, Replicate) else "reduce_scatter"), dst
        if isinstance(src, Partial):  # -> R, or -> a partial of another reduce op (then zero)
            return "all_reduce", REPLICATE
        return "zero", dst

    def round(self) -> bool:
        """One round of phases; whether any step ran."""
        progress = False
        for kinds, order in _PHASES:
            axes = range(len(self.state))
            ran = False
            for axis in axes if order > 0 else reversed(axes):
                step = self.step_for(axis)
                if step is not None and step[0] in kinds:
                    self.apply(step[0], axis, step[1])
                    ran = True
            if ran:
                self.group += 1
                progress = True
        return progress

    def unblock(self) -> None:
        """No step could run: gather the innermost axis that has to leave its dim and can
        (it is pushed again later); a cycle of all-to-alls waiting on each other, or an axis
        that must come off a dim and go back on it above another, end here."""
        for axis in reversed(range(len(self.state))):
            if isinstance(self.state[axis], Shard) and self.can_pop(axis):
                self.apply("all_gather", axis, REPLICATE)
                self.group += 1
                return
        raise AssertionError(f"reshard stuck at {Layout(*self.state)!r}")  # pragma: no cover


@functools.lru_cache(maxsize=1 << 16)
def plan_reshard(have: Layout, want: Layout) -> tuple[AxisStep, ...]:
    """The steps from ``have`` to ``want`` (module docstring); cached."""
    if len(have) != len(want):
        raise UsageError(f"cannot reshard {have!r} to {want!r}: their mesh ranks differ")
    planner = _Planner(have, want)
    for _ in range(_MAX_ROUNDS):
        if tuple(planner.state) == planner.target:
            return tuple(planner.steps)
        if not planner.round():
            planner.unblock()
    raise AssertionError(f"no reshard plan from {have!r} to {want!r}")  # pragma: no cover
