"""Train a tiny example model single-device and compiled, side by side, on each rank.

Used by the multi-rank equivalence tests: every rank builds the same model (same seed),
runs 3 AdamW steps on it alone (the reference) and on its compiled copy, and returns the
losses, the gathered gradients of the first step and the gathered parameters and buffers
(batch norms' running statistics) after the last, for the test to compare. Rank 0 also
trains the model alone in float64, which measures the fp32 roundoff the comparison allows
(``tests.autopar.runtime.closeness``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

import autopar
from autopar.runtime.shards import local_of
from autopar_examples.models import build
from tests.autopar.runtime.closeness import in_float64

STEPS = 3


def loss_of(name: str, output: Any, target: torch.Tensor) -> torch.Tensor:
    if name == "mlp-tiny":
        return F.mse_loss(output, target)
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_case(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    torch.manual_seed(0)
    model, inputs = build(name, batch_size=4)
    generator = torch.Generator().manual_seed(1)
    if name == "mlp-tiny":
        target = torch.randn(inputs[0].shape[0], 16, generator=generator)
    elif hasattr(model, "lm_head"):  # a language model: a token per position
        vocab = model.lm_head.weight.shape[0]
        target = torch.randint(0, vocab, inputs[0].shape, generator=generator)
    else:  # an image classifier: a class per image
        classes = model.head.weight.shape[0]
        target = torch.randint(0, classes, inputs[0].shape[:1], generator=generator)
    return model, inputs, target


def exact_run(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, name: str
) -> dict[str, Any]:
    """Losses, first gradients and final parameters of the single-device run in float64."""
    exact, inputs64, target64 = in_float64(model, inputs, target)
    losses, grads, _ = train(
        exact,
        inputs64,
        target64,
        name,
        lambda: {n: p.grad.clone() for n, p in exact.named_parameters()},
    )
    return {
        "exact_losses": losses,
        "exact_grads": grads,
        "exact_params": {n: p.detach() for n, p in exact.named_parameters()},
        "exact_buffers": dict(exact.named_buffers()),
    }


def train(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    target: torch.Tensor,
    name: str,
    gradients: Any,
) -> tuple[list[float], dict[str, torch.Tensor], torch.optim.Optimizer]:
    # eps: some parameters have an exactly zero true gradient (GPT's key bias: softmax is
    # shift-invariant), so both runs hold only roundoff (~1e-10) there, different in each
    # (sums run in another order). Adam divides by sqrt(v) + eps and, with the default
    # eps=1e-8, turns that roundoff into steps of the size of lr, in random directions. With
    # eps=1e-3 a zero gradient moves nothing and a real one still takes a normalised step.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    losses, first_grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(name, model(*inputs), target)
        loss.backward()
        if step == 0:
            first_grads = gradients()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, first_grads, optimizer


def compare(
    rank: int, world_size: int, shape: tuple[int, ...], cases: list[tuple[Any, ...]]
) -> list[dict[str, Any]]:
    """Run each (model, style[, options]) case on a mesh of ``shape``; rank 0 returns the
    tensors. ``options`` go to ``autopar.compile`` (``{"zero": 2}``)."""
    names = ("dp", "tp") if len(shape) == 2 else ("x",)
    mesh = autopar.Mesh(shape, names, device="cpu")
    results = []
    for name, style, *more in cases:
        options = more[0] if more else {}
        model, inputs, target = make_case(name)
        exact = exact_run(model, inputs, target, name) if rank == 0 else {}
        buffer_names = [n for n, _ in model.named_buffers()]
        if rank == 0:  # the references on rank 0 alone, which reports
            reference = copy.deepcopy(model)
            ref_losses, ref_grads, _ = train(
                reference,
                inputs,
                target,
                name,
                lambda ref=reference: {n: p.grad.clone() for n, p in ref.named_parameters()},
            )
        compiled = autopar.compile(model, mesh, example_inputs=inputs, force=style, **options)
        names_ = list(compiled.plan.params)
        losses, grads, optimizer = train(
            compiled,
            inputs,
            target,
            name,
            lambda c=compiled, ns=names_: {n: c.full_gradient(n) for n in ns},
        )
        params = {n: compiled.full_parameter(n) for n in names_}
        # what the steps changed besides the parameters (batch norms' running statistics)
        state = compiled.state_dict()
        buffers = {n: state[n] for n in buffer_names if n in state}
        if rank == 0:
            ref_params = dict(reference.named_parameters())
            results.append(
                {
                    "case": f"{name}/{style or 'free'}"
                    + "".join(f"/{k}={v}" for k, v in options.items()),
                    "state_fraction": _state_fraction(optimizer, compiled),
                    "parallelism": compiled.plan.parallelism.model_dump(),
                    "losses": losses,
                    "ref_losses": ref_losses,
                    "grads": grads,
                    "ref_grads": {n: ref_grads[n] for n in names_},
                    "params": params,
                    "ref_params": {n: ref_params[n].detach() for n in names_},
                    "exact_losses": exact["exact_losses"],
                    "exact_grads": {n: exact["exact_grads"][n] for n in names_},
                    "exact_params": {n: exact["exact_params"][n] for n in names_},
                    "buffers": buffers,
                    "ref_buffers": {n: b for n, b in reference.named_buffers() if n in buffers},
                    "exact_buffers": {n: exact["exact_buffers"][n] for n in buffers},
                }
            )
    return results


def _state_fraction(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> float:
    """This rank's Adam state values over the whole model's parameter count (the state of a
    DTensor parameter is a DTensor: its local shard is what this rank holds)."""
    held = sum(local_of(s["exp_avg"]).numel() for s in optimizer.state.values() if "exp_avg" in s)
    whole = sum(_count(info.shape) for info in model.plan.params.values())
    return held / whole


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
