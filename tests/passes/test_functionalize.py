"""In-place writes into an intermediate tensor, directly or through views, are made functional
(``autopar_passes.functionalize``): the planned model computes what the eager one does
whichever layouts the solver picks, and a write it cannot rewrite is refused plainly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.testing.simulate import simulated_value
from autopar_passes.strategies.inplace import mutates_first_input
from autopar_passes.trace import trace
from autopar_plans import UsageError


class WritesThroughViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h[:, :4].mul_(2)  # a slice
        h.add_(1)  # the tensor itself
        h[:, 2].sub_(0.5)  # a select
        h[1:3, 4:].copy_(torch.ones(2, 4))  # a slice of a slice; x[...] = y
        h.t()[0].add_(0.25)  # a row of the transpose
        h.view(4, 16)[1].mul_(0.5)  # a row of a reshape
        return self.b(torch.relu(h))


@pytest.mark.parametrize("force", [None, "dp", "tp"])
def test_the_plan_computes_what_eager_does(force: str | None) -> None:
    """Without the rewrite all three were off by about 0.5: later readers of ``h`` read
    a local tensor the write through the view had not reached."""
    torch.manual_seed(0)
    model, x = WritesThroughViews(), torch.randn(8, 8)
    traced = trace(model, (x,))
    plan = autopar.plan(model, autopar.Mesh((2, 2), device="cpu"), (x,), force=force)
    got = simulated_value(traced, plan, model, (x,), traced.user_outputs[0])
    assert got is not None
    torch.testing.assert_close(got, model(x.clone()), atol=1e-5, rtol=1e-5)


def test_no_write_into_an_intermediate_tensor_is_left() -> None:
    traced = trace(WritesThroughViews(), (torch.randn(8, 8),))
    assert not [
        node
        for node in traced.graph.nodes
        if node.op == "call_function" and mutates_first_input(node.target)
    ]
    targets = {str(node.target) for node in traced.graph.nodes}
    assert {"aten.slice_scatter.default", "aten.select_scatter.default"} <= targets


def test_a_write_through_another_view_is_refused_plainly() -> None:
    class WritesThroughADiagonal(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            h.diagonal().sub_(0.5)
            return h

    with pytest.raises(UsageError, match=r"through the view aten.diagonal.default .*out of place"):
        trace(WritesThroughADiagonal(), (torch.randn(4, 4),))


def test_a_view_taken_before_a_write_and_read_after_it_keeps_the_write_in_place() -> None:
    class ReadsAnOlderView(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            first = h[0]
            h.add_(1)
            return first * 3

    traced = trace(ReadsAnOlderView(), (torch.randn(4, 4),))
    assert "aten.add_.Tensor" in {str(node.target) for node in traced.graph.nodes}


def test_a_no_grad_block_is_inlined_and_its_result_detached() -> None:
    """Export wraps ``with torch.no_grad():`` in a call of a submodule, which no rule
    knows; inlined, its ops plan as any others, and what leaves it carries no gradient."""

    class NoGradInside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                weights = self.proj(x).softmax(-1)
            return (self.proj(x) * weights).sum()

    torch.manual_seed(0)
    model, x = NoGradInside(), torch.randn(4, 8)
    traced = trace(model, (x,))
    targets = [str(node.target) for node in traced.graph.nodes if node.op == "call_function"]
    assert "wrap_with_set_grad_enabled" not in " ".join(targets)
    assert targets.count("aten.detach.default") == 1
    plan = autopar.plan(model, autopar.Mesh((2,), device="cpu"), (x,), force="dp")
    assert not plan.warnings
    got = simulated_value(traced, plan, model, (x,), traced.user_outputs[0])
    torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)
