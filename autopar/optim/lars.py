"""LARS: SGD with momentum and a layer-wise learning rate (You, Gitman & Ginsburg 2017,
"Large Batch Training of Convolutional Networks", arXiv 1708.03888, Algorithm 1).

For each parameter ``w`` with gradient ``g``, at step ``t`` with global learning rate
``lr`` (the schedule's), momentum ``m`` and weight decay ``beta``:

    local_lr = eta * ||w|| / (||g|| + beta * ||w|| + eps)      (1 if ||w|| or ||g|| is 0)
    v        = m * v + lr * local_lr * (g + beta * w)           (v starts at 0)
    w        = w - v

``||.||`` is the L2 norm of the whole parameter, over every shard (``norms``), so a
sharded model steps exactly as one device would. The global learning rate sits inside the
momentum, as in the paper's Algorithm 1 (torch's SGD puts it outside; the two agree while
``lr`` is constant). A parameter left out (``layerwise``: biases and norm gains by default)
takes ``local_lr = 1`` and no weight decay: plain SGD with momentum, ``v = m v + lr g``.

State per parameter: ``momentum_buffer`` (one value per parameter value, the same as
``torch.optim.SGD`` with momentum) and ``trust_ratio`` (a scalar, the last ``local_lr``).

>>> w = torch.nn.Parameter(torch.ones(2, 2))
>>> optimizer = LARS([w], lr=1.0, momentum=0.0, weight_decay=0.0, eta=0.5, eps=0.0)
>>> w.grad = torch.full((2, 2), 4.0)
>>> optimizer.step()
>>> w.detach()  # local_lr = 0.5 * 2 / 8: the step is 0.125 * 4
tensor([[0.5000, 0.5000],
        [0.5000, 0.5000]])
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.optim.layerwise import (
    ExcludeRule,
    GroupWork,
    LayerwiseOptimizer,
    by_group,
    is_bias_or_norm,
    local_params,
    trust_ratio,
)
from autopar.optim.norms import global_norms


class LARS(LayerwiseOptimizer):
    """Layer-wise adaptive rate scaling on SGD with momentum (module doc).

    Defaults: ``lr=0.1``, ``momentum=0.9``, ``weight_decay=1e-4``, ``eta=1e-3`` (the trust
    coefficient, the paper's ``eta``), ``eps=1e-8`` (keeps the ratio finite),
    ``exclude=is_bias_or_norm`` (parameters of at most one dim get no trust ratio and no
    weight decay; ``None`` adapts every parameter; a param group's ``"exclude"`` overrides).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        eta: float = 1e-3,
        eps: float = 1e-8,
        *,
        exclude: ExcludeRule | None = is_bias_or_norm,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if value < 0:
                raise ValueError(f"LARS: {name} must be >= 0, got {value}")
        if eta <= 0 or eps < 0:
            raise ValueError(f"LARS: eta must be > 0 and eps >= 0, got {eta} and {eps}")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "eta": eta,
            "eps": eps,
        }
        super().__init__(params, defaults, exclude)

    def _step(self, works: list[GroupWork]) -> None:
        adapted = [p for work in works for p in work.adapted]
        norms = global_norms(adapted + [work.grad(p) for work in works for p in work.adapted])
        weight_norms, grad_norms = norms[: len(adapted)], norms[len(adapted) :]
        for work, weights, grads in zip(
            works, by_group(works, weight_norms), by_group(works, grad_norms), strict=True
        ):
            self._step_group(work, weights, grads)

    def _step_group(
        self, work: GroupWork, weight_norms: list[torch.Tensor], grad_norms: list[torch.Tensor]
    ) -> None:
        """``v = m v + lr * local_lr * (g + beta w)``, ``w -= v``, with foreach ops on the
        local shards: ``mul_(v)``, ``addcmul_(v, g)``, ``addcmul_(v, w)``, ``sub_(w, v)``."""
        group = work.group
        lr, decay = group["lr"], group["weight_decay"]
        params = work.adapted + work.excluded
        if not params:
            return
        ratios = self._ratios(group, weight_norms, grad_norms)
        self.record(work, ratios)
        buffers = [self._buffer(p) for p in params]
        count = len(work.adapted)
        torch._foreach_mul_(buffers, group["momentum"])
        if work.adapted:
            assert ratios is not None
            scales = lr * ratios
            grads = work.local_grads(work.adapted)
            torch._foreach_addcmul_(buffers[:count], grads, list(scales.unbind()))
            if decay:
                decays = list((decay * scales).unbind())
                torch._foreach_addcmul_(buffers[:count], local_params(work.adapted), decays)
        if work.excluded:
            torch._foreach_add_(buffers[count:], work.local_grads(work.excluded), alpha=lr)
        torch._foreach_sub_(local_params(params), buffers)

    @staticmethod
    def _ratios(
        group: dict[str, Any], weight_norms: list[torch.Tensor], grad_norms: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """``eta ||w|| / (||g|| + beta ||w|| + eps)`` of the adapted parameters, as one
        vector (None when there are none)."""
        if not weight_norms:
            return None
        w, g = torch.stack(weight_norms), torch.stack(grad_norms)
        local_lr = group["eta"] * w / (g + group["weight_decay"] * w + group["eps"])
        return trust_ratio(local_lr, w, g)

    def _buffer(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s momentum buffer's local shard (the state keeps it laid out as the
        parameter, a DTensor for a DTensor, which checkpoints save per shard)."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return local_params([state["momentum_buffer"]])[0]
