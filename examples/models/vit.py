"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

>>> model, (images,) = vit(image_size=32, patch_size=8, d_model=32, n_layer=2, n_head=4,
...                        d_ff=64, num_classes=10, batch_size=2)
>>> model(images).shape
torch.Size([2, 10])

The image is cut into patches by a convolution whose kernel and stride are the patch size,
a learned class token is put before them and learned positions added; pre-norm encoder
layers (attention, then a GELU MLP, each in a residual branch); the class token's final
state, normalized, is classified by a linear head. ViT-B/16 has 86,567,656 parameters.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from autopar_examples.models._build import (
    Built,
    check_divides,
    check_positive,
    init_weights,
    is_meta,
    make_config,
    normalize_dtype,
)
from autopar_plans.errors import UsageError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    d_ff: int = 3072
    num_classes: int = 1000
    in_channels: int = 3
    norm_eps: float = 1e-6
    batch_size: int = 1
    device: str | torch.device = "cpu"
    dtype: torch.dtype | str = torch.float32

    def __post_init__(self) -> None:
        check_positive(
            self, "image_size", "patch_size", "d_model", "n_layer", "n_head", "d_ff",
            "num_classes", "in_channels", "batch_size",
        )  # fmt: skip
        check_divides(self, "n_head", "d_model")
        if self.image_size % self.patch_size:
            raise UsageError(
                f"ViTConfig: patch_size={self.patch_size} must divide image_size={self.image_size}"
            )
        normalize_dtype(self)

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, **factory)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, **factory)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, **factory)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, **factory)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, **factory)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, 1 + patches, C)
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)  # (B, nh, T, hs), every token sees all
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.patches = nn.Conv2d(
            cfg.in_channels, cfg.d_model, cfg.patch_size, cfg.patch_size, **factory
        )
        self.class_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model, **factory))
        self.positions = nn.Parameter(torch.zeros(1, 1 + cfg.n_patches, cfg.d_model, **factory))
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, **factory)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes, **factory)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)  # (B, patches, C)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        for layer in self.layers:
            x = layer(x)  # (B, 1 + patches, C)
        return self.head(self.ln_f(x[:, 0]))  # the class token: (B, num_classes)


def vit(**config: object) -> Built:
    """Build a ViT from the fields of :class:`ViTConfig`; returns ``(model, (images,))``."""
    cfg = make_config(ViTConfig, config)
    model = ViT(cfg)
    shape = (cfg.batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
    if is_meta(cfg.device):
        return model, (torch.empty(shape, device=cfg.device, dtype=cfg.dtype),)
    init_weights(model, n_residual=2 * cfg.n_layer, residual=("proj.weight", "fc_out.weight"))
    images = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return model, (images.to(device=cfg.device, dtype=cfg.dtype),)
