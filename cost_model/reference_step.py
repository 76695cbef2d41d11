"""A fixed reference training step, timed by ``autopar calibrate``, that tells how much
slower ops run inside a step than each alone.

The op figures (``op_rates``, copy bandwidth, op overhead) are measured op by op, each on
inputs it has just used: caches warm, the allocator idle. In a training step the weights,
activations and gradients of the other ops pass through the same caches, and each op's
inputs come from the op before in whatever layout it left them. On one CPU thread a small
decoder's step took 1.34x the sum of its ops' predicted times (attention's backward 3.4x,
element-wise multiplies 2x, matmuls 1.2x). ``autopar calibrate`` times this step's
forward and backward and fits the preset's ``in_step`` to it (``autopar_passes.reference_step``).

The model is a GPT-style decoder (pre-norm blocks of causal attention and a GELU MLP),
fixed here so that every calibration times the same work; it is not one of the models a
benchmark measures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL, HEADS, LAYERS, SEQ, BATCH = 256, 8, 2, 128, 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.up, self.down = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        heads = [z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ReferenceModel(nn.Module):
    """The reference decoder; its loss is the mean square of the last block's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def reference_step(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[ReferenceModel, torch.Tensor]:
    """The reference model and its input, seeded alike on every call."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ReferenceModel().to(device=device, dtype=dtype)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=generator).to(device=device, dtype=dtype)
    return model, x


def step_runner(device: torch.device) -> Callable[[], None]:
    """A callable running one forward and backward of the reference step (fp32)."""
    model, x = reference_step(device)
    x.requires_grad_()

    def run() -> None:
        model(x).backward()
        model.zero_grad(set_to_none=True)
        x.grad = None

    return run
