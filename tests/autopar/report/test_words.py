"""A plan said in words a person uses, and the plans no one would train with called out."""

from __future__ import annotations

import autopar
from autopar.report.words import cautions, plan_in_words
from autopar_examples.models import build
from autopar_plans.mesh import MeshSpec
from autopar_plans.plan import Parallelism, Plan


def with_(plan: Plan, batch: int = 64, microbatch: int = 8, **parallelism: object) -> Plan:
    p = Parallelism(**{"microbatches": batch // microbatch, **parallelism})  # type: ignore[arg-type]
    return plan.model_copy(
        update={
            "parallelism": p,
            "global_batch": batch,
            "microbatch_size": microbatch,
            "mesh": MeshSpec((2, 8), ("node", "gpu"), gpus_per_node=8),
            "stage_mesh": None,
        }
    )


def test_a_planned_mesh_has_one_role_per_axis(planned: Plan) -> None:
    roles = planned.parallelism.axis_roles
    assert len(roles) == 2 and set(roles) <= {"", "data", "tensor", "mixed", "data+tensor"}
    words = plan_in_words(planned)
    for name, role in zip(planned.mesh.axis_names, roles, strict=True):
        assert (f"({name})" in words) == bool(role)


def test_megatron_layout_in_words(planned: Plan) -> None:
    plan = with_(planned, dp=2, tp=8, sp=8, zero=3, axis_roles=("data", "tensor"))
    assert plan_in_words(plan) == (
        "data parallel 2 across nodes (node) x tensor parallel 8 inside nodes (gpu), "
        "sequence parallel between the tensor-parallel matmuls; FSDP (parameters, gradients "
        "and optimizer states split); 8 microbatches of 8 sequences accumulated"
    )
    assert cautions(plan) == []


def test_an_axis_that_does_two_things_says_both(planned: Plan) -> None:
    plan = with_(planned, microbatch=16, dp=16, ep=8, axis_roles=("data", "data+expert"))
    assert "data parallel and expert parallel 8 inside nodes (gpu)" in plan_in_words(plan)


def test_a_plan_without_axis_roles_says_its_degrees(planned: Plan) -> None:
    plan = with_(planned, dp=2, tp=8, pp=1)
    assert plan_in_words(plan).startswith("data parallel 2 x tensor parallel 8;")


def test_one_sequence_over_a_mesh_is_no_way_to_train(planned: Plan) -> None:
    plan = with_(planned, batch=1, microbatch=1, dp=16, axis_roles=("data", "data"))
    (caution,) = cautions(plan)
    assert "one sequence a step spread over 16 devices" in caution
    assert "--global-batch" in caution
    assert "data parallel over tokens" in plan_in_words(plan)


def test_a_microbatch_smaller_than_data_parallelism_is_called_out(planned: Plan) -> None:
    plan = with_(planned, batch=64, microbatch=4, dp=16, axis_roles=("data", "data"))
    (caution,) = cautions(plan)
    assert "each microbatch of 4 sequences is split over 16 data-parallel devices" in caution
    assert "at least 16 sequences" in caution
    assert cautions(with_(planned, batch=64, microbatch=16, dp=16)) == []


def test_sequence_parallelism_counts_the_ops_it_splits_by_sequence() -> None:
    """Megatron's tensor and sequence parallelism forced on llama-tiny: the residual stream
    between the tensor-parallel matmuls is split by sequence, and the words count those ops;
    a plan that splits nothing says every device runs the whole model."""
    model, inputs = build("llama-tiny", device="meta", batch_size=8)
    mesh = autopar.Mesh.cluster(nodes=2, gpus_per_node=2, device="h100-sxm")
    forced = autopar.plan(model, mesh, inputs, stages=1, force="tp+sp")
    ops = forced.parallelism.sequence_split_ops
    assert ops > 0 and forced.parallelism.sp == 2
    assert f"activations split by sequence in {ops} ops" in plan_in_words(forced)
    unsplit = forced.model_copy(
        update={"parallelism": Parallelism(axis_roles=("", "")), "stage_mesh": None}
    )
    assert plan_in_words(unsplit) == "every device runs the whole model"
