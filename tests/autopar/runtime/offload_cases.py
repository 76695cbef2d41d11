"""Work for ``test_offload_training.py``: train a tiny model on gloo ranks with and without
an offload policy forced by a hint, and return what each rank held, copied and computed.

One spawn runs every case (starting ranks costs seconds, a case a second or two).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime.shards import local_of
from autopar_examples.models import build
from autopar_plans.ledger import tally_entries
from tests.autopar.runtime.activations import saved_bytes
from tests.autopar.runtime.features import cross_entropy

STEPS = 3


def _nbytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (of a DTensor, its local shard)."""
    return sum(local_of(t).numel() * t.element_size() for t in tensors)


def _compile(case: dict[str, Any], mesh_shape: tuple[int, ...], offload: Any) -> Any:
    torch.manual_seed(0)
    model, (tokens,) = build("gpt-tiny", batch_size=4)
    microbatches = case.get("microbatches", 2)
    hints = {"offload": offload} if offload is not None else None
    return autopar.compile(
        model,
        autopar.Mesh(mesh_shape, ("dp", "tp"), device="cpu"),
        example_inputs=(tokens,),
        loss_fn=cross_entropy,
        force=case["force"],
        zero=case.get("zero", 0),
        global_batch=4 * microbatches,
        microbatches=microbatches,
        stages=case.get("stages", 1),
        precision=case.get("precision", "fp32"),
        hints=hints,
    ), tokens.repeat(microbatches, 1)


def _held(compiled: Any, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state this rank holds on each side of the host link: the weights
    the forward reads and the optimizer's (its masters and states; offloaded, with the
    masters' gradients, in host memory)."""
    zero = list(compiled._zero.params.values())
    masters = {id(z.master) for z in zero}
    host = [z for z in zero if z.host is not None]
    states = [
        (id(p), t)
        for p, state in optimizer.state.items()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0  # not Adam's step count
    ]
    hosted = {id(z.master) for z in host}
    return {
        # a working copy's memory (none for a fetched one: runtime.param_offload)
        "params": _nbytes(p for p in compiled.parameters() if id(p) not in masters)
        + sum(z.working.untyped_storage().nbytes() for z in zero),
        "optimizer": _nbytes(z.master for z in zero if z.host is None)
        + _nbytes(t for owner, t in states if owner not in hosted),
        "host": _nbytes(z.master for z in host)
        + _nbytes(z.host_cast for z in host if z.host_cast is not None)
        + _nbytes(z.master.grad for z in host if z.master.grad is not None)
        + _nbytes(t for owner, t in states if owner in hosted),
    }


def offload_runs(
    rank: int, world: int, mesh_shape: tuple[int, ...], cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per case (``force``, ``stages``, ``microbatches``, ``precision``, ``offload``): the
    final parameters with and without the offload, the last step's collectives and host
    copies next to the plan's, and the state bytes held next to the plan's memory."""
    results = []
    # the runs without offload by setup: their record, and the model trained
    plain: dict[tuple[Any, ...], tuple[dict[str, Any], Any]] = {}
    for case in cases:
        runs = {}
        trained = {}
        key = tuple(
            case.get(k)
            for k in ("force", "stages", "microbatches", "zero", "precision", "baseline")
        )
        # compared with the run without offload, or with ``baseline``'s offload where that
        # is the same arithmetic (a ZeRO working copy's bf16 gradient, under mixed precision)
        for offload in (case.get("baseline"), case["offload"]):
            if offload is None and key in plain and not case.get("checkpoint"):
                runs[None], trained[None] = plain[key]  # the same run as an earlier case's
                continue
            compiled, batch = _compile(case, mesh_shape, offload)
            optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
            for _ in range(STEPS):
                compiled.reset_observed()
                compiled.host_log.reset()
                optimizer.zero_grad()
                compiled.train_step(batch, batch)
                optimizer.step()
            trained[offload] = (compiled, optimizer, batch)
            observed = compiled.observed_collectives()  # before reading parameters back
            log = compiled.host_log
            copied = {
                (purpose, direction): (nbytes, log.copies[(direction, purpose)])
                for (direction, purpose), nbytes in log.nbytes.items()
            }
            plan = compiled.plan
            stage = compiled.stage
            memory = (
                plan.estimate.stages[stage].memory_per_device_bytes
                if plan.estimate.stages
                else plan.estimate.memory_per_device_bytes
            )
            runs[offload] = {
                # every rank takes part in each (a pipeline's holder broadcasts it)
                "params": {
                    name: compiled.full_parameter(name).detach().clone() for name in plan.params
                },
                "offload": plan.offload.model_dump(),
                "observed": observed,
                "planned": tally_entries(e for e in plan.estimate.comm if e.stage == stage),
                "copied": copied,
                "host_plan": {
                    (h.purpose, h.direction): (h.bytes, h.calls)
                    for h in plan.estimate.host
                    if h.stage == stage
                },
                "held": _held(compiled, optimizer),
                "memory": memory.model_dump(),
            }
        baseline = case.get("baseline")
        runs[None], trained[None] = runs[baseline], trained[baseline]
        plain.setdefault(key, (runs[None], trained[None]))
        result = {"case": case, "plain": runs[None], "offloaded": runs[case["offload"]]}
        if case.get("checkpoint"):
            result["resumed"] = _resumed(case, mesh_shape, trained)
        if "activations" in case["offload"] and case.get("stages", 1) == 1:
            # what autograd keeps on the device side in one forward of a microbatch: the
            # saved tensors the offload hands outward (``ActivationOffload``) to a probe
            result["device_saved"] = {
                offload: saved_bytes(
                    compiled, (batch[: len(batch) // case.get("microbatches", 2)],)
                )[0]
                for offload, (compiled, _, batch) in trained.items()
            }
        results.append(result)
    return results


def _resumed(
    case: dict[str, Any], mesh_shape: tuple[int, ...], trained: dict[Any, Any]
) -> dict[Any, dict[str, torch.Tensor]]:
    """One more step after a sharded checkpoint of the offloaded run (model and optimizer,
    ``torch.distributed.checkpoint``) is loaded into a fresh model with and without the
    offload, and one more step of the plain run itself: each one's parameters."""
    compiled, optimizer, batch = trained[case["offload"]]
    # every rank's path alike: the ranks are children of one process
    path = os.path.join(tempfile.gettempdir(), f"autopar-offload-{os.getppid()}-{case['force']}")
    compiled.save_checkpoint(path, optimizer)
    after = {}
    for offload in (None, case["offload"]):
        fresh, _ = _compile(case, mesh_shape, offload)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh.load_checkpoint(path, fresh_optimizer)
        after[offload] = _one_more_step(fresh, fresh_optimizer, batch)
    plain, plain_optimizer, _ = trained[None]
    after["uninterrupted"] = _one_more_step(plain, plain_optimizer, batch)
    return after


def _one_more_step(
    compiled: Any, optimizer: torch.optim.Optimizer, batch: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One step as a user's script takes it: clipping with torch's own ``clip_grad_norm_``
    (its threshold above the norm, which it returns) and reading the state through torch's
    state-dict API (``get_state_dict``, as before ``dcp.save``); the parameters after it,
    the norm and how many entries each state dict has."""
    optimizer.zero_grad()
    compiled.train_step(batch, batch)
    norm = torch.nn.utils.clip_grad_norm_(compiled.parameters(), 1e9)
    optimizer.step()
    model_state, optimizer_state = get_state_dict(compiled, optimizer)
    found = {n: compiled.full_parameter(n).detach().clone() for n in compiled.plan.params}
    found["(gradient norm)"] = norm.full_tensor() if isinstance(norm, DTensor) else norm
    found["(state entries)"] = torch.tensor([len(model_state), len(optimizer_state["state"])])
    return found
