"""MeshSpec: validation with clear messages, and which axes cross nodes."""

import pytest

from autopar_plans import MeshSpec, UsageError, parse_mesh_shape


def test_mesh_describes_its_devices():
    mesh = MeshSpec((2, 4), ("dp", "tp"), device="a100-80gb-sxm")
    assert mesh.size == 8
    assert mesh.axis("tp") == 1
    assert mesh.axis_size("dp") == 2
    assert mesh.coordinates(5) == (1, 1)


@pytest.mark.parametrize(
    ("shape", "names", "message"),
    [
        ((2, 0), ("a", "b"), "positive integer"),
        ((-1,), ("a",), "positive integer"),
        ((2, 2), ("a", "a"), "repeated"),
        ((2, 2), ("a",), "one name per axis"),
        ((2,), ("not a name",), "identifier"),
        ((), (), "at least one axis"),
    ],
)
def test_bad_meshes_are_refused_with_a_reason(shape, names, message):
    with pytest.raises(UsageError, match=message):
        MeshSpec(shape, names)


def test_unknown_axis_lists_the_real_ones():
    with pytest.raises(UsageError, match=r"\['dp', 'tp'\]"):
        MeshSpec((2, 2), ("dp", "tp")).axis("pp")


def test_cluster_outer_axis_crosses_nodes_inner_does_not():
    mesh = MeshSpec.cluster(nodes=16, gpus_per_node=8)
    assert mesh.shape == (16, 8)
    assert mesh.crosses_nodes(0, 8)
    assert not mesh.crosses_nodes(1, 8)


def test_small_mesh_fits_in_one_node():
    mesh = MeshSpec((2, 4), ("dp", "tp"))
    assert not mesh.crosses_nodes(0, 8)
    assert not mesh.crosses_nodes(1, 8)
    # 4 x 4 on 8-GPU nodes: the outer axis pairs devices 8 apart, in different nodes.
    assert MeshSpec((4, 4), ("dp", "tp")).crosses_nodes(0, 8)


def test_parse_mesh_shape():
    assert parse_mesh_shape("8x8") == (8, 8)
    assert parse_mesh_shape("2,4") == (2, 4)
    with pytest.raises(UsageError, match="8x8"):
        parse_mesh_shape("eight")
    with pytest.raises(UsageError, match="positive"):
        parse_mesh_shape("0x2")


@pytest.mark.parametrize(
    ("shape", "stages", "stage_shape"),
    [
        ((4, 8), 1, (4, 8)),
        ((4, 8), 2, (2, 8)),  # across nodes: two nodes a stage
        ((4, 8), 4, (1, 8)),  # a node a stage
        ((4, 8), 8, (1, 4)),  # then inside the nodes: half a node a stage
        ((4, 8), 32, (1, 1)),
        ((1, 8), 2, (1, 4)),  # one node: only inside it
        ((2, 2, 4), 8, (1, 1, 2)),
        ((6,), 3, (2,)),
    ],
)
def test_pipeline_stages_are_blocks_of_consecutive_devices(shape, stages, stage_shape):
    mesh = MeshSpec(shape)
    stage = mesh.stage_mesh(stages)
    assert stage is not None and stage.shape == stage_shape
    assert stage.axis_names == mesh.axis_names  # every axis keeps its name, size 1 or not
    assert stages * stage.size == mesh.size


@pytest.mark.parametrize(
    ("shape", "stages"), [((4, 8), 3), ((4, 8), 64), ((6, 8), 4), ((1, 8), 16)]
)
def test_a_stage_count_that_is_no_block_of_the_mesh_has_no_stage_mesh(shape, stages):
    """4 stages of 6 x 8 would be 12 devices each: 1.5 rows of the outer axis, no sub-mesh."""
    assert MeshSpec(shape).stage_mesh(stages) is None


def test_stage_counts_list_the_cuts_up_to_the_layers():
    assert MeshSpec((4, 8)).stage_counts(10) == [1, 2, 4, 8]
    assert MeshSpec((1, 8)).stage_counts(0) == [1]
    message = MeshSpec((6, 8)).no_stage_cut(4, 10)
    assert "4 pipeline stages do not cut the mesh x=6 x y=8" in message
    assert "pick one of 1, 2, 3, 6" in message


def test_a_hand_off_crosses_nodes_only_at_a_node_edge():
    """Four stages on two nodes of 8: stage 0 hands to 1 inside node 0 (the inner axis),
    1 to 2 across nodes (the outer axis), and interleaving's wrap from 3 to 0 too."""
    mesh = MeshSpec.cluster(nodes=2, gpus_per_node=8)
    assert [mesh.handoff_axis(4, s) for s in range(4)] == [1, 0, 1, 0]
    assert [mesh.handoff_axis(2, s) for s in range(2)] == [0, 0]
