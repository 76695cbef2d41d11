"""Offload as the planner's choice (``autopar_plans.offload``): where nothing else fits the
optimizer's states go to the host; a hint forces or forbids each kind; a device whose
memory is the host's is never offloaded unasked.

llama-tiny on two H100s (a tight limit stands in for a large model), bf16 mixed precision,
one microbatch.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.cli.render import offload_summary
from autopar_cost_model.hardware import dump_preset, load_preset
from autopar_examples.models import build
from autopar_plans import InfeasiblePlanError
from autopar_plans.errors import HintError, UsageError

OPTIONS = {"precision": "bf16_mixed", "stages": 1, "microbatches": 1}


@pytest.fixture(scope="module")
def gpt():
    model, inputs = build("llama-tiny", device="meta", batch_size=4)
    mesh = autopar.Mesh((2,), device="h100-sxm")
    # every state sharded over both devices: the least any plan without offload holds
    fsdp = autopar.plan(model, mesh, inputs, force="fsdp", offload="none", **OPTIONS)
    memory = fsdp.estimate.memory_per_device_bytes
    floor = memory.total - memory.activations
    return model, inputs, mesh, fsdp, floor


def test_where_only_offload_fits_the_plan_offloads_the_optimizer_and_says_so(gpt):
    model, inputs, mesh, fsdp, floor = gpt
    limit = 0.8 * floor  # below every sharding's model states
    with pytest.raises(InfeasiblePlanError, match=r"allowing offload to host memory"):
        autopar.plan(model, mesh, inputs, memory_limit=limit, offload="none", **OPTIONS)
    plan = autopar.plan(model, mesh, inputs, memory_limit=limit, **OPTIONS)
    assert plan.offload.optimizer
    memory = plan.estimate.memory_per_device_bytes
    assert memory.total <= limit * (1 + 1e-6)
    assert memory.optimizer == 0
    # the host holds at least what the device no longer does: the states and masters
    assert memory.host >= fsdp.estimate.memory_per_device_bytes.optimizer
    # slower than the plan with room: the step waits for the host link and the CPU's step
    assert plan.estimate.step_time_s > fsdp.estimate.step_time_s
    assert plan.estimate.offload_s > 0
    assert plan.estimate.optimizer_s > fsdp.estimate.optimizer_s
    copies = {(c.purpose, c.direction): c for c in plan.estimate.host}
    assert set(copies) == {("optimizer", "to_host"), ("optimizer", "to_device")}
    assert copies["optimizer", "to_host"].calls == len(plan.params)
    assert offload_summary(plan).startswith("optimizer states in host memory")


def test_with_room_nothing_is_offloaded(gpt):
    model, inputs, mesh, *_ = gpt
    plan = autopar.plan(model, mesh, inputs, **OPTIONS)
    assert not plan.offload.active
    assert plan.estimate.memory_per_device_bytes.host == 0 and not plan.estimate.host


def test_a_hint_forces_an_offload_with_room_to_spare_and_another_forbids_it(gpt):
    model, inputs, mesh, _, floor = gpt
    forced = autopar.plan(model, mesh, inputs, hints={"offload": {"activations": "on"}}, **OPTIONS)
    assert forced.offload.activations and not forced.offload.optimizer
    memory = forced.estimate.memory_per_device_bytes
    assert memory.activations == 0 < memory.host
    forbidden = {"offload": {"optimizer": "off", "activations": "off"}}
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(model, mesh, inputs, memory_limit=0.8 * floor, hints=forbidden, **OPTIONS)


def test_a_hint_and_an_option_that_disagree_are_refused(gpt):
    model, inputs, mesh, *_ = gpt
    with pytest.raises(HintError, match="offload"):
        autopar.plan(model, mesh, inputs, hints={"offload": "optimizer"}, offload="none", **OPTIONS)


def test_a_bad_offload_option_names_what_is_allowed(gpt):
    model, inputs, mesh, *_ = gpt
    with pytest.raises(UsageError, match="optimizer, activations"):
        autopar.plan(model, mesh, inputs, offload="weights", **OPTIONS)


def test_a_device_whose_memory_is_the_hosts_is_offloaded_only_when_told():
    """On the ``cpu`` preset the host is the device (``HostLink.shared``): offloading frees
    nothing, so a tight limit is met by recomputation and a forced offload still runs."""
    model, inputs = build("gpt-tiny", device="meta", batch_size=4)
    mesh = autopar.Mesh((1,), device="cpu")
    roomy = autopar.plan(model, mesh, inputs, stages=1, microbatches=1)
    memory = roomy.estimate.memory_per_device_bytes
    limit = memory.total - 0.5 * memory.activations
    tight = autopar.plan(model, mesh, inputs, memory_limit=limit, stages=1, microbatches=1)
    assert not tight.offload.active and tight.recompute
    forced = autopar.plan(model, mesh, inputs, offload="optimizer", stages=1, microbatches=1)
    assert forced.offload.optimizer


def test_forced_recomputation_and_forced_activation_offload_exclude_each_other(gpt):
    model, inputs, mesh, *_ = gpt
    hints = {"recompute": ["layers.*"], "offload": "activations"}
    with pytest.raises(UsageError, match="recomputes activations"):
        autopar.plan(model, mesh, inputs, hints=hints, **OPTIONS)


def test_a_host_too_small_for_the_offloaded_state_is_refused_saying_how_much(gpt, tmp_path):
    """The node's host memory is shared by its devices: an offload plan whose host bytes per
    device exceed that share is no plan (here a node whose host holds one device's)."""
    model, inputs, mesh, _, floor = gpt
    needs = autopar.plan(model, mesh, inputs, memory_limit=0.8 * floor, **OPTIONS)
    host = needs.estimate.memory_per_device_bytes.host
    h100 = load_preset("h100-sxm")
    assert h100.host is not None
    small = h100.model_copy(
        update={
            "name": "h100-small-host",
            "host": h100.host.model_copy(update={"memory_bytes": host}),
        }
    )
    path = tmp_path / "h100-small-host.yaml"
    path.write_text(dump_preset(small))
    small_mesh = autopar.Mesh((2,), device=str(path))  # two devices share it: half each
    with pytest.raises(InfeasiblePlanError, match=r"of host memory per device where each"):
        autopar.plan(model, small_mesh, inputs, memory_limit=0.8 * floor, **OPTIONS)


def test_zero2_and_a_forced_optimizer_offload_exclude_each_other(gpt):
    model, inputs, mesh, *_ = gpt
    with pytest.raises(UsageError, match="zero=2 sums each microbatch"):
        autopar.plan(model, mesh, inputs, zero=2, offload="optimizer", **OPTIONS)


@pytest.fixture(scope="module")
def deep():
    """llama-tiny with eight layers (two layers' working copies in flight are a quarter of
    them, where two of two would be all) and the least states an offloaded optimizer
    leaves on the device: every parameter sharded over both, working copies and
    gradients."""
    model, inputs = build("llama-tiny", device="meta", batch_size=4, n_layer=8)
    mesh = autopar.Mesh((2,), device="h100-sxm")
    optimizer = autopar.plan(model, mesh, inputs, force="fsdp", offload="optimizer", **OPTIONS)
    memory = optimizer.estimate.memory_per_device_bytes
    return model, inputs, mesh, optimizer, memory.params + memory.grads


def test_where_only_parameter_offload_fits_the_plan_offloads_the_parameters_too(deep):
    """At a limit the optimizer's offload fills with its states alone (no plan without
    activations), the working copies go to the host as well."""
    model, inputs, mesh, optimizer, floor = deep
    plan = autopar.plan(model, mesh, inputs, memory_limit=floor, **OPTIONS)
    assert plan.offload.parameters and plan.offload.optimizer
    assert plan.parallelism.zero in (0, 3)  # no ZeRO-1/2 axes: FSDP layouts may shard
    memory = plan.estimate.memory_per_device_bytes
    assert memory.params == 0 and memory.optimizer == 0
    assert memory.total <= floor * (1 + 1e-6)
    # the host holds the masters, states and (mixed precision) the cast working copies
    assert memory.host > optimizer.estimate.memory_per_device_bytes.host
    # every microbatch waits for some of the fetches: slower than the optimizer's offload
    assert plan.estimate.step_time_s > optimizer.estimate.step_time_s
    assert offload_summary(plan).startswith("optimizer states and parameters in host memory")


def test_offloaded_parameters_leave_two_layers_working_copies_on_the_device(deep):
    model, inputs, mesh, optimizer, _ = deep
    plan = autopar.plan(model, mesh, inputs, force="fsdp", offload="parameters", **OPTIONS)
    assert plan.offload.parameters and plan.parallelism.zero == 3
    memory = plan.estimate.memory_per_device_bytes
    kept = optimizer.estimate.memory_per_device_bytes
    assert memory.params == 0 and memory.grads == kept.grads
    # what stays of the working copies: about two of the ten groups' (eight layers, the
    # embedding before and the head after), held with the activations
    transient = memory.activations - kept.activations
    assert 0 < transient < 0.5 * kept.params
    assert memory.total < kept.total


@pytest.mark.parametrize("zero", [1, 2])
def test_forced_parameter_offload_and_a_forced_zero_stage_exclude_each_other(gpt, zero):
    model, inputs, mesh, *_ = gpt
    with pytest.raises(UsageError, match=r"ZeRO stage 0 only.*force zero 0"):
        autopar.plan(model, mesh, inputs, zero=zero, offload="parameters", **OPTIONS)


def test_parameter_offload_without_the_optimizers_is_refused_saying_what_to_do(gpt):
    model, inputs, mesh, *_ = gpt
    wanted = {"parameters": "on", "optimizer": "off"}
    with pytest.raises(UsageError, match=r"needs the optimizer offloaded too"):
        autopar.plan(model, mesh, inputs, offload=wanted, **OPTIONS)
    with pytest.raises(HintError, match=r"needs the optimizer offloaded too"):
        autopar.plan(model, mesh, inputs, hints={"offload": wanted}, **OPTIONS)


def test_with_everything_offloaded_the_refusal_counts_no_activations_on_the_device(gpt):
    model, inputs, mesh, _, floor = gpt
    everything = {"optimizer": "on", "activations": "on", "parameters": "on"}
    with pytest.raises(InfeasiblePlanError) as refused:
        autopar.plan(model, mesh, inputs, memory_limit=0.01 * floor, offload=everything, **OPTIONS)
    message = str(refused.value)
    assert "activations dominate" not in message  # they are in host memory
    assert "already offloaded to host memory" in message
