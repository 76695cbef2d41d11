"""Measure the most bytes autograd holds for backward at once on a pipeline rank, next to
the plan's activations for the rank's stage.

Run on every rank by ``run_ranks`` (``test_pipeline_activations.py``). A schedule keeps
several microbatches' activations alive at once (GPipe all of them, 1F1B at most the
stages after this one), so one forward's saved bytes do not say what a stage holds: this
counts the distinct storages autograd holds while a ``train_step`` runs, adding a storage
when a forward saves it and dropping it when backward releases the last saved tensor on
it, and keeps the peak. Parameters, buffers and the step's inputs are left out: they live
anyway, as in ``activations.saved_bytes``. So is what the user's loss function saves (its
log-probabilities, logits-sized, per microbatch in flight on the last stage): the plan
counts the traced model's activations only, and the loss is the user's code, not traced
(docs/activation_memory.md, "What it leaves out").
"""

from __future__ import annotations

from typing import Any

import torch

import autopar
from autopar.runtime.shards import local_of
from tests.autopar.runtime.pipelines import BATCH, cross_entropy, make_case


class HeldSaved:
    """``saved_tensors_hooks`` that count the storages autograd holds: ``peak`` bytes."""

    def __init__(self, live: set[int]) -> None:
        self._live = live  # storages that live anyway (parameters, buffers, inputs)
        self._holders: dict[int, int] = {}  # storage -> saved tensors on it still held
        self._bytes: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.paused = False  # inside the user's loss function

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if self.paused or key in self._live or storage.nbytes() == 0:
            return tensor
        if key not in self._holders:
            self._bytes[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._holders[key] = self._holders.get(key, 0) + 1
        return _Saved(tensor, key, self)

    def unpack(self, saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.current -= self._bytes.pop(key)

    def outside(self, loss: Any) -> Any:
        """``loss`` with what it saves left uncounted."""

        def call(*args: Any) -> Any:
            self.paused = True
            try:
                return loss(*args)
            finally:
                self.paused = False

        return call

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    """One saved tensor as autograd holds it; its release is the graph letting it go."""

    def __init__(self, tensor: torch.Tensor, key: int, count: HeldSaved) -> None:
        self.tensor, self._key, self._count = tensor, key, count

    def __del__(self) -> None:
        self._count.release(self._key)


def measure_stages(
    rank: int, world: int, cases: list[tuple[str, int, tuple[int, ...], dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Per case (model, layers, mesh shape, compile options): this rank's stage, the peak
    bytes autograd held in the second ``train_step`` (the first may differ only by what
    the optimizer's first step makes, which autograd does not save) and the plan's
    activations for that stage."""
    results = []
    for name, layers, shape, options in cases:
        model, tokens, target = make_case(name, layers)
        live: set[int] = set()
        held = HeldSaved(live)
        mesh = autopar.Mesh(shape, device="cpu")
        compiled = autopar.compile(
            model,
            mesh,
            example_inputs=(tokens,),
            loss_fn=held.outside(cross_entropy),
            global_batch=BATCH,
            **options,
        )
        live |= {
            local_of(t).untyped_storage().data_ptr()
            for t in (*compiled.parameters(), tokens, target)
        }
        live |= {b.untyped_storage().data_ptr() for b in compiled.buffers()}
        optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        for step in range(2):
            optimizer.zero_grad()
            if step == 1:
                with held.hooks():
                    compiled.train_step(tokens, target)
            else:
                compiled.train_step(tokens, target)
            optimizer.step()
        stage = compiled.plan.estimate.stages[compiled.stage]
        results.append(
            {
                "case": f"{name}/L{layers}/" + ",".join(f"{k}={v}" for k, v in options.items()),
                "stage": compiled.stage,
                "measured": held.peak,
                "left": held.current,
                "estimated": stage.memory_per_device_bytes.activations,
            }
        )
    return results
