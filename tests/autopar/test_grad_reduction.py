"""Planning under a gradient-reduction policy (``autopar_plans.reduction``): the options and
the hint key that set it, what they refuse, the form the planner resolves, and what the
plan's ledger and memory charge for compression and local SGD."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import autopar
from autopar.report.gradients import explain_gradients
from autopar_examples.models import build
from autopar_plans import load_plan, save_plan
from autopar_plans.errors import HintError, UsageError
from tests.autopar.runtime.features import make

CPU = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")


@pytest.fixture(scope="module")
def llama():
    model, inputs, _ = make("llama-tiny")
    return model, inputs


def _plan(llama, mesh=CPU, **options):
    model, inputs = llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, mesh, inputs, force="dp", **options)


def _sync(plan, phase=None):
    return [
        e
        for e in plan.estimate.comm
        if e.what.startswith(("gradient sync", "local SGD")) and phase in (None, e.phase)
    ]


def test_a_hint_file_sets_the_compression(llama) -> None:
    made = _plan(llama, hints={"grad_compression": {"scheme": "topk", "ratio": 0.1}})
    assert made.grad_reduction.compression.scheme == "topk"
    assert made.grad_reduction.compression.ratio == 0.1


def test_a_hint_and_an_option_that_disagree_are_refused(llama) -> None:
    with pytest.raises(HintError, match="grad_compression 'topk', but grad_compression="):
        _plan(llama, hints={"grad_compression": "topk"}, grad_compression="powersgd")


def test_an_unknown_scheme_is_refused_with_the_schemes(llama) -> None:
    with pytest.raises(UsageError, match="schemes: none, bf16, fp16, terngrad"):
        _plan(llama, grad_compression="zip")


def test_compression_and_a_forced_zero_stage_are_refused(llama) -> None:
    with pytest.raises(UsageError, match="zero=1 reduce-scatters them"):
        _plan(llama, grad_compression="powersgd", zero=1)


def test_local_sgd_plans_pure_data_parallelism_and_refuses_other_styles(llama) -> None:
    made = _plan(llama, sync="local_sgd", period=4)
    assert made.parallelism.dp == 4 and made.parallelism.zero == 0
    model, inputs = llama
    with pytest.raises(UsageError, match=r"sync='local_sgd' .* force='tp'"):
        autopar.plan(model, CPU, inputs, force="tp", sync="local_sgd")


def test_local_sgd_charges_the_averaging_once_a_period_and_no_gradient_sum(llama) -> None:
    every = _plan(llama, reduction_form="per_axis")
    local = _plan(llama, sync="local_sgd", period=4, reduction_form="per_axis")
    sums = _sync(every)
    averagings = _sync(local)
    assert all(e.period == 4 and e.phase == "step" for e in averagings)
    assert [(e.kind, e.axes, e.bytes_per_call) for e in averagings] == [
        (e.kind, e.axes, e.bytes_per_call) for e in sums
    ]
    assert sum(e.sent_per_step for e in averagings) == sum(e.sent_per_step for e in sums) / 4


def test_powersgd_sends_less_and_keeps_its_state_in_the_plans_memory(llama) -> None:
    plain = _plan(llama)
    compressed = _plan(llama, grad_compression="powersgd")
    sent = sum(e.sent_per_step for e in _sync(compressed))
    assert 0 < sent < sum(e.sent_per_step for e in _sync(plain)) / 4
    # summed after backward, not hidden by it
    assert any(e.phase == "step" and e.exposed_s == e.time_s for e in _sync(compressed))
    more = (
        compressed.estimate.memory_per_device_bytes.optimizer
        - plain.estimate.memory_per_device_bytes.optimizer
    )
    assert more > 0


def test_bf16_sums_halve_the_gradient_bytes(llama) -> None:
    plain = _plan(llama, reduction_form="per_axis")
    cast = _plan(llama, reduction_form="per_axis", grad_compression="bf16")
    assert {e.dtype for e in _sync(cast)} == {"bfloat16"}
    assert (
        sum(e.bytes_per_call for e in _sync(cast))
        == sum(e.bytes_per_call for e in _sync(plain)) / 2
    )


def test_the_hierarchical_form_is_chosen_across_nodes_and_sends_less_over_them(llama) -> None:
    cluster = autopar.Mesh.cluster(nodes=2, gpus_per_node=4, device="h100-sxm")
    eight = build("llama-tiny", batch_size=8, d_model=512, d_ff=1024, vocab_size=4096)
    auto = _plan(eight, cluster, zero=0)
    per_axis = _plan(eight, cluster, zero=0, reduction_form="per_axis")
    assert auto.grad_reduction.form == "hierarchical"
    assert auto.grad_reduction.axis_order[-1] == "node"  # the slow axis last
    node = cluster.axis_names.index("node")

    def over_nodes(plan):
        return sum(e.sent_per_step for e in _sync(plan) if e.axes == (cluster.axis_names[node],))

    assert over_nodes(auto) == pytest.approx(over_nodes(per_axis) / 4, rel=0.01)
    assert auto.estimate.step_time_s <= per_axis.estimate.step_time_s


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autopar", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def cluster_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-8B-wide layer planned data parallel on 2 nodes of 8 H100s with PowerSGD, by
    the CLI; its model name made unbuildable, so that only the plan can answer."""
    path = tmp_path_factory.mktemp("plans") / "powersgd.json"
    result = _cli(
        "plan", "llama3-8b", "--config", "n_layer=1", "batch_size=16", "seq_len=256",
        "--cluster", "2x8", "--device", "h100-sxm", "--precision", "bf16_mixed",
        "--force", "dp", "--zero", "0", "--stages", "1", "--grad-compression", "powersgd",
        "-o", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = load_plan(path)
    save_plan(plan.model_copy(update={"model": "no/such/model.py:nothing"}), path)
    return path


def test_the_cli_plans_with_the_compression_asked_for(cluster_plan) -> None:
    plan = load_plan(cluster_plan)
    assert plan.grad_reduction.compression.scheme == "powersgd"
    assert any("powersgd" in e.what for e in plan.estimate.comm)


def test_explain_gradients_weighs_each_policy_from_the_plan_alone(cluster_plan) -> None:
    result = _cli("explain", str(cluster_plan), "gradients", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {row["name"]: row for row in report["rows"]}
    planned = rows["as planned"]
    assert planned["planned"] and planned["state_bytes"] > 0  # PowerSGD's error feedback
    assert rows["local SGD H=4"]["sent_bytes"] > 0
    plan = load_plan(cluster_plan)
    sync = [e for e in plan.estimate.comm if e.what.startswith("gradient sync")]
    assert planned["sent_bytes"] == pytest.approx(sum(e.sent_per_step for e in sync))
    assert planned["exposed_s"] <= planned["comm_s"]
    assert "exposed" in report["verdict"]


def test_explain_gradients_says_when_backward_hides_the_sum() -> None:
    """Four 2048-token sequences a device: backward hides most of the sum, and sending fewer
    bytes cannot pay for the encoding or the exposed calls."""
    model, inputs = build("llama3-8b", device="meta", batch_size=64, n_layer=1, seq_len=2048)
    mesh = autopar.Mesh.cluster(nodes=2, gpus_per_node=8, device="h100-sxm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = autopar.plan(
            model, mesh, inputs, force="dp", zero=0, stages=1, precision="bf16_mixed"
        )
    report = explain_gradients(made)
    own = report.rows[0]
    assert own.planned and own.exposed_s < 0.25 * own.comm_s
    assert all(row.step_time_s > 0.99 * own.step_time_s for row in report.rows[1:])
    assert "backward hides most of it" in report.verdict and "keep the plan's" in report.verdict
    assert "bf16" not in [row.name for row in report.rows]  # bf16_mixed sums in bf16 already
    powersgd = next(row for row in report.rows if row.name.startswith("powersgd"))
    assert powersgd.sent_bytes < own.sent_bytes / 100  # it sends far less, and still loses
