"""The optimizer's step (``autopar_cost_model.optimizer``): memory-bound, the passes torch's foreach
implementations make over the values, and the host's time per op and tensor on a CPU."""

from __future__ import annotations

import pytest

from autopar_cost_model.hardware import OpOverhead
from autopar_cost_model.optimizer import STEP_TRAFFIC, optimizer_step_time
from autopar_plans.errors import UsageError


def test_adamw_streams_twenty_passes_of_its_values(make_preset):
    """AdamW (weight decay, the default 0.01): 20 tensor-sized reads and writes per value,
    fp32: 80 bytes a value at 2 TB/s (the synthetic preset, efficiency 1)."""
    preset = make_preset()
    assert optimizer_step_time(1e9, "adamw", 4, preset) == pytest.approx(80e9 / 2e12)
    # Adam without weight decay skips the parameters' scaling; SGD reads two, writes one
    assert optimizer_step_time(1e9, "adam", 4, preset) == pytest.approx(72e9 / 2e12)
    assert optimizer_step_time(1e9, "sgd", 4, preset) == pytest.approx(12e9 / 2e12)
    # under pure bf16 the masters and states are 2 bytes wide
    assert optimizer_step_time(1e9, "adamw", 2, preset) == pytest.approx(40e9 / 2e12)


def test_a_cpu_pays_its_op_overhead_per_tensor_and_foreach_op_an_accelerator_hides_it(
    make_preset,
):
    host = OpOverhead(forward=5e-6, backward=0.0, asynchronous=False)
    cpu = make_preset().model_copy(update={"op_overhead": host})
    streamed = 80e6 / 2e12
    ops = STEP_TRAFFIC["adamw"].ops
    assert optimizer_step_time(1e6, "adamw", 4, cpu, tensors=3) == pytest.approx(
        streamed + 3 * ops * 5e-6
    )
    gpu = make_preset().model_copy(
        update={"op_overhead": host.model_copy(update={"asynchronous": True})}
    )
    assert optimizer_step_time(1e6, "adamw", 4, gpu, tensors=3) == pytest.approx(streamed)


def test_nothing_to_step_costs_nothing_and_an_unknown_optimizer_is_refused(make_preset):
    assert optimizer_step_time(0, "adamw", 4, make_preset()) == 0.0
    with pytest.raises(UsageError, match="unknown optimizer 'lion'"):
        optimizer_step_time(1e6, "lion", 4, make_preset())
