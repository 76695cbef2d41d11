"""Work for ``test_calls.py``: a compiled model called as training scripts call it, at shapes
and in modes it was not traced for, next to the same calls on one device.

Each case compiles gpt-tiny (batch 4, sequence 16) on the ranks and then, with the same
weights on one device in fp32 and in float64 (``closeness``):

- calls forward at another batch (3: the last, partial batch), another sequence length (9)
  and both;
- trains three AdamW steps on batches of 4, 4 and 3 (a partial last batch), the loss
  computed from forward's outputs, or with ``loss_fn``, three ``train_step``s on batches of
  8, 8 and 6 (microbatches of 4, then 4 and 2);
- with dropout, calls forward in eval mode (dropout off), as ``model.eval()`` asks.

Every rank returns its outputs, losses and gathered parameters, and the plans of the calls
its compiled model made.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar_examples.models import build

VOCAB = 64  # gpt-tiny's
MESH = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _batches(sizes: list[tuple[int, int]], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, size, generator=generator),
            torch.randint(0, VOCAB, size, generator=generator),
        )
        for size in sizes
    ]


def _train(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    step: Any,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW steps over ``batches`` (``step(model, x, y)`` returns the step's loss); the
    losses and the parameters after the last step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        losses.append(float(step(model, x, y)))
        optimizer.step()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _forward_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = _loss(model(x), y)
    loss.backward()
    return loss.detach()


def _reference_step(size: int) -> Any:
    """What ``train_step`` computes, on one device: the mean over microbatches of ``size``
    (the last smaller) weighted by their sizes."""

    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=next(model.parameters()).dtype)
        for start in range(0, x.shape[0], size):
            part = slice(start, start + size)
            loss = _loss(model(x[part]), y[part]) * (x[part].shape[0] / x.shape[0])
            loss.backward()
            total += loss.detach()
        return total

    return step


def _full(compiled: Any) -> dict[str, torch.Tensor]:
    return {n: compiled.full_parameter(n) for n, _ in compiled.named_parameters()}


def _three(model: nn.Module, run: Any) -> dict[str, Any]:
    """``run(model)`` on one device in fp32 and in float64: the reference and its roundoff."""
    return {"single": run(copy.deepcopy(model)), "exact": run(copy.deepcopy(model).double())}


def _forward_case(model: nn.Module, tokens: torch.Tensor, options: dict[str, Any]) -> Any:
    compiled = autopar.compile(copy.deepcopy(model), MESH, example_inputs=(tokens,), **options)
    inputs = [x for x, _ in _batches([(3, 16), (4, 9), (2, 9)], seed=2)]
    with torch.no_grad():
        outputs = [compiled(x) for x in inputs]
    batches = _batches([(4, 16), (4, 16), (3, 16)], seed=3)
    losses, _ = _train(compiled, batches, _forward_step)
    return compiled, {
        "outputs": outputs,
        "reference": _three(model, lambda m: [m(x).detach() for x in inputs]),
        "losses": losses,
        "params": _full(compiled),
        "trained": _three(model, lambda m: _train(m, batches, _forward_step)),
    }


def _train_step_case(model: nn.Module, tokens: torch.Tensor, options: dict[str, Any]) -> Any:
    compiled = autopar.compile(
        copy.deepcopy(model),
        MESH,
        example_inputs=(tokens,),
        loss_fn=_loss,
        global_batch=8,
        microbatches=2,
        stages=1,
        **options,
    )
    batches = _batches([(8, 16), (8, 16), (6, 16)], seed=4)
    losses, _ = _train(compiled, batches, lambda m, x, y: m.train_step(x, y))
    return compiled, {
        "losses": losses,
        "params": _full(compiled),
        "trained": _three(model, lambda m: _train(m, batches, _reference_step(4))),
    }


def _eval_case(model: nn.Module, tokens: torch.Tensor, options: dict[str, Any]) -> Any:
    compiled = autopar.compile(copy.deepcopy(model), MESH, example_inputs=(tokens,), **options)
    compiled.eval()
    with torch.no_grad():
        outputs = [compiled(tokens)]
    compiled.train()
    model.eval()
    return compiled, {
        "outputs": outputs,
        "reference": _three(model, lambda m: [m(tokens).detach()]),
    }


CASES = {"forward": _forward_case, "train_step": _train_step_case, "eval": _eval_case}


def call_shapes(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        torch.manual_seed(0)
        model, (tokens,) = build("gpt-tiny", batch_size=4, **case.get("config", {}))
        options = {"force": case.get("force"), "zero": case.get("zero")}
        if case.get("offload"):
            options["hints"] = {"offload": case["offload"]}
        compiled, result = CASES[case["kind"]](model, tokens, options)
        result["case"] = case
        result["plans"] = [
            {
                "parallelism": str(plan.parallelism),
                "params": {n: (str(p.param), str(p.optimizer)) for n, p in plan.params.items()},
                "batch": plan.global_batch,
                "offload": plan.offload.kinds,
            }
            for plan in compiled.call_plans
        ]
        results.append(result)
    return results
