"""The decompose pass: a mean cross-entropy becomes sum / count, with the same loss and
gradients on real tensors, and the exported program around it still runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar_passes.decompose import decompose_for_sharding

aten = torch.ops.aten
N, C, D = 8, 5, 3
CLASS_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)


class CrossEntropy(nn.Module):
    def __init__(self, weighted: bool, **options: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(4, C, dtype=torch.float64)
        self.options = options
        self.weighted = weighted

    def forward(self, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x).movedim(-1, 1)  # (N, C) or (N, C, D)
        w = weight if self.weighted else None
        return F.cross_entropy(logits, target, weight=w, **self.options) * 3.0


class NllLoss(nn.Module):
    def forward(
        self, logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        return F.nll_loss(torch.log_softmax(logits, dim=1), target, weight=weight, ignore_index=1)


def _inputs(
    extra_dim: bool, ignore_index: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (N, D) if extra_dim else (N,)
    x = torch.randn(*shape, 4, dtype=torch.float64, generator=generator)
    target = torch.randint(0, C, shape, generator=generator)
    target.view(-1)[::3] = ignore_index
    weight = torch.rand(C, dtype=torch.float64, generator=generator) + 0.5
    return x, target, weight


def _export(model: nn.Module, args: tuple[Any, ...]) -> torch.export.ExportedProgram:
    return torch.export.export(model, args, strict=False)


def _run(
    graph_module: torch.fx.GraphModule, model: nn.Module, args: tuple[Any, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and d loss / d x of the graph on real tensors (parameters lifted as inputs)."""
    x = args[0].clone().requires_grad_(True)
    params = [p.detach() for p in model.parameters()]
    (loss,) = graph_module(*params, x, *args[1:])
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def _mean_losses_left(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    left = []
    for node in graph_module.graph.nodes:
        if node.target in CLASS_LOSSES:
            reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
            if reduction == 1:
                left.append(node)
    return left


@pytest.mark.parametrize("extra_dim", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_rewritten_loss_and_gradients_match(
    extra_dim: bool, weighted: bool, smoothing: float, ignore_index: int
) -> None:
    model = CrossEntropy(weighted, ignore_index=ignore_index, label_smoothing=smoothing)
    args = _inputs(extra_dim, ignore_index)
    original = _export(model, args)
    rewritten = _export(model, args)
    assert decompose_for_sharding(rewritten.graph_module) == 1
    assert not _mean_losses_left(rewritten.graph_module)
    assert _mean_losses_left(original.graph_module)
    for seed in range(3):
        fresh = _inputs(extra_dim, ignore_index, seed=seed)
        want_loss, want_grad = _run(original.graph_module, model, fresh)
        got_loss, got_grad = _run(rewritten.graph_module, model, fresh)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    # the exported program still runs: the output keeps its name in the signature
    torch.testing.assert_close(rewritten.module()(*args), model(*args), rtol=1e-12, atol=1e-12)


def test_nll_loss_is_rewritten_too() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(N, C, D, dtype=torch.float64, generator=generator)
    target = torch.randint(0, C, (N, D), generator=generator)
    target[0] = 1
    weight = torch.rand(C, dtype=torch.float64, generator=generator) + 0.5
    exported = _export(NllLoss(), (logits, target, weight))
    assert decompose_for_sharding(exported.graph_module) == 1
    assert not _mean_losses_left(exported.graph_module)
    # the loss is the graph's output: the division took its name, the signature still holds
    (output,) = exported.graph_module.graph.find_nodes(op="output")[0].args[0]
    assert output.target == aten.div.Tensor
    assert list(exported.graph_signature.user_outputs) == [output.name]
    got = exported.module()(logits, target, weight)
    want = NllLoss()(logits, target, weight)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_every_target_ignored_gives_nan_as_torch_does() -> None:
    model = CrossEntropy(False)
    x, target, weight = _inputs(False, -100)
    exported = _export(model, (x, target, weight))
    decompose_for_sharding(exported.graph_module)
    target = torch.full_like(target, -100)
    assert torch.isnan(model(x, target, weight))
    assert torch.isnan(exported.module()(x, target, weight))


def test_new_nodes_carry_val_module_stack_and_stack_trace() -> None:
    model = CrossEntropy(True, label_smoothing=0.1)
    args = _inputs(True, -100)
    exported = _export(model, args)
    graph = exported.graph_module.graph
    (loss,) = [n for n in graph.nodes if n.target == aten.cross_entropy_loss.default]
    name, stack, trace = loss.name, loss.meta["nn_module_stack"], loss.meta["stack_trace"]
    before = {n.name for n in graph.nodes}
    decompose_for_sharding(exported.graph_module)
    # run the rewritten graph on real tensors, recording each node's real output
    real: dict[str, torch.Tensor] = {}
    interpreter = torch.fx.Interpreter(exported.graph_module)
    original_run_node = interpreter.run_node

    def run_node(node: torch.fx.Node) -> Any:
        value = original_run_node(node)
        real[node.name] = value
        return value

    interpreter.run_node = run_node  # type: ignore[method-assign]
    interpreter.run(*[p.detach() for p in model.parameters()], *args)
    new = [n for n in graph.nodes if n.name not in before]
    assert len(new) >= 5
    for node in [*new, next(n for n in graph.nodes if n.name == name)]:
        val = node.meta["val"]
        assert val.shape == real[node.name].shape and val.dtype == real[node.name].dtype
        assert node.meta["nn_module_stack"] == stack
        assert node.meta["stack_trace"] == trace
    div = next(n for n in graph.nodes if n.name == name)
    assert div.target == aten.div.Tensor  # the rewritten node keeps its name and users
    outputs = graph.find_nodes(op="output")[0].args[0]
    assert list(exported.graph_signature.user_outputs) == [n.name for n in outputs]


def test_meta_device_graph_is_rewritten() -> None:
    model = CrossEntropy(False).to("meta")
    args = tuple(t.to("meta") for t in _inputs(True, -100))
    exported = _export(model, args)
    assert decompose_for_sharding(exported.graph_module) == 1
    for node in exported.graph_module.graph.nodes:
        if node.op == "call_function":
            assert node.meta["val"].device.type == "meta"


class Untouched(nn.Module):
    def forward(
        self, logits: torch.Tensor, target: torch.Tensor, soft: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return (
            F.cross_entropy(logits, target, reduction="sum"),
            F.cross_entropy(logits, target, reduction="none"),
            F.cross_entropy(logits, soft),  # probabilities: the count is static
            F.mse_loss(logits, soft),
        )


def test_other_reductions_and_probability_targets_are_left_alone() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(N, C, generator=generator)
    target = torch.randint(0, C, (N,), generator=generator)
    soft = torch.softmax(torch.randn(N, C, generator=generator), dim=1)
    exported = _export(Untouched(), (logits, target, soft))
    before = [(n.target, n.args) for n in exported.graph_module.graph.nodes]
    assert decompose_for_sharding(exported.graph_module) == 0
    assert [(n.target, n.args) for n in exported.graph_module.graph.nodes] == before


def test_ops_under_a_second_name_take_the_first_ones_rule() -> None:
    """``multiply``, ``view_as`` and ``expand_as`` become ``mul``, ``view`` and ``expand``
    (static shapes), so the planned model has a rule for each and computes the same."""
    import autopar
    from autopar.testing.simulate import first_mismatch
    from autopar_passes.trace import trace

    class SecondNames(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            bias = self.proj.bias.expand_as(h)
            return (h * torch.multiply(bias, 2)).view_as(x).sum()

    model, x = SecondNames(), torch.randn(4, 8)
    traced = trace(model, (x,))
    targets = {str(node.target) for node in traced.graph.nodes}
    assert not targets & {"aten.multiply.Tensor", "aten.view_as.default", "aten.expand_as.default"}
    plan = autopar.plan(model, autopar.Mesh((2,), device="cpu"), (x,), force="dp")
    assert not plan.warnings
    assert first_mismatch(traced, plan, model, (x,)) is None
