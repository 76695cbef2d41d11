"""What mixed precision changes in what is gathered, held and kept
(``autopar_passes.mixed_precision``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar_examples.models import build
from autopar_passes.layer_sharing import layer_copies
from autopar_passes.mixed_precision import (
    autocast_dtypes,
    autocast_saved,
    cast_for_gather,
    working_cast_nodes,
)
from autopar_passes.trace import trace


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


def test_a_reshard_moves_a_value_in_the_dtype_autocast_gives_it(traced) -> None:
    """The norm's output stays fp32 under autocast and the linear's is bf16; the solver
    prices a reshard of each in that dtype, as the ledger counts and the runtime moves
    them (a Llama's residual sums are fp32: priced in bf16, llama3-8b's all-reduces on 2x2
    were half their bytes)."""
    from autopar_cost_model import MeshCost, load_preset
    from autopar_passes.annotation import META_KEY
    from autopar_passes.costs import CostModel
    from autopar_plans import MeshSpec

    found = autocast_saved(traced, "bf16_mixed")
    assert found is not None
    names = {n.target: n for n in traced.graph.nodes if n.op == "call_function"}
    norm = names[torch.ops.aten.layer_norm.default]
    linear = names[torch.ops.aten.linear.default]
    assert found.output_dtypes[norm.name] == "float32"
    assert found.output_dtypes[linear.name] == "bfloat16"
    mesh = MeshCost(MeshSpec((2,), ("x",)), load_preset("h100-sxm"))
    cost = CostModel(mesh, precision="bf16_mixed", autocast_saved=found)
    plain = CostModel(mesh, precision="bf16_mixed")
    for node, itemsize in ((norm, 4), (linear, 2)):
        info = node.meta[META_KEY].outputs[0]
        assert info.dtype == "float32"  # traced in fp32
        assert cost.wire_itemsize(info, node.name) == itemsize
        assert plain.wire_itemsize(info, node.name) == 2  # without autocast's run: bf16


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("gpt-tiny", {"n_layer": 6}), ("llama-tiny", {"n_layer": 5}), ("moe-tiny", {"n_layer": 5})],
)
def test_copied_layers_keep_what_a_run_of_every_layer_finds(monkeypatch, name, overrides):
    """The autocast runs run one layer of each class and copy the rest (``LayerCopies``):
    what they find equals a run of every op, node for node."""
    from autopar_passes import mixed_precision
    from autopar_passes.layer_sharing import LayerCopies

    model, inputs = build(name, **overrides)
    copied = trace(model, inputs)
    saved = autocast_saved(copied, "bf16_mixed")
    dtypes = autocast_dtypes(copied, "bf16_mixed")
    assert len(layer_copies(copied.graph).representative) > 0
    monkeypatch.setattr(mixed_precision, "layer_copies", lambda *_: LayerCopies({}, {}, {}))
    whole = trace(model, inputs)
    assert autocast_saved(whole, "bf16_mixed") == saved
    assert autocast_dtypes(whole, "bf16_mixed") == dtypes
