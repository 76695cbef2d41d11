"""Fitting ``in_step`` to the reference step (``autopar_passes.reference_step``): the factor at
which the cost model predicts the step in the seconds it took."""

from __future__ import annotations

import pytest
import torch

from autopar_cost_model import load_preset
from autopar_cost_model.hardware import DevicePreset, OpOverhead
from autopar_cost_model.reference_step import reference_step
from autopar_passes.reference_step import fit_in_step, predicted_reference_s


def _with_host_time() -> DevicePreset:
    """The shipped CPU preset with a calibrated machine's host time per op."""
    host = OpOverhead(forward=2.5e-6, backward=3.5e-6, asynchronous=False)
    return load_preset("cpu").model_copy(update={"op_overhead": host})


def test_the_fit_recovers_the_factor_a_step_was_predicted_at():
    cpu = _with_host_time()
    slower = cpu.model_copy(update={"in_step": 1.7})
    assert fit_in_step(cpu, predicted_reference_s(slower)) == pytest.approx(1.7)


def test_host_time_is_not_scaled():
    """On a CPU a step is host time per op plus kernel time; only the kernels' time is the
    op's figures measured alone, so only it scales (a step as fast as its host time alone
    fits a factor of 0)."""
    cpu = _with_host_time()
    no_kernels = predicted_reference_s(cpu.model_copy(update={"in_step": 1e-9}))
    assert no_kernels > 0
    assert fit_in_step(cpu, no_kernels) == pytest.approx(0.0, abs=1e-6)


def test_kernels_scale_with_in_step_and_host_time_does_not():
    cpu = _with_host_time()
    once = predicted_reference_s(cpu)
    twice = predicted_reference_s(cpu.model_copy(update={"in_step": 2.0}))
    assert once < twice < 2 * once


def test_the_reference_step_runs_alike_on_every_call():
    (model_a, x_a), (model_b, x_b) = (
        reference_step(torch.device("cpu")),
        reference_step(torch.device("cpu")),
    )
    torch.testing.assert_close(model_a(x_a), model_b(x_b), rtol=0, atol=0)
