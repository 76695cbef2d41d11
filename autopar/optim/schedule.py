"""The learning rate for a large batch: scale it with the batch, then warm up to it.

**Scaling.** Going from a batch ``B0`` tuned at ``lr0`` to a global batch ``B``
(``k = B / B0``):

- ``"linear"``: ``lr = lr0 * k``. Goyal et al. 2017 ("Accurate, Large Minibatch SGD:
  Training ImageNet in 1 Hour", arXiv 1706.02677, Sec. 2.1): ``k`` SGD steps of batch
  ``B0`` move the weights about as one step of batch ``k B0`` at ``k`` times the rate,
  while the gradient changes little over those ``k`` steps.
- ``"sqrt"``: ``lr = lr0 * sqrt(k)``. Keeps the variance of the step the same as the
  gradient's variance falls as ``1 / B`` (Krizhevsky 2014, "One weird trick for
  parallelizing convolutional neural networks", arXiv 1404.5997; Hoffer et al. 2017);
  the rule LAMB's paper uses for BERT (You et al. 2019, Sec. 4).

**Warm-up.** Early in training the weights change fast and the linear rule breaks, so the
rate ramps linearly over the first ``W`` steps (Goyal et al. 2017, Sec. 2.2, "gradual
warmup"), as a factor of the scaled rate:

    factor(t) = start + (1 - start) * t / W     for t < W,   then 1 (or ``then(t - W)``)

Goyal et al. start from the small batch's rate, ``start = lr0 / lr = 1 / k``
(``warmup_from``); BERT and LAMB start from 0.

The global batch can be given as a number or read from a compiled model
(``model.plan.global_batch``, the batch per optimizer step over all devices):

>>> scaled_lr(0.1, 256, 8192, rule="linear"), scaled_lr(0.1, 256, 1024, rule="sqrt")
(3.2, 0.2)
>>> ramp = LinearWarmup(4, start=0.25)
>>> [ramp(t) for t in range(6)]
[0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from autopar_plans.errors import UsageError

ScalingRule = Literal["linear", "sqrt"]


def global_batch_of(batch: int | Any) -> int:
    """The batch per optimizer step: ``batch`` itself when a number, else the plan's
    ``global_batch`` of a compiled model."""
    if isinstance(batch, int | float):
        if batch <= 0:
            raise UsageError(f"a global batch must be positive, got {batch}")
        return int(batch)
    try:
        return int(batch.plan.global_batch)
    except AttributeError as error:
        raise UsageError(
            "the global batch: pass a number or a compiled model whose plan is made (a "
            "lazily compiled model plans on its first call; call it once first)"
        ) from error


def scaled_lr(
    base_lr: float, base_batch: int, global_batch: int | Any, rule: ScalingRule = "linear"
) -> float:
    """``base_lr``, tuned at ``base_batch``, scaled to ``global_batch`` (a number or a
    compiled model) by ``rule`` (module doc)."""
    if base_batch <= 0:
        raise UsageError(f"base_batch must be positive, got {base_batch}")
    ratio = global_batch_of(global_batch) / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise UsageError(f"unknown scaling rule {rule!r}; one of 'linear', 'sqrt'")


def warmup_from(base_lr: float, lr: float) -> float:
    """Goyal et al.'s starting factor: the warm-up begins at the small batch's rate."""
    if lr <= 0:
        raise UsageError(f"the scaled learning rate must be positive, got {lr}")
    return base_lr / lr


@dataclass(frozen=True)
class LinearWarmup:
    """The factor of ``LambdaLR`` at step ``t``: a linear ramp from ``start`` to 1 over
    ``steps`` steps, then ``then(t - steps)`` (1 without ``then``). A dataclass rather than a
    closure, so ``LambdaLR.state_dict`` saves its fields."""

    steps: int
    start: float = 0.0
    then: Callable[[int], float] | None = None

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise UsageError(f"warm-up steps must be >= 0, got {self.steps}")
        if not 0.0 <= self.start <= 1.0:
            raise UsageError(f"the warm-up's start factor must lie in [0, 1], got {self.start}")

    def __call__(self, step: int) -> float:
        if step < self.steps:
            return self.start + (1.0 - self.start) * step / self.steps
        return 1.0 if self.then is None else self.then(step - self.steps)


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    start: float = 0.0,
    then: Callable[[int], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that ramps every group's rate from ``start`` times its initial value
    to the value itself over ``warmup_steps`` calls of ``step()`` (``LinearWarmup``).

    >>> w = torch.nn.Parameter(torch.zeros(1))
    >>> optimizer = torch.optim.SGD([w], lr=scaled_lr(0.1, 256, 1024))
    >>> schedule = warmup_schedule(optimizer, 2, start=warmup_from(0.1, 0.4))
    >>> rates = []
    >>> for _ in range(3):
    ...     rates.append(round(optimizer.param_groups[0]["lr"], 6))
    ...     optimizer.step()
    ...     schedule.step()
    >>> rates
    [0.1, 0.25, 0.4]
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(warmup_steps, start, then))
