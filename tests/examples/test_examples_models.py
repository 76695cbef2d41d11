"""Tiny presets on CPU: forward, backward, names, init, rotary, GQA, causality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar_examples.models import PRESETS, build
from autopar_examples.models.llama import apply_rotary, repeat_kv, rotary_angles
from autopar_plans.errors import UsageError

TINY = [name for name in PRESETS if name.endswith("-tiny")]


def logits_of(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("name", TINY)
def test_forward_shape_and_finite(name: str) -> None:
    model, inputs = build(name)
    out = logits_of(model(*inputs))
    config = PRESETS[name].config
    if name == "mlp-tiny":
        assert out.shape == (config["batch_size"], config["d_out"])
    elif "num_classes" in config:  # an image classifier
        assert out.shape == (config["batch_size"], config["num_classes"])
    else:
        assert out.shape == (config["batch_size"], config["seq_len"], config["vocab_size"])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", TINY)
def test_backward_reaches_every_parameter(name: str) -> None:
    model, inputs = build(name)
    output = model(*inputs)
    loss = logits_of(output).float().pow(2).mean()
    if isinstance(output, tuple):
        loss = loss + output[1]  # the MoE load-balancing loss
    loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert torch.isfinite(param.grad).all(), pname
        assert param.grad.abs().sum() > 0, pname


def test_gpt_names() -> None:
    model, _ = build("gpt-tiny")
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    expected = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"}
    for i in range(2):
        for sub in ("ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.fc", "mlp.proj"):
            expected |= {f"layers.{i}.{sub}.weight", f"layers.{i}.{sub}.bias"}
    assert names == expected
    assert isinstance(model.layers, nn.ModuleList)
    assert model.lm_head.weight is model.wte.weight
    assert model.layers[0].attn.qkv.weight.shape == (3 * 32, 32)


def test_gpt_untied_and_biasless() -> None:
    model, _ = build("gpt-tiny", tie_embeddings=False, bias=False)
    assert model.lm_head.weight is not model.wte.weight
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_llama_names_and_shapes() -> None:
    model, _ = build("llama-tiny")
    names = {name for name, _ in model.named_parameters()}
    expected = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.attn_norm.weight", f"layers.{i}.mlp_norm.weight"}
        for sub in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"):
            expected.add(f"layers.{i}.{sub}.weight")
        for sub in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            expected.add(f"layers.{i}.{sub}.weight")
    assert names == expected
    attn = model.layers[0].attn
    assert attn.k_proj.weight.shape == (4 * 8, 64)  # 4 kv heads of size 64 / 8
    assert model.lm_head.weight is not model.embed_tokens.weight


def test_moe_names_and_shapes() -> None:
    model, _ = build("moe-tiny")
    params = dict(model.named_parameters())
    assert params["layers.1.moe.router.weight"].shape == (4, 32)
    assert params["layers.1.moe.experts.w_gate"].shape == (4, 32, 64)
    assert params["layers.1.moe.experts.w_up"].shape == (4, 32, 64)
    assert params["layers.1.moe.experts.w_down"].shape == (4, 64, 32)
    assert "layers.0.attn.q_proj.weight" in params
    assert "layers.0.mlp_norm.weight" in params


def test_mlp_names() -> None:
    model, (x,) = build("mlp-tiny")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {
        "layers.0.weight": (64, 16),
        "layers.0.bias": (64,),
        "layers.1.weight": (64, 64),
        "layers.1.bias": (64,),
        "layers.2.weight": (16, 64),
        "layers.2.bias": (16,),
    }
    assert x.shape == (4, 16)


@pytest.mark.parametrize("name", TINY)
def test_init_is_deterministic_given_the_seed(name: str) -> None:
    torch.manual_seed(123)
    a, _ = build(name)
    torch.manual_seed(123)
    b, _ = build(name)
    torch.manual_seed(124)
    c, _ = build(name)
    for (pname, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), pname
        if pa.ndim > 1:
            assert not torch.equal(pa, pc), pname


def test_init_is_normal_002_with_scaled_residual_projections() -> None:
    torch.manual_seed(0)
    model, _ = build("gpt-tiny", vocab_size=1024)
    assert abs(model.wte.weight.std().item() - 0.02) < 0.001  # 32k samples
    # GPT-2: residual projections scaled by 1 / sqrt(2 * n_layer) = 1/2 here.
    proj = torch.cat([layer.mlp.proj.weight.flatten() for layer in model.layers])
    assert abs(proj.std().item() - 0.01) < 0.001
    assert torch.equal(model.layers[0].attn.qkv.bias, torch.zeros(96))
    assert torch.equal(model.ln_f.weight, torch.ones(32))


@pytest.mark.parametrize("name", ["llama-tiny", "moe-tiny"])
def test_meta_built_model_materialises_to_the_same_model(name: str) -> None:
    real, inputs = build(name)
    meta, _ = build(name, device="meta")
    assert list(meta.buffers()) == []  # rotary angles come from arange, not a buffer
    meta = meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    torch.testing.assert_close(meta(*inputs), real(*inputs), rtol=0, atol=0)


def test_rotary_position_zero_is_identity_and_scores_depend_on_offset_only() -> None:
    hs, T = 8, 6
    cos, sin = rotary_angles(T, hs, theta=10000.0, device=torch.device("cpu"))
    q = torch.randn(hs).expand(1, 1, T, hs)  # the same vector at every position
    k = torch.randn(hs).expand(1, 1, T, hs)
    rq, rk = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    torch.testing.assert_close(rq[0, 0, 0], q[0, 0, 0])
    scores = rq[0, 0] @ rk[0, 0].T  # (T, T): <R_m q, R_n k>
    for m in range(T - 1):
        for n in range(T - 1):
            torch.testing.assert_close(scores[m + 1, n + 1], scores[m, n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))


def test_repeat_kv_matches_sdpa_grouped_query_attention() -> None:
    B, nh, nkv, T, hs = 2, 8, 2, 5, 4
    q = torch.randn(B, nh, T, hs)
    k, v = torch.randn(B, nkv, T, hs), torch.randn(B, nkv, T, hs)
    ours = F.scaled_dot_product_attention(
        q, repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv), is_causal=True
    )
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, reference)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("gpt-tiny", {}), ("llama-tiny", {}), ("moe-tiny", {"top_k": 1})],
)
def test_causal_later_tokens_do_not_change_earlier_logits(
    name: str, overrides: dict[str, object]
) -> None:
    # MoE only with top-1: with top-2, second choices queue behind all first choices of the
    # sequence, so a later token can take an earlier token's second-choice slot (GShard).
    model, (idx,) = build(name, **overrides)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 64
    a, b = logits_of(model(idx)), logits_of(model(changed))
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_rejects_sequences_longer_than_its_position_table() -> None:
    model, _ = build("gpt-tiny")
    with pytest.raises(UsageError, match="longer than seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_dropout_only_in_training() -> None:
    model, (idx,) = build("gpt-tiny", dropout=0.5)
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))
