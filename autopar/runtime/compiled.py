"""``CompiledModel``: the module each rank runs, holding only its local shards.

Built from a plan (``passes`` made it) and the user's module:

- parameters become ``nn.Parameter`` local shards under their original dotted names, so
  ``named_parameters()`` reads like the user's model (a tied weight once, under its first
  name) and any ``torch.optim`` optimizer works on ``parameters()``; buffers and constants
  stay whole. A parameter the trace planned in another shape (a fused q/k/v weight as
  ``[3, C, Cin]``, ``passes.expose``) is held in that shape and given back in the user's
  (``full_parameter``, ``state_dict``);
- the lowered per-rank graph (``passes.lower_spmd``) becomes a ``GraphModule`` (``program``)
  whose collectives are submodules over the mesh axes' process groups;
- gradients of parameters replicated over mesh axes are summed there after backward,
  bucketed and overlapped (``autopar.runtime.grad_sync``).

One module tree, three views. The parameters hang on small holder modules at the user's
paths; the ``CompiledModel`` and its ``program`` share that tree's registries
(``_parameters``, ``_buffers``, ``_modules``), so ``named_parameters``, ``.to()``,
``train()`` and attribute paths (``compiled.wte.weight``) all see the user's names, also
when the compiled model sits inside another module, while the program's generated code
reads the same tensors. ``state_dict`` and ``load_state_dict`` speak whole tensors
(gathered; each rank keeps its shard on load): the holders save and load nothing
themselves, the ``CompiledModel`` does it for the whole tree.

Inputs and outputs. By default every rank passes the same global inputs and gets the whole
outputs back, so swapping the model for the compiled one changes nothing else in a training
script. ``inputs="local"``: each rank passes only its slice of each input
(``input_slices()``). ``outputs="sharded"``: each rank gets its local piece of each output
(``output_layouts()``); the loss it computes from them must be its summand of the global
loss (for a token-mean cross-entropy: the local sum divided by the global token count), and
ranks holding the same piece compute the same term (``passes.lower_spmd``, the output
boundary).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils import _pytree as pytree

from autopar.runtime import checkpoint
from autopar.runtime.collectives import MODULES
from autopar.runtime.grad_sync import GradientSync
from autopar.runtime.groups import axis_groups
from autopar.runtime.precision import run_precision
from autopar.runtime.shards import gather_full, local_slices
from autopar.runtime.zero import ZeroParam, ZeroShards, master_piece, zero_axes
from passes.from_plan import PlanLayouts
from passes.lower_spmd import LoweredGraph, local_shard, lower_spmd
from passes.trace import TracedModel
from plans.errors import UsageError
from plans.placement import Layout, Replicate
from plans.plan import Plan

InputMode = Literal["global", "local"]
OutputMode = Literal["whole", "sharded"]


class _Holder(nn.Module):
    """An empty module to hang parameters on at their original dotted paths.

    It saves and loads nothing itself: its tensors are shards, and the ``CompiledModel``
    above it saves and loads the whole tensors for every path (also when a parent module's
    ``state_dict`` or ``load_state_dict`` walks the tree).
    """

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None


def _set_attr(root: nn.Module, dotted: str, value: Any, kind: str) -> None:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = _Holder()
            module.add_module(part, child)
        module = child
    if kind == "param":
        module.register_parameter(leaf, value)
    elif kind == "module":
        module.add_module(leaf, value)
    else:
        module.register_buffer(leaf, value, persistent=kind == "buffer")


def _share_tree(module: nn.Module, tree: nn.Module) -> None:
    """Make ``module``'s registries ``tree``'s own (the same dicts, not copies)."""
    for registry in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        object.__setattr__(module, registry, getattr(tree, registry))


class CompiledModel(nn.Module):
    """The user's model, planned and lowered for this rank."""

    def __init__(
        self,
        model: nn.Module,
        traced: TracedModel,
        plan: Plan,
        device_mesh: Any,
        device: torch.device,
        *,
        inputs: InputMode = "global",
        outputs: OutputMode = "whole",
    ) -> None:
        super().__init__()
        mesh = plan.mesh
        rank = dist.get_rank()
        self.plan = plan
        self.device_mesh = device_mesh
        self.device = device
        self.precision = run_precision(plan.precision, device.type)
        self.coords = mesh.coordinates(rank)
        self.inputs_mode: InputMode = inputs
        self.outputs_mode: OutputMode = outputs
        layouts = PlanLayouts(traced, plan, local_inputs=inputs == "local")
        lowered = lower_spmd(
            traced,
            layouts.strategy,
            layouts.layout,
            mesh,
            self.coords,
            device,
            sharded_outputs=outputs == "sharded",
        )
        self.lowered: LoweredGraph = lowered
        self._out_spec = traced.exported.call_spec.out_spec
        # name -> (the user's shape, the planned shape), for parameters planned reshaped
        self._reshaped = dict(traced.reshaped)
        self._inputs = [
            (name, _shape_of(traced, name), layouts.inputs[name]) for name in traced.user_inputs
        ]
        self._sync_axis_groups = axis_groups(mesh)
        zero: list[ZeroParam] = []
        tree = self._build_tree(model, traced, lowered, zero)
        self._zero = ZeroShards(zero)
        program = torch.fx.GraphModule(
            tree, lowered.graph, class_name=f"{type(model).__name__}Rank{rank}"
        )
        _share_tree(program, tree)
        object.__setattr__(self, "program", program)  # not a child: it shares our tree
        self._state_keys = _state_keys(model, plan, lowered)
        self._sync = GradientSync(
            [
                (p, self._sync_groups(n))
                for n, p in self._named_local()
                if n not in self._zero.params
            ]
        )
        _share_tree(self, tree)

    def _build_tree(
        self,
        model: nn.Module,
        traced: TracedModel,
        lowered: LoweredGraph,
        zero: list[ZeroParam],
    ) -> nn.Module:
        """The holder tree: local shards, buffers, constants and collectives at their paths.

        A parameter whose optimizer state the plan shards further (ZeRO-1/2) hangs there as
        its *master* piece, and the graph reads a working copy instead (``runtime.zero``)."""
        mesh, device = self.plan.mesh, self.device
        cast = self.precision.params
        tree = _Holder()
        full_params = dict(model.named_parameters(remove_duplicate=False))
        for target, name in lowered.params.items():
            full = full_params[name].detach().to(device)
            if name in self._reshaped:
                full = full.reshape(self._reshaped[name][1])
            dist.broadcast(full, src=0)  # every rank starts from rank 0's weights, as DDP
            local = local_shard(full, self.plan.params[name].param, self.coords, mesh.shape)
            if cast is not None and local.is_floating_point():
                local = local.to(cast)
            placed = self._zero_param(name, target, local, lowered, tree)
            if placed is not None:
                zero.append(placed)
                continue
            _set_attr(tree, target, nn.Parameter(local.clone()), "param")
        buffers = dict(model.named_buffers(remove_duplicate=False))
        for target, name in lowered.buffers.items():
            value = buffers[name].detach().to(device)
            if cast is not None and value.is_floating_point():
                value = value.to(cast)
            _set_attr(tree, target, value, "buffer")
        constants = traced.exported.constants
        for target, name in lowered.constants.items():
            _set_attr(tree, target, constants[name].detach().to(device), "constant")
        for module_name, (kind, axis) in lowered.collectives.items():
            group = self.device_mesh.get_group(axis)
            _set_attr(tree, module_name, MODULES[kind](group, mesh.axis_names[axis]), "module")
        return tree

    def _zero_param(
        self, name: str, target: str, local: torch.Tensor, lowered: LoweredGraph, tree: nn.Module
    ) -> ZeroParam | None:
        """Place a ZeRO-1/2 parameter: its master piece at ``target`` (what the optimizer
        steps), a working copy elsewhere that the graph's ``get_attr`` now reads."""
        plan, mesh_shape = self.plan.params[name], self.plan.mesh.shape
        found = zero_axes(plan.param, plan.optimizer, mesh_shape)
        if not found:
            return None
        axes = tuple(axis for axis, _ in found)
        dims = tuple(dim for _, dim in found)
        coords = tuple(self.coords[axis] for axis in axes)
        sizes = tuple(mesh_shape[axis] for axis in axes)
        master = nn.Parameter(master_piece(local, dims, coords, sizes).clone())
        _set_attr(tree, target, master, "param")
        working = local.clone().requires_grad_(True)
        working_path = "_zero_working." + target.replace(".", "__")
        _set_attr(tree, working_path, working, "constant")
        for node in lowered.graph.nodes:
            if node.op == "get_attr" and node.target == target:
                node.target = working_path
        groups = self._sync_axis_groups
        others = tuple(
            groups[axis]  # type: ignore[misc]
            for axis, p in enumerate(plan.param)
            if isinstance(p, Replicate) and mesh_shape[axis] > 1 and axis not in axes
        )
        return ZeroParam(
            name,
            master,
            working,
            axes,
            dims,
            coords,
            tuple(groups[a] for a in axes),  # type: ignore[misc]
            others,
            shard_gradient=plan.grad != plan.param,
        )

    def _named_local(self) -> Iterator[tuple[str, nn.Parameter]]:
        for target, name in self.lowered.params.items():
            yield name, self.program.get_parameter(target)

    def _sync_groups(self, name: str) -> tuple[dist.ProcessGroup, ...]:
        layout = self.plan.params[name].param
        groups = self._sync_axis_groups
        return tuple(
            groups[axis]  # type: ignore[misc]
            for axis, p in enumerate(layout)
            if isinstance(p, Replicate) and self.plan.mesh.shape[axis] > 1
        )

    # ---- running ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = pytree.tree_flatten((args, kwargs))
        if len(leaves) != len(self._inputs):
            raise UsageError(
                f"the compiled model takes {len(self._inputs)} inputs (as traced), "
                f"got {len(leaves)}"
            )
        prepared = [self._prepare(i, leaf) for i, leaf in enumerate(leaves)]
        self._zero.gather()  # ZeRO: working copies from the masters the optimizer stepped
        with self.precision.autocast(self.device.type):
            flat = self.program(*prepared)
        flat_list = list(flat) if isinstance(flat, list | tuple) else [flat]
        if self._out_spec is None:
            return flat
        return pytree.tree_unflatten(flat_list, self._out_spec)

    def _prepare(self, index: int, value: Any) -> Any:
        """Check an input's shape against the plan; cast it for pure-bf16 runs."""
        if not isinstance(value, torch.Tensor):
            return value
        name, shape, _ = self._inputs[index]
        want = self._expected_shape(index)
        if want is not None and tuple(value.shape) != want:
            if self.inputs_mode == "local":
                raise UsageError(
                    f"input {index} ({name}) has shape {tuple(value.shape)}; with "
                    f"inputs='local' this rank passes its slice of the global {shape}, "
                    f"of shape {want}: x[compiled.input_slices()[{index}]]"
                )
            raise UsageError(
                f"input {index} ({name}) has shape {tuple(value.shape)} but the plan was "
                f"made for {shape}; every rank passes the whole batch of that shape "
                "(compile again to plan for another shape, or use inputs='local')"
            )
        cast = self.precision.params
        if cast is not None and value.is_floating_point():
            return value.to(cast)
        return value

    def _expected_shape(self, index: int) -> tuple[int, ...] | None:
        _, shape, layout = self._inputs[index]
        if shape is None or self.inputs_mode == "global":
            return shape
        return tuple(
            s.stop - s.start for s in local_slices(shape, layout, self.coords, self.plan.mesh.shape)
        )

    @property
    def code(self) -> str:
        """The Python this rank runs (``autopar codegen`` prints it)."""
        return self.program.code

    # ---- inputs and outputs ---------------------------------------------------------
    def input_layouts(self) -> tuple[Layout, ...]:
        """For each input (flattened, as ``forward`` takes them), the layout its consumers
        need: where they disagree, the one most of them need (ties: the first in graph
        order); ``Partial`` is read as ``Replicate``."""
        return tuple(layout for _, _, layout in self._inputs)

    def input_slices(self) -> tuple[tuple[slice, ...], ...]:
        """For each input, this rank's slice of the whole input, one ``slice`` per dim, in
        ``input_layouts()``: what a data loader loads for ``inputs="local"``.

        >>> tokens[compiled.input_slices()[0]]     # doctest: +SKIP
        """
        mesh_shape = self.plan.mesh.shape
        return tuple(
            local_slices(shape, layout, self.coords, mesh_shape) if shape is not None else ()
            for _, shape, layout in self._inputs
        )

    def output_layouts(self) -> tuple[Layout | None, ...]:
        """For each output (flattened), the layout ``forward`` returns it in: replicated by
        default; with ``outputs="sharded"`` the plan's layout with partial sums completed.
        None for an output that is not a tensor."""
        return tuple(self.lowered.outputs)

    # ---- parameters by name ---------------------------------------------------------
    def _canonical(self, name: str) -> str:
        """The plan's name of a parameter, given any of its names (a tied weight has many)."""
        if name in self.plan.params:
            return name
        for first, info in self.plan.params.items():
            if name in info.aliases:
                return first
        raise UsageError(f"no parameter named {name!r}; see compiled.named_parameters()")

    def _local_param(self, name: str) -> nn.Parameter:
        return self.program.get_parameter(self._canonical(name))

    def _local_value(self, name: str) -> torch.Tensor:
        """This rank's piece of parameter ``name`` in the parameter's layout (for ZeRO
        parameters the working copy, gathered from the masters)."""
        canonical = self._canonical(name)
        if canonical in self._zero.params:
            return self._zero.local_value(canonical)
        return self._local_param(canonical).detach()

    def param_layout(self, name: str) -> Layout:
        """The layout the parameter ``name`` is stored in."""
        return self.plan.params[self._canonical(name)].param

    def param_shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of parameter ``name`` as planned (and as its shards lie)."""
        return tuple(self.plan.params[self._canonical(name)].shape)

    def user_shape(self, name: str) -> tuple[int, ...]:
        """The shape of parameter ``name`` in the user's model."""
        canonical = self._canonical(name)
        if canonical in self._reshaped:
            return self._reshaped[canonical][0]
        return self.param_shape(canonical)

    def full_parameter(self, name: str) -> torch.Tensor:
        """The whole value of parameter ``name`` in the user's shape, gathered from every
        rank's shard. Collective: every rank calls it. An unsharded parameter's value
        shares its storage (``shards.gather_full``)."""
        local = self._local_value(name)
        whole = gather_full(local, self.param_layout(name), self.device_mesh)
        return whole.reshape(self.user_shape(name))

    def full_gradient(self, name: str) -> torch.Tensor | None:
        """The whole gradient of parameter ``name`` (None before backward). Collective."""
        canonical = self._canonical(name)
        if canonical in self._zero.params:
            grad = self._zero.local_grad(canonical)
        else:
            grad = self._local_param(name).grad
        if grad is None:
            return None
        whole = gather_full(grad.detach(), self.param_layout(name), self.device_mesh)
        return whole.reshape(self.user_shape(name))

    # ---- state: whole tensors -------------------------------------------------------
    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        """Whole tensors under the user's names, in the user's ``state_dict`` order (a tied
        weight under each of its names; non-persistent buffers left out, as torch does).

        Gathers every sharded parameter: collective, every rank calls ``state_dict()``.
        ``keep_vars`` cannot hold: the values are gathered copies, not the parameters.
        """
        gathered: dict[str, torch.Tensor] = {}
        for key, kind, source in self._state_keys:
            if kind == "param":
                if source not in gathered:
                    gathered[source] = self.full_parameter(source)
                destination[prefix + key] = gathered[source]
            else:
                destination[prefix + key] = self.program.get_buffer(source).detach()

    def load_state_dict(
        self, state_dict: Any, strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load whole tensors (as the single-device model's ``state_dict`` has them); each
        rank keeps its shard. Every rank passes the same state.

        Raises ``UsageError`` for missing or unexpected keys (when ``strict``) and for
        tensors of the wrong shape.
        """
        if assign:
            raise UsageError(
                "load_state_dict(assign=True) would replace the local shards with whole "
                "tensors; load without assign (values are copied into the shards)"
            )
        expected = {key for key, _, _ in self._state_keys}
        if strict:
            missing = sorted(expected - set(state_dict))
            unexpected = sorted(set(state_dict) - expected)
            if missing or unexpected:
                raise UsageError(
                    "load_state_dict: the state does not fit this model: "
                    f"missing {missing[:5]}, unexpected {unexpected[:5]}; pass the "
                    "single-device model's state_dict() (or strict=False)"
                )
        for key, kind, source in self._state_keys:
            if key in state_dict:
                want = (
                    self.user_shape(source)
                    if kind == "param"
                    else tuple(self.program.get_buffer(source).shape)
                )
                got = tuple(state_dict[key].shape)
                if got != want:
                    raise UsageError(
                        f"load_state_dict: {key} has shape {got}, the model {want}; the "
                        "state comes from another model configuration"
                    )
        return super().load_state_dict(state_dict, strict=strict)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Copy this rank's piece of each whole tensor into its shard (torch's hook, so a
        parent module's ``load_state_dict`` works too)."""
        expected = set()
        with torch.no_grad():
            for key, kind, source in self._state_keys:
                expected.add(prefix + key)
                value = state_dict.get(prefix + key)
                if value is None:
                    missing_keys.append(prefix + key)
                    continue
                if kind == "param":
                    layout, shape = self.param_layout(source), self.user_shape(source)
                    target: torch.Tensor = self._local_param(source)
                else:
                    layout = Layout.replicated(self.plan.mesh.ndim)
                    target = self.program.get_buffer(source)
                    shape = tuple(target.shape)
                if tuple(value.shape) != shape:
                    error_msgs.append(
                        f"size mismatch for {prefix + key}: {tuple(value.shape)} in the "
                        f"state, {shape} in the model"
                    )
                    continue
                if kind == "param":
                    value = value.reshape(self.param_shape(source))
                piece = local_shard(
                    value.to(target.device), layout, self.coords, self.plan.mesh.shape
                )
                if kind == "param" and self._canonical(source) in self._zero.params:
                    self._zero.assign(self._canonical(source), piece)
                else:
                    target.copy_(piece)
        if strict:
            unexpected_keys.extend(
                k for k in state_dict if k.startswith(prefix) and k not in expected
            )

    def local_state_items(self) -> Iterator[tuple[str, Any]]:
        """The ``state_dict`` keys with, for a parameter, ``(local shard, layout, whole
        shape)``, for a buffer its (whole) tensor: what a sharded checkpoint writes.

        A parameter planned reshaped is described in its planned shape: its shards are
        pieces of that tensor, not of the user's (a Megatron q/k/v split is no ``Shard``
        of the fused weight)."""
        for key, kind, source in self._state_keys:
            if kind == "param":
                local = self._local_value(source)
                yield key, (local, self.param_layout(source), self.param_shape(source))
            else:
                yield key, self.program.get_buffer(source).detach()

    # ---- state: sharded checkpoints -------------------------------------------------
    def save_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Save this rank's shards (and ``optimizer``'s state) with
        ``torch.distributed.checkpoint``; see ``autopar.runtime.checkpoint``. Collective."""
        checkpoint.save_checkpoint(self, path, optimizer)

    def load_checkpoint(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Load a checkpoint saved under any plan (DCP reshards it). Collective."""
        checkpoint.load_checkpoint(self, path, optimizer)


def _shape_of(traced: TracedModel, node_name: str) -> tuple[int, ...] | None:
    for node in traced.graph.nodes:
        if node.name == node_name:
            val = node.meta.get("val")
            return tuple(val.shape) if isinstance(val, torch.Tensor) else None
    return None


def _state_keys(model: nn.Module, plan: Plan, lowered: LoweredGraph) -> list[tuple[str, str, str]]:
    """The user's ``state_dict`` keys in order, each with its kind and where it lives:
    ``("lm_head.weight", "param", "wte.weight")``, ``("mask", "buffer", "mask")``."""
    param_of = {}
    for name, info in plan.params.items():
        param_of[name] = name
        for alias in info.aliases:
            param_of[alias] = name
    first_buffer = {id(b): n for n, b in model.named_buffers()}
    buffer_of = {
        key: first_buffer[id(b)]
        for key, b in model.named_buffers(remove_duplicate=False)
        if first_buffer[id(b)] in lowered.buffers
    }
    keys = []
    for key in model.state_dict(keep_vars=True):
        if key in param_of:
            keys.append((key, "param", param_of[key]))
        elif key in buffer_of:
            keys.append((key, "buffer", buffer_of[key]))
    return keys
