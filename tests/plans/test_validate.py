"""Each rule of ``autopar_plans.validate``: a plan that breaks it is refused with the file,
the parameter (or op) and what is wrong; plans the planner makes pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autopar_plans import (
    Estimate,
    Layout,
    MemoryBreakdown,
    MeshSpec,
    OpPlan,
    Parallelism,
    ParamPlan,
    Partial,
    Plan,
    PlanFileError,
    Replicate,
    Shard,
    Stage,
    dump_plan,
    save_plan,
)
from autopar_plans.validate import (
    check_plan,
    check_plan_against,
    load_checked_plan,
    plan_problems,
)

R = Replicate()
MESH = MeshSpec((2, 2), ("dp", "tp"))


def param(
    shape: tuple[int, ...], layout: Layout, grad: Layout | None = None, opt: Layout | None = None
) -> ParamPlan:
    return ParamPlan(
        shape=shape, dtype="float32", param=layout, grad=grad or layout, optimizer=opt or layout
    )


def make_plan(**changes: Any) -> Plan:
    """A consistent plan on dp=2 x tp=2: a column-parallel weight with ZeRO-2 over dp."""
    fields: dict[str, Any] = {
        "model": "mlp-tiny",
        "mesh": MESH,
        "global_batch": 8,
        "microbatch_size": 4,
        "parallelism": Parallelism(dp=2, tp=2, zero=2, microbatches=2),
        "estimate": Estimate(
            step_time_s=0.1,
            flops_per_step=1e9,
            mfu=0.3,
            comm_bytes_per_step=1e6,
            memory_per_device_bytes=MemoryBreakdown(total=1e6),
        ),
        "params": {
            "fc.weight": param(
                (64, 16),
                Layout(R, Shard(0)),
                grad=Layout(Shard(1), Shard(0)),
                opt=Layout(Shard(1), Shard(0)),
            ),
            "fc.bias": param((64,), Layout(R, Shard(0))),
        },
        "ops": {
            "linear": OpPlan(
                op="aten.linear.default",
                strategy="RS,RR->RS",
                output=Layout(Shard(0), Shard(1)),
                inputs=(Layout(Shard(0), R), Layout(R, Shard(0)), None),
            )
        },
    }
    fields.update(changes)
    return Plan(**fields)


def with_param(**params: ParamPlan) -> Plan:
    return make_plan(params=params)


def refused(plan: Plan) -> str:
    with pytest.raises(PlanFileError) as caught:
        check_plan(plan, "plan.json")
    message = str(caught.value)
    assert message.startswith("plan.json: ")
    assert "\n" not in message  # one line
    return message


def test_a_consistent_plan_passes():
    assert plan_problems(make_plan()) == []
    check_plan(make_plan(), "plan.json")


def test_more_placements_than_mesh_axes():
    message = refused(with_param(w=param((8, 8), Layout(R, R, Shard(0)))))
    assert "'w'" in message
    assert "3 placements" in message and "2 axes (dp, tp)" in message


def test_fewer_placements_than_mesh_axes_in_the_optimizer_state():
    message = refused(with_param(w=param((8, 8), Layout(R, R), opt=Layout(R))))
    assert "optimizer-state layout [R] has 1 placements" in message


def test_an_ops_layout_with_another_axis_count():
    op = OpPlan(op="aten.relu.default", strategy="R->R", output=Layout(R), inputs=(Layout(R),))
    message = refused(make_plan(ops={"relu": op}))
    assert "op 'relu': output" in message


def test_an_ops_input_with_another_axis_count():
    op = OpPlan(
        op="aten.relu.default", strategy="R->R", output=Layout(R, R), inputs=(Layout(R, R, R),)
    )
    assert "op 'relu': input 0" in refused(make_plan(ops={"relu": op}))


def test_a_dim_out_of_range():
    message = refused(with_param(b=param((64,), Layout(R, Shard(1)))))
    assert "'b'" in message and "shards dim 1" in message and "dims 0..0" in message


def test_63_rows_over_2_devices():
    message = refused(with_param(w=param((63, 16), Layout(Shard(0), R))))
    assert "splits dim 0 (size 63) 2 ways over mesh axis 'dp'" in message
    assert "does not divide" in message


def test_a_dim_sharded_by_more_than_it_has():
    message = refused(with_param(w=param((1, 16), Layout(R, Shard(0)))))
    assert "splits dim 0 (size 1) 2 ways" in message


def test_divisibility_counts_every_axis_that_shards_the_dim():
    """6 rows split by dp (3 each), then by tp: 3 does not split in 2."""
    message = refused(with_param(w=param((6, 4), Layout(Shard(0), Shard(0)))))
    assert "size 6, 3 per piece already" in message and "'tp'" in message
    assert plan_problems(with_param(w=param((8, 4), Layout(Shard(0), Shard(0))))) == []


def test_an_uneven_zero_state_is_refused_too():
    message = refused(
        with_param(w=param((64, 15), Layout(R, Shard(0)), opt=Layout(Shard(1), Shard(0))))
    )
    assert "optimizer-state layout" in message and "size 15" in message


def test_a_partial_parameter():
    message = refused(with_param(w=param((8, 8), Layout(Partial(), R))))
    assert "partial over mesh axis 'dp'" in message


def test_the_optimizer_state_is_a_piece_of_the_parameters_shard():
    w = param((8, 8), Layout(R, Shard(0)), opt=Layout(R, Shard(1)))
    message = refused(with_param(w=w))
    assert "the parameter is S(0) on mesh axis 'tp' but its optimizer-state layout is S(1)" in (
        message
    )


def test_the_gradient_lies_as_the_parameter_or_as_the_optimizer_state():
    w = param((8, 8), Layout(R, R), grad=Layout(Shard(1), R), opt=Layout(Shard(0), R))
    assert "neither the parameter's" in refused(with_param(w=w))


def test_the_global_batch_is_microbatches_times_their_size():
    message = refused(make_plan(global_batch=6))
    assert "global_batch 6 is not microbatches x microbatch_size (2 x 4 = 8)" in message


def test_stage_ranks_on_the_mesh():
    stages = (Stage(index=0, layers=(0, 1), ranks=(0, 1, 2, 7)),)
    assert "ranks [7], outside the mesh's 4 devices" in refused(make_plan(stages=stages))


def test_a_parameter_on_a_stage_the_plan_lacks():
    stages = (Stage(index=0, layers=(0, 1)), Stage(index=1, layers=(2, 3)))
    w = param((8, 8), Layout(R, R)).model_copy(update={"stage": 2})
    message = refused(make_plan(stages=stages, params={"w": w}))
    assert "'w' is on pipeline stage 2, but the plan has 2 stages" in message


def test_layouts_are_read_on_the_stage_mesh():
    """With pipeline stages, dp=2 is cut into stages of dp=1: a dim of 3 splits 'over' it."""
    inner = MeshSpec((1, 2), ("dp", "tp"))
    plan = make_plan(stage_mesh=inner, params={"w": param((3, 8), Layout(Shard(0), Shard(1)))})
    assert plan_problems(plan) == []
    assert "size 3" in refused(plan.model_copy(update={"stage_mesh": None}))


def test_a_stage_mesh_with_other_axes():
    inner = MeshSpec((1, 2), ("pp", "tp"))
    assert "stage_mesh has axes ['pp', 'tp']" in refused(make_plan(stage_mesh=inner))


def test_a_stage_mesh_larger_than_the_mesh():
    inner = MeshSpec((4, 2), ("dp", "tp"))
    assert "larger than the mesh" in refused(make_plan(stage_mesh=inner))


def test_every_problem_is_counted_on_the_one_line():
    bad = param((8, 8), Layout(R, R, R))
    message = refused(with_param(a=bad, b=bad, c=bad))
    assert "'a'" in message and message.endswith("(and 2 more problems)")


def test_an_old_plan_file_without_grad_reduction_loads_and_passes(tmp_path: Path):
    data = json.loads(dump_plan(make_plan()))
    del data["grad_reduction"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_checked_plan(path).params.keys() == {"fc.weight", "fc.bias"}


def test_load_checked_plan_names_the_file(tmp_path: Path):
    path = tmp_path / "bad.json"
    save_plan(with_param(w=param((63, 16), Layout(Shard(0), R))), path)
    with pytest.raises(PlanFileError, match=r"bad\.json: parameter 'w'"):
        load_checked_plan(path)


# ---- against the mesh and the model ------------------------------------------------------


def against(plan: Plan, **given: Any) -> str:
    with pytest.raises(PlanFileError) as caught:
        check_plan_against(plan, "plan.json", **given)
    return str(caught.value)


def test_the_mesh_it_was_made_for():
    check_plan_against(make_plan(), "plan.json", mesh=MeshSpec((2, 2), ("dp", "tp"), device="cpu"))
    message = against(make_plan(), mesh=MeshSpec((4,), ("dp",)))
    assert "made for the mesh dp=2 x tp=2 (4 devices), not dp=4 (4 devices)" in message


def test_the_mesh_axis_names_it_was_made_for():
    message = against(make_plan(), mesh=MeshSpec((2, 2), ("x", "y")))
    assert "not x=2 x y=2" in message


MODEL = {"fc.weight": (64, 16), "fc.bias": (64,)}


def test_the_model_it_was_made_for():
    check_plan_against(make_plan(), "plan.json", params=MODEL)


def test_a_parameter_the_model_lacks():
    message = against(make_plan(), params={"fc.weights": (64, 16), "fc.bias": (64,)})
    assert "parameter 'fc.weight' is not in the model (did you mean 'fc.weights'?)" in message
    assert "'mlp-tiny'" in message


def test_a_parameter_the_plan_lacks():
    message = against(make_plan(), params={**MODEL, "head.weight": (4, 64)})
    assert "the plan has no layout for parameter 'head.weight'" in message


def test_a_parameter_of_another_shape():
    message = against(make_plan(), params={"fc.weight": (32, 16), "fc.bias": (64,)})
    assert "'fc.weight' has shape (32, 16) in the model but (64, 16) in the plan" in message


def test_a_tied_parameters_other_name_is_known():
    tied = make_plan().params["fc.weight"].model_copy(update={"aliases": ("head.weight",)})
    plan = make_plan(params={"fc.weight": tied, "fc.bias": make_plan().params["fc.bias"]})
    check_plan_against(plan, "plan.json", params={**MODEL, "head.weight": (64, 16)})
