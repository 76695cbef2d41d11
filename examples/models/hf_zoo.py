"""Hugging Face models built tiny from their configs (random weights, no download): the
families most used for training, as the coverage sweep and the zoo tests build them.

>>> model, kwargs = hf_tiny("llama")                    # doctest: +SKIP
>>> model(**kwargs).loss                                # the model's own loss
tensor(4.17..., grad_fn=...)

Every model takes keyword inputs with ``labels`` (the loss is Hugging Face's own); decoders
and encoders a batch of 4 sequences of 16 tokens of a vocabulary of 64, image models 4
images of 32x32. Dropout is off (an equivalence check draws no random numbers), caches are
off (training has no use for them). Needs ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn

from autopar_plans.errors import UsageError

VOCAB, BATCH, LENGTH, IMAGE, CLASSES = 64, 4, 16, 32, 10

_DECODER: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "use_cache": False,
}
_GPT2_LIKE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "use_cache": False,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
_ENCODER: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


class Family(NamedTuple):
    config: str  # the transformers config class
    model: str  # the model class (with its training head)
    overrides: Mapping[str, Any]
    inputs: str = "tokens"  # "tokens", or "images"


def _family(config: str, model: str, inputs: str = "tokens", **overrides: Any) -> Family:
    return Family(config, model, MappingProxyType(overrides), inputs)


FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "llama": _family("LlamaConfig", "LlamaForCausalLM", **_DECODER),
        "mistral": _family("MistralConfig", "MistralForCausalLM", **_DECODER),
        "qwen2": _family("Qwen2Config", "Qwen2ForCausalLM", **_DECODER),
        "qwen3": _family("Qwen3Config", "Qwen3ForCausalLM", **_DECODER, head_dim=8),
        "gemma": _family("GemmaConfig", "GemmaForCausalLM", **_DECODER, head_dim=8),
        "gemma2": _family(
            "Gemma2Config", "Gemma2ForCausalLM", **_DECODER, head_dim=8, sliding_window=8
        ),
        "gemma3": _family(
            "Gemma3TextConfig", "Gemma3ForCausalLM", **_DECODER, head_dim=8, sliding_window=8
        ),
        "phi3": _family("Phi3Config", "Phi3ForCausalLM", **_DECODER, pad_token_id=0),
        "gpt2": _family("GPT2Config", "GPT2LMHeadModel", **_GPT2_LIKE),
        "gpt_neox": _family(
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            **_DECODER,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        "gptj": _family("GPTJConfig", "GPTJForCausalLM", **_GPT2_LIKE, rotary_dim=4),
        "falcon": _family(
            "FalconConfig",
            "FalconForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            use_cache=False,
        ),
        "opt": _family(
            "OPTConfig",
            "OPTForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            use_cache=False,
            dropout=0.0,
        ),
        "bloom": _family(
            "BloomConfig",
            "BloomForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            n_layer=2,
            n_head=4,
            use_cache=False,
        ),
        "starcoder2": _family(
            "Starcoder2Config",
            "Starcoder2ForCausalLM",
            **_DECODER,
            residual_dropout=0.0,
            embedding_dropout=0.0,
        ),
        "olmo": _family("OlmoConfig", "OlmoForCausalLM", **_DECODER),
        "bert": _family("BertConfig", "BertForMaskedLM", **_ENCODER),
        "roberta": _family("RobertaConfig", "RobertaForMaskedLM", **_ENCODER, pad_token_id=1),
        "t5": _family(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            use_cache=False,
            decoder_start_token_id=0,
        ),
        "vit": _family(
            "ViTConfig",
            "ViTForImageClassification",
            "images",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=IMAGE,
            patch_size=8,
            num_labels=CLASSES,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        "resnet": _family(
            "ResNetConfig",
            "ResNetForImageClassification",
            "images",
            embedding_size=8,
            hidden_sizes=[8, 16, 32, 64],
            depths=[1, 1, 1, 1],
            num_labels=CLASSES,
        ),
        "resnet18": _family(  # ResNet-18's depth: two basic blocks a stage
            "ResNetConfig",
            "ResNetForImageClassification",
            "images",
            embedding_size=8,
            hidden_sizes=[8, 16, 32, 64],
            depths=[2, 2, 2, 2],
            layer_type="basic",
            num_labels=CLASSES,
        ),
        "mixtral": _family(
            "MixtralConfig",
            "MixtralForCausalLM",
            **_DECODER,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "qwen2_moe": _family(
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            **_DECODER,
            **_MOE,
            num_experts=4,
            shared_expert_intermediate_size=32,
        ),
        "deepseek_v3": _family(
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            **{**_DECODER, **_MOE, "num_key_value_heads": 4},
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
        ),
    }
)


def hf_tiny(name: str, seed: int = 0, **overrides: Any) -> tuple[nn.Module, dict[str, Any]]:
    """Family ``name`` built tiny (``overrides`` replace config fields), and keyword inputs
    for a training call (``labels`` included)."""
    family = FAMILIES.get(name)
    if family is None:
        raise UsageError(f"no Hugging Face family {name!r}; known: {', '.join(FAMILIES)}")
    import transformers

    config = getattr(transformers, family.config)(**{**family.overrides, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, family.model)(config)
    return model, example_inputs(family.inputs, seed)


def example_inputs(kind: str, seed: int = 0) -> dict[str, Any]:
    """A batch of tokens (``labels``: the tokens, shifted by the model) or of images (with
    a class each)."""
    generator = torch.Generator().manual_seed(seed + 1)
    if kind == "images":
        return {
            "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=generator),
        }
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    return {"input_ids": tokens, "labels": tokens}


# Every architecture of the installed transformers, for the coverage sweep: its config made
# small by the fields its constructor takes, then whatever the constructor derives from them.
_SMALL: dict[str, Any] = {
    **_DECODER,
    **_GPT2_LIKE,
    **_ENCODER,
    "head_dim": 8,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "n_inner": 64,
    "word_embed_proj_dim": 32,
    "embedding_size": 32,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "image_size": IMAGE,
    "patch_size": 8,
    "num_channels": 3,
    "num_labels": CLASSES,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 0,
    "dropout": 0.0,
    "dropout_rate": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "hidden_dropout": 0.0,
}
HEADS = (  # the task mappings swept, in the order a model type takes its first
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "tokens"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "tokens"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "tokens"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "images"),
)


def architectures() -> dict[str, tuple[str, str]]:
    """Model type -> (model class with a training head, input kind), for every architecture
    of the installed transformers that has a language-model or image-classification head."""
    from transformers.models.auto import modeling_auto

    found: dict[str, tuple[str, str]] = {}
    for mapping, kind in HEADS:
        for model_type, model_class in getattr(modeling_auto, mapping).items():
            if isinstance(model_class, str):
                found.setdefault(model_type, (model_class, kind))
    return found


def hf_auto(model_type: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """Any architecture of ``architectures()``, its config's size fields made small (those
    its constructor takes), with keyword inputs for a training call."""
    import inspect

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_class, kind = architectures()[model_type]
    config_class = CONFIG_MAPPING[model_type]
    takes = inspect.signature(config_class.__init__).parameters
    config = config_class(**{k: v for k, v in _SMALL.items() if k in takes})
    config.use_cache = False
    if kind == "images":
        config.num_labels = CLASSES
    if (
        getattr(config, "is_encoder_decoder", False)
        and getattr(config, "decoder_start_token_id", None) is None
    ):
        config.decoder_start_token_id = 0
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    return model, example_inputs(kind, seed)


def in_float64(model: nn.Module) -> nn.Module:
    """A float64 copy, to measure the fp32 roundoff of a step (``autopar.testing.
    closeness``); experts run by their plain loop (torch's grouped matmul has no float64
    kernel)."""
    import copy

    exact = copy.deepcopy(model).double()
    config = getattr(exact, "config", None)
    if config is not None and hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return exact


def double_inputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inputs with float tensors in float64."""
    return {
        k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in kwargs.items()
    }
