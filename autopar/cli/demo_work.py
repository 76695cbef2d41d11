"""What each rank of ``autopar demo`` runs (a module of its own so spawned ranks import it)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn.functional as F

import autopar
from autopar.model_source import build_model


def train_side_by_side(
    rank: int,
    world_size: int,
    model_spec: str,
    config: dict[str, Any],
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    steps: int,
    device: str = "cpu",
) -> dict:
    """Train the model on this rank alone and compiled over the mesh; return both losses.

    Rank 0 prints what it is doing as it goes (the ranks work for a minute or two before the
    parent has anything to show)."""

    def progress(message: str) -> None:
        if rank == 0:
            print(f"  rank 0: {message}", flush=True)

    torch.manual_seed(0)
    model, inputs, name = build_model(model_spec, config)
    tokens = inputs[0]
    generator = torch.Generator().manual_seed(1)
    logits_dim = model(*inputs)
    vocab = (logits_dim[0] if isinstance(logits_dim, tuple) else logits_dim).shape[-1]
    targets = torch.randint(0, vocab, tokens.shape, generator=generator)
    reference = copy.deepcopy(model)
    mesh = autopar.Mesh(shape, axes, device=device)
    progress(f"compiling {name}: trace, plan (ILP), lower to {world_size} ranks ...")
    start = time.perf_counter()
    compiled = autopar.compile(model, mesh, example_inputs=inputs, name=name)
    progress(f"compiled in {time.perf_counter() - start:.1f} s")

    def loss_of(output: Any) -> torch.Tensor:
        logits = output[0] if isinstance(output, tuple) else output
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    losses: dict[str, list[float]] = {"single device": [], "autopar": []}
    for label, module in (("single device", reference), ("autopar", compiled)):
        optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            loss = loss_of(module(*inputs))
            loss.backward()
            optimizer.step()
            losses[label].append(float(loss.detach()))
            progress(f"{label} step {step}/{steps}: loss {losses[label][-1]:.6f}")
    return {
        "plan": compiled.plan.model_dump(mode="json"),
        "losses": losses,
        "code": compiled.code if rank == 0 else "",
    }
