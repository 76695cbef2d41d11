"""The output boundary's all-reduce skips its adjoint and is not waited for in forward
(``autopar_passes.rewrites.output_boundary``, ``runtime.pending``).

A data-parallel step with the loss inside the module runs, as DDP does, no collective in
backward but the gradient buckets; the one scalar all-reduce left is the loss's in forward
(every rank returns the global loss), launched there and waited for only when the loss is
read. Gradients are the single device's.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.testing.ranks import run_ranks
from autopar_examples.models import build
from autopar_passes.local_ops import scale_grad
from autopar_passes.lower_spmd import LoweredGraph
from autopar_passes.rewrites.output_boundary import skip_output_adjoints
from tests.autopar.runtime.collective_counts import counting


class _WithLoss(nn.Module):
    """A model and its mean token cross-entropy: the loss is computed inside."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _boundary_graph(
    axes: tuple[str, ...], factor: float, extra_user: bool = False
) -> tuple[LoweredGraph, torch.fx.Node]:
    """``scale_grad(all_reduce_<axes[-1]>(...all_reduce_<axes[0]>(x)), factor)`` as the
    output of a lowered graph; with ``extra_user`` the last all-reduce also feeds an op."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    collectives = {}
    for axis, name in enumerate(axes):
        value = graph.call_module(f"all_reduce_{name}", (value,))
        collectives[f"all_reduce_{name}"] = ("all_reduce", axis)
    outputs: list[torch.fx.Node] = [graph.call_function(scale_grad, (value, factor))]
    if extra_user:
        outputs.append(graph.call_function(torch.neg, (value,)))
    graph.output(tuple(outputs))
    return LoweredGraph(graph, (0,) * len(axes), collectives=collectives), value


def _calls(graph: torch.fx.Graph) -> list[Any]:
    return [n.target for n in graph.nodes if n.op in ("call_module", "call_function")]


def test_output_all_reduce_skips_its_adjoint_and_the_scale_goes() -> None:
    lowered, reduce = _boundary_graph(("dp",), 0.25)
    assert skip_output_adjoints(lowered, (4,)) == 1
    # the output itself now: not waited for in forward
    assert reduce.kwargs == {"adjoint": False, "deferred": True}
    assert _calls(lowered.graph) == ["all_reduce_dp"]  # no scale_grad: 4 * 1/4 = 1


def test_a_replicated_axis_without_all_reduce_keeps_its_scale() -> None:
    # Partial over dp, already Replicate over tp (2 x 2 mesh): 1/4 becomes 1/2
    graph = torch.fx.Graph()
    reduce = graph.call_module("all_reduce_dp", (graph.placeholder("x"),))
    boundary = graph.call_function(scale_grad, (reduce, 0.25))
    graph.output((boundary,))
    lowered = LoweredGraph(graph, (0, 0), collectives={"all_reduce_dp": ("all_reduce", 0)})
    assert skip_output_adjoints(lowered, (2, 2)) == 1
    assert boundary.args == (reduce, 0.5)
    assert reduce.kwargs == {"adjoint": False}  # the scale reads it: waited for in forward


def test_all_reduces_over_two_axes_both_skip() -> None:
    lowered, _ = _boundary_graph(("dp", "tp"), 1 / 6)
    assert skip_output_adjoints(lowered, (2, 3)) == 2
    inner, outer = (n for n in lowered.graph.nodes if n.op == "call_module")
    assert inner.kwargs == {"adjoint": False}  # the outer one reads it
    assert outer.kwargs == {"adjoint": False, "deferred": True}
    assert scale_grad not in _calls(lowered.graph)


def test_an_all_reduce_read_inside_the_graph_keeps_its_adjoint() -> None:
    # its other consumer's gradient is a summand: the adjoint must add them up
    lowered, reduce = _boundary_graph(("dp",), 0.5, extra_user=True)
    assert skip_output_adjoints(lowered, (2,)) == 0
    assert reduce.kwargs == {}
    assert scale_grad in _calls(lowered.graph)


def _dp_step(rank: int, world: int) -> dict[str, Any]:
    """One data-parallel step with the loss inside: collectives per phase, loss, gradients."""
    torch.manual_seed(0)
    # long enough sequences and vocabulary that the plan sums the loss per batch shard
    # (shorter ones gather the logits instead)
    model, (tokens,) = build("llama-tiny", batch_size=4, n_layer=2, seq_len=64, vocab_size=256)
    targets = torch.randint(0, model.lm_head.out_features, tokens.shape)
    reference = _WithLoss(copy.deepcopy(model))
    reference_loss = reference(tokens, targets)
    reference_loss.backward()
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    # check_inputs="off": the first call's check that ranks share the batch (one all-gather,
    # tests/autopar/runtime/test_faults.py) is not the step's
    compiled = autopar.compile(
        _WithLoss(model), mesh, example_inputs=(tokens, targets), force="dp", check_inputs="off"
    )
    forward: Counter[str] = Counter()
    backward: Counter[str] = Counter()
    with counting(forward):
        loss = compiled(tokens, targets)
    in_flight_after_forward = loss.in_flight
    with counting(backward):
        loss.backward()
    return {
        "type": type(loss).__name__,
        "in_flight": (in_flight_after_forward, loss.in_flight),
        "forward": dict(forward),
        "backward": dict(backward),
        "buckets": len(compiled._sync.buckets),
        "code": compiled.code,
        "loss": (loss.detach(), reference_loss.detach()),
        "grads": {n: compiled.full_gradient(n) for n, _ in reference.named_parameters()},
        "ref_grads": {n: p.grad for n, p in reference.named_parameters()},
    }


@pytest.fixture(scope="module")
def dp_step() -> list[dict[str, Any]]:
    return run_ranks(_dp_step, 2)


@pytest.mark.multirank
def test_dp_step_all_reduces_the_loss_once(dp_step: list[dict[str, Any]]) -> None:
    for rank in dp_step:
        assert "adjoint = False, deferred = True" in rank["code"]
        # forward: the loss (every rank returns the global loss, DDP its local one)
        assert rank["forward"] == {"all_reduce": 1}
        # backward: the gradient buckets only, as DDP (no all-reduce of the loss's gradient)
        assert rank["backward"] == {"all_reduce": rank["buckets"]}


@pytest.mark.multirank
def test_dp_step_loss_and_gradients_equal_one_device(dp_step: list[dict[str, Any]]) -> None:
    for rank in dp_step:
        torch.testing.assert_close(*rank["loss"], rtol=1e-5, atol=1e-6)
        for name, ref in rank["ref_grads"].items():
            scale = float(ref.abs().max()) or 1.0
            torch.testing.assert_close(
                rank["grads"][name], ref, rtol=1e-4, atol=1e-6 * scale, msg=name
            )


@pytest.mark.multirank
def test_dp_step_does_not_wait_for_the_loss_before_reading_it(
    dp_step: list[dict[str, Any]],
) -> None:
    """Forward and backward leave the loss's sum in flight (no rank waits for the others
    there); reading the loss afterwards (``detach`` above) gave the global loss."""
    for rank in dp_step:
        assert rank["type"] == "PendingSum"
        assert rank["in_flight"] == (True, True)
