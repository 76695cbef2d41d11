"""MeshSpec: validation with clear messages, and which axes cross nodes."""

import pytest

from plans import MeshSpec, UsageError, parse_mesh_shape


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
