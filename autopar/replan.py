"""Plans for the calls a compiled model was not traced for (``autopar.runtime.calls``).

``compile`` keeps a *skeleton* of the user's model (the same modules, every parameter and
buffer on the ``meta`` device, so it holds no memory) and a ``CallPlanner`` over it. For a
call of another shape, mode or keywords, rank 0 plans that call (as ``compile`` planned the
first one) with every parameter pinned to the layout it is stored in and the same ZeRO
stage, so the new program reads the same shards and its gradients and optimizer state are
the same tensors; every rank then traces the skeleton for its lowering. The call's
constants come from the first program's (a program reads no constant the first did not).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.mesh import Mesh
from autopar_passes.solve import Constraint
from autopar_passes.strategies.graph import NodeChoices
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel, trace
from autopar_plans.placement import Layout
from autopar_plans.plan import Plan

LOG = logging.getLogger("autopar")

# the planning options a call's plan keeps from the first (its own batch, one microbatch,
# no pipeline; the ZeRO stage pinned). Not a forced style or hints: the pinned parameters
# are what they decided that a call must keep, and what they ask of activations may not
# fit another shape (data parallelism over 4 devices splits no batch of 3)
KEPT_OPTIONS = (
    "memory_limit",
    "optimizer",
    "precision",
    "time_limit",
    "name",
    "batch_norm",
    "grad_compression",
    "sync",
    "period",
    "sync_warmup",
    "reduction_form",
)


def skeleton(model: nn.Module) -> nn.Module | None:
    """``model`` deep-copied with every tensor it holds on ``meta``; None when it cannot be
    copied (a module holding a lock, a file, ...)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in memo:
                memo[id(param)] = nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
                )
        for value in (*module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except (TypeError, RuntimeError, copy.Error) as error:
        LOG.info("calls of other shapes need a new compile: the model cannot be copied (%s)", error)
        return None


def zero_stage(plan: Plan) -> int:
    """The ZeRO stage the solver chose (0, 1 or 2) for ``plan``'s parameter layouts:
    ``Plan.parallelism.zero`` describes what ends up sharded, which FSDP's parameters make
    3."""
    params = plan.params.values()
    if any(p.grad != p.param for p in params):
        return 2
    return 1 if any(p.optimizer != p.param for p in params) else 0


def pinned_layouts(traced: TracedModel, plan: Plan) -> dict[str, Layout]:
    """Each parameter placeholder's stored layout in ``plan``."""
    return {
        node: plan.params[name].param for name, info in traced.params.items() for node in info.nodes
    }


def keep_pinned(pinned: Mapping[str, Layout]) -> Constraint:
    """A constraint: the parameters stay in ``pinned``'s layouts."""

    def rule(node: str, choices: NodeChoices, strategy: Strategy) -> bool:
        want = pinned.get(node)
        return choices.kind != "param" or want is None or strategy.outputs[0] == want

    return rule


@dataclass
class CallPlanner:
    """Plans a call of the compiled model that its first plan does not take."""

    skeleton: nn.Module
    mesh: Mesh
    options: dict[str, Any]  # ``KEPT_OPTIONS`` of the first plan, and its ZeRO stage
    pinned: dict[str, Layout]

    def __call__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], training: bool
    ) -> tuple[Plan, TracedModel]:
        from autopar.api import plan_on_rank0

        args, kwargs = _on_meta(args), _on_meta(kwargs)
        self.skeleton.train(training)
        options = dict(self.options, stages=1, microbatches=1)
        shapes = [tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)]
        LOG.info("planning a call of %s (training=%s), the parameters in place", shapes, training)
        plan, traced = plan_on_rank0(self.skeleton, self.mesh, args, kwargs, options, self.pinned)
        if traced is None:  # not rank 0: trace the call for the lowering
            traced = trace(self.skeleton, args, kwargs, batch_norm_groups=plan.batch_norm_groups)
        return plan, traced


def _on_meta(inputs: Any) -> Any:
    return pytree.tree_map(
        lambda x: x.detach().to("meta") if isinstance(x, torch.Tensor) else x, inputs
    )
