"""A 16-bit linear layer with unaligned output rows runs padded, and computes the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autopar_passes.rewrites.aligned_linear import align_linears, aligned_linear

aten = torch.ops.aten


class MatmulShapes(TorchDispatchMode):
    """Records the weight shape each matmul kernel is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten.addmm.default, aten.mm.default):
            self.weights.append(tuple(args[-1].shape))
        return func(*args, **(kwargs or {}))


def _inputs(rows: int, dtype: torch.dtype, bias: bool = True):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(rows, 16, generator=generator).to(dtype).requires_grad_()
    b = torch.randn(rows, generator=generator).to(dtype).requires_grad_() if bias else None
    return x, weight, b


@pytest.mark.parametrize("bias", [True, False])
def test_padded_bf16_linear_gives_the_same_outputs_and_gradients(bias):
    x, weight, b = _inputs(1001, torch.bfloat16, bias)
    x2, weight2, b2 = (t.detach().clone().requires_grad_() if t is not None else None
                       for t in (x, weight, b))  # fmt: skip
    out, expected = aligned_linear(x, weight, b), F.linear(x2, weight2, b2)
    assert out.shape == (4, 3, 1001) and out.is_contiguous()
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(weight.grad, weight2.grad)
    assert weight.grad.shape == (1001, 16)
    if bias:
        torch.testing.assert_close(b.grad, b2.grad)


def test_the_matmul_sees_rows_padded_to_a_multiple_of_8_only_in_16_bits():
    cases = [  # (rows, dtype, autocast, the weight rows the matmul is given)
        (1001, torch.bfloat16, False, 1008),
        (1001, torch.float16, False, 1008),
        (1001, torch.float32, True, 1008),  # fp32 master weights under bf16 autocast
        (1001, torch.float32, False, 1001),  # fp32: nothing to gain
        (1000, torch.bfloat16, False, 1000),  # aligned already
    ]
    for rows, dtype, autocast, seen in cases:
        x, weight, b = _inputs(rows, dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), MatmulShapes() as log:
            out = aligned_linear(x, weight, b)
        assert out.shape[-1] == rows
        assert {max(shape) for shape in log.weights} == {seen}, (rows, dtype, autocast)


def test_align_linears_rewrites_a_graphs_linears_and_keeps_its_results():
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 13))
    x = torch.randn(5, 16)
    exported = torch.export.export(model, (x,)).module()
    graph = exported.graph
    assert align_linears(graph) == 2
    assert not any(n.target is aten.linear.default for n in graph.nodes)
    exported.recompile()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with MatmulShapes() as log:
            out = exported(x)
        expected = model(x)
    assert out.shape == (5, 13)
    torch.testing.assert_close(out, expected)
    # 24 x 16 as it was; 13 x 24 padded to 16 x 24 (each seen transposed, as mm's operand)
    assert sorted(log.weights) == [(16, 24), (24, 16)]
