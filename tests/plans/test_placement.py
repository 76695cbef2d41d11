"""Placements and layouts: the two spellings convert both ways; bad specs are refused."""

import pytest

from autopar_plans import (
    Layout,
    Partial,
    Replicate,
    Shard,
    UsageError,
    format_spec,
    layout_from_spec,
    parse_placement,
    spec_from_layout,
)

AXES = ("dp", "tp")


@pytest.mark.parametrize(
    ("spec", "layout"),
    [
        (["dp", None, "tp"], Layout(Shard(0), Shard(2))),
        ([None, None], Layout(Replicate(), Replicate())),
        (["tp", None], Layout(Replicate(), Shard(0))),
        ([("dp", "tp"), None], Layout(Shard(0), Shard(0))),
    ],
)
def test_spec_and_layout_convert_both_ways(spec, layout):
    assert layout_from_spec(spec, AXES) == layout
    back = spec_from_layout(layout, AXES, ndim=len(spec))
    assert [tuple(e) if isinstance(e, list) else e for e in back] == [
        tuple(e) if isinstance(e, list) else e for e in spec
    ]


def test_unknown_axis_names_the_mesh_axes():
    with pytest.raises(UsageError, match=r"unknown mesh axis 'pp'.*\['dp', 'tp'\]"):
        layout_from_spec(["pp", None], AXES)


def test_axis_used_twice_is_refused():
    with pytest.raises(UsageError, match="used twice"):
        layout_from_spec(["dp", "dp"], AXES)


def test_axes_on_one_dim_must_follow_mesh_order():
    with pytest.raises(UsageError, match="mesh order"):
        layout_from_spec([("tp", "dp")], AXES)


def test_partial_has_no_spec_spelling_but_displays():
    layout = Layout(Shard(1), Partial())
    with pytest.raises(UsageError, match="partial"):
        spec_from_layout(layout, AXES, ndim=2)
    assert format_spec(layout, AXES, 2) == "[None, dp] partial(tp)"


def test_placements_serialise_to_short_strings_and_back():
    layout = Layout(Shard(0), Partial())
    assert layout.model_dump() == ["S(0)", "P(sum)"]
    assert Layout.model_validate(["S(0)", "P(sum)"]) == layout
    assert parse_placement("R") == Replicate()
    with pytest.raises(ValueError, match="not a placement"):
        parse_placement("X(1)")


def test_local_shape_and_divisibility():
    layout = Layout(Shard(0), Shard(0))
    assert layout.local_shape((8, 6), (2, 4)) == (1, 6)
    assert layout.shard_factor((2, 4)) == 8
    assert layout.divides((8, 6), (2, 4))
    assert not layout.divides((6, 6), (2, 4))
    assert Layout(Shard(1), Replicate()).local_shape((8, 6), (2, 4)) == (8, 3)
