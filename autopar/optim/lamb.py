"""LAMB: Adam with a layer-wise trust ratio (You et al. 2019, "Large Batch Optimization for
Deep Learning: Training BERT in 76 minutes", arXiv 1904.00962, Algorithm 2).

For each parameter ``w`` with gradient ``g``, at step ``t`` (from 1) with learning rate
``lr``, moments' rates ``(b1, b2)`` and weight decay ``lambda``:

    m = b1 m + (1 - b1) g            m_hat = m / (1 - b1^t)
    v = b2 v + (1 - b2) g^2          v_hat = v / (1 - b2^t)
    r = m_hat / (sqrt(v_hat) + eps) + lambda w
    w = w - lr * phi(||w||) / ||r|| * r      (phi the identity; the ratio is 1 if ||w|| or
                                              ||r|| is 0)

``||.||`` is the L2 norm of the whole parameter over every shard (``norms``): the update's
norm needs the update first, so a step computes every parameter's ``r``, sums the squared
norms (one small all-reduce per mesh axis), then applies them. A parameter left out
(``layerwise``: biases and norm gains by default) takes ratio 1 and no weight decay: plain
Adam, ``w -= lr * m_hat / (sqrt(v_hat) + eps)``.

State per parameter: ``exp_avg`` and ``exp_avg_sq`` (two values per parameter value, as
Adam), ``step`` and ``trust_ratio`` (scalars). The step holds one more tensor the size of
the parameters while it runs (``r``, which the norms need whole before any weight moves).

>>> w = torch.nn.Parameter(torch.full((2, 2), 3.0))
>>> optimizer = LAMB([w], lr=0.1, weight_decay=0.0, eps=0.0)
>>> w.grad = torch.ones(2, 2)
>>> optimizer.step()  # r = 1 everywhere: ||w|| / ||r|| = 6 / 2, a step of 0.3
>>> w.detach()
tensor([[2.7000, 2.7000],
        [2.7000, 2.7000]])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autopar.optim.layerwise import (
    ExcludeRule,
    GroupWork,
    LayerwiseOptimizer,
    as_whole,
    by_group,
    is_bias_or_norm,
    local_params,
    trust_ratio,
)
from autopar.optim.norms import global_norms


class LAMB(LayerwiseOptimizer):
    """Layer-wise adaptive moments for large batches (module doc).

    Defaults: ``lr=1e-3``, ``betas=(0.9, 0.999)``, ``eps=1e-6`` (the paper's), and
    ``weight_decay=0.01``, ``exclude=is_bias_or_norm`` (parameters of at most one dim get no
    trust ratio and no weight decay; ``None`` adapts every parameter; a param group's
    ``"exclude"`` overrides).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        exclude: ExcludeRule | None = is_bias_or_norm,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"LAMB: lr, eps, weight_decay must be >= 0: {lr}, {eps}, {weight_decay}"
            )
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LAMB: betas must lie in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, exclude)

    def _step(self, works: list[GroupWork]) -> None:
        updates = [self._updates(work) for work in works]
        adapted = [p for work in works for p in work.adapted]
        wholes = [
            u
            for work, group_updates in zip(works, updates, strict=True)
            for u in as_whole(work.adapted, group_updates[: len(work.adapted)])
        ]
        norms = global_norms(adapted + wholes)
        weight_norms, update_norms = norms[: len(adapted)], norms[len(adapted) :]
        for work, group_updates, weights, sizes in zip(
            works,
            updates,
            by_group(works, weight_norms),
            by_group(works, update_norms),
            strict=True,
        ):
            ratios = _ratios(weights, sizes)
            self.record(work, ratios)
            _apply(work, group_updates, ratios)

    def _updates(self, work: GroupWork) -> list[torch.Tensor]:
        """Move the moments and return ``r`` for each of the group's parameters (adapted
        first, then excluded), as local shards: foreach ``lerp_(m, g)``, ``mul_(v)``,
        ``addcmul_(v, g, g)``, ``sqrt(v)``, ``mul_``, ``add_(eps)``, ``div(m, .)``, and
        ``add_(r, w)`` for the weight decay."""
        group = work.group
        params = work.adapted + work.excluded
        if not params:
            return []
        beta1, beta2 = group["betas"]
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        exp_avgs = local_params(s["exp_avg"] for s in states)
        exp_avg_sqs = local_params(s["exp_avg_sq"] for s in states)
        grads = work.local_grads(params)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        # m_hat / (sqrt(v_hat) + eps) = m / (sqrt(v) * c1 / sqrt(c2) + eps * c1), c_i = 1 - b_i^t
        firsts = [1 - beta1 ** float(t) for t in steps]
        seconds = [1 - beta2 ** float(t) for t in steps]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_mul_(
            denominators, [c1 / math.sqrt(c2) for c1, c2 in zip(firsts, seconds, strict=True)]
        )
        torch._foreach_add_(denominators, [group["eps"] * c1 for c1 in firsts])
        updates = list(torch._foreach_div(exp_avgs, denominators))
        if work.adapted and group["weight_decay"]:
            torch._foreach_add_(
                updates[: len(work.adapted)],
                local_params(work.adapted),
                alpha=group["weight_decay"],
            )
        return updates

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        """``param``'s state, created at its first step: the moments laid out as the
        parameter (DTensors for a DTensor, which checkpoints save per shard) and the step
        count as a host scalar (as ``torch.optim.Adam``'s, so reading it syncs nothing)."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state


def _ratios(
    weight_norms: list[torch.Tensor], update_norms: list[torch.Tensor]
) -> torch.Tensor | None:
    """``||w|| / ||r||`` of the adapted parameters, as one vector (None when none)."""
    if not weight_norms:
        return None
    w, r = torch.stack(weight_norms), torch.stack(update_norms)
    return trust_ratio(w / r, w, r)


def _apply(work: GroupWork, updates: list[torch.Tensor], ratios: torch.Tensor | None) -> None:
    """``w -= lr * ratio * r``: foreach ``addcmul_(w, r, ratio)`` for the adapted
    parameters, ``add_(w, r)`` for the excluded ones."""
    lr = work.group["lr"]
    count = len(work.adapted)
    if work.adapted:
        assert ratios is not None
        torch._foreach_addcmul_(
            local_params(work.adapted), updates[:count], list(ratios.unbind()), value=-lr
        )
    if work.excluded:
        torch._foreach_add_(local_params(work.excluded), updates[count:], alpha=-lr)
