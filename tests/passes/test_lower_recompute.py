"""Recompute regions, wrapped in checkpoints, keep less and compute the same."""

from __future__ import annotations

import torch
from torch import nn

import autopar
from autopar.testing.simulate import _set
from autopar_examples.models import build
from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_recompute import Recompute, wrap_recompute
from autopar_passes.lower_spmd import lower_spmd
from autopar_passes.trace import trace
from autopar_plans.plan import RecomputeRegion


def one_device_program(name: str, limit_fraction: float):
    """A plan on one device whose memory limit forces recomputation, and its program with
    the model's weights as leaves."""
    torch.manual_seed(0)
    model, inputs = build(name, batch_size=8)
    mesh = autopar.Mesh((1,), device="cpu")
    roomy = autopar.plan(model, mesh, inputs, microbatches=1)
    memory = roomy.estimate.memory_per_device_bytes
    limit = memory.total - (1 - limit_fraction) * memory.activations
    plan = autopar.plan(model, mesh, inputs, memory_limit=limit, microbatches=1)
    traced = trace(model, inputs)
    layouts = PlanLayouts(traced, plan)
    lowered = lower_spmd(traced, layouts.strategy, layouts.layout, mesh, (0,))
    root = nn.Module()
    params = dict(model.named_parameters(remove_duplicate=False))
    leaves = {}
    for target, param_name in lowered.params.items():
        value = params[param_name].detach()
        if param_name in traced.reshaped:
            value = value.reshape(traced.reshaped[param_name][1])
        leaves[param_name] = value.clone().requires_grad_(True)
        _set(root, target, leaves[param_name])
    for target, buffer in lowered.buffers.items():
        _set(root, target, dict(model.named_buffers())[buffer])
    program = torch.fx.GraphModule(root, lowered.graph)
    return plan, program, inputs, leaves


def saved_and_grads(program, inputs, leaves):
    seen: dict[int, int] = {}
    live = {t.untyped_storage().data_ptr() for t in leaves.values()}
    live |= {t.untyped_storage().data_ptr() for t in inputs}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in live:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (out,) = program(*inputs)
    out.float().pow(2).mean().backward()
    return sum(seen.values()), {n: t.grad.clone() for n, t in leaves.items()}


def test_wrapped_regions_save_less_and_give_the_same_gradients():
    for name in ("gpt-tiny", "llama-tiny"):
        plan, program, inputs, leaves = one_device_program(name, 0.5)
        assert plan.recompute, f"{name}: the limit should call for recomputation"
        plain_saved, plain_grads = saved_and_grads(program, inputs, leaves)
        for leaf in leaves.values():
            leaf.grad = None
        assert wrap_recompute(program, plan.recompute) > 0
        assert "recompute_" in program.code
        saved, grads = saved_and_grads(program, inputs, leaves)
        assert saved < plain_saved
        # the plan's account of what recomputation frees, against what autograd keeps less
        freed = sum(region.saved_bytes for region in plan.recompute)
        assert abs((plain_saved - saved) - freed) <= 0.1 * plain_saved
        for key, grad in plain_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-7)


def test_a_recomputed_batch_norm_updates_its_running_statistics_once():
    """A region of a ResNet recomputed in backward runs its ops twice; the writes of the
    batch norms' running statistics stay outside it, so the statistics after one step are
    one forward's, as on a model that recomputes nothing."""
    torch.manual_seed(0)
    reference, inputs = build("resnet-tiny", batch_size=8)
    plan, program, _, _ = one_device_program("resnet-tiny", 0.8)
    assert plan.recompute, "the limit should call for recomputation"
    assert wrap_recompute(program, plan.recompute) > 0
    regions = [m for m in program.modules() if isinstance(m, Recompute)]
    assert regions and not any("copy_" in region.body.code for region in regions)
    (out,) = program(*inputs)
    out.float().pow(2).mean().backward()
    reference(*inputs)  # its own buffers: one forward's update
    state = dict(program.named_buffers())
    for name, buffer in reference.named_buffers():
        target = name.replace(".", "_")
        found = [value for key, value in state.items() if key.endswith(target) or key == name]
        assert found, name
        torch.testing.assert_close(found[0], buffer, rtol=1e-5, atol=1e-7)


def test_a_pipeline_stage_input_named_after_a_region_op_stays_an_input():
    """A later stage's input is a placeholder named after the op that made it on the stage
    before (the last op of a recomputed layer there): it is not a region op to wrap."""
    graph = torch.fx.Graph()
    carried = graph.placeholder("add_4")  # the stage before's layer output
    doubled = graph.call_function(torch.mul, (carried, 2.0))
    graph.output(doubled)
    program = torch.fx.GraphModule(nn.Module(), graph)
    region = RecomputeRegion(name="layers[1] full", kind="full", nodes=("add_4",))
    assert wrap_recompute(program, [region]) == 0
    assert [n.op for n in program.graph.nodes] == ["placeholder", "call_function", "output"]
    assert program(torch.ones(2)).tolist() == [2.0, 2.0]
