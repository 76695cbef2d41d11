"""Planning under a gradient-reduction policy (``autopar_plans.reduction``): the options and
the hint key that set it, what they refuse, the form the planner resolves, and what the
plan's ledger and memory charge for compression and local SGD."""

from __future__ import annotations

import warnings

import pytest

import autopar
from autopar_examples.models import build
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
