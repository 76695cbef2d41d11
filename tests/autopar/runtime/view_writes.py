"""Work for ``test_view_writes.py``: the model of ``tests/passes/test_functionalize.py``
trained one step compiled on 2x2 gloo ranks next to one device (fp32 and float64)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import autopar
from tests.passes.test_functionalize import WritesThroughViews


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, dict[str, Any]]:
    loss = model(x).pow(2).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def compare_view_writes(rank: int, world: int, styles: list[str | None]) -> list[dict[str, Any]]:
    results = []
    for style in styles:
        torch.manual_seed(0)
        model, x = WritesThroughViews(), torch.randn(8, 8)
        ref_loss, ref_grads = _step(copy.deepcopy(model), x.clone())
        exact_loss, exact_grads = _step(copy.deepcopy(model).double(), x.double())
        compiled = autopar.compile(
            model, autopar.Mesh((2, 2), device="cpu"), example_inputs=(x,), force=style
        )
        loss = compiled(x.clone()).pow(2).mean()
        loss.backward()
        grads = {n: compiled.full_gradient(n) for n in ref_grads}
        results.append(
            {
                "case": style or "free",
                "losses": [float(loss.detach())],
                "ref_losses": [ref_loss],
                "exact_losses": [exact_loss],
                "grads": grads,
                "ref_grads": ref_grads,
                "exact_grads": exact_grads,
            }
        )
    return results
