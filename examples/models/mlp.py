"""A plain multi-layer perceptron: ``n_layers`` Linear layers with GELU between them.

>>> model, (x,) = mlp(d_in=16, d_hidden=64, d_out=8, n_layers=3, batch_size=4)
>>> model(x).shape
torch.Size([4, 8])
>>> [name for name, _ in model.named_parameters()][:2]
['layers.0.weight', 'layers.0.bias']

The smallest model on which a planner's choices have closed forms: pure data parallel
costs exactly the gradient all-reduces; two layers on a tensor-parallel axis go
column-parallel then row-parallel with one all-reduce (Megatron).
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from autopar_examples.models._build import (
    Built,
    check_positive,
    init_weights,
    is_meta,
    make_config,
    normalize_dtype,
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MLPConfig:
    d_in: int
    """Input features."""
    d_hidden: int
    """Width of every hidden layer."""
    d_out: int
    """Output features."""
    n_layers: int
    """Number of Linear layers: d_in -> d_hidden -> ... -> d_hidden -> d_out (1: d_in -> d_out)."""
    batch_size: int = 1
    """B of the example inputs."""
    bias: bool = True
    """Biases in every Linear."""
    device: str | torch.device = "cpu"
    """Where the weights live; "meta" builds shapes only and skips init."""
    dtype: torch.dtype | str = torch.float32
    """Dtype of the weights and the example inputs; a name such as "bfloat16" is accepted."""

    def __post_init__(self) -> None:
        check_positive(self, "d_in", "d_hidden", "d_out", "n_layers", "batch_size")
        normalize_dtype(self)


class DenseLayer(nn.Linear):
    """A Linear followed by GELU (exact, erf form) unless it is the output layer.

    A subclass rather than a wrapper so that parameters are named ``layers.{i}.weight`` and
    the GELU is still traced inside ``layers.{i}``.
    """

    def __init__(self, d_in: int, d_out: int, activate: bool, cfg: MLPConfig) -> None:
        super().__init__(d_in, d_out, bias=cfg.bias, device=cfg.device, dtype=cfg.dtype)
        self.activate = activate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # (B, d_out)
        return F.gelu(y) if self.activate else y


class MLP(nn.Module):
    """``layers.0`` ... ``layers.{n_layers-1}``; GELU after every layer but the last."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        dims = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [cfg.d_out]
        last = cfg.n_layers - 1
        self.layers = nn.ModuleList(
            DenseLayer(dims[i], dims[i + 1], activate=i < last, cfg=cfg)
            for i in range(cfg.n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # (B, d_hidden), then (B, d_out) after the last layer
        return x


def mlp(**config: object) -> Built:
    """Build an MLP from the fields of :class:`MLPConfig`; returns ``(model, (x,))``."""
    cfg = make_config(MLPConfig, config)
    model = MLP(cfg)
    if is_meta(cfg.device):
        x = torch.empty(cfg.batch_size, cfg.d_in, device=cfg.device, dtype=cfg.dtype)
    else:
        init_weights(model, n_residual=1)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(cfg.batch_size, cfg.d_in, generator=generator)
        x = x.to(device=cfg.device, dtype=cfg.dtype)
    return model, (x,)
