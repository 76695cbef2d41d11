"""Work for ``test_frozen.py``: a model with a frozen parameter (``requires_grad=False``,
as fine-tuning leaves the layers it does not train) compiled in several styles, trained
two SGD steps over ``compiled.parameters()`` as a user's loop does."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import autopar


class PartlyFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 16)
        self.trained = nn.Linear(16, 8)
        self.positions = nn.Parameter(torch.randn(4, 8), requires_grad=False)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(torch.relu(self.frozen(x + self.positions))).pow(2).mean()


def _train(model: nn.Module, x: torch.Tensor) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def train_partly_frozen(rank: int, world: int, styles: list[dict[str, Any]]) -> list[dict]:
    results = []
    for options in styles:
        torch.manual_seed(0)
        model, x = PartlyFrozen(), torch.randn(4, 8)
        reference = copy.deepcopy(model)
        expected = _train(reference, x)
        mesh = autopar.Mesh((2, 2), device="cpu")
        compiled = autopar.compile(model, mesh, example_inputs=(x,), **options)
        flags = {n: p.requires_grad for n, p in compiled.named_parameters()}
        got = _train(compiled, x)
        results.append(
            {
                "options": options,
                "flags": flags,
                "losses": got,
                "ref_losses": expected,
                "params": {n: compiled.full_parameter(n) for n, _ in reference.named_parameters()},
                "ref_params": {n: p.detach() for n, p in reference.named_parameters()},
            }
        )
    return results
