"""ResNet (He et al. 2016, "Deep Residual Learning for Image Recognition"): the image
classifier of the seed texts' large-batch data-parallel runs.

>>> model, (images,) = resnet(layers=(1, 1, 1, 1), block="basic", width=8, num_classes=10,
...                           image_size=32, batch_size=2)
>>> model(images).shape
torch.Size([2, 10])

A 7x7 stride-2 stem and a 3x3 max pool, four stages of residual blocks (the first at the
stem's width, each next one twice as wide at half the resolution), global average pooling
and a linear classifier. ``block="basic"`` is two 3x3 convolutions (ResNet-18 and -34);
``"bottleneck"`` is 1x1, 3x3, 1x1 with 4x expansion (ResNet-50, -101, -152), the stride in
the 3x3 convolution as the widely used "v1.5" puts it. Every convolution is followed by
batch normalization; a block whose shape changes projects its shortcut with a 1x1
convolution. Parameter counts match the published models: ResNet-18 11,689,512,
ResNet-50 25,557,032.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autopar_examples.models._build import (
    Built,
    check_positive,
    is_meta,
    make_config,
    normalize_dtype,
)
from autopar_plans.errors import UsageError

EXPANSION = {"basic": 1, "bottleneck": 4}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResNetConfig:
    layers: tuple[int, ...]
    """Residual blocks per stage (ResNet-18: (2, 2, 2, 2); ResNet-50: (3, 4, 6, 3))."""
    block: str = "basic"
    """"basic" (two 3x3 convolutions) or "bottleneck" (1x1, 3x3, 1x1, 4x wider out)."""
    width: int = 64
    """Channels of the stem and of the first stage's 3x3 convolutions."""
    num_classes: int = 1000
    image_size: int = 224
    """Height and width of the example images."""
    in_channels: int = 3
    batch_size: int = 1
    """Images in the example batch."""
    device: str | torch.device = "cpu"
    dtype: torch.dtype | str = torch.float32

    def __post_init__(self) -> None:
        check_positive(self, "width", "num_classes", "image_size", "in_channels", "batch_size")
        if self.block not in EXPANSION:
            raise UsageError(
                f"ResNetConfig.block must be 'basic' or 'bottleneck', not {self.block!r}"
            )
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or any(not isinstance(n, int) or n < 1 for n in self.layers):
            raise UsageError(f"ResNetConfig.layers must be positive ints, not {self.layers!r}")
        normalize_dtype(self)


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int, cfg: ResNetConfig) -> nn.Sequential:
    """A bias-free convolution ("same" padding for odd kernels) and its batch norm."""
    factory = {"device": cfg.device, "dtype": cfg.dtype}
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False, **factory),
        nn.BatchNorm2d(c_out, **factory),
    )


class Block(nn.Module):
    """One residual block: ``relu(body(x) + shortcut(x))``."""

    def __init__(self, c_in: int, planes: int, stride: int, cfg: ResNetConfig) -> None:
        super().__init__()
        c_out = planes * EXPANSION[cfg.block]
        if cfg.block == "basic":
            self.body = nn.Sequential(
                _conv_bn(c_in, planes, 3, stride, cfg),
                nn.ReLU(),
                _conv_bn(planes, c_out, 3, 1, cfg),
            )
        else:
            self.body = nn.Sequential(
                _conv_bn(c_in, planes, 1, 1, cfg),
                nn.ReLU(),
                _conv_bn(planes, planes, 3, stride, cfg),
                nn.ReLU(),
                _conv_bn(planes, c_out, 1, 1, cfg),
            )
        self.shortcut = (
            _conv_bn(c_in, c_out, 1, stride, cfg) if stride != 1 or c_in != c_out else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))  # (B, c_out, H / stride, W / stride)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _conv_bn(cfg.in_channels, cfg.width, 7, 2, cfg),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, c_in = [], cfg.width
        for stage, count in enumerate(cfg.layers):
            planes = cfg.width * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(Block(c_in, planes, stride, cfg))
                c_in = planes * EXPANSION[cfg.block]
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c_in, cfg.num_classes, device=cfg.device, dtype=cfg.dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(images))  # (B, C, H / 32, W / 32)
        return self.head(self.pool(x).flatten(1))  # (B, C), then (B, num_classes)


@torch.no_grad()
def _init(model: ResNet) -> None:
    """He normal (fan out) for convolutions, as the paper; batch norms at gain 1, shift 0;
    the classifier as ``nn.Linear`` makes it (uniform), seeded by the caller."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")


def resnet(**config: object) -> Built:
    """Build a ResNet from the fields of :class:`ResNetConfig`; returns ``(model,
    (images,))``, images of shape (batch_size, in_channels, image_size, image_size)."""
    cfg = make_config(ResNetConfig, config)
    model = ResNet(cfg)
    shape = (cfg.batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
    if is_meta(cfg.device):
        return model, (torch.empty(shape, device=cfg.device, dtype=cfg.dtype),)
    _init(model)
    images = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return model, (images.to(device=cfg.device, dtype=cfg.dtype),)
