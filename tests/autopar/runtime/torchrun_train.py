"""Train GPT-tiny on a (2,) mesh under ``torchrun``; rank 0 writes the losses as JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 2 torchrun_train.py OUT

A training script as users write one: ``torchrun`` sets the rank and the rendezvous in the
environment, the script builds a ``DeviceMesh`` with ``init_device_mesh`` and compiles onto
it (``examples/train.py`` is the script that leaves the process group to ``compile``).
The model is compiled lazily (planned on its first call), the optimizer is built after
that call, and gradients are clipped with ``torch.nn.utils.clip_grad_norm_``; after
training it reads the state and the parameter names through the lazy wrapper.
``test_torchrun.py`` runs it.

The model is dropped and garbage collected before ``destroy_process_group``: gloo's worker
threads can hold the last reference to a tensor that a collective run in backward used,
and freeing it during interpreter shutdown aborts the process (SIGABRT, "terminate called
without an active exception"; pytorch/pytorch#179291), with or without autopar.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from tests.autopar.runtime.features import adamw, cross_entropy, make

STEPS = 2
MAX_NORM = 0.5


def train() -> dict[str, Any]:
    model, inputs, target = make("gpt-tiny")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    compiled = autopar.compile(model, mesh)
    optimizer = None
    losses, norms = [], []
    for _ in range(STEPS):
        loss = cross_entropy(compiled(*inputs), target)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(compiled.parameters(), MAX_NORM)
        optimizer = optimizer or adamw(compiled)  # parameters exist after the first call
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
    state = compiled.state_dict()  # collective: gathers on every rank
    return {
        "losses": losses,
        "norms": norms,
        "given_mesh_used": compiled.device_mesh is mesh,
        "world": dist.get_world_size(),
        "state_keys": list(state),
        "names": [name for name, _ in compiled.named_parameters()],
    }


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    result = train()
    gc.collect()
    if dist.get_rank() == 0:
        with open(out_path, "w") as file:
            json.dump(result, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
