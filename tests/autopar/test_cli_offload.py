"""``autopar plan --offload`` and ``autopar explain PLAN offload``, as a user runs them."""

from __future__ import annotations

import json

import pytest

from autopar_plans import load_plan
from autopar_plans.units import format_bytes
from tests.autopar.test_cli_inspect import run


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory: pytest.TempPathFactory):
    """llama-tiny on two H100s with the optimizer forced to the host, as a plan file."""
    path = tmp_path_factory.mktemp("plans") / "offloaded.json"
    result = run(
        "plan", "llama-tiny", "--mesh", "2", "--device", "h100-sxm", "--stages", "1",
        "--offload", "optimizer", "-o", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return path, result.stdout


def test_the_summary_says_what_is_offloaded_and_what_it_costs(offloaded):
    path, stdout = offloaded
    plan = load_plan(path)
    assert plan.offload.optimizer and not plan.offload.activations
    words = " ".join(stdout.replace("│", " ").split())  # the table wraps its cells
    assert "offload optimizer states in host memory" in words
    assert "the optimizer steps on the CPU in" in words


def test_explain_offload_answers_from_the_plan_alone(offloaded):
    path, _ = offloaded
    result = run("explain", str(path), "offload", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {row["kind"]: row for row in report["rows"]}
    assert rows["optimizer"]["used"] and not rows["activations"]["used"]
    plan = load_plan(path)
    host = plan.estimate.memory_per_device_bytes.host
    assert rows["optimizer"]["host_bytes"] == pytest.approx(host)
    assert rows["optimizer"]["moved_bytes"] == pytest.approx(
        sum(c.bytes for c in plan.estimate.host)
    )
    # forced with room to spare, which the verdict says
    assert "would fit without it" in report["verdict"]
    table = run("explain", str(path), "offload")
    assert table.returncode == 0 and "frees on device" in table.stdout


def test_a_bad_offload_value_exits_2_naming_the_kinds():
    result = run("plan", "llama-tiny", "--mesh", "2", "--offload", "weights")
    assert result.returncode == 2
    assert "optimizer, activations" in result.stderr


def test_the_memory_views_show_what_each_device_keeps_in_host_memory(offloaded, tmp_path):
    path, stdout = offloaded
    host = load_plan(path).estimate.memory_per_device_bytes.host
    assert "in host memory" in " ".join(stdout.replace("│", " ").split())
    report = tmp_path / "report.html"
    result = run("show", str(path), "--report", str(report))
    assert result.returncode == 0, result.stderr
    page = report.read_text()
    assert "in host memory" in page and format_bytes(host) in page


def test_offload_parameters_forces_the_optimizers_too_and_explain_says_so(tmp_path):
    path = tmp_path / "parameters.json"
    result = run(
        "plan", "llama-tiny", "--mesh", "2", "--device", "h100-sxm", "--stages", "1",
        "--offload", "parameters", "-o", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = load_plan(path)
    assert plan.offload.parameters and plan.offload.optimizer
    assert plan.estimate.memory_per_device_bytes.params == 0
    words = " ".join(result.stdout.replace("│", " ").split())
    assert "offload optimizer states and parameters in host memory" in words
    explained = run("explain", str(path), "offload", "--format", "json")
    assert explained.returncode == 0, explained.stderr
    rows = {row["kind"]: row for row in json.loads(explained.stdout)["rows"]}
    assert rows["parameters"]["used"] and rows["optimizer"]["used"]
    assert rows["parameters"]["frees_bytes"] > 0
