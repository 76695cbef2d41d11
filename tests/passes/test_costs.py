"""Per-device bytes an op keeps for backward, under a strategy.

An op keeps its output split as the output is, and what it keeps internally (a norm's
statistics, a loss's log-probabilities) split as its work is: a loss returns one
replicated scalar, but keeps log-probabilities as large as its logits, which shrink as the
batch is split.
"""

from __future__ import annotations

import pytest
import torch

from autopar_cost_model import load_preset
from autopar_cost_model.collectives import MeshCost
from autopar_passes.annotation import META_KEY
from autopar_passes.costs import CostModel
from autopar_passes.strategies.graph import graph_choices
from autopar_passes.trace import trace
from autopar_plans import MeshSpec
from autopar_plans.placement import Shard

DEVICES = 4
BATCH, SEQ, VOCAB = 8, 16, 1000


class Logits(torch.nn.Module):
    """A vocabulary projection and its cross-entropy: the loss keeps log-softmax of the
    logits (BATCH x SEQ x VOCAB floats), while its output is one scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


@pytest.fixture(scope="module")
def loss_node():
    inputs = (torch.randn(BATCH, SEQ, 32), torch.randint(0, VOCAB, (BATCH, SEQ)))
    traced = trace(Logits(), inputs)
    (node,) = [n for n in traced.graph.nodes if "cross_entropy" in str(n.target)]
    choices, _ = graph_choices(traced.graph, (DEVICES,))
    return node.meta[META_KEY], choices[node.name].strategies


def cost_model() -> CostModel:
    mesh = MeshSpec((DEVICES,), ("dp",), device="h100-sxm")
    return CostModel(MeshCost(mesh, load_preset("h100-sxm")), precision="fp32")


def test_a_loss_keeps_log_probabilities_as_large_as_its_logits(loss_node):
    note, _ = loss_node
    assert note.outputs[0].shape == ()
    assert note.internal_saved_bytes >= BATCH * SEQ * VOCAB * 4


def test_a_batch_split_loss_keeps_its_share_of_the_log_probabilities(loss_node):
    note, strategies = loss_node
    split = [s for s in strategies if s.inputs[0][0] == Shard(0)]
    whole = [s for s in strategies if s.split == 1]
    assert split and whole
    cost = cost_model()
    for strategy in whole:
        assert cost.activation_bytes(note, strategy) == pytest.approx(note.saved_bytes)
    for strategy in split:
        assert strategy.split == DEVICES
        # the scalar output is whole on every device; the log-probabilities are a quarter
        assert cost.activation_bytes(note, strategy) == pytest.approx(
            note.internal_saved_bytes / DEVICES
        )


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_op_pays_the_hosts_time_to_issue_it(asynchronous):
    """``DevicePreset.op_overhead``: a CPU issues an op and then runs it, so the two add; an
    accelerator runs the queued kernel while the host issues the next, so an op takes the
    longer of the two. A view launches no kernel: it costs the host's time only where the
    two add."""
    from types import SimpleNamespace

    from autopar_cost_model.hardware import OpOverhead
    from autopar_passes.annotation import NodeAnnotation, TensorInfo

    preset = load_preset("h100-sxm")
    host = OpOverhead(forward=10e-6, backward=20e-6, asynchronous=asynchronous)
    mesh = MeshSpec((1,), ("dp",), device="h100-sxm")
    plain = CostModel(MeshCost(mesh, preset))
    hosted = CostModel(MeshCost(mesh, preset.model_copy(update={"op_overhead": host})))
    out = (TensorInfo((1024, 1024), "float32"),)
    one = SimpleNamespace(split=1)
    small = NodeAnnotation(
        "op", "aten.add.Tensor", out, 2**20, 2**20, 12 * 2**20, 4 * 2**20, requires_grad=True
    )
    big = NodeAnnotation(
        "op", "aten.add.Tensor", out, 2**30, 2**30, 2**32, 2**32, requires_grad=True
    )
    view = NodeAnnotation("view", "aten.view.default", out, requires_grad=True)
    for note in (small, big):
        (fwd, bwd), (kernel_fwd, kernel_bwd) = hosted.op_time(note, one), plain.op_time(note, one)
        if asynchronous:
            assert (fwd, bwd) == (max(kernel_fwd, 10e-6), max(kernel_bwd, 20e-6))
        else:
            assert (fwd, bwd) == pytest.approx((kernel_fwd + 10e-6, kernel_bwd + 20e-6))
    assert hosted.op_time(view, one) == ((0.0, 0.0) if asynchronous else (10e-6, 20e-6))


def test_a_smaller_microbatch_pays_each_ops_issue_again_and_its_matmuls_run_slower():
    """``op_time(batch=s)``: the op on ``s`` times the traced batch. On a CPU the host's
    time to issue it does not shrink with the batch (``fixed + kernel s``); a matmul of
    fewer FLOPs reaches less of the peak where the preset measured its rates
    (``op_rates``), so half the batch takes more than half the kernel's time."""
    from types import SimpleNamespace

    from autopar_cost_model.hardware import OpOverhead
    from autopar_passes.annotation import NodeAnnotation, TensorInfo

    cpu = load_preset("cpu")
    host = OpOverhead(forward=10e-6, backward=20e-6, asynchronous=False)
    rates = {"matmul": {"float32": [(1e6, 1e9), (1e9, 1e10)]}}
    preset = cpu.model_copy(update={"op_overhead": host, "op_rates": rates})
    cost = CostModel(MeshCost(MeshSpec((1,), ("dp",), device="cpu"), preset))
    one = SimpleNamespace(split=1)
    out = (TensorInfo((64, 64), "float32"),)
    add = NodeAnnotation("op", "aten.add.Tensor", out, 0, 0, 2**20, 2**20, requires_grad=True)
    fwd, bwd = cost.op_time(add, one)
    half_fwd, half_bwd = cost.op_time(add, one, batch=0.5)
    assert half_fwd == pytest.approx(10e-6 + (fwd - 10e-6) / 2)
    assert half_bwd == pytest.approx(20e-6 + (bwd - 20e-6) / 2)
    mm = NodeAnnotation("op", "aten.mm.default", out, 1e8, 2e8, 2**10, 2**10, requires_grad=True)
    kernel = cost.op_time(mm, one)[0] - 10e-6
    half_kernel = cost.op_time(mm, one, batch=0.5)[0] - 10e-6
    assert kernel / 2 < half_kernel < kernel


def test_a_parameter_of_no_elements_plans() -> None:
    """MobileBERT built small holds a [0, 64] weight; its share of an FSDP group's bytes
    is zero, which the reshard price divided by (found by the coverage sweep)."""
    import autopar
    from autopar_examples.models.hf_zoo import hf_auto

    model, kwargs = hf_auto("mobilebert")
    assert any(p.numel() == 0 for p in model.parameters())
    plan = autopar.plan(model, autopar.Mesh((2, 2), device="cpu"), (), example_kwargs=kwargs)
    assert plan.params
