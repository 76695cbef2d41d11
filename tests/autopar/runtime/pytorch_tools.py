"""Work for ``test_pytorch_tools.py``: a training script of the usual shape on gloo ranks.

It clips gradients with ``torch.nn.utils.clip_grad_norm_``, steps AdamW under a cosine LR
schedule, saves with ``torch.distributed.checkpoint.state_dict.get_state_dict`` and
``dcp.save``, and resumes into a model compiled under another layout through ``dcp.load``
and ``set_state_dict`` (stepping AdamW's foreach kernels from then on), exactly as it would
for FSDP2 or DTensor tensor parallelism. The
same loop runs on one process without autopar; rank 0 returns both.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

import autopar
from autopar.runtime.shards import torch_placements
from autopar_plans.errors import UsageError
from tests.autopar.runtime.features import cross_entropy, make

MAX_NORM = 0.5  # below the gradients' norm, so clipping scales every step
STEPS = 3  # before the checkpoint
AFTER = 2  # after it


def _optimizer(model: nn.Module, foreach: bool | None = None) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, foreach=foreach)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=8)


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any, batch: tuple
) -> tuple[float, float]:
    """One step of the loop: (loss, the norm clip_grad_norm_ returned)."""
    inputs, target = batch
    loss = cross_entropy(model(*inputs), target)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    value = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return float(loss.detach()), float(value)


def _compile(model: nn.Module, force: str, zero: int, inputs: tuple) -> nn.Module:
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    return autopar.compile(model, mesh, example_inputs=inputs, force=force, zero=zero)


def _placements(compiled: Any) -> dict[str, Any]:
    """Per parameter: whether it is a DTensor, its placements against the plan's, whether its
    whole value is the one ``full_parameter`` gathers, and this rank's shard."""
    found = {}
    for name, param in compiled.named_parameters():
        canonical = compiled._canonical(name)
        info = compiled.plan.params[canonical]
        zero = canonical in compiled._zero.params
        layout = info.optimizer if zero else info.param
        planned = torch_placements(layout, compiled.mesh.shape, info.param if zero else None)
        is_dtensor = isinstance(param, DTensor)
        whole = param.full_tensor() if is_dtensor else param.detach()
        found[name] = {
            "dtensor": is_dtensor and isinstance(param, nn.Parameter),
            "placements": tuple(param.placements) == planned if is_dtensor else False,
            "whole": torch.equal(
                whole.reshape(compiled.user_shape(name)), compiled.full_parameter(name)
            ),
            "local": param.to_local().detach().clone() if is_dtensor else param.detach(),
            "strided": any(isinstance(p, _StridedShard) for p in planned),
            "sharded_on": [axis for axis, p in enumerate(planned) if not p.is_replicate()],
        }
    return found


def _batches(inputs: tuple, target: torch.Tensor, count: int) -> list[tuple]:
    """``count`` batches of the example's shapes (the example's, then shifted tokens)."""
    return [
        (tuple(torch.roll(x, i, dims=1) for x in inputs), torch.roll(target, i, dims=1))
        for i in range(count)
    ]


def _gradient_gap(compiled: Any, single: nn.Module) -> dict[str, float | None]:
    """Per parameter: the largest difference between its whole gradient and the single
    model's, relative to the latter's largest entry (None where the parameter has none)."""
    reference = dict(single.named_parameters())
    gaps: dict[str, float | None] = {}
    for name, param in compiled.named_parameters():
        want = reference[name].grad
        if param.grad is None or want is None:
            gaps[name] = None if param.grad is None and want is None else float("inf")
            continue
        got = param.grad.full_tensor().reshape(compiled.user_shape(name))
        gaps[name] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    return gaps


def _gradient_patterns(compiled: Any, single: nn.Module, batches: list[tuple]) -> dict[str, Any]:
    """The gradients a user sees under the usual patterns, against one process's:
    accumulated over two backwards, after zeroing in place, with a parameter frozen."""

    def backward(model: nn.Module, batch: tuple) -> None:
        inputs, target = batch
        cross_entropy(model(*inputs), target).backward()

    found: dict[str, Any] = {}
    for model in (compiled, single):
        backward(model, batches[0])
        backward(model, batches[1])
    found["accumulated"] = _gradient_gap(compiled, single)
    for model in (compiled, single):
        model.zero_grad(set_to_none=False)
        backward(model, batches[0])
    found["zeroed in place"] = _gradient_gap(compiled, single)
    frozen = next(name for name, _ in single.named_parameters())
    for model in (compiled, single):
        model.zero_grad()
        model.get_parameter(frozen).requires_grad_(False)
        backward(model, batches[1])
    found["frozen"] = {"name": frozen, "gaps": _gradient_gap(compiled, single)}
    for model in (compiled, single):
        model.get_parameter(frozen).requires_grad_(True)
        model.zero_grad()
    return found


def run_script(
    rank: int, world: int, cases: list[tuple[str, str, int, str, int]], root: str
) -> dict[str, Any]:
    """Per case ``(model, force, zero, resume_force, resume_zero)``: the loop on 2x2 and on one
    process, the checkpoint after ``STEPS`` steps resumed under the second layout."""
    results: dict[str, Any] = {}
    coords = None
    for name, force, zero, again, again_zero in cases:
        model, inputs, target = make(name)
        batches = _batches(inputs, target, STEPS + AFTER)
        single = copy.deepcopy(model)
        optimizer, schedule = _optimizer(single)
        reference = [_step(single, optimizer, schedule, b) for b in batches]

        compiled = _compile(copy.deepcopy(model), force, zero, inputs)
        coords = compiled.coords
        gradients = _gradient_patterns(compiled, copy.deepcopy(model), batches[:2])
        optimizer, schedule = _optimizer(compiled)
        placed = _placements(compiled)
        steps = [_step(compiled, optimizer, schedule, b) for b in batches[:STEPS]]
        path = os.path.join(root, f"{name}-{force}-{zero}")
        model_state, optim_state = get_state_dict(compiled, optimizer)
        dcp.save(
            {"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()},
            checkpoint_id=path,
        )
        steps += [_step(compiled, optimizer, schedule, b) for b in batches[STEPS:]]
        trained = _placements(compiled)

        # a fresh job under another layout: the standard resume, stepping AdamW's foreach
        # kernels (CUDA's default), which bump no DTensor's version counter
        resumed = _compile(make(name, seed=7)[0], again, again_zero, inputs)
        optimizer, schedule = _optimizer(resumed, foreach=True)
        model_state, optim_state = get_state_dict(resumed, optimizer)
        state = {"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            resumed, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        schedule.load_state_dict(state["schedule"])
        after = [_step(resumed, optimizer, schedule, b) for b in batches[STEPS:]]
        results[f"{name}/{force}/zero={zero}"] = {
            "parallelism": compiled.plan.parallelism.model_dump(),
            "resumed_parallelism": resumed.plan.parallelism.model_dump(),
            "reference": reference,
            "steps": steps,
            "resumed": after,
            "placed": placed,
            "trained": trained,
            "gradients": gradients,
            "optimizer_state_is_dtensor": all(
                isinstance(value, DTensor)
                for entries in optimizer.state.values()
                for key, value in entries.items()
                if key != "step"
            ),
        }
        dist.barrier()
    return {"coords": coords, "results": results}


def _hf_llama(seed: int = 0) -> nn.Module:
    """A Hugging Face Llama from a config with its defaults (``use_cache=True`` among
    them), at tiny sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def _hf_step(model: nn.Module, optimizer: Any, schedule: Any, tokens: torch.Tensor) -> tuple:
    loss = model(input_ids=tokens, labels=tokens).loss  # the model's own shifted loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    value = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return float(loss.detach()), float(value)


def run_hf_script(rank: int, world: int, forces: list[str]) -> dict[str, Any]:
    """Per layout: a Hugging Face Llama trained as its users write it (compiled lazily,
    called with ``input_ids`` and ``labels``, the optimizer made after the first call), and
    the same loop on one process."""
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (4, 16), generator=generator) for _ in range(STEPS)]
    results = {}
    for force in forces:
        single = _hf_llama()
        optimizer, schedule = _optimizer(single)
        reference = [_hf_step(single, optimizer, schedule, tokens) for tokens in batches]
        mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
        compiled = autopar.compile(_hf_llama(), mesh, force=force)
        first = compiled(input_ids=batches[0], labels=batches[0]).loss  # plans here
        optimizer, schedule = _optimizer(compiled)
        first.backward()
        norm = torch.nn.utils.clip_grad_norm_(compiled.parameters(), MAX_NORM)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        value = norm.full_tensor() if isinstance(norm, DTensor) else norm
        steps = [(float(first.detach()), float(value))]
        steps += [_hf_step(compiled, optimizer, schedule, tokens) for tokens in batches[1:]]
        results[force] = {
            "reference": reference,
            "steps": steps,
            "other calls": _other_calls(compiled, single),
        }
    return results


def _other_calls(compiled: nn.Module, single: nn.Module) -> dict[str, Any]:
    """Calls a script makes besides training, on the compiled model and on one device: the
    logits without labels, greedy generation of a few tokens in eval mode (Hugging Face's
    ``generate`` on one device), and a call asking for the KV cache (refused)."""
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(5))
    prompt = tokens[:2, :5]
    with torch.no_grad():
        logits = (compiled(input_ids=tokens).logits, single(input_ids=tokens).logits)
    compiled.eval()
    single.eval()
    generated = (
        compiled.generate(prompt, max_new_tokens=4),
        single.generate(prompt, max_new_tokens=4, do_sample=False),
    )
    compiled.train()
    single.train()
    refused = ""
    try:
        compiled(input_ids=tokens, labels=tokens, use_cache=True)
    except UsageError as error:
        refused = str(error)
    return {"logits": logits, "generated": generated, "refused": refused}


def run_foreach_zero(rank: int, world: int, zero: int) -> dict[str, list[float]]:
    """Three steps of AdamW's foreach kernels (CUDA's default) under data parallelism with
    ZeRO stage ``zero``, on one process and compiled: the losses of each."""
    model, inputs, target = make("llama-tiny")
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    compiled = autopar.compile(
        copy.deepcopy(model), mesh, example_inputs=inputs, force="dp", zero=zero
    )
    losses: dict[str, list[float]] = {}
    for label, trained in (("single", model), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2, foreach=True)
        losses[label] = []
        for _ in range(3):
            loss = cross_entropy(trained(*inputs), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[label].append(float(loss.detach()))
    return losses


def run_pipeline_checkpoint(rank: int, world: int, root: str) -> dict[str, list[float]]:
    """Train gpt-tiny under a 2-stage pipeline (``train_step``) and under data parallelism,
    each saving a checkpoint with ``get_state_dict`` and ``dcp.save`` after two steps that
    the other layout resumes from: the losses of each run, and of one process."""
    model, inputs, target = make("gpt-tiny")
    plain = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    losses: dict[str, list[float]] = {"single": []}
    for _ in range(4):
        loss = cross_entropy(plain(*inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses["single"].append(float(loss.detach()))
    layouts = {
        "pipeline": {"stages": 2, "schedule": "gpipe", "microbatches": 2},
        "dp": {"stages": 1, "force": "dp"},
    }

    def compiled(layout: str) -> Any:
        mesh = autopar.Mesh((world,), ("x",), device="cpu")
        return autopar.compile(
            copy.deepcopy(model),
            mesh,
            example_inputs=inputs,
            loss_fn=cross_entropy,
            **layouts[layout],
        )

    for saved, resumed in (("pipeline", "dp"), ("dp", "pipeline")):
        trained = compiled(saved)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        run = losses.setdefault(f"{saved} then {resumed}", [])
        for _ in range(2):
            run.append(float(trained.train_step(inputs, target)))
            optimizer.step()
            optimizer.zero_grad()
        path = os.path.join(root, saved)
        model_state, optim_state = get_state_dict(trained, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        again = compiled(resumed)
        optimizer = torch.optim.AdamW(again.parameters(), lr=1e-2)
        model_state, optim_state = get_state_dict(again, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            again, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        for _ in range(2):
            run.append(float(again.train_step(inputs, target)))
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
    return losses
