"""Hugging Face-style models built from a config (no download) trace with use_cache=False."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from autopar_passes.trace import trace


def _gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=101, n_positions=32, use_cache=False)
    )


def _llama() -> torch.nn.Module:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_cache=False,
        )
    )


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_huggingface_decoder_traces(build):
    model = build()
    tokens = torch.randint(0, 101, (2, 16))
    traced = trace(model, (tokens,), {"use_cache": False})
    summary = traced.summary()
    assert summary.layers == 3
    assert summary.layer_container in ("transformer.h", "model.layers")
    assert summary.parameters == sum(p.numel() for p in model.parameters())
    assert summary.fwd_flops > 0
    assert not traced.warnings


def test_huggingface_llama_traces_on_meta():
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    traced = trace(model, (torch.zeros(1, 64, dtype=torch.long),), {"use_cache": False})
    assert traced.summary().layers == 4


def test_a_model_whose_config_asks_for_a_kv_cache_is_traced_without_one():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    tokens = torch.randint(0, 64, (2, 8))
    with pytest.warns(UserWarning, match="use_cache=False"):
        traced = trace(model, (), {"input_ids": tokens, "labels": tokens})
    assert traced.added_kwargs == {"use_cache": False}
    assert traced.exported.call_spec.out_spec.context == ["loss", "logits"]
