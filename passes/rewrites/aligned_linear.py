"""A 16-bit linear layer whose output rows are not 16-byte aligned runs padded.

cuBLAS's fast Hopper kernels want every leading dimension of a bf16/fp16 matmul to be a
multiple of 8 elements (16 bytes). The lm_head of GPT-2's vocabulary (50257 rows, odd)
breaks that in the output, whose rows are 50257 long, so it runs on an old ``align1``
kernel: on an H200, 34.1 ms for a 16384 x 2048 by 2048 x 50257 forward against 4.8 ms
with 50264 rows, and 23 ms against 5 ms for each gradient
(``benchmarks/results/h200/matmul_alignment.txt``, ``benchmarks/gpu_alignment.py``); that
one layer was a fifth of gpt3-1.3b's step. Megatron-LM pads the vocabulary of the model
itself (``--make-vocab-size-divisible-by``, 128 by default); here the model keeps its
shapes, and the rank's program pads the weight on the fly::

    linear(x, W, b)  =  linear(x, pad(W), pad(b))[..., :N]        (W: [N, K], N % 8 != 0)

The padded rows are zeros, so the first N outputs are the same sums; the slice is made
contiguous (callers ``view`` logits), a copy of the output that costs what one pass over
it costs, against tens of milliseconds saved. Backward is autograd's: the gradient of the
slice is zero-padded, both gradient matmuls run aligned, and the weight's gradient is
the first N rows of the padded one.

The rewrite is for CUDA devices: CPU kernels gain nothing from it. Only the output rows
are padded: a contraction dim (K) that is not a multiple of 8 would need the activation
copied too, and no preset model has one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten

ALIGN_ELEMENTS = 8
"""Rows of a 16-bit matmul's operands are 16-byte aligned when a multiple of this."""


def runs_in_16_bits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` computes in bf16 or fp16 here (autocast or dtypes)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device).itemsize == 2
    return weight.dtype.is_floating_point and weight.dtype.itemsize == 2


def aligned_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with the weight's rows padded to a multiple of
    ``ALIGN_ELEMENTS`` when it computes in 16 bits and they are not (module docstring)."""
    rows = weight.shape[0]
    pad = -rows % ALIGN_ELEMENTS
    if pad == 0 or weight.dim() != 2 or not runs_in_16_bits(x, weight):
        return F.linear(x, weight, bias)
    padded_bias = F.pad(bias, (0, pad)) if bias is not None else None
    out = F.linear(x, F.pad(weight, (0, 0, 0, pad)), padded_bias)
    return out[..., :rows].contiguous()


def align_linears(graph: torch.fx.Graph) -> int:
    """Rewrite, in place, each ``aten.linear`` of a rank's ``graph`` as ``aligned_linear``
    (which pads only where it pays, deciding on the shapes and dtype it is called with);
    returns how many."""
    rewritten = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.linear.default:
            node.target = aligned_linear
            rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten
