"""Plans round-trip exactly through JSON and YAML; other versions and broken files are refused."""

import json

import pytest
import yaml

from autopar_plans import (
    PLAN_VERSION,
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
    RecomputeRegion,
    Replicate,
    Shard,
    SolverReport,
    Stage,
    dump_plan,
    load_plan,
    load_plan_text,
    save_plan,
)


@pytest.fixture
def plan() -> Plan:
    mesh = MeshSpec((2, 2), ("dp", "tp"), device="h100-sxm")
    return Plan(
        model="gpt:gpt_tiny",
        mesh=mesh,
        global_batch=8,
        microbatch_size=4,
        parallelism=Parallelism(dp=2, tp=2, sp=2, zero=1, microbatches=2, schedule="1f1b"),
        estimate=Estimate(
            step_time_s=0.123456789,
            flops_per_step=1.5e15,
            mfu=0.4213,
            comm_bytes_per_step=3.25e9,
            memory_per_device_bytes=MemoryBreakdown(
                params=1e9, grads=1e9, optimizer=1.5e8, activations=2.5e9, total=4.65e9
            ),
        ),
        params={
            "layers.0.mlp.fc.weight": ParamPlan(
                shape=(128, 32),
                dtype="float32",
                param=Layout(Replicate(), Shard(0)),
                grad=Layout(Replicate(), Shard(0)),
                optimizer=Layout(Shard(1), Shard(0)),
            )
        },
        ops={
            "linear_3": OpPlan(
                op="aten.linear.default",
                strategy="S(2)xS(1)->P",
                output=Layout(Shard(0), Partial()),
                inputs=(Layout(Shard(0), Shard(2)), Layout(Replicate(), Shard(1)), None),
                module="layers.0.mlp.proj",
                layer=0,
            )
        },
        stages=(Stage(index=0, layers=(0, 1), ranks=(0, 1, 2, 3)),),
        recompute=(RecomputeRegion(name="layers.*.attn.core", kind="selective", saved_bytes=1e6),),
        solver=SolverReport(
            backend="highs",
            status="optimal",
            time_s=0.5,
            variables=120,
            constraints=80,
            objective=0.1,
            gap=0.0,
        ),
    )


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_plan_round_trips_exactly(plan, fmt):
    text = dump_plan(plan, fmt)
    again = load_plan_text(text, fmt)
    assert again == plan
    assert dump_plan(again, fmt) == text


def test_json_is_stable_and_readable(plan):
    data = json.loads(dump_plan(plan, "json"))
    assert data["version"] == PLAN_VERSION
    assert data["ops"]["linear_3"]["output"] == ["S(0)", "P(sum)"]
    assert list(data) == sorted(data)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_and_load_files(plan, tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    save_plan(plan, path)
    assert load_plan(path) == plan


def test_another_version_is_refused_by_name(plan, tmp_path):
    data = json.loads(dump_plan(plan, "json"))
    data["version"] = PLAN_VERSION + 1
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=rf"future.json: plan version {PLAN_VERSION + 1}"):
        load_plan(path)


def test_missing_field_is_named(plan, tmp_path):
    data = yaml.safe_load(dump_plan(plan, "yaml"))
    del data["estimate"]["mfu"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanFileError, match=r"estimate\.mfu: Field required"):
        load_plan(path)


def test_not_a_plan_file(tmp_path):
    path = tmp_path / "junk.json"
    path.write_text("{ not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        load_plan(path)
    with pytest.raises(PlanFileError, match="no such plan file"):
        load_plan(tmp_path / "missing.json")
