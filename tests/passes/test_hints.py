"""Hints on a traced model: every check, the constraints in the ILP, conflicts named, and the
example hint files honoured by the plans they steer."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar_examples.models import build
from autopar_passes.hints import hint_constraint, resolve_hints
from autopar_passes.pipeline.search import PipelineRequest
from autopar_passes.solve import SolveRequest
from autopar_passes.strategies.graph import NodeChoices
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel, trace
from autopar_plans import HintError, InfeasiblePlanError, MeshSpec, Plan
from autopar_plans.hints import HintConflictError, Hints, hints_from_text, load_hints
from autopar_plans.offload import offload_request
from autopar_plans.placement import Layout, Partial, Replicate, Shard, format_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hints"
MESH = MeshSpec((2, 2), ("dp", "tp"), device="h100-sxm")


@pytest.fixture(scope="module")
def llama() -> TracedModel:
    model, inputs = build("llama-tiny", device="meta")
    return trace(model, inputs)


def plan_hinted(
    traced: TracedModel,
    mesh: MeshSpec,
    hints: Hints,
    *,
    global_batch: int | None = None,
    stages: int | None = None,
    memory_limit: float = 80e9,
) -> Plan:
    """What ``autopar.api._plan`` does with ``hints=``: resolve, then plan through them."""
    resolved = resolve_hints(hints, traced, mesh)
    batch = next(
        int(n.meta["val"].shape[0]) for n in traced.graph.nodes if n.name in traced.user_inputs
    )
    request = PipelineRequest(
        SolveRequest(mesh, memory_limit, time_limit=60.0, offload=offload_request(hints.offload)),
        global_batch or batch,
        batch,
        "test",
        stages,
    )
    return resolved.plan(traced, request)


def spec(plan: Plan, name: str) -> str:
    param = plan.params[name]
    mesh = plan.stage_mesh or plan.mesh
    return format_spec(param.param, mesh.axis_names, len(param.shape))


# ---- checks against the model -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'shard:\n  "layers.*.attn.q_prj.weight": [tp, null]\n',
            'h.yaml:2: shard "layers.*.attn.q_prj.weight": [tp, null]: matches no parameter '
            "or module; closest: layers.*.attn.q_proj.weight",
        ),
        (
            "replicate:\n  - emb_tokens.weight\n",
            'h.yaml:2: replicate "emb_tokens.weight": matches no parameter or module; '
            "closest: embed_tokens.weight",
        ),
        (
            'shard:\n  "layers.*.attn.q_proj.weight": [tpp, null]\n',
            "unknown mesh axis 'tpp'; did you mean tp? (the mesh's axes are dp, tp)",
        ),
        (
            'shard:\n  "layers.*.attn.q_proj.weight": [tp, null, null]\n',
            'h.yaml:2: shard "layers.*.attn.q_proj.weight": [tp, null, null]: the spec has 3 '
            "entries but layers.0.attn.q_proj.weight has 2 dims (shape [64, 64]): dim 2 is "
            "out of range",
        ),
        (
            'shard:\n  "layers.*.attn.q_proj": [null, null, null, tp]\n',
            "the output of layers.0.attn.q_proj (linear) has 3 dims",
        ),
        ('shard:\n  "lm_head.weight": [tp, tp]\n', "mesh axis 'tp' is used twice"),
        ("ban:\n  node: [fsdp]\n", "h.yaml:2: ban node: fsdp: unknown mesh axis 'node'"),
        ("mesh:\n  shape: [4, 2]\n", "h.yaml:2: the hints are for a mesh of shape [4, 2]"),
        ("mesh: {axes: [data, tp]}\n", "h.yaml:1: the hints name the mesh axes ['data', 'tp']"),
        ("pipeline:\n  stages: 4\n", "h.yaml:2: 4 pipeline stages but the model has 2 layers"),
        ("pipeline: {cuts: [0, 3]}\n", "cut at layer 3, but the model's layers are 0..1"),
        ("recompute: [layers.*.mpl]\n", "matches no module; closest: layers.*.mlp"),
    ],
)
def test_hints_that_do_not_fit_the_model_name_file_line_and_closest_names(llama, text, expected):
    with pytest.raises(HintError) as error:
        resolve_hints(hints_from_text(text, "h.yaml"), llama, MESH)
    assert expected in str(error.value)


def test_a_size_the_axis_does_not_divide(llama):
    mesh = MeshSpec((2, 3), ("dp", "tp"), device="h100-sxm")
    text = 'shard:\n  "layers.*.attn.k_proj.weight": [tp, null]\n'
    with pytest.raises(HintError) as error:
        resolve_hints(hints_from_text(text, "h.yaml"), llama, mesh)
    assert (
        'h.yaml:2: shard "layers.*.attn.k_proj.weight": [tp, null]: dim 0 of '
        "layers.0.attn.k_proj.weight (shape [32, 64]) has size 32, which tp (3) does not "
        "divide into 3 equal pieces"
    ) in str(error.value)


def test_with_the_stages_fixed_a_layout_need_only_divide_a_stages_mesh(llama):
    """Two stages of a 4 x 2 mesh are 2 x 2 each: the batch of 2 splits over a stage's dp
    (Megatron's 530B run: 35 stages of 315 nodes, dp over a stage's 9), though not over
    the whole mesh's 4."""
    mesh = MeshSpec((4, 2), ("dp", "tp"), device="h100-sxm")
    shard = 'shard:\n  "layers.*.mlp.down_proj": [dp]\n'
    with pytest.raises(HintError, match="dp \\(4\\) does not divide into 4 equal pieces"):
        resolve_hints(hints_from_text(shard, "h.yaml"), llama, mesh)
    hints = hints_from_text(shard + "pipeline: {stages: 2}\n", "h.yaml")
    resolved = resolve_hints(hints, llama, mesh)
    (target, *_) = next(iter(resolved.targets.values()))
    assert format_spec(target.layout, mesh.axis_names, 3) == "[dp, None, None]"
    plan = plan_hinted(llama, mesh, hints, global_batch=8, stages=2)
    assert plan.parallelism.pp == 2


def test_pipeline_stages_must_cut_the_mesh_into_blocks(llama):
    mesh = MeshSpec((3, 2), ("pp", "tp"), device="h100-sxm")
    with pytest.raises(HintError, match="2 pipeline stages do not cut the mesh"):
        resolve_hints(hints_from_text("pipeline: {stages: 2}\n"), llama, mesh)


def test_globs_resolve_to_parameters_first_then_module_outputs(llama):
    text = (
        'shard:\n  "layers.*.mlp.up_proj.weight": [tp]\n'  # short spec: the rest is null
        '  "layers.*.mlp.up_proj": [dp, null, tp]\n'
    )
    resolved = resolve_hints(hints_from_text(text), llama, MESH)
    weights, outputs = resolved.targets.values()
    assert [t.label for t in weights] == [
        "layers.0.mlp.up_proj.weight",
        "layers.1.mlp.up_proj.weight",
    ]
    assert weights[0].layout == Layout(Replicate(), Shard(0))
    assert not weights[0].partial_ok
    assert [t.label for t in outputs] == [
        "the output of layers.0.mlp.up_proj (linear_5)",
        "the output of layers.1.mlp.up_proj (linear_12)",
    ]
    assert outputs[0].layout == Layout(Shard(0), Shard(2)) and outputs[0].partial_ok


def test_tied_parameters_match_by_every_name():
    model, inputs = build("gpt-tiny", device="meta")
    traced = trace(model, inputs)
    tied = [info for info in traced.params.values() if info.aliases]
    assert tied, "gpt-tiny ties its embedding and head"
    alias = tied[0].aliases[0]
    text = f'shard:\n  "{alias}": [dp]\n'
    resolved = resolve_hints(hints_from_text(text), traced, MESH)
    (targets,) = resolved.targets.values()
    assert {t.node for t in targets} == set(tied[0].nodes)


# ---- constraints ----------------------------------------------------------------------------


def _param_choices(shape: tuple[int, ...]) -> NodeChoices:
    return NodeChoices("p", "param", [], [])


def test_a_layout_on_a_grouped_mesh_holds_only_when_the_group_places_its_axes_alike(llama):
    mesh = MeshSpec((2, 2, 2), ("a", "b", "c"), device="h100-sxm")
    text = 'shard:\n  "norm.weight": [[a, b]]\n'
    resolved = resolve_hints(hints_from_text(text), llama, mesh)
    (hint,) = resolved.targets
    node = resolved.targets[hint][0].node
    choices = _param_choices((64,))

    def allows(on: MeshSpec, groups, layout: Layout) -> bool:
        rule = hint_constraint(resolved, hint, on, groups)
        return rule(node, choices, Strategy((), (layout,)))

    ab_c = mesh.model_copy(update={"shape": (4, 2), "axis_names": ("a_b", "c")})
    assert allows(ab_c, ((0, 1), (2,)), Layout(Shard(0), Replicate()))
    assert not allows(ab_c, ((0, 1), (2,)), Layout(Replicate(), Replicate()))
    a_bc = mesh.model_copy(update={"shape": (2, 4), "axis_names": ("a", "b_c")})
    # b and c placed differently: no layout of the grouping "b_c" is the hinted one
    assert not allows(a_bc, ((0,), (1, 2)), Layout(Shard(0), Shard(0)))
    assert not allows(a_bc, ((0,), (1, 2)), Layout(Shard(0), Replicate()))
    assert allows(mesh, ((0,), (1,), (2,)), Layout(Shard(0), Shard(0), Replicate()))


def test_bans_are_predicates_on_strategies(llama):
    text = "ban:\n  tp: [tensor_parallel, data_parallel, fsdp]\n"
    resolved = resolve_hints(hints_from_text(text), llama, MESH)
    tp, dp_ban, fsdp = resolved.items
    groups = ((0,), (1,))
    rule = {h.ban: hint_constraint(resolved, h, MESH, groups) for h in (tp, dp_ban, fsdp)}
    linear = next(n for n, op in resolved.weighted.items() if n.startswith("linear"))
    op = NodeChoices(linear, "op", [], [])
    column = Strategy((Layout(Shard(0), Replicate()), Layout(Replicate(), Shard(0))), ())
    batch = Strategy((Layout(Replicate(), Shard(0)), Layout(Replicate(), Replicate())), ())
    row = Strategy((Layout(Replicate(), Shard(2)), Layout(Replicate(), Shard(1))), ())
    assert not rule["tensor_parallel"](linear, op, column)
    assert not rule["tensor_parallel"](linear, op, row)
    assert rule["tensor_parallel"](linear, op, batch)
    assert not rule["data_parallel"](linear, op, batch)
    assert rule["data_parallel"](linear, op, column)
    param = NodeChoices("p", "param", [], [])
    assert not rule["fsdp"]("p", param, Strategy((), (Layout(Replicate(), Shard(0)),)))
    assert rule["fsdp"]("p", param, Strategy((), (Layout(Shard(0), Replicate()),)))


def test_module_outputs_accept_a_pending_sum_where_the_spec_says_null(llama):
    text = 'shard:\n  "layers.*.mlp.down_proj": [dp]\n'
    resolved = resolve_hints(hints_from_text(text), llama, MESH)
    (hint,) = resolved.targets
    target = resolved.targets[hint][0]
    rule = hint_constraint(resolved, hint, MESH, ((0,), (1,)))
    choices = NodeChoices(target.node, "op", [], [])
    assert rule(target.node, choices, Strategy((), (Layout(Shard(0), Partial()),)))
    assert rule(target.node, choices, Strategy((), (Layout(Shard(0), Replicate()),)))
    assert not rule(target.node, choices, Strategy((), (Layout(Replicate(), Partial()),)))


# ---- plans that honour the examples ---------------------------------------------------------


def test_megatron_example_gives_megatron_tensor_parallelism(llama):
    hints = load_hints(EXAMPLES / "megatron.yaml")
    plan = plan_hinted(llama, MESH, hints)
    for name in plan.params:
        if name.startswith("layers.") and name.endswith("_proj.weight"):
            (pattern,) = [p for p in hints.shard if p.endswith(name.split(".", 2)[2])]
            assert (
                spec(plan, name)
                == "[" + ", ".join(str(e) if e else "None" for e in hints.shard[pattern]) + "]"
            ), name
    assert spec(plan, "layers.0.attn.q_proj.weight") == "[tp, None]"
    assert spec(plan, "layers.1.mlp.down_proj.weight") == "[None, tp]"
    for op in plan.ops.values():
        if op.module.startswith("layers.") and op.op == "aten.linear.default":
            assert op.output[0] == Shard(0), op  # the batch over dp
    assert (plan.parallelism.dp, plan.parallelism.tp, plan.parallelism.pp) == (2, 2, 1)


def test_fsdp_example_shards_every_parameter_and_the_batch():
    model, inputs = build("llama-tiny", device="meta", batch_size=4)
    traced = trace(model, inputs)
    mesh = MeshSpec((4,), ("dp",), device="h100-sxm")
    plan = plan_hinted(traced, mesh, load_hints(EXAMPLES / "fsdp.yaml"))
    assert all(p.param == Layout(Shard(0)) for p in plan.params.values())
    assert plan.parallelism.dp == 4 and plan.parallelism.zero == 3
    assert plan.parallelism.tp == 1 and plan.parallelism.pp == 1


def test_pipeline_example_has_four_stages():
    model, inputs = build("llama-tiny", device="meta", n_layer=4)
    traced = trace(model, inputs)
    mesh = MeshSpec((4, 2), ("pp", "tp"), device="h100-sxm")
    plan = plan_hinted(traced, mesh, load_hints(EXAMPLES / "pipeline.yaml"), global_batch=8)
    assert plan.parallelism.pp == 4 and plan.parallelism.schedule == "1f1b"
    assert len(plan.stages) == 4
    assert [s.layers for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_hinted_stages_may_cut_inside_the_inner_axis():
    """Four stages on 2 x 4: both rows of the outer axis, then halves of the inner one;
    the stage's devices are a 1 x 2 block and the plan's layouts are on it."""
    model, inputs = build("llama-tiny", device="meta", n_layer=4)
    traced = trace(model, inputs)
    mesh = MeshSpec((2, 4), ("node", "gpu"), device="h100-sxm")
    plan = plan_hinted(traced, mesh, load_hints(EXAMPLES / "pipeline.yaml"), global_batch=8)
    assert plan.parallelism.pp == 4
    assert plan.stage_mesh is not None and plan.stage_mesh.shape == (1, 2)
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_explicit_cuts_fix_the_stages():
    model, inputs = build("llama-tiny", device="meta", n_layer=4)
    traced = trace(model, inputs)
    mesh = MeshSpec((2, 1), ("pp", "tp"), device="h100-sxm")
    hints = hints_from_text("pipeline: {cuts: [0, 3], schedule: gpipe, microbatches: 4}\n")
    plan = plan_hinted(traced, mesh, hints, global_batch=8)
    assert [s.layers for s in plan.stages] == [(0, 2), (3, 3)]
    assert plan.parallelism.microbatches == 4 and plan.parallelism.schedule == "gpipe"


def test_microbatches_the_batch_cannot_take_name_the_line(llama):
    hints = hints_from_text("pipeline:\n  stages: 1\n  microbatches: 3\n", "h.yaml")
    with pytest.raises(HintError, match=r"h\.yaml:3: 3 microbatches do not divide"):
        plan_hinted(llama, MESH, hints, global_batch=4)


# ---- conflicts ------------------------------------------------------------------------------


def test_overlapping_globs_that_disagree_are_named_as_a_conflict(llama):
    text = (
        "shard:\n"
        '  "layers.*.attn.*.weight": [tp, null]\n'
        '  "layers.*.mlp.up_proj.weight": [tp, null]\n'
        '  "layers.*.attn.o_proj.weight": [null, tp]\n'
    )
    with pytest.raises(HintConflictError) as error:
        plan_hinted(llama, MESH, hints_from_text(text, "h.yaml"), stages=1)
    message = str(error.value)
    assert 'h.yaml:2: shard "layers.*.attn.*.weight": [tp, null]' in message
    assert 'h.yaml:4: shard "layers.*.attn.o_proj.weight": [null, tp]' in message
    assert "up_proj" not in message  # not part of the conflict
    assert "layers.0.attn.o_proj.weight" in message
    assert isinstance(error.value, InfeasiblePlanError)  # exit code 3 on the CLI


def test_an_output_layout_and_a_ban_that_forbids_it_conflict(llama):
    text = (
        'shard:\n  "layers.*.attn.q_proj": [dp, null, tp]\n'
        "ban:\n  tp: [sequence_parallel]\n  dp: [data_parallel]\n"
    )
    with pytest.raises(HintConflictError) as error:
        plan_hinted(llama, MESH, hints_from_text(text, "h.yaml"), stages=1)
    lines = str(error.value).splitlines()
    assert lines[1:3] == [
        '  h.yaml:2: shard "layers.*.attn.q_proj": [dp, null, tp]',
        "  h.yaml:5: ban dp: data_parallel",
    ]


def test_hints_that_together_exceed_the_memory_limit_are_named():
    model, inputs = build("mlp-tiny", device="meta")
    traced = trace(model, inputs)
    mesh = MeshSpec((4,), ("dp",), device="h100-sxm")
    text = (
        'memory_limit: 40KiB\nreplicate: ["**.weight"]\n'
        'shard:\n  "layers.0.bias": [dp]\npipeline: {stages: 1}\n'
    )
    with pytest.raises(HintConflictError) as error:
        plan_hinted(traced, mesh, hints_from_text(text, "h.yaml"))
    message = str(error.value)
    assert "h.yaml:1: memory_limit: 40KiB" in message
    assert 'h.yaml:2: replicate "**.weight"' in message
    assert "layers.0.bias" not in message
    assert "40.0 KiB per device" in message


def test_infeasible_without_the_hints_is_the_plain_error():
    model, inputs = build("mlp-tiny", device="meta")
    traced = trace(model, inputs)
    mesh = MeshSpec((4,), ("dp",), device="h100-sxm")
    hints = hints_from_text('replicate: ["layers.0.bias"]\npipeline: {stages: 1}\n')
    with pytest.raises(InfeasiblePlanError) as error:
        plan_hinted(traced, mesh, hints, memory_limit=1000.0)
    assert not isinstance(error.value, HintConflictError)
    assert "does not fit in 1000 B per device" in str(error.value)


@pytest.fixture(scope="module")
def whole_layers(llama: TracedModel) -> Plan:
    """llama-tiny with every layer recomputed by a hint, memory to spare."""
    return plan_hinted(llama, MESH, hints_from_text("recompute: [layers.*]\n"), stages=1)


def test_recompute_hints_force_the_layer_or_the_selective_region(llama, whole_layers):
    """Forced with memory to spare: the whole layer for ``layers.*``, the MLP's activation
    run for ``layers.*.mlp``; every copy, as the plan records."""
    whole = whole_layers
    assert {r.kind for r in whole.recompute} == {"full"}
    assert sorted(layer for r in whole.recompute for layer in r.layers) == [0, 1]
    assert whole.estimate.recompute_s > 0
    mlp = plan_hinted(llama, MESH, hints_from_text("recompute: [layers.*.mlp]\n"), stages=1)
    assert mlp.recompute and all(r.kind == "selective" for r in mlp.recompute)
    modules = {n.name: n.meta["autopar"].module for n in llama.graph.nodes if "autopar" in n.meta}
    for region in mlp.recompute:
        assert all(modules[n].startswith("layers.") and ".mlp" in modules[n] for n in region.nodes)
    free = plan_hinted(llama, MESH, hints_from_text("pipeline: {stages: 1}\n"))
    assert not free.recompute  # without the hint nothing is recomputed


def test_a_recomputing_plans_step_pays_its_recomputation(whole_layers):
    """The step is its parts: compute apart from recomputation, recomputation, exposed
    communication, bubble and the optimizer's step. The exposed figure the ledger replaces
    is what is left of the step after them: read off it with recomputation counted in
    neither, it had taken the recomputation with it (llama3-8b on 1x8: 4.4 s under its
    plan); counted in both, the parts exceeded the step."""
    e = whole_layers.estimate
    assert e.recompute_s > 0
    parts = e.compute_s + e.recompute_s + e.exposed_comm_s + e.bubble_s + e.optimizer_s
    assert e.step_time_s == pytest.approx(parts, rel=1e-9)


def test_no_recompute_hint_against_a_limit_only_recomputation_meets_is_a_conflict(llama):
    """On one device nothing can be sharded: a limit under the plain plan's memory calls for
    recomputation (one microbatch: no smaller ones either; no offload either), and
    forbidding it leaves no plan; the error names the hint."""
    one = MeshSpec((1,), ("dp",), device="h100-sxm")
    stages = hints_from_text("pipeline: {stages: 1, microbatches: 1}\noffload: none\n")
    memory = plan_hinted(llama, one, stages).estimate.memory_per_device_bytes
    limit = memory.total - 0.3 * memory.activations
    tight = plan_hinted(llama, one, stages, memory_limit=limit)
    assert any(r.kind == "full" for r in tight.recompute)
    hints = hints_from_text(
        "pipeline: {stages: 1, microbatches: 1}\noffload: none\nno_recompute: [layers.*]\n",
        "h.yaml",
    )
    with pytest.raises(HintConflictError, match=r'h\.yaml:3: no_recompute "layers\.\*"'):
        plan_hinted(llama, one, hints, memory_limit=limit)


def test_a_recompute_hint_on_some_of_identical_layers_is_refused():
    """Layers 2 and 3 of a 4-layer Llama are one class: planned together, so a hint takes
    both or neither. (Layer 0 computes the rotary table; layer 1 shares its decisions with
    2 and 3, but its casts follow layer 0's residual sum where theirs follow a layer of
    their class, so its region is a class of its own: ``Decisions.representatives``.)"""
    model, inputs = build("llama-tiny", device="meta", n_layer=4)
    traced = trace(model, inputs)
    hints = hints_from_text("recompute: [layers.2]\n", "h.yaml")
    with pytest.raises(HintError, match="takes 1 of the 2 identical layers"):
        plan_hinted(traced, MESH, hints, stages=1)
