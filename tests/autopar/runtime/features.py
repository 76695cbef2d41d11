"""Work the runtime feature tests run on gloo ranks: state, checkpoints, precision, I/O.

Spawning ranks costs seconds and a check milliseconds, so each function runs many checks in
one spawn and returns plain values and tensors (rank 0's, or every rank's where they differ)
for ``test_state.py`` and ``test_precision_io.py`` to compare with the single-device model.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.runtime.shards import local_slices
from autopar_examples.models import build
from autopar_plans.errors import UsageError


def make(
    name: str, seed: int = 0, **overrides: Any
) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """A tiny example model (weights from ``seed``), its inputs and a target."""
    torch.manual_seed(seed)
    model, inputs = build(name, batch_size=4, **overrides)
    generator = torch.Generator().manual_seed(1)
    if name == "mlp-tiny":
        target = torch.randn(inputs[0].shape[0], 16, generator=generator)
    else:
        vocab = model.lm_head.weight.shape[0]
        target = torch.randint(0, vocab, inputs[0].shape, generator=generator)
    return model, inputs, target


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), **kwargs
    )


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # eps=1e-3 as in equivalence.py: zero true gradients hold only roundoff, which Adam's
    # default eps would blow up into steps of size lr in random directions.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: tuple[torch.Tensor, ...],
    target: torch.Tensor,
) -> float:
    optimizer.zero_grad()
    loss = cross_entropy(model(*inputs), target)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def gathered(compiled: Any) -> dict[str, torch.Tensor]:
    """Whole parameters, copied: an unsharded one would share the live parameter's storage."""
    return {n: compiled.full_parameter(n).clone() for n, _ in compiled.named_parameters()}


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in state.items()}


class WithBuffers(nn.Module):
    """A model with a persistent and a non-persistent buffer (the examples have none)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("offset", torch.ones(8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale + self.offset


# ---- (2, 2) mesh: state_dict, DCP checkpoints, sharded outputs --------------------------
def state_on_2x2(rank: int, world_size: int, tmpdir: str) -> dict[str, Any]:
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    out: dict[str, Any] = {}

    # state_dict and load_state_dict under the user's names, tied weights, sharded params
    model, inputs, target = make("gpt-tiny")
    reference = copy.deepcopy(model)
    compiled = autopar.compile(model, mesh, example_inputs=inputs, force="tp")
    out["sharded"] = sorted(
        name for name, info in compiled.plan.params.items() if not info.param.is_replicated
    )
    out["names"] = [n for n, _ in compiled.named_parameters()]
    out["ref_names"] = [n for n, _ in reference.named_parameters()]
    out["optimizer_params"] = len(adamw(compiled).param_groups[0]["params"])
    out["state"] = snapshot(compiled.state_dict())
    out["ref_state"] = snapshot(reference.state_dict())
    modified = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in modified.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    compiled.load_state_dict(modified.state_dict())
    out["loaded_output"] = compiled(*inputs).detach()
    out["modified_output"] = modified(*inputs).detach()

    # the same inside a parent module: names, state_dict and load_state_dict prefixed
    parent = nn.ModuleDict({"net": compiled})
    out["parent_names"] = [n for n, _ in parent.named_parameters()]
    out["parent_state_keys"] = list(parent.state_dict())
    parent.load_state_dict({f"net.{k}": v for k, v in reference.state_dict().items()})
    out["parent_loaded_output"] = compiled(*inputs).detach()
    out["ref_output"] = reference(*inputs).detach()
    try:
        compiled.load_state_dict({"wte.weight": torch.zeros(3, 3)})
    except UsageError as error:
        out["bad_state_error"] = str(error)

    # DCP: save under tp, load into fresh models (other weights) planned tp and dp
    path = os.path.join(tmpdir, "checkpoint")
    optimizer = adamw(compiled)
    train_step(compiled, optimizer, inputs, target)  # the optimizer now has state
    compiled.save_checkpoint(path, optimizer=optimizer)
    saved = gathered(compiled)
    out["ckpt_saved"] = {
        "params": saved,
        "next_loss": train_step(compiled, optimizer, inputs, target),
        "after": gathered(compiled),
    }
    for style in ("tp", "dp"):
        fresh, _, _ = make("gpt-tiny", seed=1)
        other = autopar.compile(fresh, mesh, example_inputs=inputs, force=style)
        other_optimizer = adamw(other)
        differs = any(not torch.equal(p, saved[n]) for n, p in gathered(other).items())
        other.load_checkpoint(path, optimizer=other_optimizer)
        out[f"ckpt_{style}"] = {
            "differed_before": differs,
            "params": gathered(other),
            "next_loss": train_step(other, other_optimizer, inputs, target),
            "after": gathered(other),
            "layouts": {n: str(i.param) for n, i in other.plan.params.items()},
        }
    try:
        other.load_checkpoint(os.path.join(tmpdir, "nowhere"))
    except UsageError as error:
        out["missing_ckpt_error"] = str(error)

    # sharded outputs with a sharded and a replicated axis: each rank's loss is its
    # summand, the local squared-error sum over the global count
    mlp, mlp_inputs, mlp_target = make("mlp-tiny", n_layers=2)
    mlp_reference = copy.deepcopy(mlp)
    sharded = autopar.compile(mlp, mesh, example_inputs=mlp_inputs, force="tp", outputs="sharded")
    layout = sharded.output_layouts()[0]
    piece = mlp_target[local_slices(mlp_target.shape, layout, sharded.coords, (2, 2))]
    local = sharded(*mlp_inputs)
    ((local - piece) ** 2).sum().div(mlp_target.numel()).backward()
    F.mse_loss(mlp_reference(*mlp_inputs), mlp_target).backward()
    out["sharded_output"] = {
        "layout": str(layout),
        "local_shape": tuple(local.shape),
        "grads": {n: sharded.full_gradient(n) for n, _ in sharded.named_parameters()},
        "ref_grads": {n: p.grad for n, p in mlp_reference.named_parameters()},
    }
    return out if rank == 0 else {}


# ---- (2,) mesh: precision, local inputs and sharded outputs, errors ---------------------
def precision_io_on_2(rank: int, world_size: int) -> dict[str, Any]:
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    out: dict[str, Any] = {"rank": rank}

    # a mesh that is not the world size
    model, inputs, target = make("gpt-tiny")
    try:
        autopar.compile(model, autopar.Mesh((4,), ("dp",), device="cpu"), example_inputs=inputs)
    except UsageError as error:
        out["mesh_error"] = str(error)

    # bf16 mixed precision: 3 steps next to the single-device model under the same autocast
    reference = copy.deepcopy(model)
    compiled = autopar.compile(model, mesh, example_inputs=inputs, precision="bf16_mixed")
    optimizer, ref_optimizer = adamw(compiled), adamw(reference)
    losses, ref_losses = [], []
    for _ in range(3):
        losses.append(train_step(compiled, optimizer, inputs, target))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_optimizer.zero_grad()
            loss = cross_entropy(reference(*inputs), target)
        loss.backward()
        ref_optimizer.step()
        ref_losses.append(float(loss.detach()))
    logits = compiled(*inputs)
    try:  # a saved plan runs in the precision it was made for
        autopar.compile(model, mesh, example_inputs=inputs, plan=compiled.plan, precision="fp32")
    except UsageError as error:
        out["plan_precision_error"] = str(error)
    out["bf16_mixed"] = {
        "losses": losses,
        "ref_losses": ref_losses,
        "output_dtype": str(logits.dtype),
        "param_dtypes": sorted({str(p.dtype) for p in compiled.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in compiled.parameters()}),
        "state_dtypes": sorted(
            {str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        ),
    }

    # pure bf16: parameters held in bf16; fp16 mixed: autocast to fp16 (CPU has it)
    for precision in ("bf16", "fp16_mixed"):
        model, inputs, target = make("gpt-tiny")
        reference = copy.deepcopy(model)
        compiled = autopar.compile(model, mesh, example_inputs=inputs, precision=precision)
        if precision == "bf16":
            ref_loss = cross_entropy(reference.bfloat16()(*inputs), target)
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                ref_loss = cross_entropy(reference(*inputs), target)
        out[precision] = {
            "loss": float(cross_entropy(compiled(*inputs), target).detach()),
            "ref_loss": float(ref_loss),
            "param_dtypes": sorted({str(p.dtype) for p in compiled.parameters()}),
        }

    # each rank passes its slice and gets its piece; its loss is its summand: the local
    # sum over the global count (GPT: cross-entropy per token; MLP: squared error)
    for name in ("gpt-tiny", "mlp-tiny"):
        out[f"local_io/{name}"] = local_io(name, mesh)

    # buffers: persistent ones in the state_dict, non-persistent ones not, as torch does
    torch.manual_seed(0)
    buffered = WithBuffers()
    x = torch.randn(4, 8)
    compiled = autopar.compile(copy.deepcopy(buffered), mesh, example_inputs=(x,))
    out["buffers"] = {
        "keys": list(compiled.state_dict()),
        "ref_keys": list(buffered.state_dict()),
        "scale": compiled.state_dict()["scale"].clone(),
        "output": compiled(x).detach(),
        "ref_output": buffered(x).detach(),
    }
    return out


def local_io(name: str, mesh: autopar.Mesh) -> dict[str, Any]:
    """``inputs="local"`` and ``outputs="sharded"`` with DP forced, next to one device."""
    model, inputs, target = make(name)
    reference = copy.deepcopy(model)
    compiled = autopar.compile(
        model, mesh, example_inputs=inputs, force="dp", inputs="local", outputs="sharded"
    )
    slices = compiled.input_slices()
    local = compiled(*(x[s] for x, s in zip(inputs, slices, strict=True)))
    layout = compiled.output_layouts()[0]
    whole = reference(*inputs)
    piece = local_slices(whole.shape, layout, compiled.coords, mesh.shape)
    if name == "mlp-tiny":
        loss = ((local - target[piece]) ** 2).sum() / target.numel()
        ref_loss = F.mse_loss(whole, target)
    else:
        assert piece[-1] == slice(0, whole.shape[-1]), "the vocabulary must be whole"
        loss = cross_entropy(local, target[piece[:-1]], reduction="sum") / target.numel()
        ref_loss = cross_entropy(whole, target)
    loss.backward()
    ref_loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    shape_error = None
    try:
        compiled(*inputs)  # the whole batch, where each rank should pass its slice
    except UsageError as error:
        shape_error = str(error)
    return {
        "shape_error": shape_error,
        "input_slices": slices,
        "input_layouts": [str(layout) for layout in compiled.input_layouts()],
        "output_layout": str(layout),
        "local_shape": tuple(local.shape),
        "piece": piece,
        "loss": float(total),
        "ref_loss": float(ref_loss),
        "grads": {n: compiled.full_gradient(n) for n, _ in compiled.named_parameters()},
        "ref_grads": {n: p.grad for n, p in reference.named_parameters()},
    }
