"""The hint file's schema: YAML in, validated hints out, every error naming file and line."""

from __future__ import annotations

import pytest

from autopar_plans import HintError
from autopar_plans.hints import (
    BAN_KINDS,
    Hints,
    as_hints,
    closest_names,
    hints_from_dict,
    hints_from_text,
    load_hints,
    name_matches,
)

DESIGN_EXAMPLE = """\
mesh: {shape: [2, 4], axes: [dp, tp]}
shard:
  "layers.*.attn.q_proj.weight": [tp, null]     # split dim 0 over tp
  "layers.*.mlp.down_proj.weight": [null, tp]
  "lm_head.weight": [[dp, tp], null]
replicate: ["embed_tokens.weight"]
pipeline: {stages: 4, schedule: 1f1b, microbatches: 16}
no_recompute: ["layers.*.mlp"]
memory_limit: 60GiB
ban:
  dp: [tensor_parallel, fsdp]
"""


def test_the_design_example_reads_with_every_line():
    hints = hints_from_text(DESIGN_EXAMPLE, "hints.yaml")
    assert hints.mesh is not None and hints.mesh.shape == (2, 4)
    assert hints.shard["lm_head.weight"] == (("dp", "tp"), None)
    assert hints.pipeline is not None and hints.pipeline.stage_count == 4
    assert hints.memory_limit_bytes == 60 * 2**30
    assert [str(h) for h in hints.items()] == [
        'hints.yaml:3: shard "layers.*.attn.q_proj.weight": [tp, null]',
        'hints.yaml:4: shard "layers.*.mlp.down_proj.weight": [null, tp]',
        'hints.yaml:5: shard "lm_head.weight": [[dp, tp], null]',
        'hints.yaml:6: replicate "embed_tokens.weight"',
        "hints.yaml:7: pipeline: {stages: 4, schedule: 1f1b, microbatches: 16}",
        'hints.yaml:8: no_recompute "layers.*.mlp"',
        "hints.yaml:9: memory_limit: 60GiB",
        "hints.yaml:11: ban dp: tensor_parallel",
        "hints.yaml:11: ban dp: fsdp",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("shard:\n  x: [tp, 3]\n", "h.yaml:2: shard.x: 3 is not a spec entry"),
        ("shard:\n  x: tp\n", "h.yaml:2: shard.x: 'tp' is not a spec"),
        ("ban:\n  dp: [tensor]\n", "h.yaml:2: ban.dp.0: Input should be 'tensor_parallel'"),
        ("sharding: {}\n", "h.yaml:1: 'sharding' is not a hint; did you mean shard?"),
        ("\n\npipeline: {stages: 2, cuts: [0, 4, 8]}\n", "h.yaml:3: pipeline: stages: 2 but"),
        ("pipeline: {cuts: [0, 4, 4]}\n", "must increase"),
        ("pipeline:\n  schedule: zigzag\n", "h.yaml:2: pipeline.schedule"),
        ("pipeline: {schedule: 1f1b, chunks: 2}\n", "chunks: 2 needs schedule: interleaved"),
        ("memory_limit: lots\n", "h.yaml:1: memory_limit: memory size 'lots'"),
        ("shard: [1]\n", "h.yaml:1: shard: Input should be a valid dictionary"),
        ("shard:\n  x: [tp]\n  x: [dp]\n", "h.yaml:3: 'x' is written twice (first on line 2)"),
        ("shard: {x: [tp]\n", "h.yaml:2: not valid YAML"),
        ("- a\n- b\n", "h.yaml: a hint file holds a mapping"),
        ("replicate: ['']\n", "h.yaml:1: replicate: a name pattern must not be empty"),
    ],
)
def test_bad_hints_name_file_and_line(text, expected):
    with pytest.raises(HintError) as error:
        hints_from_text(text, "h.yaml")
    assert expected in str(error.value)


def test_cuts_start_at_layer_zero():
    hints = hints_from_text("pipeline: {cuts: [8, 16, 24]}\n")
    assert hints.pipeline is not None
    assert hints.pipeline.cuts == (0, 8, 16, 24)
    assert hints.pipeline.stage_count == 4


def test_empty_file_is_no_hints():
    assert hints_from_text("# nothing yet\n").items() == []


def test_hints_from_files_dicts_and_models(tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text("replicate:\n  - norm.weight\n")
    loaded = load_hints(path)
    assert str(loaded.items()[0]) == f'{path}:2: replicate "norm.weight"'
    assert as_hints(str(path)).replicate == ("norm.weight",)
    assert as_hints({"replicate": ["a"]}).where("replicate", 0) == "<hints>"
    made = Hints(replicate=("a",))
    assert as_hints(made) is made
    assert hints_from_dict(made) is made
    with pytest.raises(HintError, match="no such hint file"):
        load_hints(tmp_path / "missing.yaml")
    with pytest.raises(HintError, match="got int"):
        as_hints(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("layers.*.attn.q_proj.weight", "layers.11.attn.q_proj.weight", True),
        ("layers.*.weight", "layers.0.attn.q_proj.weight", False),  # * stays in a component
        ("layers.**.weight", "layers.0.attn.q_proj.weight", True),
        ("**", "anything.at.all", True),
        ("**.weight", "weight", False),
        ("layers.?.mlp", "layers.3.mlp", True),
        ("layers.?.mlp", "layers.13.mlp", False),
        ("layers.*.attn.[qkv]_proj.weight", "layers.0.attn.k_proj.weight", True),
        ("layers.*.attn.[!qk]_proj.weight", "layers.0.attn.k_proj.weight", False),
        ("layers.*.attn.[!qk]_proj.weight", "layers.0.attn.v_proj.weight", True),
        ("lm_head.weight", "lm_head.weight2", False),  # the whole name
        ("a+b.weight", "a+b.weight", True),  # regex characters are literal
    ],
)
def test_glob_matching(pattern, name, matches):
    assert name_matches(pattern, name) is matches


def test_closest_names_collapse_layer_numbers_for_globs():
    names = [f"layers.{i}.attn.q_proj.weight" for i in range(8)] + ["norm.weight"]
    assert closest_names("layers.*.attn.q_prj.weight", names)[0] == "layers.*.attn.q_proj.weight"
    assert closest_names("layers.3.attn.q_prj.weight", names)[0] == "layers.3.attn.q_proj.weight"


def test_every_ban_kind_is_documented():
    assert set(BAN_KINDS) == {"tensor_parallel", "fsdp", "sequence_parallel", "data_parallel"}
    assert all(len(text) > 40 for text in BAN_KINDS.values())
