"""Measure what autograd saves on each rank during a compiled forward, next to the plan.

Run on every rank by ``run_ranks`` (``test_activation_memory.py``): for each case, compile
the model under a forced style (and, for recompute cases, a memory limit that calls for
it), count the bytes of the distinct storages autograd saves in one forward
(``saved_tensors_hooks``; parameters and inputs excluded: they live anyway), then run
backward and gather every gradient next to the single-device model's.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

import autopar
from autopar.runtime.shards import local_of
from autopar_examples.models import build


def saved_bytes(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves in ``module(*inputs)``, and the output."""
    live = {local_of(p).untyped_storage().data_ptr() for p in module.parameters()}
    live |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    live |= {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in live:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    return sum(seen.values()), out


def _loss(out: Any) -> torch.Tensor:
    logits = out[0] if isinstance(out, tuple | list) else out
    return logits.float().square().mean()


def measure(
    rank: int,
    world: int,
    shape: tuple[int, ...],
    cases: list[tuple[str, str | None, dict[str, Any], str]],
) -> list[dict[str, Any]]:
    """Per case (model, style, compile options, label): the bytes saved on this rank next to
    the plan's activations, and the gradients next to the single-device model's (under
    bf16_mixed, the single-device model runs under the same autocast)."""
    mesh = autopar.Mesh(shape, device="cpu")
    results = []
    for name, style, options, label in cases:
        torch.manual_seed(0)
        model, inputs = build(name, batch_size=8)
        reference = copy.deepcopy(model)
        with precision_context(options.get("precision", "fp32")):
            _loss(reference(*inputs)).backward()
        compiled = autopar.compile(model, mesh, example_inputs=inputs, force=style, **options)
        measured, out = saved_bytes(compiled, inputs)
        _loss(out).backward()
        grads = {n: compiled.full_gradient(n) for n, _ in reference.named_parameters()}
        plan = compiled.plan
        results.append(
            {
                "case": f"{name}/{style}/{label}",
                "measured": measured,
                "estimated": plan.estimate.memory_per_device_bytes.activations,
                "recompute": [(r.kind, len(r.layers)) for r in plan.recompute],
                "freed": sum(r.saved_bytes for r in plan.recompute),
                "grads": grads,
                "ref_grads": {n: p.grad for n, p in reference.named_parameters()},
            }
        )
    return results


def precision_context(precision: str) -> contextlib.AbstractContextManager[object]:
    """The autocast a single-device run of ``precision`` runs in."""
    if precision == "bf16_mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def recompute_limit(name: str, shape: tuple[int, ...], style: str, fraction: float) -> str:
    """A memory limit that leaves ``fraction`` of the plain plan's activations: the states
    stay as they are (``zero=0``), so only recomputation can make it fit."""
    model, inputs = build(name, batch_size=8, device="meta")
    mesh = autopar.Mesh(shape, device="cpu")
    memory = autopar.plan(model, mesh, inputs, force=style, zero=0).estimate.memory_per_device_bytes
    return f"{int(memory.total - (1 - fraction) * memory.activations)}B"
