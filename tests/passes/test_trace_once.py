"""Repeated layers exported once: the program equals a full export node for node, and the
copy is refused wherever it could differ."""

import pytest
import torch
from torch import nn

import autopar
from autopar.testing.simulate import first_mismatch
from autopar_examples.models import build
from autopar_passes.layers import module_path
from autopar_passes.trace import _export, trace
from autopar_passes.trace_once import export_layers_once

DEEP = [("gpt-tiny", {"n_layer": 6}), ("llama-tiny", {"n_layer": 7}), ("vit-tiny", {"n_layer": 5})]


def _as_args(inputs):
    return tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)


def _node_view(program):
    return [
        (n.name, n.op, str(n.target), str(n.args), str(n.kwargs), module_path(n))
        for n in program.graph.nodes
    ]


@pytest.mark.parametrize(("name", "overrides"), DEEP)
def test_the_program_equals_the_full_export(name, overrides):
    model, inputs = build(name, **overrides)
    args = _as_args(inputs)
    once = export_layers_once(model, args, {}, _export)
    assert once is not None, "identical layers are exported once"
    full = _export(model, args, {})
    assert _node_view(once) == _node_view(full)
    assert once.graph_signature.input_specs == full.graph_signature.input_specs
    assert once.graph_signature.output_specs == full.graph_signature.output_specs
    # the program runs, and computes what the model does
    torch.manual_seed(0)
    assert torch.equal(once.module()(*args), full.module()(*args))


@pytest.mark.parametrize(("name", "overrides"), DEEP)
def test_the_annotations_equal_the_full_trace(name, overrides):
    """Shapes, FLOPs, saved bytes (attributed by storage: each copy aliases its own)."""
    model, inputs = build(name, **overrides)
    once = trace(model, inputs)
    full = trace(model, inputs, layers_once=False)
    assert once.annotations() == full.annotations()
    assert once.params == full.params
    assert once.layers == full.layers
    assert once.summary().saved_activation_bytes == full.summary().saved_activation_bytes


def test_a_plan_of_the_copied_program_computes_the_model():
    """Lowered for 4 ranks (simulated), every node's value matches the single device's."""
    module, inputs = build("llama-tiny", n_layer=6)
    mesh = autopar.Mesh((2, 2), device="h100-sxm")
    plan = autopar.plan(module, mesh, inputs)
    assert first_mismatch(trace(module, inputs), plan, module, inputs) is None


class _Block(nn.Module):
    def __init__(self, width: int, window: int | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return x + (y if self.window is None else y[:, : self.window].sum(1, keepdim=True))


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], tail: str = "last") -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.tail = tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = []
        for i, layer in enumerate(self.layers):
            if self.tail == "index" and i == 4:  # the model's own code singles out a layer
                x = x * 2
            x = layer(x)
            seen.append(x.sum())
        return torch.stack(seen).sum() if self.tail == "every" else x.sum()


def _copied(model: nn.Module) -> bool:
    return export_layers_once(model, (torch.randn(2, 8),), {}, _export) is not None


def test_identical_layers_are_copied():
    assert _copied(_Stack([_Block(8) for _ in range(6)]))


@pytest.mark.parametrize(
    ("why", "model"),
    [
        # a plain attribute that differs by layer (Gemma's sliding windows)
        ("attribute", _Stack([_Block(8, window=(2 if i % 3 == 2 else None)) for i in range(6)])),
        # the same layers, but the model's own code treats layer 4's input apart
        ("code", _Stack([_Block(8) for _ in range(6)], tail="index")),
        # too few layers to be worth it
        ("few", _Stack([_Block(8) for _ in range(4)])),
    ],
)
def test_layers_that_may_differ_are_exported_whole(why, model):
    assert not _copied(model)


def test_a_sum_over_every_layer_after_them_is_kept():
    """The nodes after the layers may read every layer (Mixtral's router loss): they are
    traced as the model runs them, reading each copy."""
    model = _Stack([_Block(8) for _ in range(6)], tail="every")
    args = (torch.randn(2, 8),)
    once = export_layers_once(model, args, {}, _export)
    assert once is not None
    assert _node_view(once) == _node_view(_export(model, args, {}))


def test_a_hook_on_a_layer_exports_whole():
    model = _Stack([_Block(8) for _ in range(6)])
    model.layers[3].register_forward_hook(lambda m, i, o: o * 2)
    assert not _copied(model)


def test_a_weight_shared_between_layers_exports_whole():
    model = _Stack([_Block(8) for _ in range(6)])
    model.layers[4].proj.weight = model.layers[1].proj.weight
    assert not _copied(model)
