"""``CompiledModel``: the module each rank runs, holding only its local shards.

Built from a plan (``passes`` made it) and the user's module:

- parameters become ``nn.Parameter`` local shards under their original names (so
  ``named_parameters()`` reads like the user's model, and any ``torch.optim`` optimizer
  works on ``parameters()``); buffers and constants stay whole;
- the lowered per-rank graph (``passes.lower_spmd``) becomes a ``GraphModule`` whose
  collectives are submodules over the mesh axes' process groups;
- gradients of parameters replicated over mesh axes are summed there after backward,
  bucketed and overlapped (``autopar.runtime.grad_sync``).

Every rank passes the same global inputs and gets the whole outputs back, so swapping the
model for the compiled one changes nothing else in a training script.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.runtime.collectives import MODULES
from autopar.runtime.grad_sync import GradientSync
from autopar.runtime.groups import axis_groups
from passes.from_plan import PlanLayouts
from passes.lower_spmd import LoweredGraph, local_shard, lower_spmd
from passes.trace import TracedModel
from plans.errors import UsageError
from plans.placement import Layout, Replicate, Shard
from plans.plan import Plan


class _Holder(nn.Module):
    """An empty module to hang parameters on at their original dotted paths."""


def _set_attr(root: nn.Module, dotted: str, value: torch.Tensor, kind: str) -> None:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        child = getattr(module, part, None)
        if child is None:
            child = _Holder()
            module.add_module(part, child)
        module = child
    if kind == "param":
        module.register_parameter(leaf, value)  # type: ignore[arg-type]
    else:
        module.register_buffer(leaf, value, persistent=kind == "buffer")


class CompiledModel(nn.Module):
    """The user's model, planned and lowered for this rank."""

    def __init__(
        self,
        model: nn.Module,
        traced: TracedModel,
        plan: Plan,
        device_mesh: Any,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.device_mesh = device_mesh
        self.traced = traced
        mesh = plan.mesh
        rank = dist.get_rank()
        self.coords = mesh.coordinates(rank)
        layouts = PlanLayouts(traced, plan)
        lowered = lower_spmd(traced, layouts.strategy, layouts.layout, mesh, self.coords, device)
        self.lowered: LoweredGraph = lowered
        root = _Holder()
        full_params = dict(model.named_parameters(remove_duplicate=False))
        self._layouts: dict[str, Layout] = {}
        for target, name in lowered.params.items():
            full = full_params[name].detach().to(device)
            dist.broadcast(full, src=0)  # every rank starts from rank 0's weights, as DDP
            layout = plan.params[name].param
            local = local_shard(full, layout, self.coords, mesh.shape)
            _set_attr(root, target, nn.Parameter(local.clone()), "param")
            self._layouts[name] = layout
        buffers = dict(model.named_buffers(remove_duplicate=False))
        constants = traced.exported.constants
        for target, name in lowered.buffers.items():
            _set_attr(root, target, buffers[name].detach().to(device), "buffer")
        for target, name in lowered.constants.items():
            _set_attr(root, target, constants[name].detach().to(device), "constant")
        for module_name, (kind, axis) in lowered.collectives.items():
            group = device_mesh.get_group(axis)
            root.add_module(module_name, MODULES[kind](group, mesh.axis_names[axis]))
        self.module = torch.fx.GraphModule(
            root, lowered.graph, class_name=f"{type(model).__name__}Rank{rank}"
        )
        self._sync_axis_groups = axis_groups(mesh)
        self._sync = GradientSync([(p, self._sync_groups(name)) for name, p in self._named_local()])

    def _named_local(self) -> Iterator[tuple[str, nn.Parameter]]:
        for target, name in self.lowered.params.items():
            yield name, self.module.get_parameter(target)

    def _sync_groups(self, name: str) -> tuple[dist.ProcessGroup, ...]:
        layout = self._layouts[name]
        groups = self._sync_axis_groups
        return tuple(
            groups[axis]
            for axis, p in enumerate(layout)  # type: ignore[misc]
            if isinstance(p, Replicate) and self.plan.mesh.shape[axis] > 1
        )

    # ---- running ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = pytree.tree_flatten((args, kwargs))
        expected = len(self.traced.user_inputs)
        if len(leaves) != expected:
            raise UsageError(
                f"the compiled model takes {expected} inputs (as traced), got {len(leaves)}"
            )
        flat = self.module(*leaves)
        out_spec = self.traced.exported.call_spec.out_spec
        flat_list = list(flat) if isinstance(flat, list | tuple) else [flat]
        return pytree.tree_unflatten(flat_list, out_spec) if out_spec is not None else flat

    @property
    def code(self) -> str:
        """The Python this rank runs (``autopar codegen`` prints it)."""
        return self.module.code

    # ---- state --------------------------------------------------------------------
    def full_parameter(self, name: str) -> torch.Tensor:
        """The whole value of parameter ``name``, gathered from every rank's shard."""
        target = next(t for t, n in self.lowered.params.items() if n == name)
        local = self.module.get_parameter(target).detach()
        return gather_full(local, self._layouts[name], self.device_mesh)

    def full_gradient(self, name: str) -> torch.Tensor | None:
        target = next(t for t, n in self.lowered.params.items() if n == name)
        grad = self.module.get_parameter(target).grad
        if grad is None:
            return None
        return gather_full(grad.detach(), self._layouts[name], self.device_mesh)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Whole tensors under the user's names (tied weights under each of their names)."""
        state: dict[str, Any] = {}
        for name in self.plan.params:
            value = self.full_parameter(name)
            state[name] = value
            for alias in self.plan.params[name].aliases:
                state[alias] = value
        for target, name in self.lowered.buffers.items():
            state[name] = self.module.get_buffer(target).detach()
        return state

    def load_state_dict(
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:  # type: ignore[override]
        """Load whole tensors (as ``state_dict`` returns them); each rank keeps its shard."""
        missing = [n for n in self.plan.params if n not in state_dict]
        if strict and missing:
            raise UsageError(f"load_state_dict: missing {missing[:5]}")
        with torch.no_grad():
            for target, name in self.lowered.params.items():
                if name not in state_dict:
                    continue
                local = local_shard(
                    state_dict[name].to(self._device()),
                    self._layouts[name],
                    self.coords,
                    self.plan.mesh.shape,
                )
                self.module.get_parameter(target).copy_(local)
        return None

    def _device(self) -> torch.device:
        return next(self.module.parameters()).device


def gather_full(local: torch.Tensor, layout: Layout, device_mesh: Any) -> torch.Tensor:
    """All-gather a local shard back to the whole tensor (no autograd)."""
    from autopar.runtime.collectives import all_gather

    value = local
    for axis in reversed(range(len(layout))):
        placement = layout[axis]
        if isinstance(placement, Shard):
            value = all_gather(value, placement.dim, device_mesh.get_group(axis))
    return value
