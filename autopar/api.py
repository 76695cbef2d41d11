"""``autopar.plan`` and ``autopar.compile``: the two ways in.

``plan`` works offline, with no processes and no weights (a model on the ``meta`` device
is fine): trace, choose strategies, estimate. ``compile`` does the same on every rank of a
running job (planning once, on rank 0, and sharing the plan), then lowers the plan into
the rank's module.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.force import style_constraints
from autopar.hints_api import apply_hints, options_with_hints
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.replan import keep_pinned
from autopar.runtime.faults import DEFAULT_TIMEOUT_S
from autopar.runtime.precision import check_precision, run_precision
from autopar_passes.pipeline.search import PipelineRequest, Progress, silent
from autopar_passes.solve import Constraint, SolveRequest, no_constraints
from autopar_passes.trace import TracedModel, trace
from autopar_plans.errors import AutoparError, PlanWarning, UsageError
from autopar_plans.io import load_plan, plan_from_dict
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout
from autopar_plans.plan import Plan
from autopar_plans.units import parse_bytes
from autopar_plans.validate import check_plan, check_plan_against

if TYPE_CHECKING:  # the runtime (DTensor, DCP) loads when a model is compiled, not on import
    from autopar.replan import CallPlanner
    from autopar.runtime.compiled import CompiledModel


def plan(
    model: nn.Module,
    mesh: MeshSpec,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> Plan:
    """Plan ``model`` on ``mesh`` for batches shaped like ``example_inputs``.

    ``options`` (``autopar.options.PlanOptions``): ``global_batch`` (default: the example's
    batch) is the batch per optimizer step, run as ``global_batch / example batch``
    microbatches with gradient accumulation; ``memory_limit`` per device (default: the
    preset's memory); ``optimizer`` and ``precision`` (what the memory and time are costed
    for); ``force`` a parallel style (``autopar.force.STYLES``); ``zero`` a ZeRO stage;
    ``time_limit`` for the solver; ``name`` for the plan; ``hints`` a GShard-style hint
    file (``docs/hints.md``) whose every hint is a constraint the solver plans around.
    ``progress``, if given, is told in a few words what planning is doing (the trace, each
    candidate's solve and its estimate): ``autopar plan`` shows it on a terminal.
    """
    made = _plan(
        model, mesh, example_inputs, example_kwargs, PlanOptions.of(options), progress=progress
    )[0]
    warn_about(made)
    return made


def warn_about(made: Plan, stacklevel: int = 3) -> None:
    """Each of the plan's warnings through ``warnings.warn`` (``PlanWarning``), pointing at
    the user's call (``stacklevel``: 3 from ``plan``, 4 through ``compile``'s ``_build``)."""
    for text in made.warnings:
        warnings.warn(text, PlanWarning, stacklevel=stacklevel)


def _plan(
    model: nn.Module,
    mesh: MeshSpec,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None,
    options: PlanOptions,
    pinned: dict[str, Layout] | None = None,
    progress: Progress | None = None,
) -> tuple[Plan, TracedModel]:
    """The plan and the trace it was made on; ``pinned``: parameter placeholders whose
    layout is fixed (``autopar.replan``)."""
    from autopar_cost_model.hardware import load_preset

    if not isinstance(mesh, MeshSpec):
        raise UsageError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    preset = load_preset(mesh.device)
    options = _with_reduction(options_with_hints(options))
    groups = options.batch_norm_groups(mesh)
    say = progress or silent
    say("tracing the model")
    traced = trace(model, example_inputs, example_kwargs, batch_norm_groups=groups)
    say(f"traced {len(traced.graph.nodes)} nodes in {traced.trace_seconds:.1f} s")
    hinted = apply_hints(options.hints, traced, mesh, options)  # checked before solving
    batch = _batch_size(traced)
    global_batch = options.global_batch or batch
    if global_batch % batch:
        raise UsageError(
            f"global_batch={global_batch} is not a multiple of the example "
            f"inputs' batch ({batch}); pass a multiple or other example inputs"
        )
    limit = (
        float(parse_bytes(options.memory_limit))
        if options.memory_limit is not None
        else preset.memory_bytes
    )
    request = SolveRequest(
        mesh,
        limit,
        options.optimizer,
        options.precision,
        options.time_limit,
        partial(_constraints, options.force, pinned),
        zero_levels=(options.zero,) if options.zero is not None else (0, 1, 2),
        reduction=options.grad_reduction(),
        offload=options.offload_request(),
    )
    stages = options.stages if options.stages is not None or not options.force else 1
    pipeline = PipelineRequest(
        request,
        global_batch,
        batch,
        options.name or type(model).__name__,
        stages,
        options.schedule,
        options.microbatches,
        options.chunks,
        # microbatches below a stage's devices are planned on the model traced at that size
        retrace=lambda size: trace(
            model,
            microbatch_inputs(tuple(example_inputs), batch, size),
            microbatch_inputs(example_kwargs or {}, batch, size),
            batch_norm_groups=groups,
        ),
        progress=say,
    )
    made = hinted.plan(traced, pipeline)
    if groups > 1:
        made = made.model_copy(update={"batch_norm_groups": groups})
    return made, traced


def _with_reduction(options: PlanOptions) -> PlanOptions:
    """``options`` as a gradient-reduction policy needs them. Compression applies where a
    gradient is all-reduced, so ZeRO (which reduce-scatters) is not searched under it; local
    SGD averages whole models, so it plans pure data parallelism (``force='dp'``)."""
    policy = options.grad_reduction()
    if policy.sync == "local_sgd":
        clash = {
            "force": options.force not in (None, "dp"),
            "zero": options.zero not in (None, 0),
            "stages": options.stages not in (None, 1),
        }
        if any(clash.values()):
            given = ", ".join(f"{k}={getattr(options, k)!r}" for k, bad in clash.items() if bad)
            raise UsageError(
                f"sync='local_sgd' averages whole models every period and plans pure data "
                f"parallelism; it cannot run with {given}: drop those options, or use "
                "sync='every_step'"
            )
        _no_optimizer_offload(options, "sync='local_sgd' averages the parameters the device steps")
        return options.model_copy(
            update={"force": "dp", "zero": 0, "stages": 1, "offload": _without_optimizer(options)}
        )
    if policy.compression.active:
        if options.zero not in (None, 0):
            raise UsageError(
                f"grad_compression={policy.compression.scheme!r} compresses gradients that "
                f"are all-reduced, and zero={options.zero} reduce-scatters them instead: "
                "drop one of the two options"
            )
        _no_optimizer_offload(
            options, f"grad_compression={policy.compression.scheme!r} keeps its state on the device"
        )
        return options.model_copy(update={"zero": 0, "offload": _without_optimizer(options)})
    return options


def _no_optimizer_offload(options: PlanOptions, why: str) -> None:
    if options.offload_request().optimizer == "on":
        raise UsageError(
            f"{why}: it cannot run with the optimizer offloaded to the host; drop one of the two"
        )


def _without_optimizer(options: PlanOptions) -> dict[str, str]:
    """The offload request with the optimizer's kept on the device."""
    request = options.offload_request()
    return {**request.model_dump(), "optimizer": "off"}


def _constraints(
    force: str | None, pinned: dict[str, Layout] | None, mesh: MeshSpec
) -> list[Constraint]:
    """A forced style's constraints, and the pinned parameters'."""
    found = style_constraints(force, mesh) if force else no_constraints(mesh)
    return [*found, keep_pinned(pinned)] if pinned else found


def _batch_size(traced: TracedModel) -> int:
    for node in traced.graph.nodes:
        if node.name in traced.user_inputs:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() > 0:
                return int(val.shape[0])
    return 1


class LazyCompiled(nn.Module):
    """Plans on the first call, from the real inputs' shapes, like ``torch.compile``.

    Once built it shares the ``CompiledModel``'s module tree (``named_parameters`` give the
    user's names, not ``compiled.``-prefixed ones) and hands it every other attribute.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, options: dict[str, Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule; dropped once built
        self._mesh = mesh
        self._options = options
        object.__setattr__(self, "compiled", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            self._build_from(args, kwargs)
        return self.compiled(*args, **kwargs)

    def train_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """``CompiledModel.train_step``; the first call plans from ``inputs`` (the global
        batch)."""
        if self.compiled is None:
            args = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
            self._build_from(args, {})
        assert self.compiled is not None
        return self.compiled.train_step(inputs, targets)

    def _build_from(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        compiled = _build(self._model, self._mesh, args, kwargs, self._options)
        object.__setattr__(self, "compiled", compiled)
        object.__setattr__(self, "_model", None)
        for registry in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, registry, getattr(compiled, registry))

    def _built(self, what: str) -> CompiledModel:
        if self.compiled is None:
            raise UsageError(
                f"{what}: the compiled model is planned on its first call; call it once "
                "(or pass example_inputs= to autopar.compile) first"
            )
        return self.compiled

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Any:
        self._built("parameters() for the optimizer")
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self._built("state_dict()")._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._built("load_state_dict()")._load_from_state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._built("load_state_dict()").load_state_dict(state_dict, strict, assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            compiled = self.__dict__.get("compiled")
            if compiled is None:
                raise
            return getattr(compiled, name)


def compile(
    model: nn.Module,
    mesh: Mesh | DeviceMesh,
    *,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    plan: Plan | str | Path | None = None,
    inputs: str = "global",
    outputs: str = "whole",
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    check_inputs: str = "first",
    **options: Any,
) -> nn.Module:
    """Shard ``model`` over ``mesh`` on every rank of a running job.

    ``mesh``: an ``autopar.Mesh`` (its process groups are made here; under ``torchrun``
    the default group too, when the script has not made it), or a ``DeviceMesh`` the
    script built with ``init_device_mesh`` (costed as ``Mesh.from_device_mesh`` says).

    With ``example_inputs`` (positional) or ``example_kwargs`` (keyword inputs, such as
    ``{"input_ids": x, "labels": x}``) it is built now; otherwise on the first call.
    ``options`` go to ``autopar.plan`` (memory_limit, optimizer, precision, force,
    global_batch, time_limit, stages, schedule, microbatches, chunks); ``precision`` also
    sets how the model runs (``autopar.runtime.precision``: ``"bf16_mixed"`` autocasts the
    forward to bf16 and keeps fp32 parameters).

    ``loss_fn(outputs, targets)``, the loss as the user computes it on one device (a mean
    over the batch), enables ``compiled.train_step(inputs, targets)``: one optimizer step's
    forward and backward over the global batch, in the plan's microbatches, through a
    pipeline when the plan has one. Without ``loss_fn`` the model is planned for
    ``forward`` alone: no pipeline stages, the example batch as the microbatch (unless
    ``stages`` or ``microbatches`` say otherwise). With it, the planner may choose a
    pipeline (stages, schedule, microbatches); the example inputs are then traced again
    at the chosen microbatch size.

    ``timeout``: seconds a collective waits for its peers before its rank gives up
    (default 600); a rank that fails, is killed or is stuck then makes every other rank
    raise ``RankFailedError`` naming it (``runtime.faults``). ``check_inputs``: with
    ``inputs="global"``, whether ranks check that they were given the same batch:
    ``"first"`` (default: the first call, one small all-gather), ``"every"`` call (a debug
    mode), or ``"off"``.

    ``inputs="global"`` (default): every rank passes the whole batch. ``inputs="local"``:
    each rank passes only its slice (``compiled.input_slices()``); planning then needs
    ``example_inputs`` of the whole batch's shapes. ``outputs="whole"`` (default): every
    rank gets whole outputs. ``outputs="sharded"``: its local pieces
    (``compiled.output_layouts()``), from which each rank computes its summand of the loss.
    """
    if isinstance(mesh, DeviceMesh):
        mesh = Mesh.from_device_mesh(mesh)
    elif not isinstance(mesh, Mesh):
        mesh = Mesh.from_spec(mesh)
    if inputs not in ("global", "local"):
        raise UsageError(
            f"inputs={inputs!r}: pass 'global' (every rank the whole batch) or 'local'"
        )
    if outputs not in ("whole", "sharded"):
        raise UsageError(f"outputs={outputs!r}: pass 'whole' or 'sharded'")
    PlanOptions.of(options)  # refuse a bad option before anything starts
    if "precision" in options:
        check_precision(options["precision"])
    if inputs == "local" and example_inputs is None:
        raise UsageError(
            "inputs='local' needs example_inputs= shaped like the whole (global) batch: "
            "each rank's own slice does not say how large the batch is"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn must be callable (outputs, targets) -> loss, not {loss_fn!r}")
    if check_inputs not in ("first", "every", "off"):
        raise UsageError(f"check_inputs={check_inputs!r}: pass 'first', 'every' or 'off'")
    if not timeout > 0:
        raise UsageError(f"timeout={timeout!r}: pass the seconds a collective may wait, > 0")
    source = _plan_source(plan)
    if plan is not None:
        plan = given_plan(plan, mesh)  # a bad plan file is refused before anything starts
    options = dict(
        options,
        plan=plan,
        plan_source=source,
        inputs=inputs,
        outputs=outputs,
        loss_fn=loss_fn,
        timeout=timeout,
        check_inputs=check_inputs,
    )
    if example_inputs is not None or example_kwargs is not None:
        args = tuple(example_inputs) if example_inputs is not None else ()
        return _build(model, mesh, args, dict(example_kwargs or {}), options)
    return LazyCompiled(model, mesh, options)


def _build(
    model: nn.Module,
    mesh: Mesh,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> CompiledModel:
    from autopar.runtime.compiled import CompiledModel
    from autopar.runtime.pipeline import pipeline_mesh, schedule_to_run

    options = dict(options)
    timeout = float(options.pop("timeout", DEFAULT_TIMEOUT_S))
    check_inputs = options.pop("check_inputs", "first")
    device_mesh = mesh.init(timeout)
    cuda = mesh.runtime_device_type() == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    given = options.pop("plan", None)
    source = options.pop("plan_source", "plan=")
    inputs, outputs = options.pop("inputs", "global"), options.pop("outputs", "whole")
    loss_fn = options.pop("loss_fn", None)
    batch = example_batch((*args, *kwargs.values()))
    if loss_fn is None:
        # planned for forward: the whole example batch in one program, no pipeline
        if options.get("stages") not in (None, 1):
            raise UsageError(
                f"stages={options['stages']}: a pipeline runs through "
                "compiled.train_step, which needs the loss: pass loss_fn= to compile"
            )
        options.setdefault("stages", 1)
        if batch:
            options.setdefault(
                "microbatches", max((options.get("global_batch") or batch) // batch, 1)
            )
    if "precision" in options:
        run_precision(options["precision"], device.type)  # before planning: fail fast
    example_kwargs = dict(kwargs)  # tensors too: model(input_ids=..., labels=...)
    traced: TracedModel | None = None
    if given is not None:
        chosen = given if isinstance(given, Plan) else load_plan(given)
        wanted = options.get("precision", chosen.precision)
        if wanted != chosen.precision:
            raise UsageError(
                f"the plan was made for precision {chosen.precision!r}, not {wanted!r}; "
                "plan again with that precision, or drop precision="
            )
        if chosen.parallelism.pp > 1 and loss_fn is None:
            raise UsageError(
                "the plan has pipeline stages, which run through compiled.train_step: "
                "pass loss_fn= to compile"
            )
    else:
        chosen, traced = plan_on_rank0(model, mesh, args, example_kwargs, options)
        warn_about(chosen, stacklevel=4)
    schedule_to_run(chosen.parallelism)  # refuse what torch cannot run, before it starts
    if traced is None or (batch and chosen.microbatch_size != batch):
        # the program runs one microbatch: trace at its size (the plan was costed there)
        traced = trace(
            model,
            microbatch_inputs(args, batch, chosen.microbatch_size),
            microbatch_inputs(example_kwargs, batch, chosen.microbatch_size),
            batch_norm_groups=chosen.batch_norm_groups,
        )
    if given is not None:
        shapes = {name: info.shape for name, info in traced.params.items()}
        check_plan_against(chosen, source, params=shapes)
    if chosen.parallelism.pp > 1:
        device_mesh = pipeline_mesh(chosen, device.type, timeout)
    _seed_alike(device)
    compiled = CompiledModel(
        model,
        traced,
        chosen,
        device_mesh,
        device,
        inputs=inputs,
        outputs=outputs,
        loss_fn=loss_fn,
        call_planner=_call_planner(model, mesh, traced, chosen, options),
        timeout=timeout,
        check_inputs=check_inputs,
    )
    # torch.export leaves reference cycles (its tracer's module wrapper) that hold the
    # traced module, hence its weights; Python's cycle collector runs on object counts, not
    # on device memory, so without this the weights the compiled module has copied would
    # stay allocated beside it: one whole fp32 copy of the model on a GPU.
    del traced
    gc.collect()
    return compiled


def given_plan(plan: Plan | str | Path, mesh: MeshSpec) -> Plan:
    """The ``plan=`` of ``compile``, read if it is a file and checked, on its own and
    against ``mesh`` (``autopar_plans.validate``); the model is checked once traced."""
    if not isinstance(plan, Plan | str | Path):
        raise UsageError(
            f"plan={type(plan).__name__}: pass an autopar.Plan or the path of a plan file"
        )
    chosen = plan if isinstance(plan, Plan) else load_plan(plan)
    source = _plan_source(plan)
    check_plan(chosen, source)
    check_plan_against(chosen, source, mesh=mesh)
    return chosen


def _plan_source(plan: Plan | str | Path | None) -> str:
    """How messages name the plan: its file, or the argument."""
    return str(plan) if isinstance(plan, str | Path) else "plan="


def _call_planner(
    model: nn.Module, mesh: Mesh, traced: TracedModel, chosen: Plan, options: dict[str, Any]
) -> CallPlanner | None:
    """What plans the calls the first plan does not take (``autopar.replan``); None for a
    pipeline plan, whose schedule runs the batch it was planned for."""
    from autopar.replan import KEPT_OPTIONS, CallPlanner, pinned_layouts, skeleton, zero_stage

    if chosen.parallelism.pp > 1:
        return None
    copied = skeleton(model)
    if copied is None:
        return None
    kept = {key: options[key] for key in KEPT_OPTIONS if options.get(key) is not None}
    # the parameters are held as the first plan holds them: the same ZeRO stage, and the
    # same offload (a master on the host, a working copy fetched or held)
    offload = {kind: "on" if on else "off" for kind, on in chosen.offload.model_dump().items()}
    kept.update(precision=chosen.precision, zero=zero_stage(chosen), offload=offload)
    return CallPlanner(copied, mesh, kept, pinned_layouts(traced, chosen))


def example_batch(args: tuple[Any, ...]) -> int:
    """The batch of the example inputs (dim 0 of the first tensor that has dims), or 0."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            return int(arg.shape[0])
    return 0


Inputs = TypeVar("Inputs", tuple[Any, ...], dict[str, Any])


def microbatch_inputs(inputs: Inputs, batch: int, size: int) -> Inputs:
    """The first microbatch of ``size`` of every input (positional, or keyword) whose dim 0
    is the ``batch``: what the program of a plan with that microbatch size is traced on. A
    ``size`` larger than the example's (a multiple of it) repeats the example: the search
    plans one sequence per node from an example of one (``autopar_passes.pipeline.search``)."""
    if not batch or size == batch:
        return inputs
    if size > batch and size % batch:
        raise UsageError(
            f"a microbatch of {size} from example inputs of batch {batch}: pass example "
            "inputs whose batch divides it"
        )

    def first(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch:
            if size > batch:
                return a.repeat(size // batch, *[1] * (a.dim() - 1))
            return a[:size]
        return a

    if isinstance(inputs, dict):
        return {key: first(value) for key, value in inputs.items()}
    return tuple(first(a) for a in inputs)


def plan_on_rank0(
    model: nn.Module,
    mesh: Mesh,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    pinned: dict[str, Layout] | None = None,
) -> tuple[Plan, TracedModel | None]:
    """Rank 0 plans; every rank receives the same plan (a solver's time limit could make
    ranks disagree). Rank 0's trace comes back with it; the other ranks trace for their
    own lowering once they know the microbatch size (None here)."""
    payload: list[Any] = [None]
    traced: TracedModel | None = None
    if dist.get_rank() == 0:
        try:
            made, traced = _plan(model, mesh, args, kwargs, PlanOptions.of(options), pinned)
            payload[0] = made.model_dump(mode="json")
        except AutoparError as error:  # every rank raises it, none waits for a plan
            payload[0] = error
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], AutoparError):
        raise payload[0]
    chosen = plan_from_dict(payload[0], "<plan from rank 0>")
    return chosen, traced


def _seed_alike(device: torch.device) -> None:
    """Every rank seeds torch's RNG alike, so replicated random ops agree (dropout policy).

    The seed travels on the run's device: an NCCL-only process group cannot broadcast a
    CPU tensor.
    """
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
    dist.broadcast(seed, src=0)
    torch.manual_seed(int(seed.item()))
