"""Every preset traces with torch.export: tiny ones on CPU (checked against eager), full-size
ones on meta with two layers (shapes and names only)."""

from __future__ import annotations

import pytest
import torch

from autopar_examples.models import PRESETS, build

TINY = [name for name in PRESETS if name.endswith("-tiny")]
FULL_SIZE = [name for name in PRESETS if not name.endswith("-tiny")]


def as_tuple(output: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


@pytest.mark.parametrize("name", TINY)
def test_tiny_export_matches_eager(name: str) -> None:
    model, inputs = build(name)
    program = torch.export.export(model, inputs, strict=False)
    assert not program.range_constraints  # no data-dependent (unbacked) sizes
    exported = as_tuple(program.module()(*inputs))
    eager = as_tuple(model(*inputs))
    assert len(exported) == len(eager)
    for got, want in zip(exported, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_export_matches_eager_with_dropped_tokens(top_k: int) -> None:
    model, inputs = build("moe-tiny", top_k=top_k, capacity_factor=0.5)
    program = torch.export.export(model, inputs, strict=False)
    for got, want in zip(program.module()(*inputs), model(*inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# A parameter each full-size family must show under its documented name.
EXPECTED_PARAMETER = {
    "gpt": "layers.1.attn.qkv.weight",
    "llama": "layers.1.attn.k_proj.weight",
    "mixtral": "layers.1.moe.experts.w_down",
}


@pytest.mark.parametrize("name", [n for n in FULL_SIZE if "seq_len" in PRESETS[n].config])
def test_full_size_traces_on_meta(name: str) -> None:
    model, inputs = build(name, device="meta", n_layer=2)
    program = torch.export.export(model, inputs, strict=False)
    assert not program.range_constraints
    config = PRESETS[name].config
    (output,) = [node for node in program.graph.nodes if node.op == "output"]
    shapes = [tuple(node.meta["val"].shape) for node in as_tuple(output.args[0])]
    batch, seq, vocab = config.get("batch_size", 1), config["seq_len"], config["vocab_size"]
    assert shapes[0] == (batch, seq, vocab)
    if name.startswith("mixtral"):
        assert shapes[1] == ()  # the auxiliary loss
    family = next(key for key in EXPECTED_PARAMETER if name.startswith(key))
    assert EXPECTED_PARAMETER[family] in program.graph_signature.parameters
    stacks = [
        node.meta.get("nn_module_stack")
        for node in program.graph.nodes
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default
    ]
    assert stacks and all(stacks)  # module paths survive for naming


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "vit-b16"])
def test_full_size_image_models_trace_on_meta(name: str) -> None:
    overrides = {"n_layer": 2} if name.startswith("vit") else {}
    model, inputs = build(name, device="meta", batch_size=2, **overrides)
    program = torch.export.export(model, inputs, strict=False)
    (output,) = [node for node in program.graph.nodes if node.op == "output"]
    assert [tuple(n.meta["val"].shape) for n in as_tuple(output.args[0])] == [(2, 1000)]
    convs = [n for n in program.graph.nodes if n.target == torch.ops.aten.conv2d.default]
    assert len(convs) == {"resnet18": 20, "resnet50": 53, "vit-b16": 1}[name]
