"""Work for ``test_zoo.py``: Hugging Face families built tiny (``autopar_examples.models.
hf_zoo``), one training step compiled on gloo ranks next to the same step on one device.

Per case (family, forced style or None): the model's own loss on its example batch, then
every parameter's gradient (gathered), on one device in fp32 and in float64 (rank 0) and
compiled; an SGD step would move every parameter by its gradient, so equal gradients are
equal parameters after one step.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import autopar
from autopar_examples.models.hf_zoo import double_inputs, hf_tiny, in_float64


def _step(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    loss = model(**kwargs).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def compare_zoo(
    rank: int, world: int, shape: tuple[int, ...], cases: list[tuple[str, str | None]]
) -> list[dict[str, Any]]:
    names = ("dp", "tp") if len(shape) == 2 else ("x",)
    mesh = autopar.Mesh(shape, names, device="cpu")
    results = []
    for family, style in cases:
        model, kwargs = hf_tiny(family)
        # the references on rank 0 alone, which reports (the others would only repeat them)
        ref_loss, ref_grads = _step(copy.deepcopy(model), kwargs) if rank == 0 else (0.0, {})
        exact_loss, exact_grads = (
            _step(in_float64(model), double_inputs(kwargs)) if rank == 0 else (0.0, {})
        )
        compiled = autopar.compile(model, mesh, example_kwargs=kwargs, force=style)
        loss = compiled(**kwargs).loss
        loss.backward()
        # collective: every rank, each parameter by its name
        grads = {n: compiled.full_gradient(n) for n, _ in model.named_parameters()}
        if rank == 0:
            results.append(
                {
                    "case": f"{family}/{style or 'free'}",
                    "parallelism": compiled.plan.parallelism.model_dump(),
                    "losses": [float(loss.detach())],
                    "ref_losses": [ref_loss],
                    "exact_losses": [exact_loss],
                    "grads": grads,
                    "ref_grads": ref_grads,
                    "exact_grads": exact_grads,
                }
            )
    return results
