"""The trace pass: ``torch.export`` a model into an annotated ATen graph.

>>> model, inputs = autopar_examples.models.build("gpt-tiny")          # doctest: +SKIP
>>> traced = trace(model, inputs)                              # doctest: +SKIP
>>> traced.summary().layers                                    # doctest: +SKIP
2

Export is non-strict (``strict=False``): the model's Python runs as written, on fake
tensors, so a model built on the ``meta`` device (no weights allocated) traces as fast as a
small one. The graph is the training IR: high-level ATen ops (``aten.linear``,
``aten.scaled_dot_product_attention``, ``aten.layer_norm``) that the sharding rules speak.

Failures come back as one message: which module, which source line, what to change
(``UntraceableModelError``), or what is wrong with the example inputs (``UsageError``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from autopar_passes.annotate import annotate_graph
from autopar_passes.annotation import META_KEY, NodeAnnotation, NodeKind, TensorInfo
from autopar_passes.collector import collector_paused
from autopar_passes.decompose import decompose_for_sharding
from autopar_passes.dtype_check import check_dtypes
from autopar_passes.expose import expose_fused_projections
from autopar_passes.functionalize import view_chain
from autopar_passes.layers import LayerContainer, find_layer_container, module_path
from autopar_passes.strategies.inplace import mutates_first_input
from autopar_passes.trace_once import export_layers_once
from autopar_plans.errors import UntraceableModelError, UsageError

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter of the traced model.

    ``name`` is its first name in ``named_parameters()``; a tied weight has other names
    (``aliases``) and export may give it one placeholder per name (``nodes``).
    """

    name: str
    nodes: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return TensorInfo(self.shape, self.dtype).numel

    @property
    def nbytes(self) -> int:
        return TensorInfo(self.shape, self.dtype).nbytes


@dataclass(frozen=True, slots=True)
class GraphSummary:
    """What ``autopar demo`` and ``autopar trace`` print about a traced model."""

    nodes: int
    ops: dict[str, int]
    parameters: int
    parameter_bytes: int
    fwd_flops: int
    bwd_flops: int
    saved_activation_bytes: int
    layers: int
    layer_container: str
    trace_seconds: float


@dataclass
class TracedModel:
    """The exported program plus what autopar read off it."""

    exported: torch.export.ExportedProgram
    params: dict[str, ParamInfo]
    buffers: dict[str, str]
    user_inputs: list[str]
    user_outputs: list[str]
    layers: LayerContainer | None
    trace_seconds: float
    warnings: list[str] = field(default_factory=list)
    # parameters planned in another shape than the model's (``autopar_passes.expose``):
    # name -> (the model's shape, the planned shape)
    reshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # the keyword inputs that are no tensors, as traced: the program is specialised to them
    # (torch.export), so a call must pass the same; ``added`` those autopar set itself
    constant_kwargs: dict[str, Any] = field(default_factory=dict)
    added_kwargs: dict[str, Any] = field(default_factory=dict)
    # the model's mode when traced: dropout and the like are traced as that mode runs them
    training: bool = True
    # what passes derive from the graph and read again, by key (``derived``): the graph does
    # not change once traced, and the pipeline search reads the same analyses per stage count
    _derived: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def derived(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """``make()``, computed once per ``key`` for this trace."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]  # type: ignore[no-any-return]

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.exported.graph_module

    @property
    def graph(self) -> torch.fx.Graph:
        return self.exported.graph_module.graph

    def annotations(self) -> dict[str, NodeAnnotation]:
        """Node name -> annotation, in graph order."""
        return {n.name: n.meta[META_KEY] for n in self.graph.nodes}

    def summary(self) -> GraphSummary:
        notes = [n.meta[META_KEY] for n in self.graph.nodes]
        ops = Counter(a.op for a in notes if a.kind in ("op", "view"))
        return GraphSummary(
            nodes=len(notes),
            ops=dict(ops.most_common()),
            parameters=sum(p.numel for p in self.params.values()),
            parameter_bytes=sum(p.nbytes for p in self.params.values()),
            fwd_flops=sum(a.fwd_flops for a in notes),
            bwd_flops=sum(a.bwd_flops for a in notes),
            saved_activation_bytes=sum(a.saved_bytes for a in notes),
            layers=self.layers.count if self.layers else 0,
            layer_container=self.layers.path if self.layers else "",
            trace_seconds=self.trace_seconds,
        )


@torch.enable_grad()  # a program for training, also when made for a call under no_grad
@collector_paused()
def trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    batch_norm_groups: int = 1,
    layers_once: bool = True,
) -> TracedModel:
    """Export ``model`` on its example inputs and annotate every node.

    Training batch norms take their statistics over each of ``batch_norm_groups``
    consecutive slices of the batch (``autopar_passes.batch_norm``; 1: the whole batch).
    Repeated layers are exported once and copied (``autopar_passes.trace_once``;
    ``layers_once=False`` exports every layer).
    Inputs on another device than a ``meta`` model are moved to ``meta``. Raises
    ``UsageError`` when the inputs do not fit ``forward`` and ``UntraceableModelError`` when
    the model's code cannot be traced.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"autopar traces an nn.Module, got {type(model).__name__}")
    args = tuple(example_inputs) if isinstance(example_inputs, list | tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    added = _without_cache(model, kwargs)
    kwargs.update(added)
    _check_signature(model, args, kwargs)
    if _model_device(model) == torch.device("meta"):
        args, kwargs = _to_meta((args, kwargs))
    start = time.perf_counter()
    exported = (
        export_layers_once(model, args, kwargs, _export) if layers_once else None
    ) or _export(model, args, kwargs)
    _check_static_shapes(exported.graph_module.graph)
    check_dtypes(exported.graph_module.graph, autocast=_autocast_on())
    _refuse_writes_into_inputs(exported)
    decompose_for_sharding(exported.graph_module, batch_norm_groups)
    signature = exported.graph_signature
    names_of = _tied_names(model)
    reshaped = expose_fused_projections(
        exported.graph_module,
        {
            node: names_of.get(name, (name,))[0]
            for node, name in signature.inputs_to_parameters.items()
        },
    )
    placeholder_kinds: dict[str, tuple[NodeKind, str | None]] = {}
    for node_name, param in signature.inputs_to_parameters.items():
        placeholder_kinds[node_name] = ("param", names_of.get(param, (param,))[0])
    for node_name, buffer in signature.inputs_to_buffers.items():
        placeholder_kinds[node_name] = ("buffer", buffer)
    for node_name, constant in signature.inputs_to_lifted_tensor_constants.items():
        placeholder_kinds[node_name] = ("constant", constant)
    graph = exported.graph_module.graph
    layers = find_layer_container(
        [module_path(n) for n in graph.nodes] + list(signature.inputs_to_parameters.values())
    )
    notes = annotate_graph(graph, placeholder_kinds, layers)
    params: dict[str, ParamInfo] = {}
    for node in graph.nodes:
        kind, name = placeholder_kinds.get(node.name, ("input", None))
        if kind == "param" and name is not None:
            info = node.meta[META_KEY].outputs[0]
            known = params.get(name)
            nodes = (*known.nodes, node.name) if known else (node.name,)
            params[name] = ParamInfo(
                name, nodes, info.shape, info.dtype, names_of[name][1:] if name in names_of else ()
            )
    return TracedModel(
        exported=exported,
        params=params,
        buffers=dict(signature.inputs_to_buffers),
        user_inputs=list(signature.user_inputs),
        user_outputs=[str(o) for o in signature.user_outputs],
        layers=layers,
        trace_seconds=time.perf_counter() - start,
        warnings=notes,
        reshaped=reshaped,
        constant_kwargs={k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)},
        added_kwargs=added,
        training=model.training,
    )


def _check_static_shapes(graph: torch.fx.Graph) -> None:
    """torch.export traces an op whose output size depends on the data (``torch.where(mask)``,
    ``nonzero``, ``x[mask]``) with an unbacked size; autopar costs and shards fixed shapes."""
    for node in graph.nodes:
        val = node.meta.get("val")
        for tensor in val if isinstance(val, list | tuple) else (val,):
            if isinstance(tensor, torch.Tensor) and not all(
                isinstance(size, int) for size in tensor.shape
            ):
                where = module_path(node) or "(root)"
                raise UntraceableModelError(
                    f"cannot plan the model: {node.target} in module '{where}' makes a tensor "
                    f"whose size depends on the data ({tuple(tensor.shape)}), as torch.where"
                    "(mask), nonzero and x[mask] do. autopar plans fixed shapes: give it a "
                    "fixed size (for a sparse mixture of experts, a fixed capacity per "
                    "expert: topk over the routed mask, as examples/models/moe_sparse.py "
                    "does)"
                )


def _autocast_on() -> bool:
    """Whether the trace runs under ``torch.autocast``, whose casts the graph does not show."""
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def _model_device(model: nn.Module) -> torch.device | None:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return None


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, list | tuple):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _without_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``{"use_cache": False}`` for a Hugging Face model whose config asks for a KV cache
    when the caller did not say (else nothing): the cache serves generation, and its
    ``DynamicCache`` output is no tensor the program can return. Said with a warning."""
    config = getattr(model, "config", None)
    if kwargs.get("use_cache") is True:
        raise UsageError(
            "use_cache=True: the KV cache a model returns for generation is no tensor a "
            "compiled program can return; call it with use_cache=False (or leave it out), "
            "and generate with compiled.generate"
        )
    if "use_cache" in kwargs or not getattr(config, "use_cache", False):
        return {}
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return {}
    warnings.warn(
        f"autopar traces {type(model).__name__} with use_cache=False (its config says "
        "True): a training step has no use for the KV cache, and the compiled model "
        "returns no past_key_values; set config.use_cache=False to silence this",
        stacklevel=3,
    )
    return {"use_cache": False}


def _check_signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as error:
        raise UsageError(
            f"the example inputs do not fit {type(model).__name__}.forward"
            f"{inspect.signature(model.forward)}: {error}; pass one value per argument of forward"
        ) from None


def _tied_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter name -> every name of the same tensor, the first name first."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return {name: tuple(names) for names in by_tensor.values() for name in names}


def _refuse_writes_into_inputs(exported: torch.export.ExportedProgram) -> None:
    """An in-place op on a user input (or a view of one) is refused: each device holds its
    own copy or piece of an input, and no write would reach the caller's tensor, which
    eager code changes."""
    inputs = set(exported.graph_signature.user_inputs)
    for node in exported.graph_module.graph.nodes:
        if node.op != "call_function" or not mutates_first_input(node.target):
            continue
        chain = view_chain(node.args[0]) if node.args else []
        written = chain[-1].args[0] if chain else (node.args[0] if node.args else None)
        if (
            isinstance(written, torch.fx.Node)
            and written.op == "placeholder"
            and written.name in inputs
        ):
            where = module_path(node) or "the model's own forward"
            raise UsageError(
                f"the model writes into its input {written.name!r} in place "
                f"({node.target} in {where}); autopar gives each device its own copy or "
                "piece of an input, so the caller's tensor would not change as it does "
                "eagerly: write the op out of place (x = x * 2, not x.mul_(2)) or clone "
                "the input first"
            )


def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.export.ExportedProgram:
    was_training = model.training
    # torch logs and prints each failure at length (graphs, stacks); our one message
    # replaces that. What it writes on success is passed on; other loggers (the user's)
    # are left as they are.
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), _torch_loggers_off():
            exported = torch.export.export(model, args, kwargs, strict=False)
        sys.stderr.write(captured.getvalue())
        return exported
    except Exception as error:
        raise _explain_failure(model, error) from None
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _torch_loggers_off() -> Iterator[None]:
    """torch's own loggers (``torch`` and those under it) off for the block, then as they
    were; unlike ``logging.disable`` this leaves every other logger alone."""
    names = ["torch"] + [
        name for name in logging.root.manager.loggerDict if name.startswith("torch.")
    ]
    loggers = [logging.getLogger(name) for name in names]
    was = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, was, strict=True):
            logger.disabled = disabled


_DATA_DEPENDENT_HINTS = (
    "data-dependent",
    "GuardOnDataDependentSymNode",
    "item()",
    "unbacked",
    "Could not guard on data-dependent",
    "Could not extract specialized integer",
)

_EXPORT_MACHINERY = ("torch/_dynamo", "torch/export", "torch/fx/experimental")


def _explain_failure(model: nn.Module, error: Exception) -> Exception:
    """One message naming the user's module and source line, with what to change."""
    where = _user_frame(model, error)
    first_line = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else ""
    message = f"{type(error).__name__}: {first_line}"
    text = str(error)
    if any(hint in text for hint in _DATA_DEPENDENT_HINTS) or "meta tensors" in text:
        advice = (
            "the model's control flow or shapes depend on tensor values (for example "
            "`if x.sum() > 0`, `.item()`, `.tolist()`, boolean-mask indexing). Compute on "
            "tensors instead: torch.where for branches, torch.cond for real control flow, "
            "fixed-size masks instead of x[mask]"
        )
        return UntraceableModelError(f"cannot trace the model at {where}: {advice}.\n  ({message})")
    if isinstance(error, RuntimeError | ValueError | IndexError | TypeError) and not _raised_by(
        error, _EXPORT_MACHINERY
    ):
        return UsageError(
            f"the example inputs do not fit the model at {where}: {message}. Check the "
            "example inputs' shapes and dtypes against what forward expects"
        )
    return UntraceableModelError(
        f"cannot trace the model at {where}: torch.export failed. Rewrite that line with "
        f"torch operations (no numpy, no Python on tensor values).\n  ({message})"
    )


def _raised_by(error: BaseException, places: tuple[str, ...]) -> bool:
    """Whether the innermost frame of the error's traceback lies in one of ``places``."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and any(place in frames[-1].filename for place in places)


def _user_frame(model: nn.Module, error: BaseException) -> str:
    """``module 'layers.0.attn' (model.py:42: `if x.sum() > 0:`)`` for the innermost user frame."""
    names = {id(m): name for name, m in model.named_modules()}
    torch_root = str(Path(torch.__file__).parent)
    user: tuple[str, str] | None = None
    innermost_module: str | None = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        filename = frame.f_code.co_filename
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            path = names[id(owner)] or "(root)"
            innermost_module = path
            if not filename.startswith(torch_root) and filename != __file__:
                line = traceback.extract_tb(tb, limit=1)[0]
                source = f"{Path(filename).name}:{line.lineno}: `{(line.line or '').strip()}`"
                user = (path, source)
        tb = tb.tb_next
    if user is not None:
        return f"module '{user[0]}' ({user[1]})"
    if innermost_module is not None:
        return f"module '{innermost_module}' ({type(model).__name__})"
    return f"module {type(model).__name__} (source line unknown)"
