"""Published model sizes, and tiny ones for tests, by name.

>>> model, (idx,) = build("llama3-8b", device="meta", n_layer=2)
>>> idx.shape
torch.Size([1, 8192])
>>> sorted(PRESETS)[:3]
['gpt-tiny', 'gpt2-124m', 'gpt3-1.3b']

Each preset also has a function with an identifier name (``llama3_8b(**overrides)``), so
``autopar_examples.models:llama3_8b`` names a callable on the command line. Overrides replace any
config field; an unknown field or preset name is a :class:`~autopar_plans.errors.UsageError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from autopar_examples.models._build import Built, closest_first
from autopar_examples.models.gpt import gpt
from autopar_examples.models.llama import llama
from autopar_examples.models.mlp import mlp
from autopar_examples.models.moe import moe
from autopar_examples.models.resnet import resnet
from autopar_examples.models.vit import vit
from autopar_plans.errors import UsageError


class Preset(NamedTuple):
    """A factory, the config it is called with, and where the numbers come from."""

    factory: Callable[..., Built]
    config: Mapping[str, Any]
    source: str


def _preset(factory: Callable[..., Built], source: str, **config: Any) -> Preset:
    return Preset(factory, MappingProxyType(config), source)


_GPT3 = "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1"
_LLAMA3 = "Llama Team 2024, 'The Llama 3 Herd of Models', Table 3"
_MIXTRAL = "Jiang et al. 2024, 'Mixtral of Experts', Table 1"
_RESNET = "He et al. 2016, 'Deep Residual Learning for Image Recognition', Table 1"
_VIT = "Dosovitskiy et al. 2021, 'An Image is Worth 16x16 Words', Table 1"

# One preset per few lines reads better as a table than one argument per line.
# fmt: off
PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # Radford et al. 2019 (the paper rounds it to "117M"); 124,439,808 parameters.
        "gpt2-124m": _preset(
            gpt, "Radford et al. 2019, GPT-2 small as released",
            vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768,
        ),
        # GPT-3 XL: Table 2.1 lists 24 heads and d_head 128, which cannot both hold for
        # d_model 2048; 16 heads of 128 is the usual reading. Heads do not change the count.
        "gpt3-1.3b": _preset(
            gpt, _GPT3, vocab_size=50257, seq_len=2048, n_layer=24, n_head=16, d_model=2048
        ),
        "gpt3-6.7b": _preset(
            gpt, _GPT3, vocab_size=50257, seq_len=2048, n_layer=32, n_head=32, d_model=4096
        ),
        # Table 2.1 prints d_model 5140, which 40 heads of 128 do not give; 5120 is meant.
        "gpt3-13b": _preset(
            gpt, _GPT3, vocab_size=50257, seq_len=2048, n_layer=40, n_head=40, d_model=5120
        ),
        "gpt3-175b": _preset(
            gpt, _GPT3, vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288
        ),
        "llama3-8b": _preset(
            llama, _LLAMA3,
            vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8,
            d_model=4096, d_ff=14336, rope_theta=500000.0, norm_eps=1e-5,
        ),
        "llama3-70b": _preset(
            llama, _LLAMA3,
            vocab_size=128256, seq_len=8192, n_layer=80, n_head=64, n_kv_head=8,
            d_model=8192, d_ff=28672, rope_theta=500000.0, norm_eps=1e-5,
        ),
        # Context is 32768 tokens (Table 1); seq_len 4096 keeps the example inputs and the
        # GShard dispatch tensors (which grow as T^2 per sequence) at a training-like size.
        # rope_theta 1e6 is from the released params.json. Mixtral routes without dropping
        # tokens; a capacity factor of 1.25 keeps the expert FLOPs close to top-2's.
        "mixtral-8x7b": _preset(
            moe, _MIXTRAL,
            vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, n_kv_head=8,
            d_model=4096, d_ff=14336, rope_theta=1e6, norm_eps=1e-5,
            n_experts=8, top_k=2, capacity_factor=1.25,
        ),
        # The model `autopar demo` plans and trains on a local CPU mesh: small enough for a
        # few steps on 4 gloo ranks in seconds, big enough to show every kind of layout.
        "gpt-demo": _preset(
            gpt, "autopar demo",
            vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128, batch_size=8,
        ),
        # Tiny models for tests: every head count, width and the vocabulary divide by 4.
        "gpt-tiny": _preset(
            gpt, "tests",
            vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, batch_size=2,
        ),
        "llama-tiny": _preset(
            llama, "tests",
            vocab_size=64, seq_len=16, n_layer=2, n_head=8, n_kv_head=4, d_model=64,
            d_ff=128, batch_size=2,
        ),
        "moe-tiny": _preset(
            moe, "tests",
            vocab_size=64, seq_len=16, n_layer=2, n_head=8, n_kv_head=4, d_model=32,
            d_ff=64, n_experts=4, top_k=2, capacity_factor=1.25, batch_size=2,
        ),
        # Mixtral's sparse block as Hugging Face writes it (index_select / index_add per
        # expert, fixed shapes: examples/models/moe_sparse.py); capacity_factor
        # n_experts / top_k gives every expert room for every token, so none is dropped.
        "mixtral-sparse-tiny": _preset(
            moe, "tests",
            vocab_size=64, seq_len=16, n_layer=2, n_head=8, n_kv_head=4, d_model=32,
            d_ff=64, n_experts=4, top_k=2, capacity_factor=2.0, batch_size=2,
            dispatch="index",
        ),
        "mlp-tiny": _preset(
            mlp, "tests", d_in=16, d_hidden=64, d_out=16, n_layers=3, batch_size=4
        ),
        # ImageNet shapes: 224x224 images, 1000 classes
        "resnet18": _preset(resnet, _RESNET, layers=(2, 2, 2, 2), block="basic"),
        "resnet50": _preset(resnet, _RESNET, layers=(3, 4, 6, 3), block="bottleneck"),
        "vit-b16": _preset(vit, _VIT),
        # a ResNet of every kind of layer, small enough for tests on gloo ranks
        "resnet-tiny": _preset(
            resnet, "tests",
            layers=(1, 1, 1, 1), block="basic", width=8, num_classes=16, image_size=32,
            batch_size=8,
        ),
        "vit-tiny": _preset(
            vit, "tests",
            image_size=32, patch_size=8, d_model=32, n_layer=2, n_head=4, d_ff=64,
            num_classes=16, batch_size=8,
        ),
    }
)
# fmt: on


def build(name: str, **overrides: Any) -> Built:
    """Build preset ``name`` with ``overrides`` replacing config fields.

    Returns ``(model, example_inputs)``. Unknown names and fields are a UsageError.
    """
    preset = PRESETS.get(name)
    if preset is None:
        names = ", ".join(closest_first(name, PRESETS))
        raise UsageError(f"no model preset named {name!r}; known presets: {names}")
    return preset.factory(**{**preset.config, **overrides})


def gpt2_124m(**overrides: Any) -> Built:
    """GPT-2 small, 124M parameters."""
    return build("gpt2-124m", **overrides)


def gpt3_1p3b(**overrides: Any) -> Built:
    """GPT-3 XL, 1.3B parameters."""
    return build("gpt3-1.3b", **overrides)


def gpt3_6p7b(**overrides: Any) -> Built:
    """GPT-3 6.7B."""
    return build("gpt3-6.7b", **overrides)


def gpt3_13b(**overrides: Any) -> Built:
    """GPT-3 13B."""
    return build("gpt3-13b", **overrides)


def gpt3_175b(**overrides: Any) -> Built:
    """GPT-3 175B."""
    return build("gpt3-175b", **overrides)


def llama3_8b(**overrides: Any) -> Built:
    """Llama 3 8B."""
    return build("llama3-8b", **overrides)


def llama3_70b(**overrides: Any) -> Built:
    """Llama 3 70B."""
    return build("llama3-70b", **overrides)


def mixtral_8x7b(**overrides: Any) -> Built:
    """Mixtral 8x7B: 8 experts, top-2."""
    return build("mixtral-8x7b", **overrides)


def gpt_demo(**overrides: Any) -> Built:
    """The small GPT that ``autopar demo`` plans and trains."""
    return build("gpt-demo", **overrides)


def gpt_tiny(**overrides: Any) -> Built:
    """A ~28k-parameter GPT for tests."""
    return build("gpt-tiny", **overrides)


def llama_tiny(**overrides: Any) -> Built:
    """An ~82k-parameter Llama with grouped-query attention for tests."""
    return build("llama-tiny", **overrides)


def moe_tiny(**overrides: Any) -> Built:
    """A ~60k-parameter MoE transformer with 4 experts, top-2, for tests."""
    return build("moe-tiny", **overrides)


def resnet18(**overrides: Any) -> Built:
    """ResNet-18, 11.7M parameters, on 224x224 images."""
    return build("resnet18", **overrides)


def resnet50(**overrides: Any) -> Built:
    """ResNet-50, 25.6M parameters, on 224x224 images."""
    return build("resnet50", **overrides)


def vit_b16(**overrides: Any) -> Built:
    """ViT-B/16, 86.6M parameters, on 224x224 images."""
    return build("vit-b16", **overrides)


def resnet_tiny(**overrides: Any) -> Built:
    """A ResNet with one basic block a stage, 8 channels wide, on 32x32 images, for tests."""
    return build("resnet-tiny", **overrides)


def vit_tiny(**overrides: Any) -> Built:
    """A two-layer ViT on 32x32 images in 8x8 patches, for tests."""
    return build("vit-tiny", **overrides)


def mixtral_sparse_tiny(**overrides: Any) -> Built:
    """moe-tiny's sizes with Mixtral's sparse block (index_select / index_add), for tests."""
    return build("mixtral-sparse-tiny", **overrides)


def mlp_tiny(**overrides: Any) -> Built:
    """A 3-layer MLP, 16 -> 64 -> 64 -> 16, for tests."""
    return build("mlp-tiny", **overrides)
