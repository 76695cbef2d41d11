"""Hugging Face decoders built from a config (no download), compiled on real ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

import autopar
from tests.autopar.runtime.closeness import in_float64

# the sizes every tiny Llama-family decoder here is built with
TINY_DECODER: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "use_cache": False,
}


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
    if kind == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        # rotary embeddings (rotate_half: a cat of the head dim's two halves), logit
        # soft-capping and sliding-window layers
        return Gemma2ForCausalLM(
            Gemma2Config(head_dim=8, sliding_window=8, max_position_embeddings=64, **TINY_DECODER)
        )
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER))


def logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def compare_hf(rank: int, world_size: int, kind: str, style: str | None) -> dict[str, Any]:
    """One forward and backward of the model alone (fp32, and float64 on rank 0) and
    compiled on a 2 x 2 mesh: the losses and every parameter's gradient."""
    model = make(kind)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    runs: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    if rank == 0:
        exact, _, _ = in_float64(model, (), tokens)
        runs["exact"] = _one_step(exact, tokens, lambda n, p: p.grad)
    reference = copy.deepcopy(model)
    runs["ref"] = _one_step(reference, tokens, lambda n, p: p.grad)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    compiled = autopar.compile(model, mesh, example_inputs=(tokens,), force=style)
    names = [n for n, _ in reference.named_parameters()]
    loss, _ = _one_step(compiled, tokens, lambda n, p: None)
    result: dict[str, Any] = {
        "case": f"{kind}/{style or 'free'}",
        "losses": [loss],
        "grads": {n: compiled.full_gradient(n) for n in names},
        "parallelism": compiled.plan.parallelism.model_dump(),
    }
    for run, (run_loss, grads) in runs.items():
        result[f"{run}_losses"] = [run_loss]
        result[f"{run}_grads"] = {n: grads[n] for n in names}
    return result


def _one_step(
    module: torch.nn.Module, tokens: torch.Tensor, grad_of: Any
) -> tuple[float, dict[str, torch.Tensor]]:
    out = logits(module(tokens))
    loss = F.cross_entropy(out.flatten(0, 1), tokens.flatten())
    loss.backward()
    grads = {n: grad_of(n, p) for n, p in module.named_parameters()}
    return float(loss.detach()), grads
