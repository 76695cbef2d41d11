"""Sharded save and load through ``torch.distributed.checkpoint`` (DCP).

Each rank writes only its shards: every parameter goes in as a DTensor (its local shard,
the mesh, and the plan's layout in DTensor's placements), keyed by the user's parameter
name, so the checkpoint holds whole tensors in pieces and says where each piece lies:

    {"model": {"wte.weight": DTensor, "lm_head.weight": <the same DTensor>, ...,
               <persistent buffers, whole>},
     "optimizer": {"state": {"wte.weight": {"exp_avg": DTensor, "step": tensor}, ...},
                   "param_groups": [{"lr": ..., "params": ["wte.weight", ...]}, ...]}}

The model part has exactly the keys of the single-device model's ``state_dict()`` (a tied
weight under each of its names), so the same checkpoint loads into the single-device model
(``dcp.load({"model": model.state_dict()}, checkpoint_id=path)``) or into a compiled model
of any plan: DCP reads each rank's pieces from whichever files hold them (it reshards).

Optimizer state is saved when its values are per-element, shaped like the parameter (SGD
momentum, Adam's moments) or scalars (Adam's step): those lie as the parameter does. A
state of another shape (Adafactor's row and column factors) has no layout on the mesh and
is refused with a message. Loading needs the optimizer's state to exist; a fresh
optimizer gets it from one step at learning rate zero with zero gradients (as
``torch.distributed.checkpoint.state_dict`` does), which the load then overwrites.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from autopar.runtime.shards import local_of, to_dtensor
from autopar_plans.errors import UsageError

if TYPE_CHECKING:
    from autopar.runtime.compiled import CompiledModel

Path = str | os.PathLike[str]


def save_checkpoint(
    model: CompiledModel, path: Path, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write this rank's shards of ``model`` (and ``optimizer``'s state) under ``path``.

    Collective: every rank calls it with the same path (a directory every rank can reach).
    """
    state: dict[str, Any] = {"model": model_state(model)}
    if optimizer is not None:
        state["optimizer"] = optimizer_state(model, optimizer)
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(
    model: CompiledModel, path: Path, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Read ``model``'s shards (and ``optimizer``'s state) from a checkpoint under ``path``.

    The checkpoint may come from any plan, or from the single-device model. Collective.
    """
    metadata = _read_metadata(path)
    state: dict[str, Any] = {"model": model_state(model)}
    _check_tensors(metadata, state["model"], path)
    if optimizer is not None:
        if not any(key.startswith("optimizer.") for key in metadata.state_dict_metadata):
            raise UsageError(
                f"the checkpoint at {os.fspath(path)!r} has no optimizer state; load "
                "without optimizer=, or save one with save_checkpoint(path, optimizer=opt)"
            )
        _init_state(optimizer)
        state["optimizer"] = optimizer_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            loaded = state["model"][name]
            local = loaded.to_local() if isinstance(loaded, DTensor) else loaded
            if local.data_ptr() != local_of(param).data_ptr():
                local_of(param).copy_(local)
    if optimizer is not None:
        _restore_optimizer(model, optimizer, state["optimizer"])


def model_state(model: CompiledModel) -> dict[str, Any]:
    """The single-device ``state_dict``'s keys; parameters as DTensors over local shards."""
    state: dict[str, Any] = {}
    for key, value in model.local_state_items():
        if isinstance(value, tuple):
            local, layout, shape = value
            state[key] = to_dtensor(local, layout, model.device_mesh, shape)
        else:
            state[key] = value
    return state


def optimizer_state(model: CompiledModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter names, its tensors as DTensors."""
    saved = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    for index, name, param in _indexed_params(model, optimizer):
        entries = saved["state"].get(index)
        if entries is None:
            continue
        state[name] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                # a per-element state of a DTensor parameter is a DTensor like it
                if not isinstance(value, DTensor) or value.shape != param.shape:
                    raise UsageError(
                        f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, "
                        f"not the parameter's {tuple(param.shape)}: it has no layout on the "
                        "mesh; checkpoint parameters only (no optimizer=) or use an "
                        "optimizer with per-element state (SGD, Adam, AdamW)"
                    )
                state[name][key] = value
            else:
                state[name][key] = value
    groups = []
    names = {index: name for index, name, _ in _indexed_params(model, optimizer)}
    for group in saved["param_groups"]:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [names[i] for i in group["params"]]
        groups.append(entry)
    return {"state": state, "param_groups": groups}


def _indexed_params(
    model: CompiledModel, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(index in ``optimizer.state_dict()``, parameter name, parameter), in that order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = name_of.get(id(param))
            if name is None:
                raise UsageError(
                    "the optimizer holds a tensor that is not a parameter of this compiled "
                    "model; build it on compiled.parameters()"
                )
            yield index, name, param
            index += 1


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state: one step at lr 0 with zero gradients.

    Gradients the user holds are put back afterwards. SGD, Adam and AdamW move nothing at
    lr 0; the values made here are overwritten by the load.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    held = [p.grad for p in params]
    rates = [g.get("lr") for g in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        if rate is not None:
            group["lr"] = rate
    for param, grad in zip(params, held, strict=True):
        param.grad = grad


def _restore_optimizer(
    model: CompiledModel, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]
) -> None:
    """Turn the loaded, name-keyed state back into ``optimizer.load_state_dict``'s form."""
    index_of = {name: index for index, name, _ in _indexed_params(model, optimizer)}
    state = {index_of[name]: dict(entries) for name, entries in loaded["state"].items()}
    groups = []
    for group in loaded["param_groups"]:
        unknown = [n for n in group["params"] if n not in index_of]
        if unknown:
            raise UsageError(
                f"the checkpoint's optimizer holds {unknown[:3]}, which this optimizer does "
                "not; build the optimizer on the same parameters as the one that saved"
            )
        groups.append({**group, "params": [index_of[n] for n in group["params"]]})
    sizes = [len(g["params"]) for g in groups]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != mine:
        raise UsageError(
            f"the checkpoint's optimizer has parameter groups of sizes {sizes}, this one "
            f"{mine}; build the optimizer with the same groups as the one that saved"
        )
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _read_metadata(path: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as error:
        raise UsageError(
            f"no checkpoint at {os.fspath(path)!r} ({error.strerror or error}); "
            "pass the directory save_checkpoint wrote"
        ) from error


def _check_tensors(metadata: Metadata, wanted: dict[str, Any], path: Path) -> None:
    """Every tensor the model needs is in the checkpoint, with its whole shape."""
    stored = metadata.state_dict_metadata
    missing = [k for k in wanted if f"model.{k}" not in stored]
    if missing:
        raise UsageError(
            f"the checkpoint at {os.fspath(path)!r} lacks {len(missing)} of this model's "
            f"tensors ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); it was "
            "saved from another model"
        )
    for key, value in wanted.items():
        entry = stored[f"model.{key}"]
        if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != tuple(value.shape):
            raise UsageError(
                f"{key} is {tuple(entry.size)} in the checkpoint but {tuple(value.shape)} "
                "in this model; it was saved from another model configuration"
            )
