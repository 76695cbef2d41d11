"""Hugging Face GPT-2, Llama and Gemma-2 (from configs) plan with no unknown op and train
exactly."""

from __future__ import annotations

import pytest
import torch

from autopar.testing.ranks import run_ranks
from autopar_passes.strategies.graph import graph_choices
from autopar_passes.trace import trace
from tests.autopar.runtime.closeness import assert_same_training
from tests.autopar.runtime.hf import TINY_DECODER, compare_hf, make


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "gemma2"])
def test_every_op_of_a_huggingface_decoder_has_a_rule(kind: str) -> None:
    if kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(**TINY_DECODER))
    else:
        model = make(kind)
    traced = trace(model, (torch.randint(0, 64, (4, 16)),), {"use_cache": False})
    _, warnings = graph_choices(traced.graph, (2, 2))
    assert warnings == []


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("kind", "style"),
    [("llama", "tp"), ("gpt2", "tp+sp"), ("gpt2", None), ("gemma2", None), ("gemma2", "tp+sp")],
)
def test_huggingface_decoder_compiled_on_four_ranks_equals_one_device(kind, style) -> None:
    (result, *_) = run_ranks(compare_hf, 4, (kind, style))
    assert_same_training(result)
