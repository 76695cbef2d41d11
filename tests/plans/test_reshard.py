"""The reshard planner: which steps, in which order (their values are checked by running
the emitted code, ``tests/passes/test_lower_reshard.py``)."""

from __future__ import annotations

import doctest
import itertools

import pytest

import autopar_plans.reshard
from autopar_plans.placement import Layout, Partial, Replicate, Shard
from autopar_plans.reshard import plan_reshard

R, P = Replicate(), Partial()


@pytest.mark.parametrize(
    ("have", "want", "steps"),
    [
        ((Shard(1), R), (Shard(1), Shard(1)), ["slice 1"]),  # dim 1 gains an inner axis
        ((Shard(0), Shard(0)), (Shard(0), R), ["all_gather 1"]),  # loses its inner axis
        ((R, Shard(0)), (R, Shard(1)), ["all_to_all 1"]),
        ((Shard(1), Shard(0)), (Shard(1), Shard(1)), ["all_to_all 1"]),  # inside axis 0
        # the inner axis's all-to-all first: the outer axis's pad needs dim 0 to itself
        ((Shard(0), Shard(0)), (P, Shard(1)), ["all_to_all 1", "pad 0"]),
        # a dim keeps axis 1 but loses axis 0 below it: axis 1 comes off and goes back on
        ((Shard(0), Shard(0)), (R, Shard(0)), ["all_gather 1", "all_gather 0", "slice 1"]),
        ((R, Shard(1)), (Shard(1), R), ["all_gather 1", "slice 0"]),
        # the all-to-all on axis 0 first: slicing axis 1 onto dim 1 first would block it
        ((Shard(0), R), (Shard(1), Shard(1)), ["all_to_all 0", "slice 1"]),
        # two all-to-alls waiting on each other: the inner one becomes a gather and a slice
        ((Shard(0), Shard(1)), (Shard(1), Shard(0)), ["all_gather 1", "all_to_all 0", "slice 1"]),
        ((Shard(1), Shard(1)), (Shard(2), Shard(2)), ["all_gather 1", "all_to_all 0", "slice 1"]),
        # shrink first: the slice before the reduce-scatter, the all-reduce before the gather
        ((P, R), (Shard(0), Shard(1)), ["slice 1", "reduce_scatter 0"]),
        ((P, Shard(0)), (R, R), ["all_reduce 0", "all_gather 1"]),
    ],
)
def test_steps_keep_every_dims_pieces_nested_outer_axis_first(have, want, steps):
    planned = plan_reshard(Layout(*have), Layout(*want))
    assert [f"{s.kind} {s.axis}" for s in planned] == steps
    assert planned[0].before == Layout(*have) and planned[-1].after == Layout(*want)
    for earlier, later in itertools.pairwise(planned):
        assert earlier.after == later.before


def test_one_phases_collectives_share_a_group():
    """So the cost model prices [P, P] -> [R, R] as one all-reduce over both axes."""
    first, second = plan_reshard(Layout(P, P), Layout(R, R))
    assert (first.kind, second.kind) == ("all_reduce", "all_reduce")
    assert first.group == second.group


def test_nothing_to_do_is_no_steps():
    assert plan_reshard(Layout(Shard(0), R), Layout(Shard(0), R)) == ()


def test_the_docstring_example_runs():
    result = doctest.testmod(autopar_plans.reshard)
    assert result.failed == 0 and result.attempted > 0
