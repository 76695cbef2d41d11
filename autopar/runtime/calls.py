"""The calls a compiled model takes: one program per call shape, on one parameter tree.

The plan is made for the traced call: its batch and sequence length, its keyword inputs,
the model's mode. A call of another shape (the last, partial batch of an epoch, an
evaluation at another sequence length, a generation step), in the other mode
(``model.eval()``: dropout off) or with other keywords (no ``labels``) gets a program of its
own, planned for that call with every parameter kept in the layout it is stored in (so the
weights, their gradients and the optimizer's state stay as they are) and cached: a
``CallProgram``. ``CompiledModel.forward`` runs the first one that ``accepts`` its inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar_passes.trace import TracedModel
from autopar_plans.placement import Layout
from autopar_plans.plan import Plan

# (positional inputs, keyword inputs, training) -> the plan and the trace of that call,
# the same on every rank (``autopar.api``: rank 0 plans)
CallPlanner = Callable[[tuple[Any, ...], dict[str, Any], bool], tuple[Plan, TracedModel]]


@dataclass
class CallProgram:
    """One call shape's program and what it takes and gives."""

    plan: Plan
    module: torch.fx.GraphModule
    # per input (flattened in the traced order): its name, shape as the program takes it
    # (None: not a tensor) and the layout its consumers need
    inputs: list[tuple[str, tuple[int, ...] | None, Layout]]
    out_spec: Any
    keywords: tuple[str, ...]  # the keyword inputs as traced, in the program's order
    constant_kwargs: dict[str, Any]  # keyword inputs that are no tensors: specialised
    added_kwargs: dict[str, Any]  # keywords autopar set itself (use_cache=False)
    training: bool
    outputs: tuple[Layout | None, ...]

    def with_added(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**self.added_kwargs, **kwargs}

    def accepts(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        training: bool,
        shapes: list[tuple[int, ...] | None],
    ) -> bool:
        """Whether this program runs ``model(*args, **kwargs)`` in mode ``training``, its
        tensor inputs expected in ``shapes`` (global, or this rank's slices)."""
        kwargs = self.with_added(kwargs)
        if training != self.training or set(kwargs) != set(self.keywords):
            return False
        for key, value in self.constant_kwargs.items():
            if isinstance(kwargs[key], torch.Tensor) or kwargs[key] != value:
                return False
        leaves = pytree.tree_leaves((args, {key: kwargs[key] for key in self.keywords}))
        if len(leaves) != len(self.inputs):
            return False
        return all(
            not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) == shape
            for leaf, shape in zip(leaves, shapes, strict=True)
        )
