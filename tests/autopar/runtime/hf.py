"""Hugging Face decoders built from a config (no download), compiled on real ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

import autopar


def make(kind: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        # dropout off: equivalence is checked without random numbers (the dropout policy
        # draws other masks on sharded activations than one device does)
        return GPT2LMHeadModel(
            GPT2Config(
                n_embd=32,
                n_layer=2,
                n_head=4,
                vocab_size=64,
                n_positions=32,
                use_cache=False,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_cache=False,
        )
    )


def logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def compare_hf(rank: int, world_size: int, kind: str, style: str | None) -> dict[str, Any]:
    model = make(kind)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    compiled = autopar.compile(model, mesh, example_inputs=(tokens,), force=style)
    losses = []
    for module in (reference, compiled):
        out = logits(module(tokens))
        loss = F.cross_entropy(out.flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(float(loss.detach()))
    worst = 0.0
    for name, param in reference.named_parameters():
        grad = compiled.full_gradient(name)
        scale = float(param.grad.abs().max()) or 1.0
        worst = max(worst, float((grad - param.grad).abs().max()) / scale)
    return {
        "losses": losses,
        "worst_relative_grad_error": worst,
        "parallelism": compiled.plan.parallelism.model_dump(),
    }
