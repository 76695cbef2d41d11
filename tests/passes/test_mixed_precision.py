"""What mixed precision changes in what is gathered, held and kept (``passes.mixed_precision``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from passes.mixed_precision import autocast_saved, cast_for_gather, working_cast_nodes
from passes.trace import trace


class Block(nn.Module):
    """A norm, then a linear: the norm's fp32 output is what the linear reads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.norm(x)))


@pytest.fixture(scope="module")
def traced():
    return trace(Block(), (torch.randn(4, 8, 16),))


def test_only_weights_that_matmuls_alone_read_are_cast(traced) -> None:
    assert cast_for_gather(traced, "bf16_mixed") == {"proj.weight"}
    assert working_cast_nodes(traced, "bf16_mixed") == set(traced.params["proj.weight"].nodes)
    assert cast_for_gather(traced, "fp32") == frozenset()


def test_autocast_keeps_16_bit_copies_for_matmuls_and_fp32_where_it_computes_in_fp32(
    traced,
) -> None:
    found = autocast_saved(traced, "bf16_mixed")
    assert found is not None
    names = {n.target: n.name for n in traced.graph.nodes if n.op == "call_function"}
    norm = names[torch.ops.aten.layer_norm.default]
    linear = names[torch.ops.aten.linear.default]
    tanh = names[torch.ops.aten.tanh.default]
    values = 4 * 8
    # the linear keeps a bf16 copy of the norm's fp32 output (not the output itself)...
    assert found.cast_bytes[norm] == values * 16 * 2
    assert norm not in found.output_bytes
    # ... and autocast's bf16 copy of its fp32 weight
    weight = traced.params["proj.weight"].nodes[0]
    assert found.weight_casts == {(weight, linear)}
    # tanh keeps its own output, in the dtype the linear made it (bf16)
    assert found.output_bytes[tanh] == values * 32 * 2
    # the norm keeps its statistics (fp32 mean and rstd per row; its input, the model's, is
    # held anyway)
    assert found.internal_bytes[norm] == 2 * values * 4
    assert autocast_saved(traced, "fp32") is None
