"""Work for ``test_grad_policies.py``: gpt-tiny trained data parallel on a 2 x 2 gloo mesh
under each gradient-reduction policy (compression schemes, local SGD), with what each rank
issued and held, and the same loops on one process to compare with."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.runtime.shards import local_of
from autopar_examples.models import build
from autopar_plans.ledger import tally_entries
from tests.autopar.runtime.features import cross_entropy

BATCH = 8  # two sequences a device
STEPS = 30
LR = 0.05


def _data(seed: int = 0) -> torch.Tensor:
    """A fixed stream of token batches: the model learns to repeat its input."""
    torch.manual_seed(0)
    _, (tokens,) = build("gpt-tiny", batch_size=BATCH)
    generator = torch.Generator().manual_seed(seed)
    vocab = int(tokens.max()) + 1
    return torch.randint(0, max(vocab, 2), (STEPS, *tokens.shape), generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model, _ = build("gpt-tiny", batch_size=BATCH)
    return model


def _optimizer(params: Any, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=momentum)


def train(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per case (``options`` for ``autopar.compile``, the SGD ``momentum``, ``steps``): the
    losses, the collectives observed over the steps against the ledger's for as many
    steps, the compression state held against the plan's, and the parameters' local
    values at the end."""
    data = _data()
    found = {}
    for name, case in cases.items():
        options = case.get("options", {})
        compiled = autopar.compile(
            _model(),
            autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"),
            example_inputs=(data[0],),
            force="dp",
            zero=0 if options.get("sync") != "local_sgd" else None,
            **options,
        )
        optimizer = _optimizer(compiled.parameters(), case.get("momentum", 0.9))
        losses = []
        compiled.reset_observed()
        for step in range(case.get("steps", STEPS)):
            optimizer.zero_grad()
            loss = cross_entropy(compiled(data[step]), data[step])
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        found[name] = {
            "losses": losses,
            "observed": compiled.observed_collectives(),
            "planned": tally_entries(compiled.plan.estimate.comm, steps=len(losses)),
            "state_bytes": compiled._sync.compression_state_bytes(),
            "planned_optimizer_bytes": compiled.plan.estimate.memory_per_device_bytes.optimizer,
            "locals": {n: local_of(p).detach().clone() for n, p in compiled.named_parameters()},
        }
        dist.barrier()
    return found


def local_sgd_reference(world: int, period: int, warmup: int, steps: int) -> dict[str, Any]:
    """Post-local SGD on one process: ``world`` copies of the model, each stepping SGD on
    its slice of every batch with its own gradient (the mean over its slice), the copies'
    parameters averaged after every ``period``-th step past the ``warmup`` synchronous
    ones (which step every copy on the mean gradient)."""
    data = _data()
    models = [_model() for _ in range(world)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    optimizers = [_optimizer(m.parameters(), 0.9) for m in models]
    per = BATCH // world
    losses = []
    for step in range(steps):
        batch = data[step]
        total = 0.0
        for index, (m, opt) in enumerate(zip(models, optimizers, strict=True)):
            opt.zero_grad()
            piece = batch[index * per : (index + 1) * per]
            loss = cross_entropy(m(piece), piece)
            loss.backward()
            total += float(loss.detach()) / world
        if step < warmup:  # synchronous: every copy steps on the mean gradient
            for params in zip(*(m.parameters() for m in models), strict=True):
                mean = torch.stack([p.grad for p in params]).mean(0)
                for p in params:
                    p.grad = mean.clone()
        for opt in optimizers:
            opt.step()
        if step >= warmup and (step - warmup + 1) % period == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models), strict=True):
                    mean = torch.stack([p.detach() for p in params]).mean(0)
                    for p in params:
                        p.copy_(mean)
        losses.append(total)
    return {
        "losses": losses,
        "params": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models],
    }
