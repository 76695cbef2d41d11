"""``CompiledModel``: the module each rank runs, holding only its local shards.

Built from a plan (``passes`` made it) and the user's module:

- parameters become DTensor ``nn.Parameter``s on the plan's mesh, in the plan's
  placements, over this rank's shards, under their original dotted names: so
  ``named_parameters()`` reads like the user's model (a tied weight once, under its first
  name), any ``torch.optim`` optimizer works on ``parameters()`` (its state DTensors like
  them), and PyTorch's sharding-aware tools (``clip_grad_norm_``, the
  ``torch.distributed.checkpoint.state_dict`` helpers) compute what they do on one device.
  The programs compute on the plain local shards (``runtime.local_shards``); buffers and
  constants stay whole. A parameter the trace planned in another shape (a fused q/k/v weight as
  ``[3, C, Cin]``, ``autopar_passes.expose``) is held in that shape and given back in the user's
  (``full_parameter``, ``state_dict``);
- the lowered per-rank graph (``autopar_passes.lower_spmd``) becomes a ``GraphModule`` (``program``)
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
ranks holding the same piece compute the same term (``autopar_passes.lower_spmd``, the output
boundary).

Training steps and pipelines. With the ``loss_fn`` given to ``compile``, ``train_step(inputs,
targets)`` runs one optimizer step over the global batch in the plan's microbatches. A
pipeline plan holds only the parameters this rank's stages read (``holds``); the rank's
lowered program is cut into stage programs (``autopar_passes.lower_stages``), each a
``GraphModule`` sharing the one tree (``stage_modules``; ``program`` is the first), run by
``autopar.runtime.pipeline``. ``full_parameter``, ``full_gradient`` and ``state_dict`` still
give every rank whole tensors (from the first stage holding each); ``forward`` is refused.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils import _pytree as pytree

from autopar.runtime import checkpoint
from autopar.runtime.calls import CallPlanner, CallProgram
from autopar.runtime.collectives import MODULES
from autopar.runtime.comm import AxisGroup, Call, CommLog, dtype_name
from autopar.runtime.faults import DEFAULT_TIMEOUT_S, Faults, fingerprints
from autopar.runtime.generation import greedy, logits_of
from autopar.runtime.grad_sync import GradientSync
from autopar.runtime.groups import axis_groups
from autopar.runtime.local_sgd import LocalSGD
from autopar.runtime.local_shards import HOLDER as LOCAL_SHARDS
from autopar.runtime.local_shards import LocalShards
from autopar.runtime.memory_savers import Fetched
from autopar.runtime.memory_savers import install as install_memory_savers
from autopar.runtime.offload import HostLog, install_activation_offload
from autopar.runtime.param_offload import Uplink, storageless_leaf
from autopar.runtime.pipeline import (
    Loss,
    PipelineRunner,
    TiedGradients,
    boundary_metas,
    microbatch_loss,
)
from autopar.runtime.precision import run_precision
from autopar.runtime.regather import ParamGathers
from autopar.runtime.shards import as_dtensor_like, gather_full, local_of, local_slices, to_dtensor
from autopar.runtime.zero import HostSide, ZeroParam, ZeroShards, master_piece
from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_spmd import LoweredGraph, local_shard, lower_spmd
from autopar_passes.lower_stages import (
    StageProgram,
    holders,
    iter_stage_codes,
    local_parts,
    locate,
    pipeline_mesh_spec,
)
from autopar_passes.lower_stages import stage_mesh as plan_stage_mesh
from autopar_passes.mixed_precision import cast_for_gather
from autopar_passes.rewrites import (
    RankProgram,
    local_view_path,
    rewrite_rank,
    working_copy_path,
)
from autopar_passes.trace import TracedModel
from autopar_plans.errors import UsageError
from autopar_plans.ledger import CommCount, CommKey
from autopar_plans.placement import Layout, Replicate, zero_axes
from autopar_plans.plan import Plan

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

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return _elsewhere(self, name)


class _Elsewhere:
    """A dotted path of the state another pipeline stage holds. ``state_dict()`` has every
    key on every rank (gathered whole), and torch.distributed.checkpoint's state-dict
    helpers walk each key's path with ``getattr``; on this rank the path leads here,
    which holds nothing (``_mark_elsewhere``)."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self.children: dict[str, _Elsewhere] = {}

    def __getattr__(self, name: str) -> _Elsewhere:
        try:
            return self.__dict__["children"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"<{self.path}: held by another pipeline stage>"


def _elsewhere(module: nn.Module, name: str) -> _Elsewhere:
    """``module``'s child ``name`` among the paths other stages hold, or AttributeError as
    ``nn.Module`` raises it."""
    found = module.__dict__.get("_elsewhere")
    if found is not None and name in found.children:
        return found.children[name]
    raise AttributeError(f"{type(module).__name__!r} object has no attribute {name!r}")


def _mark_elsewhere(root: nn.Module, paths: Iterable[str]) -> None:
    """Hang an ``_Elsewhere`` at each dotted path that ``root``'s modules do not hold."""
    for path in paths:
        names = path.split(".")
        module, depth = root, 0
        while depth < len(names) and names[depth] in module._modules:
            module, depth = module._modules[names[depth]], depth + 1
        node = module.__dict__.setdefault("_elsewhere", _Elsewhere())
        for end in range(depth + 1, len(names) + 1):
            node = node.children.setdefault(names[end - 1], _Elsewhere(".".join(names[:end])))


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


def _has_path(root: nn.Module, dotted: str) -> bool:
    """Whether ``root`` holds a parameter, buffer or module at ``dotted``."""
    *path, leaf = dotted.split(".")
    module: nn.Module | None = root
    for part in path:
        module = module._modules.get(part) if module is not None else None
    return module is not None and (
        leaf in module._parameters or leaf in module._buffers or leaf in module._modules
    )


def _share_tree(module: nn.Module, tree: nn.Module) -> None:
    """Make ``module``'s registries ``tree``'s own (the same dicts, not copies)."""
    for registry in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        object.__setattr__(module, registry, getattr(tree, registry))


class CompiledModel(nn.Module):
    """The user's model, planned and lowered for this rank."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return _elsewhere(self, name)

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
        loss_fn: Loss | None = None,
        call_planner: CallPlanner | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        check_inputs: str = "first",
    ) -> None:
        super().__init__()
        rank = dist.get_rank()
        self.plan = plan
        # every collective this model issues is recorded here (runtime.comm), and fails
        # naming the rank that failed (runtime.faults)
        self._faults = Faults(timeout)
        self._faults.install_excepthook()
        self._comm = CommLog(faults=self._faults)
        self._check_inputs = check_inputs
        self._inputs_checked = False
        # the mesh the plan's layouts are on: one pipeline stage's mesh, or the whole mesh
        self.mesh = plan_stage_mesh(plan)
        self.device = device
        self.precision = run_precision(plan.precision, device.type)
        self.inputs_mode: InputMode = inputs
        self.outputs_mode: OutputMode = outputs
        self._loss_fn = loss_fn
        self.pipelined = plan.parallelism.pp > 1
        if self.pipelined:
            if inputs != "global" or outputs != "whole":
                raise UsageError(
                    "a pipeline plan takes the whole batch on every rank and returns the "
                    "loss (train_step): drop inputs='local' and outputs='sharded'"
                )
            place = locate(plan, rank)
            self.stage = place.stage
            self.coords = place.coords
            self._pipeline_mesh = device_mesh  # (pp, *stage mesh)
            self.device_mesh = device_mesh[self.mesh.axis_names]  # this stage's mesh
            self._pp_axis = pipeline_mesh_spec(plan).axis_names[0]
        else:
            self.stage = 0
            self.coords = self.mesh.coordinates(rank)
            self.device_mesh = device_mesh
        layouts = PlanLayouts(traced, plan, local_inputs=inputs == "local")
        whole = lower_spmd(
            traced,
            layouts.strategy,
            layouts.layout,
            self.mesh,
            self.coords,
            device,
            sharded_outputs=outputs == "sharded",
        )
        rank_program = RankProgram(
            traced,
            plan,
            whole,
            self.mesh.shape,
            device.type,
            stages=tuple(place.stages) if self.pipelined else (),
        )
        # the rewrites of the rank's program, in order (``autopar_passes.rewrites``)
        self.rewrites = rewrite_rank(rank_program)
        graphs = rank_program.graphs
        self._stage_programs: list[StageProgram] = rank_program.own_programs
        if self.pipelined:
            programs = rank_program.programs
            lowered = _held(whole, self._stage_programs)
            self._holders = holders(programs, plan.parallelism.pp)
            self._buffer_holders = _buffer_holders(programs, plan.parallelism.pp)
            self._part_of = local_parts(self._stage_programs)
        else:
            lowered = whole
            self._part_of = {}
        self.lowered: LoweredGraph = lowered
        self._out_spec = traced.exported.call_spec.out_spec
        # name -> (the user's shape, the planned shape), for parameters planned reshaped
        self._reshaped = dict(traced.reshaped)
        self._inputs = [
            (name, _shape_of(traced, name), layouts.inputs[name]) for name in traced.user_inputs
        ]
        self._buffer_meta = _buffer_meta(model, whole, self.precision.params)
        world_axes = pipeline_mesh_spec(plan).axis_names if self.pipelined else self.mesh.axis_names
        # the whole job, with the fault reports' timeout (the default group may have
        # torch's 30 minutes when the script made it)
        world_group = dist.new_group(
            list(range(dist.get_world_size())), timeout=self._faults.timeout
        )
        self._world = AxisGroup(world_group, tuple(world_axes), self._comm)
        self._mesh_groups = [
            AxisGroup(self.device_mesh.get_group(axis), (axis_name,), self._comm)
            for axis, axis_name in enumerate(self.mesh.axis_names)
        ]
        self._sync_axis_groups = (
            axis_groups(pipeline_mesh_spec(plan), self._comm)[1:]
            if self.pipelined
            else axis_groups(self.mesh, self._comm)
        )
        zero: list[ZeroParam] = []
        # offload (``autopar_plans.offload``): the host's memory, and the copies to and
        # from it, counted (``host_log``) as the plan's ``Estimate.host`` counts them
        self.host_log = HostLog()
        self._host = (
            HostSide(torch.device("cpu"), self.host_log) if plan.offload.optimizer else None
        )
        # under mixed precision the parameters only matmuls read: gathered (FSDP) and held
        # as ZeRO's working copies in the compute dtype (``autopar_passes.mixed_precision``)
        self._cast = cast_for_gather(traced, plan.precision)
        tree = self._build_tree(model, traced, whole, zero)
        # how gradients cross the axes that replicate them (``autopar_plans.reduction``)
        self._reduction = plan.grad_reduction
        reduce_dtype = self._reduce_dtype()
        self._zero = ZeroShards(zero, reduce_dtype=reduce_dtype, policy=self._reduction)
        # the programs compute on plain local shards of the DTensor parameters
        zero_names = {p.name for p in zero}
        local_shards = LocalShards(
            {
                target: tree.get_parameter(target)
                for target, param_name in self.lowered.params.items()
                if param_name not in zero_names
            },
            [p.working for p in zero],
        )
        tree.add_module(LOCAL_SHARDS, local_shards)
        object.__setattr__(self, "_tree", tree)  # not a child: the registries are ours
        object.__setattr__(self, "_local_shards", local_shards)
        self._zero_names = frozenset(zero_names)
        self._gathers: ParamGathers | None = None
        labels = [
            f"Stage{self._stage_programs[i].index}" if self.pipelined else ""
            for i in range(len(graphs))
        ]
        modules = self._graph_modules(
            graphs, labels, traced, self.lowered, plan, type(model).__name__
        )
        object.__setattr__(self, "program", modules[0])  # not a child: it shares our tree
        object.__setattr__(self, "stage_modules", modules)
        self._model_name = type(model).__name__
        # a Hugging Face model's token ids for ``generate`` (end of sequence, padding)
        self.generation_config = getattr(model, "generation_config", None)
        # the programs ``forward`` runs: the traced call's, then those of calls of other
        # shapes or modes met since, each planned with the parameters where they are
        self._calls: list[CallProgram] = [self._call(traced, plan, modules[0], self.lowered)]
        self._call_planner = call_planner
        self._state_keys = _state_keys(model, plan, whole)
        # a parameter two of this rank's pipeline stages read (part -1) is summed after the
        # schedule (``_shared_sync``); the others in their stage's last backward
        synced = [
            (target, p, self._sync_groups(n))
            for (n, p), target in zip(self._named_local(), self.lowered.params, strict=True)
            if n not in self._zero.params
        ]
        # backward accumulates into the leaves the programs read; the sync sums those
        leaf = local_shards.leaf_of
        self._sync = GradientSync(
            [(leaf(p), groups) for t, p, groups in synced if self._part_of.get(t, 0) >= 0],
            reduce_dtype=reduce_dtype,  # mixed precision: sums in bf16 / fp16
            parts=[self._part_of.get(t, 0) for t, _, _ in synced if self._part_of.get(t, 0) >= 0],
            deliver=local_shards.deliver,
            policy=self._reduction,
        )
        self._shared_sync = GradientSync(
            [(leaf(p), groups) for t, p, groups in synced if self._part_of.get(t, 0) < 0],
            reduce_dtype=reduce_dtype,
            deliver=local_shards.deliver,
            policy=self._reduction,
        )
        self._shared_sync.enabled = False
        self._local_sgd = (
            LocalSGD(
                self._reduction,
                [self._sync, self._shared_sync],
                local_shards.param_of,
                [p for _, p, _ in synced],
            )
            if self._reduction.sync == "local_sgd"
            else None
        )
        _share_tree(self, tree)
        # a parameter the user froze stays frozen; set last, since torch hooks no tensor
        # that needs no gradient (the runtime follows the flag as a user changes it later:
        # the programs' leaves and ZeRO's working copies take it from the parameter)
        frozen = {
            n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
        }
        for name, param in self.named_parameters(remove_duplicate=False):
            if name in frozen:
                param.requires_grad_(False)
        if self.pipelined:
            # the other stages' state, by name (torch.distributed.checkpoint walks its paths)
            keys = self._state_keys
            _mark_elsewhere(self, (k for k, kind, src in keys if not self._holds_state(kind, src)))
            self._start_pipeline(traced, whole, modules)

    def _reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are summed in over replicated axes: the compute dtype under
        mixed precision, or a casting compression's (``GradReduction.wire_dtype``)."""
        compute = self.precision.compute
        name = self._reduction.wire_dtype("float32", dtype_name(compute) if compute else None)
        return None if name == "float32" else getattr(torch, name)

    def _start_pipeline(
        self, traced: TracedModel, whole: LoweredGraph, modules: list[torch.fx.GraphModule]
    ) -> None:
        """The stages on torch's pipelining and the groups that sum tied weights' gradients."""
        plan = self.plan
        per_stage = self.mesh.size
        local_rank = dist.get_rank() - self.stage * per_stage
        self._tied = TiedGradients(
            self._holders, self.stage, per_stage, local_rank, self._pp_axis, self._comm
        )
        self._sync.enabled = False  # on in a stage's last backward (``_backward_hook``)
        self._pp_group = AxisGroup(self._pipeline_mesh.get_group(0), (self._pp_axis,), self._comm)
        self._runner: PipelineRunner | None = None
        if self._loss_fn is None:
            return
        metas = boundary_metas(
            traced,
            whole,
            plan,
            self.coords,
            self.device,
            self.precision.params,
            lambda: self.precision.autocast(self.device.type),
        )
        out_spec = self._out_spec

        def unflatten(flat: list[Any]) -> Any:
            return flat[0] if out_spec is None else pytree.tree_unflatten(flat, out_spec)

        loss = microbatch_loss(self._loss_fn, unflatten, plan.parallelism.microbatches)
        self._runner = PipelineRunner(
            plan,
            list(zip(self._stage_programs, modules, strict=True)),
            metas,
            self._pp_group,
            self.device,
            loss,
            self._backward_hook,
        )

    @contextmanager
    def _backward_hook(self, last: bool) -> Iterator[None]:
        """Around each backward of a pipeline stage: gradient sync and ZeRO-1's sum only
        in the stage's last microbatch (DDP's ``no_sync`` in the others)."""
        self._sync.enabled, self._zero.accumulating = last, not last
        try:
            yield
        finally:
            self._sync.enabled, self._zero.accumulating = False, False

    def _build_tree(
        self,
        model: nn.Module,
        traced: TracedModel,
        whole: LoweredGraph,
        zero: list[ZeroParam],
    ) -> nn.Module:
        """The holder tree: local shards, buffers, constants and collectives at their paths.

        A parameter whose optimizer state the plan shards further (ZeRO-1/2) hangs there as
        its *master* piece, and the graph reads a working copy instead (``runtime.zero``).
        In a pipeline the tree holds what this rank's stages read (``self.lowered``), but
        every parameter is broadcast (every rank takes part in every broadcast)."""
        mesh, device = self.mesh, self.device
        lowered = self.lowered
        cast = self.precision.params
        tree = _Holder()
        full_params = dict(model.named_parameters(remove_duplicate=False))
        for target, name in whole.params.items():
            full = full_params[name].detach().to(device)
            if name in self._reshaped:
                full = full.reshape(self._reshaped[name][1])
            # every rank starts from rank 0's weights, as DDP
            self._world.broadcast(full, group_src=0, phase="state")
            if target not in lowered.params:
                continue  # another pipeline stage holds it
            local = local_shard(full, self.plan.params[name].param, self.coords, mesh.shape)
            if cast is not None and local.is_floating_point():
                local = local.to(cast)
            info = self.plan.params[name]
            placed = self._zero_param(name, target, local, tree)
            if placed is not None:
                zero.append(placed)
                param = placed.master
            else:
                dtensor = to_dtensor(local.clone(), info.param, self.device_mesh, info.shape)
                param = nn.Parameter(dtensor)
                _set_attr(tree, target, param, "param")
            # a tied weight under each of its names, as in the user's model (named_parameters
            # gives it once; torch's state-dict helpers find it by every name)
            for alias in info.aliases:
                _set_attr(tree, alias, param, "param")
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
            group = self._mesh_groups[axis]
            _set_attr(tree, module_name, MODULES[kind](group, mesh.axis_names[axis]), "module")
        return tree

    def _zero_param(
        self,
        name: str,
        target: str,
        local: torch.Tensor,
        tree: nn.Module,
    ) -> ZeroParam | None:
        """Place a ZeRO-1/2 parameter, or any under an offloaded optimizer: its master piece
        at ``target`` (what the optimizer steps; in host memory when offloaded), a working
        copy elsewhere that the graph's ``get_attr`` now reads."""
        plan, mesh_shape = self.plan.params[name], self.mesh.shape
        if not self.plan.holds_master(name, mesh_shape):
            return None
        found = zero_axes(plan.param, plan.optimizer, mesh_shape)
        host = self._host
        axes = tuple(axis for axis, _ in found)
        dims = tuple(dim for _, dim in found)
        coords = tuple(self.coords[axis] for axis in axes)
        sizes = tuple(mesh_shape[axis] for axis in axes)
        piece = master_piece(local, dims, coords, sizes).clone()
        master_dt = to_dtensor(
            piece, plan.optimizer, self.device_mesh, plan.shape, param=plan.param
        )
        if host is not None:
            # the master in host memory, a DTensor still (on the device's mesh, as FSDP2's
            # CPU offload keeps its sharded parameters): the optimizer steps it there
            pinned = self.device.type == "cuda"  # so its copies up and down are truly async
            hosted = torch.empty_like(piece, device=host.device, pin_memory=pinned)
            master_dt = as_dtensor_like(master_dt, hosted.copy_(piece))
        master = nn.Parameter(master_dt)
        _set_attr(tree, target, master, "param")
        cast = self.precision.compute if name in self._cast else None
        fetched = self.plan.offload.parameters
        host_cast = None
        if fetched:
            # parameter offload (``runtime.param_offload``): the programs fetch the working
            # copy from the host, where the master is (cast into ``host_cast`` after each
            # step where the working dtype differs); the leaf they read holds no memory
            if axes:
                raise UsageError(
                    f"parameter offload fetches each working copy whole from the host, but "
                    f"{name!r} has its optimizer state sharded beyond its layout (ZeRO-"
                    f"{self.plan.zero}): plan it with zero=0"
                )
            working = storageless_leaf(local.to(cast or local.dtype, copy=False), self.device)
            if working.dtype != piece.dtype:
                host_cast = torch.empty(
                    piece.shape, dtype=working.dtype, pin_memory=self.device.type == "cuda"
                )
        else:
            working = local.to(cast or local.dtype, copy=True).requires_grad_(True)
        working.requires_grad_(True)
        # the graphs read it there (``autopar_passes.rewrites``: read_local_tensors)
        _set_attr(tree, working_copy_path(target), working, "constant")
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
            host=host,
            fetched=fetched,
            host_cast=host_cast,
            part=self._part_of.get(target, 0),
        )

    def _named_local(self) -> Iterator[tuple[str, nn.Parameter]]:
        for target, name in self.lowered.params.items():
            yield name, self.program.get_parameter(target)

    def _sync_groups(self, name: str) -> tuple[AxisGroup, ...]:
        layout = self.plan.params[name].param
        groups = self._sync_axis_groups
        return tuple(
            groups[axis]  # type: ignore[misc]
            for axis, p in enumerate(layout)
            if isinstance(p, Replicate) and self.mesh.shape[axis] > 1
        )

    # ---- running ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._faults.reporting():
            return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipelined:
            raise UsageError(
                f"the plan runs {self.plan.parallelism.pp} pipeline stages: each rank "
                "holds only its stages, so there is no whole forward to call; train with "
                "compiled.train_step(inputs, targets)"
            )
        call = self._call_for(args, kwargs)
        leaves, _ = pytree.tree_flatten((args, self._ordered(call, kwargs)))
        if len(leaves) != len(call.inputs):
            raise UsageError(
                f"the compiled model takes {len(call.inputs)} inputs (as traced), got {len(leaves)}"
            )
        if self.inputs_mode == "global":
            self._check_same_inputs(leaves)
        prepared = [self._prepare(call, i, leaf) for i, leaf in enumerate(leaves)]
        self._zero.gather()  # ZeRO: working copies from the masters the optimizer stepped
        with self.precision.autocast(self.device.type):
            flat = call.module(*prepared)
        flat_list = list(flat) if isinstance(flat, list | tuple) else [flat]
        if call.out_spec is None:
            return flat
        return pytree.tree_unflatten(flat_list, call.out_spec)

    # ---- calls of other shapes (``runtime.calls``) --------------------------------------
    @property
    def call_plans(self) -> list[Plan]:
        """The plan of each call this model has run a program for, the traced call's
        first: another batch or sequence length, eval mode, other keywords
        (``runtime.calls``). Each has its own estimate and communication ledger."""
        return [call.plan for call in self._calls]

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **options: Any,
    ) -> torch.Tensor:
        """Greedy decoding, as Hugging Face's ``generate(input_ids, max_new_tokens=...)``
        (``runtime.generation``): the prompt and the tokens after it, ``[batch, length]``,
        the same on every rank. The token ids default to the model's
        ``generation_config``. Sampling, beams and the like are not offered: generate with
        the model on one device for those."""
        mask = options.pop("attention_mask", None)
        if mask is not None and not bool(torch.all(mask == 1)):
            raise UsageError(
                "generate with padding in attention_mask: a compiled model takes prompts "
                "of one length (no padding); generate each length apart"
            )
        unsupported = {
            k: v
            for k, v in options.items()
            if isinstance(v, torch.Tensor) or v not in (None, False, 1)
        }
        if unsupported:
            raise UsageError(
                f"generate {', '.join(f'{k}={v!r}' for k, v in unsupported.items())}: a "
                "compiled model decodes greedily (max_new_tokens, eos_token_id, pad_token_id)"
            )
        config = self.generation_config
        if eos_token_id is None and config is not None:
            eos_token_id = config.eos_token_id
        if pad_token_id is None and config is not None:
            pad_token_id = config.pad_token_id
        keyword = "input_ids" in self._calls[0].keywords

        def logits(tokens: torch.Tensor) -> torch.Tensor:
            return logits_of(self(input_ids=tokens) if keyword else self(tokens))

        return greedy(logits, input_ids, max_new_tokens, eos_token_id, pad_token_id)

    def _call_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallProgram:
        """The program for this call: one made before, or a new one planned for it. Where
        none can be made (a loaded plan's model gone, ``inputs="local"``), the traced one,
        whose checks then say what differs."""
        for call in self._calls:
            shapes = [self._expected_shape(call, i) for i in range(len(call.inputs))]
            if call.accepts(args, kwargs, self.training, shapes):
                return call
        if (
            self._call_planner is None
            or self.inputs_mode != "global"
            or self.outputs_mode != "whole"
        ):
            return self._calls[0]
        plan, traced = self._call_planner(args, kwargs, self.training)
        call = self._add_call(traced, plan)
        self._calls.append(call)
        return call

    def _add_call(self, traced: TracedModel, plan: Plan) -> CallProgram:
        """Lower ``plan`` of another call onto this rank's parameter tree."""
        layouts = PlanLayouts(traced, plan)
        whole = lower_spmd(
            traced, layouts.strategy, layouts.layout, self.mesh, self.coords, self.device
        )
        rank_program = RankProgram(traced, plan, whole, self.mesh.shape, self.device.type)
        rewrite_rank(rank_program)
        self._share_state(traced, whole)
        label = f"Call{len(self._calls)}"
        (module,) = self._graph_modules(
            rank_program.graphs, [label], traced, whole, plan, self._model_name
        )
        return self._call(traced, plan, module, whole, layouts)

    def _share_state(self, traced: TracedModel, whole: LoweredGraph) -> None:
        """What another call's program reads: the parameters, buffers and constants the
        traced program's tree holds (the same tensors), and the collectives over the mesh's
        axes, made for it where the tree has none of that kind and axis yet."""
        tree = self._tree
        missing = [t for t in (*whole.params, *whole.buffers) if not _has_path(tree, t)]
        for target, name in whole.constants.items():
            value = traced.exported.constants[name]
            if not _has_path(tree, target):
                missing.append(target)
            elif tuple(tree.get_buffer(target).shape) != tuple(value.shape):
                missing.append(f"{target} (shape {tuple(value.shape)})")
        if missing:
            raise UsageError(
                f"a call of this shape reads {', '.join(missing)}, which the traced call did "
                "not: compile the model again for calls of this shape"
            )
        for module_name, (kind, axis) in whole.collectives.items():
            if not _has_path(tree, module_name):
                group = self._mesh_groups[axis]
                module = MODULES[kind](group, self.mesh.axis_names[axis])
                _set_attr(tree, module_name, module, "module")

    def _graph_modules(
        self,
        graphs: list[torch.fx.Graph],
        labels: list[str],
        traced: TracedModel,
        lowered: LoweredGraph,
        plan: Plan,
        name: str,
    ) -> list[torch.fx.GraphModule]:
        """A ``GraphModule`` per graph over the shared tree, reading the parameters' local
        shards; recompute regions as checkpoints; FSDP's gathers grouped per layer, the
        gathered weights regathered in backward."""
        local_shards = self._local_shards
        rank = dist.get_rank()
        modules = []
        for graph, label in zip(graphs, labels, strict=True):
            class_name = f"{name}Rank{rank}{label}"
            module = torch.fx.GraphModule(self._tree, graph, class_name=class_name)
            _share_tree(module, self._tree)
            module.register_forward_pre_hook(local_shards.refresh)
            modules.append(module)
        # where each program reads a parameter: its local view, or the working copy of a
        # parameter ZeRO or an offloaded optimizer holds (FSDP groups either's gathers)
        read_at = {
            target: working_copy_path(target)
            if param_name in self._zero_names
            else local_view_path(target)
            for target, param_name in lowered.params.items()
        }
        cast = cast_for_gather(traced, plan.precision)
        layers = _param_layers(traced, lowered)
        self._gathers = install_memory_savers(
            plan,
            modules,
            local_shards.is_local,
            {read_at[t]: layer for t, layer in layers.items() if t in read_at},
            frozenset(read_at[t] for t, n in lowered.params.items() if t in read_at and n in cast),
            gathers=self._gathers,
            fetched=self._fetched(lowered, read_at),
        )
        if plan.offload.activations:  # after the regather: its hooks nest inside
            for module in modules:
                install_activation_offload(module, self.device, self.host_log)
        return modules

    def _fetched(self, lowered: LoweredGraph, read_at: dict[str, str]) -> Fetched | None:
        """Under parameter offload, each parameter's host working copy by where the
        programs read it (``runtime.param_offload``)."""
        if not self.plan.offload.parameters:
            return None
        zero = self._zero.params
        pieces = {
            read_at[target]: zero[name].host_working
            for target, name in lowered.params.items()
            if target in read_at and name in zero
        }
        return Fetched(pieces, Uplink.to(self.device, self.host_log))

    def _call(
        self,
        traced: TracedModel,
        plan: Plan,
        module: torch.fx.GraphModule,
        lowered: LoweredGraph,
        layouts: PlanLayouts | None = None,
    ) -> CallProgram:
        if layouts is None:
            inputs = self._inputs
        else:
            inputs = [
                (name, _shape_of(traced, name), layouts.inputs[name]) for name in traced.user_inputs
            ]
        return CallProgram(
            plan=plan,
            module=module,
            inputs=inputs,
            out_spec=traced.exported.call_spec.out_spec,
            keywords=_traced_keywords(traced),
            constant_kwargs=dict(traced.constant_kwargs),
            added_kwargs=dict(traced.added_kwargs),
            training=traced.training,
            outputs=tuple(lowered.outputs),
        )

    def _ordered(self, call: CallProgram, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` in the order the model was traced with (a call may name them in any
        order); the same keywords, or a message naming the difference."""
        kwargs = call.with_added(kwargs)
        if set(kwargs) != set(call.keywords):
            missing = sorted(set(call.keywords) - set(kwargs))
            extra = sorted(set(kwargs) - set(call.keywords))
            raise UsageError(
                f"the compiled model was traced with the keyword inputs {list(call.keywords)}"
                f" (missing here: {missing}, not traced: {extra}); call it with the same "
                "keywords, or compile again for these"
            )
        for key, traced in call.constant_kwargs.items():
            if kwargs[key] != traced:
                raise UsageError(
                    f"{key}={kwargs[key]!r}: the compiled model was traced with "
                    f"{key}={traced!r}, which its program is specialised to; pass that, or "
                    "compile again"
                )
        return {key: kwargs[key] for key in call.keywords}

    def _prepare(self, call: CallProgram, index: int, value: Any) -> Any:
        """Check an input's shape against the plan; cast it for pure-bf16 runs."""
        if not isinstance(value, torch.Tensor):
            return value
        name, shape, _ = call.inputs[index]
        want = self._expected_shape(call, index)
        if want is not None and tuple(value.shape) != want:
            if self.inputs_mode == "local":
                raise UsageError(
                    f"input {index} ({name}) has shape {tuple(value.shape)}; with "
                    f"inputs='local' this rank passes its slice of the global {shape}, "
                    f"of shape {want}: x[compiled.input_slices()[{index}]] (a call of "
                    "another global shape needs inputs='global')"
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

    def _expected_shape(self, call: CallProgram, index: int) -> tuple[int, ...] | None:
        _, shape, layout = call.inputs[index]
        if shape is None or self.inputs_mode == "global":
            return shape
        return tuple(
            s.stop - s.start for s in local_slices(shape, layout, self.coords, self.mesh.shape)
        )

    def _check_same_inputs(self, tensors: list[Any]) -> None:
        """With ``inputs="global"`` every rank passes the same batch: check it once (or
        every call, ``check_inputs="every"``) by a fingerprint of each tensor, gathered
        from every rank (one small all-gather, recorded in the phase ``check``, outside a
        step's ledger), and name the ranks whose batch differs from rank 0's."""
        if self._check_inputs == "off" or (self._check_inputs == "first" and self._inputs_checked):
            return
        self._inputs_checked = True
        prints = fingerprints([t for t in tensors if isinstance(t, torch.Tensor)])
        if not prints.numel():
            return
        group = self._world
        rows = torch.empty((group.size, prints.numel()), dtype=prints.dtype)
        group.record("all_gather", rows, phase="check")
        group.call(dist.all_gather, list(rows.unbind(0)), prints, group=group.pg)
        differ = [r for r in range(group.size) if not torch.equal(rows[r], rows[0])]
        if differ:
            raise UsageError(
                f"rank(s) {', '.join(map(str, differ))} were given other inputs than rank 0 "
                "(a fingerprint of each input tensor differs): with inputs='global' every "
                "rank passes the same whole batch (seed the data loader alike, or shard it "
                "yourself and compile with inputs='local')"
            )

    def train_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        with self._faults.reporting():
            return self._train_step(inputs, targets)

    def _train_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step's forward and backward over the global batch.

        ``inputs`` is what the model takes (a tensor, or a tuple for ``model(*inputs)``),
        for the whole global batch (``plan.global_batch``), the same on every rank;
        ``targets`` the targets of that batch. The batch runs as the plan's microbatches:
        through the pipeline schedule for a pipeline plan, else one after the other with
        the gradients accumulated. Gradients are left ready for ``optimizer.step()``: those
        of the mean, over the batch, of the ``loss_fn`` given to ``compile`` (the mean of
        its per-microbatch values weighted by their sizes: for a token-mean loss with
        ignored targets this weighs microbatches by their sequences). Returns that mean
        loss (detached) on every rank.

        Without a pipeline a batch may be of another size (the last, partial batch of an
        epoch) or sequence length: it runs as microbatches of the plan's size and one of
        what is left, each of another shape on a program planned for it
        (``runtime.calls``).
        """
        if self._loss_fn is None:
            raise UsageError(
                "train_step needs the loss: autopar.compile(model, mesh, "
                "loss_fn=lambda outputs, targets: ...)"
            )
        if self.inputs_mode != "global" or self.outputs_mode != "whole":
            raise UsageError(
                "train_step takes the whole batch and computes the loss itself: compile "
                "without inputs='local' and outputs='sharded', or call forward"
            )
        args = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
        leaves, spec = pytree.tree_flatten(args)
        if len(leaves) != len(self._inputs):
            raise UsageError(
                f"the compiled model takes {len(self._inputs)} inputs (as traced), "
                f"got {len(leaves)}"
            )
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0:
            got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets)
            raise UsageError(
                f"targets of shape {got}: train_step takes the targets of the whole batch "
                f"of {self.plan.global_batch} (dim 0)"
            )
        total = int(targets.shape[0])
        if total != self.plan.global_batch and self._call_planner is None:
            raise UsageError(
                f"targets of shape {tuple(targets.shape)}: train_step takes the targets of "
                f"the whole batch of {self.plan.global_batch} (dim 0)"
                + (
                    ", which a pipeline plan's schedule runs as planned; pass batches of "
                    "that size (a data loader's drop_last)"
                    if self.pipelined
                    else ""
                )
            )
        batch_major = [self._check_batch_input(i, leaf, total) for i, leaf in enumerate(leaves)]
        self._comm.clear()
        self._check_same_inputs([*leaves, targets])
        if self.pipelined:
            return self._pipeline_step(leaves, batch_major, targets)
        return self._accumulate(leaves, spec, batch_major, targets)

    # ---- what ran ------------------------------------------------------------------
    def observed_collectives(self) -> dict[CommKey, CommCount]:
        """The collectives this rank issued in the last step, as calls and bytes per
        (kind, mesh axes, dtype): the terms of the plan's ledger
        (``autopar_plans.ledger.tally_entries(plan.estimate.comm)``). A step starts when
        ``train_step`` is called, or in a loop of your own when you call
        ``reset_observed()`` before its forward. Gathers for ``state_dict`` and
        ``full_parameter`` are not part of a step and are left out."""
        return self._comm.counts()

    def observed_calls(self) -> list[Call]:
        """Every collective since the step started, in order, with its phase."""
        return list(self._comm.calls)

    def reset_observed(self) -> None:
        """Start counting a new step (``observed_collectives``)."""
        self._comm.clear()

    def _check_batch_input(self, index: int, value: Any, total: int) -> bool:
        """Whether input ``index`` is split into microbatches: its dim 0 is the batch of
        ``total`` where the traced input's is the microbatch."""
        if not isinstance(value, torch.Tensor):
            return False
        name, shape, _ = self._inputs[index]
        size = self.plan.microbatch_size
        batched = bool(shape) and shape[0] == size  # type: ignore[index]
        flexible = self._call_planner is not None  # another shape gets its own program
        # another length of the other dims is another call shape (``runtime.calls``)
        if (
            batched
            and value.dim() == len(shape)  # type: ignore[arg-type]
            and value.shape[0] == total
            and (flexible or tuple(value.shape[1:]) == shape[1:])  # type: ignore[index]
        ):
            return True
        if not batched and not self.pipelined and (flexible or tuple(value.shape) == shape):
            return False  # not batched: every microbatch gets it whole
        want = (total, *shape[1:]) if shape else shape
        raise UsageError(
            f"input {index} ({name}) has shape {tuple(value.shape)}; train_step takes the "
            f"whole batch of {total} on every rank, of shape {want}"
        )

    def _accumulate(
        self, leaves: list[Any], spec: Any, batch_major: list[bool], targets: torch.Tensor
    ) -> torch.Tensor:
        """Microbatches one after the other, each loss weighted by its share of the batch;
        gradients synchronised in the last backward."""
        assert self._loss_fn is not None
        size, total = self.plan.microbatch_size, int(targets.shape[0])
        starts = list(range(0, total, size))
        mean = torch.zeros((), device=self.device)
        try:
            for i, start in enumerate(starts):
                last = i == len(starts) - 1
                self._sync.enabled = last  # as DDP's no_sync, but the last
                self._zero.accumulating = not last  # ZeRO-1 likewise
                part = slice(start, min(start + size, total))
                pieces = [
                    leaf[part] if split else leaf
                    for leaf, split in zip(leaves, batch_major, strict=True)
                ]
                outputs = self(*pytree.tree_unflatten(pieces, spec))
                # its share of the batch (of m equal microbatches: divided by m)
                loss = self._loss_fn(outputs, targets[part]) / (total / (part.stop - part.start))
                loss.backward()
                mean += loss.detach().float()
        finally:
            self._sync.enabled = True
            self._zero.accumulating = False
        return mean

    def _pipeline_step(
        self, leaves: list[Any], batch_major: list[bool], targets: torch.Tensor
    ) -> torch.Tensor:
        """The schedule over this rank's stages, then gradient sums, then the loss."""
        if self._runner is None:  # unreachable: compile refuses a pipeline without a loss
            raise UsageError("train_step needs the loss_fn given to autopar.compile")
        if not all(batch_major[i] for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)):
            raise UsageError("a pipeline plan splits every input tensor along dim 0")
        names = self._stage_programs[0].user_inputs
        kwargs = {name: self._prepare_value(leaf) for name, leaf in zip(names, leaves, strict=True)}
        self._zero.gather()
        # torch's schedule sends and receives by itself: a lost stage is named here
        with (
            self._faults.guard("the pipeline's sends and receives"),
            self.precision.autocast(self.device.type),
        ):
            loss = self._runner.step(kwargs, targets)
        self._shared_sync.sync_all()
        self._tied.sum(self._grad_of)
        last = self.plan.parallelism.pp - 1
        shared = loss if loss is not None else torch.zeros((), device=self.device)
        self._pp_group.broadcast(shared, group_src=last, phase="step")
        return shared

    def _prepare_value(self, value: Any) -> Any:
        cast = self.precision.params
        if isinstance(value, torch.Tensor) and cast is not None and value.is_floating_point():
            return value.to(cast)
        return value

    def _grad_of(self, name: str) -> torch.Tensor | None:
        """This rank's shard of the gradient the optimizer steps with (ZeRO: the master
        piece's)."""
        grad = self._local_param(name).grad
        return None if grad is None else local_of(grad)

    @property
    def code(self) -> str:
        """The Python this rank runs (``autopar codegen`` prints it); for a pipeline plan,
        each of the rank's stage programs under a header saying what crosses its cuts."""
        if self.pipelined:
            return "\n\n".join(iter_stage_codes(self._stage_programs))
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
        mesh_shape = self.mesh.shape
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
        """The parameter ``name`` (a DTensor; for a ZeRO parameter, its master piece)."""
        return self.program.get_parameter(self._canonical(name))

    def _local_value(self, name: str) -> torch.Tensor:
        """This rank's piece of parameter ``name`` in the parameter's layout (for ZeRO
        parameters the working copy, gathered from the masters)."""
        canonical = self._canonical(name)
        if canonical in self._zero.params:
            return self._zero.local_value(canonical)
        return local_of(self._local_param(canonical))

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

    def holds(self, name: str) -> bool:
        """Whether this rank holds parameter ``name`` (always, without a pipeline; in a
        pipeline, when one of its stages reads it)."""
        return self._canonical(name) in self.lowered.params.values()

    def full_parameter(self, name: str) -> torch.Tensor:
        """The whole value of parameter ``name`` in the user's shape, gathered from every
        rank's shard (in a pipeline, from the first stage that holds it). Collective: every
        rank calls it. An unsharded parameter's value shares its storage
        (``shards.gather_full``)."""
        canonical = self._canonical(name)
        whole = None
        if self.holds(canonical):
            local = self._local_value(canonical)
            whole = gather_full(local, self.param_layout(canonical), self._mesh_groups)
        whole = self._from_holder(whole, self._param_holder(canonical), canonical)
        assert whole is not None
        return whole.reshape(self.user_shape(canonical))

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, for every plan; returns
        the total norm (a plain tensor, the same on every rank). Collective.

        Without a pipeline, torch's own call on ``compiled.parameters()`` gives the same
        result (the parameters are DTensors). With one, each rank holds only its stages'
        parameters, so torch's call there sees one stage's norm: this sums the stages'
        (a weight held by several stages, counted once) over the pipeline axis, as
        torchtitan's pipeline-aware clipping does."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self.pipelined:
            counted = [
                p
                for name, p in self.named_parameters()
                if p.grad is not None and self._param_holder(name) == self.stage
            ]
        else:
            counted = params
        grads = [p.grad for p in counted if p.grad is not None]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
            local = norm.full_tensor() if isinstance(norm, DTensor) else norm
        else:
            local = torch.zeros((), device=self.device)
        total = local.detach().to(torch.float32)
        if self.pipelined:
            inf = math.isinf(norm_type)
            total = total if inf else total.pow(norm_type)
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            # the user's clipping is not part of the plan's step (the ledger leaves it out)
            self._pp_group.all_reduce(total, op=op, phase="clip")
            total = total if inf else total.pow(1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_gradient(self, name: str) -> torch.Tensor | None:
        """The whole gradient of parameter ``name`` (None before backward). Collective."""
        canonical = self._canonical(name)
        whole = None
        if self.holds(canonical):
            if canonical in self._zero.params:
                grad = self._zero.local_grad(canonical)
            else:
                grad = self._grad_of(canonical)
            if grad is not None:
                whole = gather_full(grad.detach(), self.param_layout(canonical), self._mesh_groups)
        whole = self._from_holder(whole, self._param_holder(canonical), canonical)
        return None if whole is None else whole.reshape(self.user_shape(canonical))

    def _param_holder(self, canonical: str) -> int:
        return self._holders[canonical][0] if self.pipelined else 0

    def _from_holder(
        self, whole: torch.Tensor | None, holder: int, canonical: str
    ) -> torch.Tensor | None:
        """In a pipeline, the holder stage's whole tensor on every rank (broadcast over the
        pipeline axis); without one, ``whole`` itself."""
        if not self.pipelined:
            return whole
        mine = self.stage == holder
        flag = torch.tensor([int(mine and whole is not None)], device=self.device)
        self._pp_group.broadcast(flag, group_src=holder, phase="state")
        if not int(flag.item()):
            return None
        if mine:
            assert whole is not None
            value = whole.contiguous()
        else:
            dtype = self.precision.params or getattr(torch, self.plan.params[canonical].dtype)
            value = torch.empty(self.param_shape(canonical), dtype=dtype, device=self.device)
        self._pp_group.broadcast(value, group_src=holder, phase="state")
        return value

    def _full_buffer(self, source: str) -> torch.Tensor:
        """A buffer's (whole) value; in a pipeline, from the first stage that holds it."""
        if not self.pipelined:
            return self.program.get_buffer(source).detach()
        holder = self._buffer_holders[source][0]
        shape, dtype = self._buffer_meta[source]
        value = (
            self.program.get_buffer(source).detach().contiguous()
            if self.stage == holder
            else torch.empty(shape, dtype=dtype, device=self.device)
        )
        self._pp_group.broadcast(value, group_src=holder, phase="state")
        return value

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
                destination[prefix + key] = self._full_buffer(source)

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
                want = self.user_shape(source) if kind == "param" else self._buffer_meta[source][0]
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
                if not self._holds_state(kind, source):
                    continue  # another pipeline stage holds it
                if kind == "param":
                    layout, shape = self.param_layout(source), self.user_shape(source)
                    target: torch.Tensor = local_of(self._local_param(source))
                else:
                    layout = Layout.replicated(self.mesh.ndim)
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
                piece = local_shard(value.to(target.device), layout, self.coords, self.mesh.shape)
                if kind == "param" and self._canonical(source) in self._zero.params:
                    self._zero.assign(self._canonical(source), piece)
                else:
                    target.copy_(piece)
        if strict:
            unexpected_keys.extend(
                k for k in state_dict if k.startswith(prefix) and k not in expected
            )

    def _holds_state(self, kind: str, source: str) -> bool:
        if kind == "param":
            return self.holds(source)
        return source in self.lowered.buffers

    def local_state_items(self) -> Iterator[tuple[str, Any]]:
        """The ``state_dict`` keys with, for a parameter, ``(local shard, layout, whole
        shape)``, for a buffer its (whole) tensor: what a sharded checkpoint writes.

        A parameter planned reshaped is described in its planned shape: its shards are
        pieces of that tensor, not of the user's (a Megatron q/k/v split is no ``Shard``
        of the fused weight)."""
        if self.pipelined:
            raise UsageError(
                "save_checkpoint does not take pipeline plans yet; use "
                "torch.distributed.checkpoint (get_state_dict, then dcp.save), which does"
            )
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


def _traced_keywords(traced: TracedModel) -> tuple[str, ...]:
    """The keyword inputs the model was traced with, in the exported program's order."""
    spec = traced.exported.call_spec.in_spec
    if spec is None or spec.num_children < 2:
        return ()
    keywords = spec.child(1).context
    return tuple(keywords) if keywords else ()


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


def _param_layers(traced: TracedModel, lowered: LoweredGraph) -> dict[str, int | None]:
    """Each parameter's ``get_attr`` target and its layer in the layer container (None
    outside it, or without one): how FSDP's gathers are grouped (``runtime.param_groups``)."""
    container = traced.layers
    return {
        target: container.index_of(name) if container is not None else None
        for target, name in lowered.params.items()
    }


def _held(whole: LoweredGraph, programs: list[StageProgram]) -> LoweredGraph:
    """``whole`` with only what ``programs`` read: what this pipeline rank holds."""
    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    constants: dict[str, str] = {}
    collectives: dict[str, tuple[str, int]] = {}
    for program in programs:
        params.update(program.params)
        buffers.update(program.buffers)
        constants.update(program.constants)
        collectives.update(program.collectives)
    return LoweredGraph(
        whole.graph,
        whole.coords,
        params={t: n for t, n in whole.params.items() if t in params},
        buffers={t: n for t, n in whole.buffers.items() if t in buffers},
        constants={t: n for t, n in whole.constants.items() if t in constants},
        collectives={t: c for t, c in whole.collectives.items() if t in collectives},
        counts=whole.counts,
        outputs=whole.outputs,
        sources=whole.sources,
    )


def _buffer_holders(programs: list[StageProgram], pp: int) -> dict[str, tuple[int, ...]]:
    found: dict[str, set[int]] = {}
    for program in programs:
        for target in program.buffers:
            found.setdefault(target, set()).add(program.index % pp)
    return {name: tuple(sorted(stages)) for name, stages in found.items()}


def _buffer_meta(
    model: nn.Module, lowered: LoweredGraph, cast: torch.dtype | None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and (run) dtype of each buffer the program reads, for ranks that do not hold
    it."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    meta = {}
    for target, name in lowered.buffers.items():
        value = buffers[name]
        dtype = cast if cast is not None and value.is_floating_point() else value.dtype
        meta[target] = (tuple(value.shape), dtype)
    return meta
