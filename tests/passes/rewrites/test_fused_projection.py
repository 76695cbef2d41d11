"""An exposed projection runs as one matmul with its bias
(``autopar_passes.rewrites.fused_projection``).

The planner sees GPT's q/k/v projection as an einsum over ``[3, C, Cin]`` plus a bias add
(``autopar_passes.expose``); each rank runs it as eager does, so a compiled step on one rank
dispatches the same matmuls and dtype casts as the eager step under autocast.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.testing.ranks import run_ranks
from autopar_examples.models import build
from autopar_passes.rewrites.fused_projection import fuse_projections, projection

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("conv1d", "equation", "weight_shape"),
    [(False, "abi,kci->abkc", (3, 8, 5)), (True, "ai,ikc->akc", (5, 3, 8))],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_projection_is_the_einsum_plus_bias(conv1d, equation, weight_shape, with_bias):
    torch.manual_seed(0)
    x = torch.randn((2, 4, 5) if not conv1d else (6, 5), dtype=torch.float64, requires_grad=True)
    weight = torch.randn(weight_shape, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 8, dtype=torch.float64, requires_grad=True) if with_bias else None
    expected = torch.einsum(equation, x, weight) + (bias if bias is not None else 0)
    got = projection(x, weight, bias, conv1d)
    torch.testing.assert_close(got, expected)
    inputs = [t for t in (x, weight, bias) if t is not None]
    grad = torch.randn_like(expected)
    torch.testing.assert_close(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)
    )


def _graph(bias_add: bool) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    x, weight, bias = (graph.placeholder(n) for n in ("x", "w", "b"))
    einsum = graph.call_function(aten.einsum.default, ("abi,kci->abkc", [x, weight]))
    last = (
        graph.call_function(aten.add.Tensor, (einsum, bias), name="bias_add")
        if bias_add
        else einsum
    )
    graph.output(graph.call_function(aten.unbind.int, (last, -2)))
    return graph


def test_the_bias_add_becomes_the_projection_and_keeps_its_name():
    graph = _graph(bias_add=True)
    assert fuse_projections(graph) == 1
    calls = [n for n in graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [projection, aten.unbind.int]
    assert calls[0].name == "bias_add"  # recompute regions name their nodes
    assert [str(a) for a in calls[0].args] == ["x", "w", "b", "False"]


def test_an_einsum_read_by_something_else_runs_without_a_bias():
    graph = _graph(bias_add=False)
    assert fuse_projections(graph) == 1
    (fused,) = [n for n in graph.nodes if n.target is projection]
    assert fused.args[2] is None


def test_other_einsums_are_left_alone():
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(aten.einsum.default, ("ij,jk->ik", [a, b])))
    assert fuse_projections(graph) == 0


class _Ops(TorchDispatchMode):
    """Counts the ATen ops a step dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _bf16_steps(rank: int, world: int) -> dict[str, Any]:
    """One autocast step of gpt-tiny, eager and compiled on one rank: the ops dispatched."""
    torch.manual_seed(0)
    model, (tokens,) = build("gpt-tiny", batch_size=2)
    targets = torch.roll(tokens, -1, dims=1)
    mesh = autopar.Mesh((world,), ("x",), device="cpu")
    compiled = autopar.compile(
        copy.deepcopy(model),
        mesh,
        example_inputs=(tokens,),
        precision="bf16_mixed",
        check_inputs="off",  # the first call's batch check is not the step's work
    )
    counts = {}
    for label, module in (("eager", model), ("compiled", compiled)):
        ops = _Ops()
        with ops:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = module(tokens)
            F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        counts[label] = dict(ops.counts)
    return {"counts": counts, "code": compiled.code}


@pytest.mark.multirank
def test_a_compiled_step_runs_the_matmuls_and_casts_of_the_eager_step():
    """Before the rewrite the compiled step ran batched matmuls with permutes for q/k/v and
    12 more casts (the bias add promoted the bf16 product to fp32, and back)."""
    (rank,) = run_ranks(_bf16_steps, 1)
    eager, compiled = rank["counts"]["eager"], rank["counts"]["compiled"]
    assert "einsum" not in rank["code"] and "projection" in rank["code"]
    for op in ("mm", "addmm", "bmm", "add", "_to_copy", "permute"):
        assert compiled.get(op, 0) == eager.get(op, 0), op
