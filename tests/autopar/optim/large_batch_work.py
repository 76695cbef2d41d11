"""Work for ``test_large_batch_multirank.py``: LARS and LAMB on a compiled model on gloo ranks.

Per layout, each optimizer trains a compiled copy of a tiny model for ``STEPS`` steps and
the same optimizer trains a single-device copy; rank 0 returns both runs' losses and the
trust ratios of every step, by parameter name, and every rank returns the local shards
of its fully replicated parameters (which must stay bit-equal across ranks).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

import autopar
from autopar.optim import LAMB, LARS, layerwise_groups, scaled_lr
from autopar.optim.layerwise import LayerwiseOptimizer
from tests.autopar.runtime.features import cross_entropy, make

STEPS = 3


def _params(model: nn.Module, by_user_shape: bool) -> Any:
    """The parameters with the default rule (``ndim <= 1`` on the parameter as stepped), or
    split by the user's shapes (``layerwise_groups``), which a model the planner reshapes
    needs: GPT's q/k/v bias ``[3C]`` is stepped as ``[3, C]``."""
    return layerwise_groups(model) if by_user_shape else model.parameters()


def _lars(model: nn.Module, by_user_shape: bool) -> LayerwiseOptimizer:
    # eta large enough that the ratios matter at this lr, weight decay on
    params = _params(model, by_user_shape)
    return LARS(params, lr=0.5, momentum=0.9, weight_decay=1e-3, eta=0.02)


def _lamb(model: nn.Module, by_user_shape: bool) -> LayerwiseOptimizer:
    return LAMB(_params(model, by_user_shape), lr=1e-2, weight_decay=0.01)


OPTIMIZERS: dict[str, Callable[[nn.Module, bool], LayerwiseOptimizer]] = {
    "lars": _lars,
    "lamb": _lamb,
}


def _train(
    model: nn.Module, optimizer: LayerwiseOptimizer, inputs: tuple, target: torch.Tensor
) -> tuple[list[float], list[dict[str, float]]]:
    """``STEPS`` steps: the loss and every parameter's trust ratio, by name, per step."""
    names = {id(p): name for name, p in model.named_parameters()}
    losses, ratios = [], []
    for _ in range(STEPS):
        loss = cross_entropy(model(*inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        ratios.append({names[id(p)]: r for p, r in optimizer.trust_ratios().items()})
    return losses, ratios


def _replicated(compiled: nn.Module) -> dict[str, torch.Tensor]:
    """The local values of the parameters no mesh axis splits."""
    return {
        name: p.to_local().detach().clone()
        for name, p in compiled.named_parameters()
        if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)
    }


def _parameter_gap(compiled: Any, single: nn.Module) -> float:
    """The largest difference of any whole parameter from the single-device one."""
    gap = 0.0
    for name, param in single.named_parameters():
        whole = compiled.full_parameter(name)
        gap = max(gap, float((whole - param.detach()).abs().max()))
    return gap


def _reshaped_vectors(compiled: Any) -> list[str]:
    """Parameters that are vectors to the user but not as stepped (the default rule would
    adapt them; ``layerwise_groups`` does not)."""
    return [
        name
        for name, p in compiled.named_parameters()
        if p.ndim > 1 and len(compiled.user_shape(name)) <= 1
    ]


def _state_layouts(compiled: nn.Module, optimizer: LayerwiseOptimizer) -> dict[str, bool]:
    """Whether the per-value states are DTensors laid out as their parameters, and whether
    torch's checkpoint API reads the optimizer (``get_state_dict``, as before ``dcp.save``)."""
    per_value = [
        (param, value)
        for param, entries in optimizer.state.items()
        for key, value in entries.items()
        if key in ("momentum_buffer", "exp_avg", "exp_avg_sq")
    ]
    _, saved = get_state_dict(compiled, optimizer)
    return {
        "dtensors": bool(per_value)
        and all(isinstance(v, DTensor) and v.placements == p.placements for p, v in per_value),
        "saved": len(saved["state"]) == len(optimizer.state),
    }


def run_cases(rank: int, world: int, cases: list[tuple[str, str, int, bool]]) -> dict[str, Any]:
    """Per case ``(model, force, zero, by_user_shape)`` on a 2x2 mesh and per optimizer:
    the compiled and the single-device runs (module doc)."""
    results: dict[str, Any] = {}
    replicated: dict[str, dict[str, torch.Tensor]] = {}
    for name, force, zero, by_user_shape in cases:
        model, inputs, target = make(name)
        for label, build in OPTIMIZERS.items():
            single = copy.deepcopy(model)
            reference = _train(single, build(single, by_user_shape), inputs, target)
            mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
            compiled = autopar.compile(
                copy.deepcopy(model), mesh, example_inputs=inputs, force=force, zero=zero
            )
            optimizer = build(compiled, by_user_shape)
            placements = {n: tuple(p.placements) for n, p in compiled.named_parameters()}
            steps = _train(compiled, optimizer, inputs, target)
            key = f"{name}/{force}/zero={zero}/{label}"
            results[key] = {
                "reference": reference,
                "steps": steps,
                "parameter_gap": _parameter_gap(compiled, single),
                "strided": any(
                    isinstance(pl, _StridedShard) for pls in placements.values() for pl in pls
                ),
                "sharded": any(not pl.is_replicate() for pls in placements.values() for pl in pls),
                "reshaped_vectors": _reshaped_vectors(compiled),
                "state": _state_layouts(compiled, optimizer),
                "global_batch_lr": scaled_lr(0.1, 2, compiled, rule="linear"),
            }
            replicated[key] = _replicated(compiled)
    return {"results": results if rank == 0 else {}, "replicated": replicated}
