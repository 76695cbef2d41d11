"""Resharding cost: each placement transition is the collective DESIGN.md names for it.

R->S local slice (free), S->R all-gather, P->R all-reduce, P->S reduce-scatter, S(i)->S(j)
all-to-all (DESIGN.md "Lower"; the same table as torch DTensor's redistribute). Bytes per
step are the tensor as it stands on that axis; times come from the same ``MeshCost``.
"""

from __future__ import annotations

import pytest

from autopar_cost_model import MeshCost, reshard_cost
from autopar_plans import Layout, MeshSpec, Partial, Replicate, Shard

R, P = Replicate(), Partial()
SHAPE = (1024, 512)
ITEM = 4
NBYTES = 1024 * 512 * 4


@pytest.fixture
def line(make_preset):
    return MeshCost(MeshSpec((4,), ("x",)), make_preset(intra_lat=1e-6, launch=5e-6))


@pytest.fixture
def grid(make_preset):
    preset = make_preset(
        intra_bw=100e9, inter_bw=10e9, intra_lat=1e-6, inter_lat=5e-6, launch=5e-6, gpus_per_node=4
    )
    return MeshCost(MeshSpec((2, 4), ("dp", "tp")), preset)


def steps(result):
    return [(s.kind, s.axes, s.nbytes) for s in result.steps]


def test_same_layout_costs_nothing(line):
    result = line.reshard(Layout(Shard(0)), Layout(Shard(0)), SHAPE, ITEM)
    assert result.time == 0.0 and result.steps == ()


def test_replicate_to_shard_is_a_free_slice(line, grid):
    result = line.reshard(Layout(R), Layout(Shard(1)), SHAPE, ITEM)
    assert result.time == 0.0 and steps(result) == [("slice", (0,), 0.0)]
    result = grid.reshard(Layout(R, R), Layout(Shard(0), Shard(1)), SHAPE, ITEM)
    assert result.time == 0.0 and result.collectives == ()


def test_replicate_to_partial_is_free(line):
    assert line.reshard(Layout(R), Layout(P), SHAPE, ITEM).time == 0.0


def test_shard_to_replicate_is_an_all_gather(line, grid):
    result = line.reshard(Layout(Shard(0)), Layout(R), SHAPE, ITEM)
    assert steps(result) == [("all_gather", (0,), NBYTES)]
    assert result.time == line.all_gather(NBYTES, 0)
    # on a 2-D mesh, gathering over tp while dp still shards dim 0 moves half the tensor
    result = grid.reshard(Layout(Shard(0), Shard(1)), Layout(Shard(0), R), SHAPE, ITEM)
    assert steps(result) == [("all_gather", (1,), NBYTES / 2)]
    assert result.time == grid.all_gather(NBYTES / 2, 1)


def test_partial_to_replicate_is_an_all_reduce(line, grid):
    result = line.reshard(Layout(P), Layout(R), SHAPE, ITEM)
    assert steps(result) == [("all_reduce", (0,), NBYTES)]
    assert result.time == line.all_reduce(NBYTES, 0)
    result = grid.reshard(Layout(Shard(0), P), Layout(Shard(0), R), SHAPE, ITEM)
    assert result.time == grid.all_reduce(NBYTES / 2, 1)


def test_partial_to_shard_is_a_reduce_scatter(line, grid):
    result = line.reshard(Layout(P), Layout(Shard(0)), SHAPE, ITEM)
    assert steps(result) == [("reduce_scatter", (0,), NBYTES)]
    assert result.time == line.reduce_scatter(NBYTES, 0)
    result = grid.reshard(Layout(R, P), Layout(R, Shard(1)), SHAPE, ITEM)
    assert result.time == grid.reduce_scatter(NBYTES, 1)


def test_shard_to_other_shard_is_an_all_to_all(line, grid):
    # each device holds NBYTES / 4 and keeps a quarter of it: nccl-tests' per-rank buffer
    result = line.reshard(Layout(Shard(0)), Layout(Shard(1)), SHAPE, ITEM)
    assert steps(result) == [("all_to_all", (0,), NBYTES / 4)]
    assert result.time == line.all_to_all(NBYTES / 4, 0)
    result = grid.reshard(Layout(Shard(1), Shard(0)), Layout(Shard(1), Shard(1)), SHAPE, ITEM)
    assert steps(result) == [("all_to_all", (1,), NBYTES / 2 / 4)]


def test_shard_to_partial_is_a_free_zero_pad(line):
    # Each device pads its shard with zeros to the full shape: the pieces sum to the tensor.
    # It is the adjoint of R -> S(d), the gradient of a slice.
    result = line.reshard(Layout(Shard(0)), Layout(P), SHAPE, ITEM)
    assert [s.kind for s in result.steps] == ["pad"]
    assert result.time == 0.0


def test_all_reduce_runs_before_all_gather_while_the_tensor_is_small(grid):
    # [S(0), P] -> [R, R]: all-reduce over tp on the half dp still shards, then gather dp
    result = grid.reshard(Layout(Shard(0), P), Layout(R, R), SHAPE, ITEM)
    assert steps(result) == [("all_reduce", (1,), NBYTES / 2), ("all_gather", (0,), NBYTES)]
    assert result.time == pytest.approx(grid.all_reduce(NBYTES / 2, 1) + grid.all_gather(NBYTES, 0))


def test_slices_and_reduce_scatters_come_first(grid):
    # [P, R] -> [S(0), S(1)]: slice over tp first, so the reduce-scatter over dp is 1/4 size
    result = grid.reshard(Layout(P, R), Layout(Shard(0), Shard(1)), SHAPE, ITEM)
    assert steps(result) == [("slice", (1,), 0.0), ("reduce_scatter", (0,), NBYTES / 4)]


def test_same_transition_on_two_axes_is_one_collective_per_axis_as_the_runtime_runs_it(grid):
    # [P, P] -> [R, R]: the runtime all-reduces over one axis, then the other, and so it is
    # priced; the hierarchical form over both (cheaper) is not what runs
    result = grid.reshard(Layout(P, P), Layout(R, R), SHAPE, ITEM)
    assert steps(result) == [("all_reduce", (0,), NBYTES), ("all_reduce", (1,), NBYTES)]
    assert result.time == grid.all_reduce(NBYTES, 0) + grid.all_reduce(NBYTES, 1)
    assert result.time > grid.all_reduce(NBYTES, (0, 1))


def test_reshard_is_cached(grid):
    src, dst = Layout(Shard(0), Shard(1)), Layout(R, R)
    grid.reshard(src, dst, SHAPE, ITEM)
    hits = reshard_cost.cache_info().hits
    grid.reshard(Layout(Shard(0), Shard(1)), Layout(R, R), SHAPE, ITEM)
    assert reshard_cost.cache_info().hits == hits + 1


def test_bad_layouts_are_refused(line):
    from autopar_plans.errors import UsageError

    with pytest.raises(UsageError, match="placements"):
        line.reshard(Layout(R, R), Layout(R), SHAPE, ITEM)
    with pytest.raises(UsageError, match="dim 2"):
        line.reshard(Layout(Shard(2)), Layout(R), SHAPE, ITEM)
