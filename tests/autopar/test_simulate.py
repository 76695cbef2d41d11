"""Every rank's lowered program, run together in one process with simulated collectives,
reassembles to the single-device values at every node (forward), across models, meshes,
hardware presets and forced styles. Fast (no processes), so it sweeps wide; the real-rank
tests (``tests/autopar/runtime``) cover backward and the runtime."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.testing.simulate import first_mismatch
from autopar_examples.models import build
from autopar_passes.trace import trace

CASES = [
    (model, shape, device, style)
    for model in ("gpt-tiny", "llama-tiny", "mlp-tiny")
    for shape, device, style in [
        ((2, 2), "h100-sxm", None),
        ((2, 2), "cpu", "tp+sp"),
        ((2, 2), "cpu", "fsdp"),
        ((2, 2, 2), "h100-sxm", None),
        ((2, 2, 2), "cpu", "tp+sp"),
        ((4, 2), "a100-80gb-sxm", None),
    ]
] + [("moe-tiny", (2,), "cpu", None), ("moe-tiny", (2, 2), "h100-sxm", None)]


@pytest.mark.parametrize(
    ("model", "shape", "device", "style"),
    CASES,
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_every_node_reassembles_to_the_single_device_value(model, shape, device, style):
    torch.manual_seed(0)
    module, inputs = build(model, batch_size=8)
    with torch.no_grad():  # biases start at zero, which would hide a misplaced bias
        for param in module.parameters():
            param.add_(0.1 * torch.randn_like(param))
    mesh = autopar.Mesh(shape, device=device)
    plan = autopar.plan(module, mesh, inputs, force=style)
    traced = trace(module, inputs)
    assert first_mismatch(traced, plan, module, inputs) is None


def test_the_simulator_finds_a_wrong_layout():
    """Tamper with one op's recorded output layout: the simulation points at it."""
    module, inputs = build("mlp-tiny", batch_size=8)
    mesh = autopar.Mesh((2,), device="cpu")
    plan = autopar.plan(module, mesh, inputs, force="dp")
    traced = trace(module, inputs)
    from autopar_passes.from_plan import PlanLayouts

    layouts = PlanLayouts(traced, plan)
    layouts.layouts[("linear_1", 0)] = autopar.Layout(autopar.Replicate())  # a lie
    from autopar.testing import simulate as sim

    original = sim.PlanLayouts
    sim.PlanLayouts = lambda t, p: layouts  # type: ignore[assignment]
    try:
        found = first_mismatch(traced, plan, module, inputs)
    finally:
        sim.PlanLayouts = original  # type: ignore[assignment]
    assert found is not None and found[0] == "linear_1"
