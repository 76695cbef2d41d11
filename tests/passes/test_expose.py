"""The expose pass turns a fused q/k/v projection into [3, C, Cin] blocks, exactly."""

from __future__ import annotations

import torch
from torch import nn

from autopar_examples.models import build
from autopar_passes.trace import trace


def run_graph(traced, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Run the traced graph with the model's parameters, reshaped as the plan holds them."""
    signature = traced.exported.graph_signature
    params = dict(model.named_parameters(remove_duplicate=False))
    values = []
    for name in signature.parameters:
        value = params[name].detach()
        planned = traced.reshaped.get(name)
        values.append(value.reshape(planned[1]) if planned else value)
    buffers = dict(model.named_buffers())
    values += [buffers[name] for name in signature.buffers]
    (out,) = traced.exported.graph_module(*values, *inputs)
    return out


def test_fused_qkv_becomes_three_blocks_and_computes_the_same():
    model, inputs = build("gpt-tiny")
    traced = trace(model, inputs)
    assert traced.reshaped["layers.0.attn.qkv.weight"] == ((96, 32), (3, 32, 32))
    assert traced.reshaped["layers.1.attn.qkv.bias"] == ((96,), (3, 32))
    ops = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert "aten.split.Tensor" not in ops
    assert ops.count("aten.einsum.default") == 2 and ops.count("aten.unbind.int") == 2
    torch.testing.assert_close(run_graph(traced, model, inputs), model(*inputs))


def test_the_column_parallel_split_of_the_blocks_is_offered_to_the_solver():
    from autopar_passes.strategies.graph import graph_choices

    model, inputs = build("gpt-tiny")
    traced = trace(model, inputs)
    choices, _ = graph_choices(traced.graph, (4,))
    [einsum] = [
        c
        for c in choices.values()
        if c.call is not None and str(c.call.target) == "aten.einsum.default" and "_1" not in c.name
    ]
    names = {s.name for s in einsum.strategies}
    assert "R,S(1)->S(3)" in names  # each device: its C/4 slice of q, k and v


def test_other_linears_are_left_alone():
    model, inputs = build("llama-tiny")  # separate q, k, v projections
    assert trace(model, inputs).reshaped == {}


def test_huggingface_gpt2_conv1d_projection_is_exposed_too():
    from tests.autopar.runtime.hf import make

    model = make("gpt2")
    tokens = torch.randint(0, 64, (4, 16))
    traced = trace(model, (tokens,), {"use_cache": False})
    assert traced.reshaped["transformer.h.0.attn.c_attn.weight"] == ((32, 96), (32, 3, 32))
    signature = traced.exported.graph_signature
    params = dict(model.named_parameters(remove_duplicate=False))
    values = [
        params[n].detach().reshape(traced.reshaped[n][1])
        if n in traced.reshaped
        else params[n].detach()
        for n in signature.parameters
    ]
    buffers = dict(model.named_buffers())
    values += [buffers[n] for n in signature.buffers]
    out = traced.exported.graph_module(*values, tokens, False)[0]  # input_ids, use_cache
    torch.testing.assert_close(out, model(tokens, use_cache=False).logits)
