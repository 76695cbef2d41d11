"""Example models for autopar: plain single-device ``nn.Module``s, configurable, by name.

Every factory returns ``(model, example_inputs)`` for ``model(*example_inputs)``:

>>> from autopar_examples.models import build, llama3_8b
>>> model, (idx,) = llama3_8b(device="meta", n_layer=2)   # shapes only, no weights
>>> model, inputs = build("gpt-tiny")                      # real weights, runs on CPU

Model families (each a factory over a config dataclass): :func:`gpt`, :func:`llama`,
:func:`moe`, :func:`mlp`, :func:`resnet`, :func:`vit`. Published sizes and tiny test sizes:
:data:`PRESETS`.
"""

from autopar_examples.models._build import Built
from autopar_examples.models.gpt import GPTConfig, gpt
from autopar_examples.models.llama import LlamaConfig, llama
from autopar_examples.models.mlp import MLPConfig, mlp
from autopar_examples.models.moe import MoEConfig, moe
from autopar_examples.models.presets import (
    PRESETS,
    Preset,
    build,
    gpt2_124m,
    gpt3_1p3b,
    gpt3_6p7b,
    gpt3_13b,
    gpt3_175b,
    gpt_demo,
    gpt_tiny,
    llama3_8b,
    llama3_70b,
    llama_tiny,
    mixtral_8x7b,
    mixtral_sparse_tiny,
    mlp_tiny,
    moe_tiny,
    resnet18,
    resnet50,
    resnet_tiny,
    vit_b16,
    vit_tiny,
)
from autopar_examples.models.resnet import ResNetConfig, resnet
from autopar_examples.models.vit import ViTConfig, vit

__all__ = [
    "PRESETS",
    "Built",
    "GPTConfig",
    "LlamaConfig",
    "MLPConfig",
    "MoEConfig",
    "Preset",
    "ResNetConfig",
    "ViTConfig",
    "build",
    "gpt",
    "gpt2_124m",
    "gpt3_1p3b",
    "gpt3_6p7b",
    "gpt3_13b",
    "gpt3_175b",
    "gpt_demo",
    "gpt_tiny",
    "llama",
    "llama3_8b",
    "llama3_70b",
    "llama_tiny",
    "mixtral_8x7b",
    "mixtral_sparse_tiny",
    "mlp",
    "mlp_tiny",
    "moe",
    "moe_tiny",
    "resnet",
    "resnet18",
    "resnet50",
    "resnet_tiny",
    "vit",
    "vit_b16",
    "vit_tiny",
]
