"""Work for ``test_ledger.py``: train a tiny model compiled under one style on gloo ranks and
return what each rank's runtime issued in a step next to what the plan's ledger promises.

One spawn runs every case (starting ranks costs seconds, a case a second or two).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

import autopar
from autopar.runtime.shards import local_of
from autopar_examples.models import build
from autopar_plans.ledger import tally_entries
from tests.autopar.runtime.collective_counts import counting
from tests.autopar.runtime.features import cross_entropy


def _nbytes(tensors: Any) -> int:
    """The bytes this rank holds of ``tensors`` (of a DTensor, its local shard)."""
    return sum(local_of(t).numel() * t.element_size() for t in tensors)


class HeldGradients:
    """The most gradient bytes a rank holds at the end of a backward, over a step: measured
    once the runtime's own end-of-backward work (gradient sync, ZeRO's sums, which free
    working gradients) is done, since their callbacks were queued first."""

    def __init__(self, compiled: Any) -> None:
        zero = list(compiled._zero.params.values())
        masters = {id(z.master) for z in zero}
        self.tensors = [p for p in compiled.parameters() if id(p) not in masters]
        # backward reaches a DTensor parameter's plain leaf (``runtime.local_shards``),
        # which holds its gradient until the sync delivers it to the parameter
        leaves = [compiled._local_shards.leaf_of(p) for p in self.tensors]
        self.tensors += leaves + [z.master for z in zero] + [z.working for z in zero]
        self.most = 0
        self._queued = False
        for t in leaves + [z.working for z in zero]:
            if t.requires_grad:
                t.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _: torch.Tensor) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._measure)
            self._queued = True

    def _measure(self) -> None:
        self._queued = False
        held = _nbytes(t.grad for t in self.tensors if t.grad is not None)
        self.most = max(self.most, held)


def logits_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (a mixture of experts returns them first in a tuple)."""
    return cross_entropy(output[0] if isinstance(output, tuple) else output, target)


def observed_and_planned(
    rank: int, world: int, mesh_shape: tuple[int, ...], cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per case (``model``, ``force``, ``zero``, ``microbatches``, ``precision``, ``stages``,
    ``schedule``, ``chunks``, ``config`` for the model's builder, ``options`` for
    ``autopar.compile``): the
    second step's observed collectives and the plan's ledger, both tallied by (kind, axes,
    dtype), and the calls in order with their phases (to read a failure)."""
    axes = ("dp", "tp")[: len(mesh_shape)] if len(mesh_shape) > 1 else ("dp",)
    results = []
    for case in cases:
        torch.manual_seed(0)
        microbatches = case.get("microbatches", 1)
        model, (tokens,) = build(
            case.get("model", "gpt-tiny"), batch_size=4, **case.get("config", {})
        )
        batch = tokens.repeat(microbatches, 1)
        compiled = autopar.compile(
            model,
            autopar.Mesh(mesh_shape, axes, device="cpu"),
            example_inputs=(tokens,),
            loss_fn=logits_loss,
            force=case.get("force"),
            zero=case.get("zero", 0),
            global_batch=4 * microbatches,
            microbatches=microbatches,
            stages=case.get("stages", 1),
            schedule=case.get("schedule"),
            chunks=case.get("chunks"),
            precision=case.get("precision", "fp32"),
            **case.get("options", {}),
        )
        optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        optimizer.zero_grad()
        compiled.train_step(batch, batch)
        optimizer.step()
        raw: Counter[str] = Counter()
        held_grads = HeldGradients(compiled)
        with counting(raw):  # the second step: ZeRO gathers the masters the first stepped
            optimizer.zero_grad()
            compiled.train_step(batch, batch)
            optimizer.step()
        zero = compiled._zero.params.values()
        masters = {id(z.master) for z in zero}
        plan = compiled.plan
        stage = compiled.stage
        results.append(
            {
                "case": case,
                "parallelism": str(plan.parallelism),
                "observed": compiled.observed_collectives(),
                "torch_calls": sum(raw.values()),
                # as the plan's memory counts them: what the forward reads (ZeRO's working
                # copies), gradients at the end of a backward, and what the optimizer
                # keeps (ZeRO's master pieces besides AdamW's moments)
                "held": {
                    "params": _nbytes(p for p in compiled.parameters() if id(p) not in masters)
                    + _nbytes(z.working for z in zero),
                    "grads": held_grads.most,
                    # the compression scheme's state (error feedback, PowerSGD's Q) too,
                    # which the plan counts with the optimizer's
                    "optimizer": compiled._sync.compression_state_bytes()
                    + compiled._shared_sync.compression_state_bytes()
                    + _nbytes(z.master for z in zero)
                    + _nbytes(
                        t
                        for state in optimizer.state.values()
                        for t in state.values()
                        if torch.is_tensor(t) and t.dim() > 0  # not Adam's step count
                    ),
                },
                "memory": (
                    plan.estimate.stages[stage].memory_per_device_bytes
                    if plan.estimate.stages
                    else plan.estimate.memory_per_device_bytes
                ).model_dump(),
                # a pipeline's ledger has every stage's entries: this rank's stage's
                "planned": tally_entries(e for e in plan.estimate.comm if e.stage == stage),
                "calls": [
                    (c.kind, c.axes, c.dtype, c.nbytes, c.phase) for c in compiled.observed_calls()
                ],
                "ledger": [
                    (e.kind, e.axes, e.dtype, e.bytes_per_call, e.calls_per_step, e.phase, e.what)
                    for e in plan.estimate.comm
                    if e.stage == stage
                ],
            }
        )
    return results
