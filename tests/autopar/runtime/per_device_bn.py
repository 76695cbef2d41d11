"""Work for the per-device batch norm test: a ResNet compiled data parallel with
``batch_norm="per_device"`` next to the same model under torch's DDP, which normalizes
each device's slice of the batch with that slice's statistics and, before each forward,
copies rank 0's running statistics over the others' (``broadcast_buffers``).

Both take two SGD steps on the same global batch of 8 images (each rank 2 of them); every
rank returns its loss, its gradients after the first step, and its parameters and
buffers after the last, for the test to compare rank by rank. Rank 0 also runs DDP's
arithmetic on one process in float64 (each slice's forward from rank 0's buffers, the
gradients averaged), which measures the fp32 roundoff the comparison allows: batch norm
over two images of a few pixels is ill-conditioned, and one fp32 ordering already differs
from float64 by a few 1e-4 of a gradient (``tests.autopar.runtime.closeness``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar_examples.models import build

STEPS = 2


def _batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(2 * world, 3, 32, 32, generator=generator)
    return images, torch.randint(0, 16, (2 * world,), generator=generator)


def _train(model: torch.nn.Module, step_inputs, gradients) -> dict[str, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first = [], {}
    for step in range(STEPS):
        images, labels = step_inputs()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        if step == 0:
            first = gradients()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": first}


def compare_with_ddp(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, _ = build("resnet-tiny", batch_size=2 * world)
    images, labels = _batch(world)
    reference = copy.deepcopy(model)
    reference_copy = copy.deepcopy(model)
    compiled = autopar.compile(
        model,
        autopar.Mesh((world,), device="cpu"),
        example_inputs=(images,),
        force="dp",
        batch_norm="per_device",
    )
    got = _train(
        compiled,
        lambda: (images, labels),
        lambda: {n: compiled.full_gradient(n) for n, _ in reference.named_parameters()},
    )
    state = compiled.state_dict()
    got["state"] = {n: compiled.full_parameter(n) for n, _ in reference.named_parameters()}
    for name, _ in reference.named_buffers():
        got["state"][name] = _full(state[name])
    got["parallelism"] = compiled.plan.parallelism.model_dump()

    assert dist.is_initialized()
    ddp = DistributedDataParallel(reference)
    mine = slice(2 * rank, 2 * rank + 2)
    expected = _train(
        ddp,
        lambda: (images[mine], labels[mine]),
        lambda: {n: p.grad.clone() for n, p in reference.named_parameters()},
    )
    expected["state"] = {n: t.detach().clone() for n, t in reference.state_dict().items()}
    exact = _ddp_in_float64(reference_copy, images, labels, world) if rank == 0 else {}
    return {"got": got, "ddp": expected, "exact": exact}


def _ddp_in_float64(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, world: int
) -> dict[str, Any]:
    """DDP's two steps on one process in float64: each rank's slice forward from rank 0's
    buffers, the mean of the slices' losses, rank 0's slice's buffers kept."""
    model = model.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first = [], {}
    for step in range(STEPS):
        start = copy.deepcopy(dict(model.named_buffers()))
        total = 0.0
        for rank in reversed(range(world)):  # rank 0 last: its buffers stay
            for name, buffer in model.named_buffers():
                buffer.copy_(start[name])
            mine = slice(2 * rank, 2 * rank + 2)
            loss = F.cross_entropy(model(images[mine].double()), labels[mine]) / world
            loss.backward()
            total += float(loss.detach())
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return {"losses": losses, "grads": first, "state": state}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()
