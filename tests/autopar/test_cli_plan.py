"""``autopar plan``, ``codegen`` and ``demo`` through a subprocess, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autopar_plans import Plan, load_plan


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autopar", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_plan_prints_json_that_validates_against_the_schema():
    result = run(
        "plan",
        "gpt-tiny",
        "--mesh",
        "2x2",
        "--axes",
        "dp,tp",
        "--device",
        "cpu",
        "--format",
        "json",
    )
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate(json.loads(result.stdout))
    assert plan.mesh.axis_names == ("dp", "tp")
    assert set(plan.params) >= {"wte.weight", "layers.1.mlp.fc.weight"}


def test_plan_table_and_file(tmp_path):
    path = tmp_path / "plan.yaml"
    result = run(
        "plan",
        "llama-tiny",
        "--cluster",
        "2x4",
        "--device",
        "h100-sxm",
        "--global-batch",
        "4",
        "-o",
        str(path),
    )
    assert result.returncode == 0, result.stderr
    assert "parallelism" in result.stdout and "memory / device" in result.stdout
    plan = load_plan(path)
    assert plan.mesh.shape == (2, 4) and plan.mesh.axis_names == ("node", "gpu")
    assert plan.global_batch == 4


@pytest.mark.parametrize("style", ["dp", "tp+sp"])
def test_forced_style_from_the_shell(style):
    result = run(
        "plan",
        "gpt-tiny",
        "--mesh",
        "2",
        "--device",
        "cpu",
        "--force",
        style,
        "--config",
        "batch_size=4",
        "--format",
        "json",
    )
    assert result.returncode == 0, result.stderr
    parallelism = json.loads(result.stdout)["parallelism"]
    assert parallelism["dp" if style == "dp" else "sp"] == 2


def test_codegen_prints_one_ranks_code_with_its_collectives():
    result = run(
        "codegen",
        "gpt-tiny",
        "--mesh",
        "2x2",
        "--axes",
        "dp,tp",
        "--device",
        "h100-sxm",
        "--rank",
        "3",
        "--stages",
        "1",  # one program (a pipeline plan prints one per stage: test_stage_split.py)
    )
    assert result.returncode == 0, result.stderr
    assert "rank 3 at mesh coordinates {'dp': 1, 'tp': 1}" in result.stdout
    assert "def forward(self, idx)" in result.stdout
    assert "torch.ops.aten.linear.default" in result.stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["plan", "gpt-tiny", "--mesh", "2x0"], 2, "positive integer"),
        (["plan", "gpt-tiny", "--mesh", "2x2", "--axes", "dp,dp"], 2, "repeated"),
        (["plan", "gpt-tiny", "--mesh", "2", "--device", "b200"], 2, "h100-sxm"),
        (["plan", "gpt2-124m", "--mesh", "2", "--memory", "1MiB"], 3, "per device"),
        (["plan", "gpt-tiny", "--mesh", "2", "--memory", "lots"], 2, "80GiB"),
        # gpt-tiny's example batch of 2 sequences cannot be split over 8 data-parallel ranks
        (["plan", "gpt-tiny", "--mesh", "2x4", "--force", "dp"], 3, "output 2x16x3x32"),
        (["codegen", "gpt-tiny", "--mesh", "2", "--rank", "5"], 2, "ranks 0..1"),
    ],
)
def test_bad_input_gets_one_message_and_an_exit_code(args, code, message):
    result = run(*args)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multirank
def test_demo_trains_on_four_ranks_next_to_single_device():
    result = run("demo", "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert "training loss, single device vs autopar" in result.stdout
    assert "parallelism" in result.stdout
