"""Local SGD: each device steps on its own gradients; the models are averaged every H steps.

Post-local SGD (Lin, Stich, Patel, Jaggi 2020, "Don't Use Large Mini-Batches, Use Local
SGD", arXiv 1808.07217): the first ``warmup`` optimizer steps sum gradients as usual
(synchronous data parallelism), then no gradient crosses the devices and, after every
``period``-th step, the parameters are averaged over the devices that replicate them. A
slow device then holds the others back once a period instead of every step, and the
communication per step is divided by ``period``; the price is that the replicas drift
apart between averagings (the paper keeps the accuracy of large-batch training with H up
to 16 after a warm-up). torch's ``PostLocalSGDOptimizer`` and ``PeriodicModelAverager``
do the same for DDP; here the averaging runs on the plan's gradient-sync groups, in the
plan's form, and is recorded like every other collective.

Only the parameters are averaged; optimizer state (momentum, Adam's moments) stays each
device's own, as in torch's averager.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from autopar.runtime.grad_sync import GradientSync, group_size
from autopar.runtime.reduction import sum_flat
from autopar.runtime.shards import local_of
from autopar_plans.reduction import GradReduction


class LocalSGD:
    """Counts the optimizer steps that step the model's parameters; switches the gradient
    syncs off after the warm-up and averages the parameters every period."""

    def __init__(
        self,
        policy: GradReduction,
        syncs: Sequence[GradientSync],
        param_of: Callable[[torch.Tensor], torch.Tensor],
        params: Sequence[torch.Tensor],
    ) -> None:
        """``syncs``: the gradient syncs whose buckets (and groups) it averages;
        ``param_of``: a bucket member's (a program's leaf) parameter; ``params``: the
        parameters an optimizer must hold for its steps to count."""
        self.policy = policy
        self.syncs = list(syncs)
        self.steps = 0
        self._param_of = param_of
        self._ids = frozenset(id(p) for p in params)
        handle = register_optimizer_step_post_hook(partial(_on_step, weakref.ref(self)))
        weakref.finalize(self, handle.remove)
        self._set_summing()

    def _set_summing(self) -> None:
        summing = self.policy.syncs_every_step(self.steps)
        for sync in self.syncs:
            sync.summing = summing

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """After an optimizer step: average if this step ends a period; count it."""
        held = any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])
        if not held:
            return
        if self.policy.averages_after(self.steps):
            self.average()
        self.steps += 1
        self._set_summing()

    @torch.no_grad()
    def average(self) -> None:
        """Every replicated parameter set to its mean over the devices that replicate it,
        bucket by bucket (the gradient sync's buckets, in the policy's form)."""
        for sync in self.syncs:
            for bucket in sync.buckets:
                locals_ = [local_of(self._param_of(leaf)) for leaf in bucket.params]
                flat = torch.cat([t.reshape(-1) for t in locals_])
                summed = sum_flat(flat, self.policy, bucket.groups) / group_size(bucket.groups)
                offset = 0
                for t in locals_:
                    t.copy_(summed[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()


def _on_step(runner: weakref.ref[LocalSGD], optimizer: torch.optim.Optimizer, *_: Any) -> None:
    alive = runner()
    if alive is not None:
        alive.stepped(optimizer)
