"""What LARS and LAMB share: which parameters get a trust ratio, and the step's bookkeeping.

Both scale each layer's step by a *trust ratio* built from whole-parameter norms
(``norms.global_norms``), so a layer whose gradient is large against its weights takes a
proportionally smaller step (You, Gitman & Ginsburg 2017, Sec. 3). Biases and the gains of
normalization layers are left out, with no trust ratio and no weight decay: the LARS paper
applies neither to them (Sec. 4) and LAMB's reference BERT code excludes ``bias`` and
``LayerNorm`` from both; their norms are tiny or dominated by the init, so the ratio would
be noise. By default a parameter is left out when it has at most one dim
(``is_bias_or_norm``), the rule most large-batch code uses (NVIDIA's LARS, timm).

Choosing, in order:

1. a param group's ``"exclude"`` (``True``: every parameter of the group is left out,
   ``False``: none is; the default ``None`` asks the rule);
2. the optimizer's ``exclude`` rule, a predicate on the parameter (``None``: none is).

The rule sees the parameter the optimizer steps: on a compiled model that is a DTensor of
the *planned* shape, which is the user's shape except for parameters the planner reshaped
(GPT's fused q/k/v bias ``[3C]`` is planned ``[3, C]``). ``layerwise_groups`` decides on
the user's shapes and names instead, and is the safe choice for a compiled model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.optim.norms import matching
from autopar.runtime.shards import as_dtensor_like, local_of

ExcludeRule = Callable[[torch.Tensor], bool]


def is_bias_or_norm(param: torch.Tensor) -> bool:
    """The default rule: a vector (a bias, a norm's gain) or a scalar gets no trust ratio.

    >>> is_bias_or_norm(torch.zeros(8)), is_bias_or_norm(torch.zeros(8, 8))
    (True, False)
    """
    return param.ndim <= 1


def layerwise_groups(
    model: nn.Module, exclude: Callable[[str, tuple[int, ...]], bool] | None = None
) -> list[dict[str, Any]]:
    """Two param groups for ``model``: those that get a trust ratio (``"exclude": False``)
    and those left out (``"exclude": True``), decided on each parameter's name and the
    user's shape (``model.user_shape(name)`` on a compiled model, so a planner's reshape
    does not change the choice). ``exclude(name, shape)`` defaults to ``len(shape) <= 1``.

    >>> groups = layerwise_groups(nn.Linear(4, 2))
    >>> [(g["exclude"], [tuple(p.shape) for p in g["params"]]) for g in groups]
    [(False, [(2, 4)]), (True, [(2,)])]
    """
    rule = exclude or (lambda _, shape: len(shape) <= 1)
    shape_of = getattr(model, "user_shape", None)
    adapted: list[nn.Parameter] = []
    excluded: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        shape = tuple(shape_of(name)) if callable(shape_of) else tuple(param.shape)
        (excluded if rule(name, shape) else adapted).append(param)
    return [
        group
        for group in ({"params": adapted, "exclude": False}, {"params": excluded, "exclude": True})
        if group["params"]
    ]


@dataclass
class GroupWork:
    """One param group's parameters that have gradients, split into those with a trust
    ratio (``adapted``) and those without, with gradients laid out as the parameters."""

    group: dict[str, Any]
    adapted: list[torch.Tensor] = field(default_factory=list)
    excluded: list[torch.Tensor] = field(default_factory=list)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # id(param) -> gradient

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s gradient laid out as ``param`` (a DTensor for a DTensor)."""
        return self.grads[id(param)]

    def local_grads(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [local_of(self.grad(p)) for p in params]


def by_group(works: list[GroupWork], values: list[Any]) -> list[list[Any]]:
    """``values``, one per adapted parameter of ``works`` laid end to end, cut per group."""
    found, start = [], 0
    for work in works:
        found.append(values[start : start + len(work.adapted)])
        start += len(work.adapted)
    return found


def local_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of ``params``, which an in-place op updates in the parameter."""
    return [local_of(p) for p in params]


def as_whole(params: Iterable[torch.Tensor], locals_: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each local tensor seen as the whole tensor laid out as its parameter, so that
    ``global_norms`` knows which ranks hold its other pieces."""
    return [as_dtensor_like(p, t) for p, t in zip(params, locals_, strict=True)]


def trust_ratio(
    ratio: torch.Tensor, weight_norm: torch.Tensor, other_norm: torch.Tensor
) -> torch.Tensor:
    """``ratio``, or 1 where the weight's norm or the gradient's (update's) norm is 0 (a
    zero-initialized layer, or no gradient): the step then falls back to the plain
    optimizer's instead of vanishing or dividing by zero (the reference implementations
    of both papers do the same)."""
    return torch.where((weight_norm > 0) & (other_norm > 0), ratio, 1.0)


class LayerwiseOptimizer(torch.optim.Optimizer):
    """An optimizer whose parameters each get a trust ratio, unless excluded (module doc).

    Subclasses implement ``_step`` (one step of the groups' work); this class runs the
    closure, splits the groups (``prepare``), records the ratios (``record``) and reports
    them (``trust_ratios``).
    """

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        exclude: ExcludeRule | None,
    ) -> None:
        self.exclude_rule = exclude
        super().__init__(params, {**defaults, "exclude": None})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of every parameter that has a gradient. Collective on a sharded model:
        the norms are summed over the shards, one small all-reduce per mesh axis."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(self.prepare())
        return loss

    def _step(self, works: list[GroupWork]) -> None:
        raise NotImplementedError

    def excluded(self, group: dict[str, Any], param: torch.Tensor) -> bool:
        """Whether ``param`` gets no trust ratio and no weight decay."""
        if group["exclude"] is not None:
            return bool(group["exclude"])
        return self.exclude_rule is not None and bool(self.exclude_rule(param))

    def prepare(self) -> list[GroupWork]:
        """Every group's parameters with a gradient, split by ``excluded``."""
        works = []
        for group in self.param_groups:
            work = GroupWork(group)
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                work.grads[id(param)] = matching(param.grad, param)
                (work.excluded if self.excluded(group, param) else work.adapted).append(param)
            works.append(work)
        return works

    def record(self, work: GroupWork, ratios: torch.Tensor | None) -> None:
        """Keep this step's ratios in the state (``"trust_ratio"``, a scalar view of the
        vector ``ratios`` of the adapted parameters), and 1 for the excluded ones."""
        if ratios is not None:
            for param, ratio in zip(work.adapted, ratios.unbind(), strict=True):
                self.state[param]["trust_ratio"] = ratio
        if work.excluded:
            one = torch.ones((), device=local_of(work.excluded[0]).device)
            for param in work.excluded:
                self.state[param]["trust_ratio"] = one

    def trust_ratios(self) -> dict[torch.Tensor, float]:
        """The trust ratio of each parameter's last step, keyed by the parameter (1 for an
        excluded one). Reads the values to the host: call it to inspect, not every step."""
        return {
            param: float(self.state[param]["trust_ratio"])
            for group in self.param_groups
            for param in group["params"]
            if "trust_ratio" in self.state.get(param, {})
        }
