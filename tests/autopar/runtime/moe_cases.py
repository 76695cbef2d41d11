"""Train tiny mixture-of-experts models single-device and compiled, side by side, per rank.

Used by ``test_moe.py``: every rank builds the same model (same seed), runs ``STEPS`` AdamW
steps on it alone (the reference) and on its compiled copy, the loss being cross-entropy
plus the model's load-balancing loss, and returns the losses, the gathered gradients of the
first step, the gathered parameters after the last step and the plan's summary. Rank 0
also trains the reference in float64, which measures the fp32 roundoff the comparison
allows (``tests.autopar.runtime.closeness``).

A ``drops`` case compiles one MoE layer alone (:class:`SlotsTaken`), whose outputs include
how many expert slots each token got in the first step: 0 for a token dropped by every
expert it chose, so the test can compare which tokens overflowed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar_examples.models import build
from autopar_examples.models.moe import MoE, load_balancing_loss
from tests.autopar.runtime.closeness import in_float64

STEPS = 2
D_MODEL = 32  # moe-tiny's width


class SlotsTaken(nn.Module):
    """One GShard MoE layer: (output, slots taken per token (G, S), balancing loss)."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        groups = self.moe.groups(x)  # (G, S, d)
        routing, probs = self.moe.route_tokens(groups)
        y = self.moe.dispatch_and_combine(groups, routing)  # (G, S, d)
        taken = routing.dispatch.sum(dim=(2, 3))  # (G, S)
        return y, taken, load_balancing_loss(probs, routing.first_choice)


def make_case(
    name: str, config: dict[str, Any]
) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """The model, its inputs and the target. ``name`` "drops" is :class:`SlotsTaken` over
    moe-tiny's first layer, on random activations."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "drops":
        model, (tokens,) = build("moe-tiny", **config)
        layer = SlotsTaken(model.layers[0].moe)
        x = torch.randn(*tokens.shape, D_MODEL, generator=generator)
        return layer, (x,), torch.randn(*tokens.shape, D_MODEL, generator=generator)
    model, (tokens,) = build(name, **config)
    vocab = model.lm_head.weight.shape[0]
    return model, (tokens,), torch.randint(0, vocab, tokens.shape, generator=generator)


def loss_of(output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus the balancing loss (a regression loss for a ``drops`` layer)."""
    if len(output) == 3:
        y, _, aux = output
        return F.mse_loss(y.reshape(target.shape), target) + aux
    logits, aux = output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) + aux


def _train(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, gradients: Any
) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor | None]:
    # eps=1e-3: see tests/autopar/runtime/equivalence.py
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    losses, first_grads, taken = [], {}, None
    for step in range(STEPS):
        optimizer.zero_grad()
        output = model(*inputs)
        loss = loss_of(output, target)
        loss.backward()
        if step == 0:
            first_grads = gradients()
            taken = output[1].detach().clone() if len(output) == 3 else None
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, first_grads, taken


def compare(
    rank: int, world_size: int, cases: list[tuple[str, str, tuple, tuple, str | None, dict]]
) -> list[dict[str, Any]]:
    """Run each ``(case id, model, mesh shape, axis names, style, config)``; rank 0 returns
    the tensors, the other ranks their losses."""
    results = []
    for case, name, shape, axes, style, config in cases:
        mesh = autopar.Mesh(shape, axes, device="cpu")
        model, inputs, target = make_case(name, config)
        if rank == 0:
            exact, inputs64, target64 = in_float64(model, inputs, target)
            exact_losses, exact_grads, _ = _train(
                exact,
                inputs64,
                target64,
                lambda ex=exact: {n: p.grad.clone() for n, p in ex.named_parameters()},
            )
        reference = copy.deepcopy(model)
        ref_losses, ref_grads, ref_taken = _train(
            reference,
            inputs,
            target,
            lambda ref=reference: {n: p.grad.clone() for n, p in ref.named_parameters()},
        )
        compiled = autopar.compile(model, mesh, example_inputs=inputs, force=style)
        names = list(compiled.plan.params)
        losses, grads, taken = _train(
            compiled,
            inputs,
            target,
            lambda c=compiled, ns=names: {n: c.full_gradient(n) for n in ns},
        )
        params = {n: compiled.full_parameter(n) for n in names}
        result: dict[str, Any] = {"case": case, "losses": losses}
        if rank == 0:
            ref_params = dict(reference.named_parameters())
            exact_params = dict(exact.named_parameters())
            result.update(
                parallelism=compiled.plan.parallelism.model_dump(),
                estimate=compiled.plan.estimate.model_dump(),
                warnings=list(compiled.plan.warnings),
                expert_layouts={
                    n: str(p.param) for n, p in compiled.plan.params.items() if "experts" in n
                },
                ref_losses=ref_losses,
                grads=grads,
                ref_grads={n: ref_grads[n] for n in names},
                params=params,
                ref_params={n: ref_params[n].detach() for n in names},
                exact_losses=exact_losses,
                exact_grads={n: exact_grads[n] for n in names},
                exact_params={n: exact_params[n].detach() for n in names},
                taken=taken,
                ref_taken=ref_taken,
            )
        results.append(result)
    return results
