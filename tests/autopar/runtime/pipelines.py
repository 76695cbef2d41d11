"""Train a tiny example model with ``train_step`` next to the single-device model, per rank.

Used by the multi-rank pipeline tests: every rank builds the same model (same seed) with a
batch large enough for the microbatches, runs ``STEPS`` AdamW steps on it alone (the
reference: one forward and backward over the whole batch) and on its compiled copy
(``compiled.train_step``), and returns the losses, the first step's gradients (gathered over
each stage's mesh, from the stage that holds each parameter) and the parameters after the
last step, for the test to compare. Rank 0 also trains the reference in float64, which measures the
fp32 roundoff the comparison allows (``tests.autopar.runtime.closeness``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

import autopar
from autopar_examples.models import build
from tests.autopar.runtime.closeness import in_float64

STEPS = 2
BATCH = 8


def cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of a language model's logits, as a user writes it."""
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_case(name: str, layers: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, (tokens,) = build(name, batch_size=BATCH, n_layer=layers)
    generator = torch.Generator().manual_seed(1)
    vocab = model.lm_head.weight.shape[0]
    target = torch.randint(0, vocab, tokens.shape, generator=generator)
    return model, tokens, target


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # eps=1e-3: see tests/autopar/runtime/equivalence.py (parameters whose true gradient is
    # exactly zero hold only roundoff, which Adam would otherwise blow up to lr-sized steps)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def _train_alone(
    model: torch.nn.Module, tokens: torch.Tensor, target: torch.Tensor
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` steps of the reference (one process, the whole batch at once): the losses
    and the first step's gradients; the model is left trained."""
    optimizer = _optimizer(model)
    losses, first_grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = cross_entropy(model(tokens), target)
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, first_grads


def compare(
    rank: int, world_size: int, cases: list[tuple[Any, ...]], refuse: bool = False
) -> dict[str, Any]:
    """Run each ``(model, layers, mesh shape, axis names, options)`` case; rank 0 returns
    the tensors, every rank its losses. ``options`` go to ``autopar.compile`` (``force``,
    ``stages``, ``schedule``, ``microbatches``, ``chunks``). With ``refuse``, then the bad
    inputs of ``refusals`` on the last case's mesh."""
    results = []
    for name, layers, shape, names, options in cases:
        mesh = autopar.Mesh(shape, names, device="cpu")
        model, tokens, target = make_case(name, layers)
        if rank == 0:
            exact, (tokens64,), target64 = in_float64(model, (tokens,), target)
            exact_losses, exact_grads = _train_alone(exact, tokens64, target64)
        reference = copy.deepcopy(model)
        ref_losses, ref_grads = _train_alone(reference, tokens, target)
        compiled = autopar.compile(
            model,
            mesh,
            example_inputs=(tokens,),
            loss_fn=cross_entropy,
            global_batch=BATCH,
            **options,
        )
        optimizer = _optimizer(compiled)
        param_names = list(compiled.plan.params)
        losses, grads = [], {}
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = compiled.train_step(tokens, target)
            if step == 0:
                grads = {n: compiled.full_gradient(n) for n in param_names}
                # a bound above the norm: clip_grad_norm_ measures and leaves them as they are
                norm = float(compiled.clip_grad_norm_(1e6))
            optimizer.step()
            losses.append(float(loss))
        params = {n: compiled.full_parameter(n) for n in param_names}
        held = sorted(n for n, _ in compiled.named_parameters())
        state = compiled.state_dict()
        if rank == 0:
            ref_params = dict(reference.named_parameters())
            exact_params = dict(exact.named_parameters())
            results.append(
                {
                    "case": case_name(name, layers, shape, options),
                    "parallelism": compiled.plan.parallelism.model_dump(),
                    "losses": losses,
                    "ref_losses": ref_losses,
                    "grads": grads,
                    "ref_grads": {n: ref_grads[n] for n in param_names},
                    "norm": norm,
                    "ref_norm": float(
                        torch.linalg.vector_norm(
                            torch.stack([g.norm() for g in ref_grads.values()])
                        )
                    ),
                    "params": params,
                    "ref_params": {n: ref_params[n].detach() for n in param_names},
                    "exact_losses": exact_losses,
                    "exact_grads": {n: exact_grads[n] for n in param_names},
                    "exact_params": {n: exact_params[n].detach() for n in param_names},
                    "state_keys": sorted(state),
                    "ref_state_keys": sorted(reference.state_dict()),
                    "code": compiled.code,
                    "held": held,
                }
            )
        else:
            results.append({"losses": losses, "held": held})
    return {"cases": results, "refusals": refusals(mesh) if refuse else {}}


def case_name(name: str, layers: int, shape: tuple[int, ...], options: dict[str, Any]) -> str:
    """``gpt-tiny/L2/4/stages=2,schedule=1f1b``: how the tests name a case."""
    mesh = "x".join(map(str, shape))
    return f"{name}/L{layers}/{mesh}/" + ",".join(f"{k}={v}" for k, v in options.items())


REFUSALS: dict[str, dict[str, Any]] = {
    "stages > layers": {"stages": 3, "loss_fn": cross_entropy},
    "microbatches do not divide": {"stages": 2, "microbatches": 3, "loss_fn": cross_entropy},
    "pipeline without a loss": {"stages": 2},
}


def refusals(mesh: autopar.Mesh) -> dict[str, Any]:
    """Each bad ``compile`` of ``REFUSALS``: the message every rank gets (all must raise;
    none may hang waiting for a plan), and what train_step and forward say when misused;
    then the first loss of a lazily compiled pipeline (planned by its first train_step)."""
    found: dict[str, Any] = {}
    model, tokens, target = make_case("gpt-tiny", 2)
    for what, options in REFUSALS.items():
        try:
            autopar.compile(model, mesh, example_inputs=(tokens,), global_batch=BATCH, **options)
        except autopar.UsageError as error:
            found[what] = str(error)
    compiled = autopar.compile(model, mesh, example_inputs=(tokens,), stages=1)
    try:
        compiled.train_step(tokens, target)
    except autopar.UsageError as error:
        found["train_step without a loss"] = str(error)
    model, tokens, target = make_case("gpt-tiny", 2)
    piped = autopar.compile(
        model,
        mesh,
        example_inputs=(tokens,),
        loss_fn=cross_entropy,
        stages=2,
        schedule="gpipe",
        microbatches=2,
    )
    try:
        piped(tokens)
    except autopar.UsageError as error:
        found["forward of a pipeline"] = str(error)
    try:
        piped.train_step(tokens[:2], target[:2])
    except autopar.UsageError as error:
        found["train_step of a microbatch"] = str(error)
    model, tokens, target = make_case("gpt-tiny", 2)
    lazy = autopar.compile(model, mesh, loss_fn=cross_entropy, stages=2, microbatches=2)
    found["lazy loss"] = float(lazy.train_step(tokens, target))  # planned on this call
    return found
