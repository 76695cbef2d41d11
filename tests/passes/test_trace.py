"""The trace pass: every example traces, annotations are right, failures explain themselves."""

import pytest
import torch
from torch import nn

from autopar_cost_model.reference import gpt_flops_per_iteration
from autopar_examples.models import PRESETS, build
from autopar_passes.annotation import annotation
from autopar_passes.trace import trace
from autopar_plans import UntraceableModelError, UsageError

TINY = ["gpt-tiny", "llama-tiny", "moe-tiny", "mlp-tiny"]
FULL = [
    "gpt2-124m",
    "gpt3-1.3b",
    "gpt3-6.7b",
    "gpt3-13b",
    "gpt3-175b",
    "llama3-8b",
    "llama3-70b",
    "mixtral-8x7b",
]


def test_linear_flops_are_two_m_n_k():
    m, k, n = 8, 16, 32
    model = nn.Sequential(nn.Linear(k, n, bias=False), nn.Linear(n, k, bias=False))
    traced = trace(model, (torch.randn(m, k),))
    first, second = [a for a in traced.annotations().values() if a.op == "aten.linear.default"]
    assert first.fwd_flops == second.fwd_flops == 2 * m * n * k
    # Backward is measured, not assumed: the first layer's input (the user's batch) needs no
    # gradient, so only its weight gradient is computed; the second needs both.
    assert first.bwd_flops == first.fwd_flops
    assert second.bwd_flops == 2 * second.fwd_flops


@pytest.mark.parametrize("name", TINY)
def test_tiny_examples_trace_with_real_weights(name):
    model, inputs = build(name)
    traced = trace(model, inputs)
    summary = traced.summary()
    assert summary.parameters == sum(p.numel() for p in model.parameters())
    assert summary.layers == model_layers(name, model)
    assert summary.fwd_flops > 0
    assert not traced.warnings


@pytest.mark.parametrize("name", FULL)
def test_full_size_examples_trace_on_meta(name):
    model, inputs = build(name, device="meta")
    traced = trace(model, inputs)
    summary = traced.summary()
    assert summary.parameters == sum(p.numel() for p in model.parameters())
    assert summary.layers == PRESETS[name][1]["n_layer"]
    assert not traced.warnings


def model_layers(name: str, model: nn.Module) -> int:
    return len(model.layers)


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt3-1.3b"])
def test_gpt_forward_flops_match_megatron_closed_form(name):
    """Narayanan et al. 2021: 72 B s l h^2 (1 + s/6h + V/12lh) per iteration is fwd + bwd, i.e.
    three forward passes, counting GEMMs only (attention scores over all s x s positions)."""
    config = PRESETS[name][1]
    model, inputs = build(name, device="meta")
    tokens = inputs[0]
    batch, seq = tokens.shape
    traced = trace(model, inputs)
    closed_form = (
        gpt_flops_per_iteration(
            B=batch, s=seq, l=config["n_layer"], h=config["d_model"], V=config["vocab_size"]
        )
        / 3
    )
    assert traced.summary().fwd_flops == pytest.approx(closed_form, rel=0.02)


def test_annotations_name_parameters_modules_and_layers():
    model, inputs = build("gpt-tiny")
    traced = trace(model, inputs)
    notes = traced.annotations()
    params = {a.param: a for a in notes.values() if a.kind == "param"}
    qkv = params["layers.1.attn.qkv.weight"]
    assert qkv.layer == 1
    assert qkv.module == "layers.1.attn.qkv"
    linears = [a for a in notes.values() if a.op == "aten.linear.default"]
    assert {a.module for a in linears if a.layer == 0} >= {"layers.0.attn.proj", "layers.0.mlp.fc"}
    # the fused q/k/v projection is exposed as an einsum over [3, C, Cin] (autopar_passes.expose)
    [qkv] = [a for a in notes.values() if a.op == "aten.einsum.default" and a.layer == 0]
    assert qkv.module == "layers.0.attn.qkv"
    # A tied weight is one parameter with two names.
    [tied] = [p for p in traced.params.values() if p.aliases]
    assert {tied.name, *tied.aliases} == {"wte.weight", "lm_head.weight"}


def test_saved_bytes_belong_to_activations_and_views_point_at_their_base():
    model, inputs = build("gpt-tiny")
    traced = trace(model, inputs)
    for node in traced.graph.nodes:
        note = annotation(node)
        if note.kind in ("param", "input"):
            assert note.saved_bytes == 0
        if note.kind == "view" and note.alias_of is not None:
            assert note.saved_bytes == 0
    # The fused qkv projection's output (its bias add, after autopar_passes.expose) is saved by
    # attention through the q/k/v views of it.
    [qkv] = [
        n
        for n in traced.graph.nodes
        if annotation(n).module == "layers.0.attn.qkv" and annotation(n).op == "aten.add.Tensor"
    ]
    assert annotation(qkv).saved_bytes >= annotation(qkv).output_bytes
    assert traced.summary().saved_activation_bytes > 0


def test_meta_model_accepts_cpu_inputs():
    model, _ = build("gpt2-124m", device="meta", n_layer=1)
    traced = trace(model, (torch.zeros(1, 1024, dtype=torch.long),))
    assert traced.summary().layers == 1


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor's value
            return self.fc(x)
        return x


class UsesItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.max().item())
        return self.fc(x)[:, :n]


def test_data_dependent_control_flow_names_module_and_line():
    with pytest.raises(UntraceableModelError) as error:
        trace(DataDependent(), (torch.randn(2, 4),))
    message = str(error.value)
    assert "module 'block'" in message
    assert "if x.sum() > 0" in message
    assert "torch.where" in message
    assert "Traceback" not in message


def test_item_is_untraceable_with_advice():
    with pytest.raises(UntraceableModelError, match=r"\.item\(\)"):
        trace(UsesItem(), (torch.randn(2, 4),))


def test_wrong_number_of_inputs_is_a_usage_error():
    with pytest.raises(UsageError, match=r"do not fit Linear.forward"):
        trace(nn.Linear(4, 4), (torch.randn(2, 4), torch.randn(2, 4)))


def test_wrong_input_shape_is_a_usage_error():
    with pytest.raises(UsageError, match="example inputs do not fit"):
        trace(nn.Linear(4, 4), (torch.randn(2, 5),))


def test_not_a_module_is_refused():
    with pytest.raises(UsageError, match=r"nn\.Module"):
        trace(lambda x: x, (torch.randn(2),))  # type: ignore[arg-type]


def test_tracing_leaves_the_users_logging_as_it_was():
    import logging

    logging.disable(logging.INFO)  # the user's own setting
    mine = logging.getLogger("my_training")
    mine.setLevel(logging.DEBUG)
    try:
        model, inputs = build("mlp-tiny", batch_size=4)
        trace(model, inputs)
        with pytest.raises(UntraceableModelError):
            trace(DataDependent(), (torch.randn(2, 4),))
        assert logging.root.manager.disable == logging.INFO
        assert not mine.disabled and mine.level == logging.DEBUG
        assert not logging.getLogger("torch").disabled  # torch's own back as they were
    finally:
        logging.disable(logging.NOTSET)


def test_a_model_traced_under_no_grad_is_traced_for_training():
    """A compiled model meets a call of a new shape under ``torch.no_grad()`` (an evaluation)
    and reuses its program for training later: the trace is the one made with gradients."""
    model, inputs = build("gpt-tiny", batch_size=2)
    with_grad = trace(model, inputs)
    with torch.no_grad():
        without = trace(model, inputs)
    assert without.graph_module.code == with_grad.graph_module.code
    assert sum(n.bwd_flops for n in without.annotations().values()) > 0


class _WritesItsInput(nn.Module):
    def __init__(self, through_a_view: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.through_a_view = through_a_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (x[:, :4] if self.through_a_view else x).mul_(2)
        return self.proj(x)


@pytest.mark.parametrize("through_a_view", [False, True])
def test_a_model_writing_into_its_input_is_refused_plainly(through_a_view: bool) -> None:
    with pytest.raises(UsageError, match=r"writes into its input 'x' in place \(aten.mul_"):
        trace(_WritesItsInput(through_a_view), (torch.randn(4, 8),))


def test_a_model_writing_into_its_own_copy_traces() -> None:
    class CopiesFirst(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y.mul_(2)
            return y

    assert trace(CopiesFirst(), (torch.randn(4, 8),)).graph
