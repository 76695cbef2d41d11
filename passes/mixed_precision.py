"""Which parameters travel in the compute dtype under mixed precision.

FSDP2 gathers parameters in its ``param_dtype`` (``MixedPrecisionPolicy``): half the bytes
of fp32, and the op finds its weight already cast. autopar runs mixed precision as
``torch.autocast`` over fp32 parameters, where an op outside autocast's lower-precision list
(a norm on CPU, an embedding) wants the fp32 weight. So a parameter is gathered cast only
when every op that reads it is one autocast runs in the compute dtype anyway (a matmul's
weight): then the values are those of the single-device autocast run. Norm weights, biases
and embeddings are gathered in fp32. The runtime (``runtime.param_groups``) and the plan's
ledger (``autopar_passes.ledger``) both ask this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from autopar_passes.annotation import META_KEY
from autopar_passes.layer_sharing import LayerCopies, layer_copies, traced_representatives
from autopar_passes.probe import storage_id, tensor_leaves
from autopar_passes.trace import TracedModel

# ops autocast runs in the compute dtype, on CPU and CUDA alike (casting every input)
LOW_PRECISION_OPS = frozenset(
    {
        "aten.linear.default",
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.matmul.default",
        "aten.einsum.default",
    }
)
COMPUTE = {"bf16_mixed": torch.bfloat16, "fp16_mixed": torch.float16}
MIXED = tuple(COMPUTE)


def cast_for_gather(traced: TracedModel, precision: str) -> frozenset[str]:
    """The parameters gathered in the compute dtype under ``precision``: those of two dims
    or more every reader of which is a lower-precision op (none unless mixed precision)."""
    if precision not in MIXED:
        return frozenset()
    nodes = {node.name: node for node in traced.graph.nodes}
    found = set()
    for name, info in traced.params.items():
        if len(info.shape) < 2:
            continue
        readers = [user for node in info.nodes for user in nodes[node].users]
        if readers and all(r.meta[META_KEY].op in LOW_PRECISION_OPS for r in readers):
            found.add(name)
    return frozenset(found)


def working_cast_nodes(traced: TracedModel, precision: str) -> frozenset[str]:
    """``cast_for_gather``'s parameters by their placeholders (``CostModel.working_cast``):
    under ZeRO their working copies are held in the compute dtype."""
    cast = cast_for_gather(traced, precision)
    return frozenset(node for name in cast for node in traced.params[name].nodes)


def autocast_dtypes(traced: TracedModel, precision: str) -> dict[str, str]:
    """Each node's output dtype when the model runs under the autocast of ``precision``
    (empty unless mixed precision): one run of the traced graph on fake tensors, so a
    norm's or an embedding's fp32 output is known for what it is, and a matmul's for bf16.

    The run uses CPU autocast's op lists; CUDA's differ in a few ops (its softmax and
    norms return fp32 for bf16 inputs), which the ledger then gets wrong there. Run once
    per trace and precision (``TracedModel.derived``)."""
    return traced.derived(("autocast_dtypes", precision), lambda: _dtypes(traced, precision))


def _dtypes(traced: TracedModel, precision: str) -> dict[str, str]:
    compute = COMPUTE.get(precision)
    if compute is None:
        return {}
    copies = layer_copies(traced.graph, traced_representatives(traced))
    values: dict[str, object] = {}
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        torch.no_grad(),
        torch.autocast("cpu", dtype=compute),
    ):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                values[node.name] = (
                    torch.empty(val.shape, dtype=val.dtype)
                    if isinstance(val, torch.Tensor)
                    else val
                )
            elif node.op == "call_function" and node.meta[META_KEY].outputs:
                copied = copies.representative.get(node.name)
                if copied is not None:  # a copied layer's op: its representative's dtypes
                    values[node.name] = values[copied]
                    continue
                args, kwargs = torch.fx.node.map_aggregate(
                    (node.args, node.kwargs), _on_cpu(values)
                )
                values[node.name] = node.target(*args, **kwargs)  # type: ignore[operator]
    return {
        name: str(value.dtype).removeprefix("torch.")
        for name, value in values.items()
        if isinstance(value, torch.Tensor)
    }


def _on_cpu(values: dict[str, object]) -> Callable[[object], object]:
    """Arguments for the fake run: nodes by their values, every device the CPU (a model
    planned on ``meta`` names its device in the graph)."""

    def convert(value: object) -> object:
        if isinstance(value, torch.fx.Node):
            return values[value.name]
        if isinstance(value, torch.device):
            return torch.device("cpu")
        return value

    return convert


@dataclass(frozen=True)
class AutocastSaved:
    """What autograd keeps for backward when the model runs under a mixed precision's
    autocast, per node of the trace, in bytes of the whole (unsharded) tensors.

    The probe of each op (``autopar_passes.probe``) runs it in the traced dtypes; under autocast an
    op of the lower-precision list keeps 16-bit *copies* of its fp32 inputs rather than the
    inputs, and a norm's fp32 output stays fp32. One run of the whole graph on fake tensors
    under autocast tells them apart:

    - ``output_bytes``: a node's value, kept as it is (in its autocast dtype) by some op;
    - ``cast_bytes``: the 16-bit copies of a node's value that its consumers keep (one per
      consumer: autocast caches casts of parameters only);
    - ``internal_bytes``: what an op keeps that is neither (statistics, masks);
    - ``weight_casts``: (parameter, op) pairs where the op keeps autocast's 16-bit copy of
      an fp32 parameter (``CostModel.weight_cast_bytes`` says when the runtime makes it);
    - ``call_casts``: those of them copied from a view of the parameter (an einsum's
      operand as it decomposes, say), which autocast casts anew at every call: its cache
      holds casts of leaf tensors only, so one copy per microbatch in flight, where a cast
      of the parameter itself is made once a step;
    - ``output_dtypes``: the dtype of a node's floating outputs under autocast, where they
      share one (a residual sum stays fp32; a matmul's is bf16): what a reshard of it moves,
      as ``autocast_dtypes`` tells the ledger.
    """

    output_bytes: dict[str, int] = field(default_factory=dict)
    cast_bytes: dict[str, int] = field(default_factory=dict)
    internal_bytes: dict[str, int] = field(default_factory=dict)
    weight_casts: frozenset[tuple[str, str]] = frozenset()
    output_dtypes: dict[str, str] = field(default_factory=dict)
    call_casts: frozenset[tuple[str, str]] = frozenset()


class _Casts(TorchDispatchMode):
    """Records which value each ``_to_copy`` result is a copy of (by storage)."""

    def __init__(self, owner: dict[int, str]) -> None:
        super().__init__()
        self.owner = owner
        self.cast_of: dict[int, str] = {}
        # the copies themselves: a storage freed could be reused at the same address by a
        # later tensor, which would then pass for a copy (fake tensors: no memory held)
        self.copies: list[torch.Tensor] = []
        self.of_view: set[int] = set()  # copies made from a view (not cached by autocast)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            source = self.owner.get(storage_id(args[0]), self.cast_of.get(storage_id(args[0])))
            if source is not None and isinstance(out, torch.Tensor):
                self.cast_of[storage_id(out)] = source
                self.copies.append(out)
                if not args[0].is_leaf:
                    self.of_view.add(storage_id(out))
        return out


def autocast_saved(traced: TracedModel, precision: str) -> AutocastSaved | None:
    """What autograd keeps under ``precision``'s autocast (None unless mixed precision):
    one forward of the traced graph on fake tensors, with ``saved_tensors_hooks``
    classifying every kept tensor by its storage (CPU autocast's op lists, as
    ``autocast_dtypes``); run once per trace and precision."""
    return traced.derived(("autocast_saved", precision), lambda: _saved(traced, precision))


def _saved(traced: TracedModel, precision: str) -> AutocastSaved | None:
    compute = COMPUTE.get(precision)
    if compute is None:
        return None
    owner: dict[int, str] = {}  # storage -> the node whose value it holds
    params = {n for info in traced.params.values() for n in info.nodes}
    live = {n.name for n in traced.graph.nodes if n.op == "placeholder"}  # kept anyway
    values: dict[str, object] = {}
    found = AutocastSaved()
    weight_casts: set[tuple[str, str]] = set()
    call_casts: set[tuple[str, str]] = set()
    # an op of a layer identical to an earlier one is not run: it keeps what its
    # representative keeps, one layer on (``LayerCopies``), and its value is a new tensor
    # shaped as the representative's (what the ops after the layers read and keep)
    copies = layer_copies(traced.graph, traced_representatives(traced))
    kept_by: dict[str, list[_Kept]] = {}
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, torch.autocast("cpu", dtype=compute), _Casts(owner) as casts:
        for node in traced.graph.nodes:
            note = node.meta[META_KEY]
            if node.op == "placeholder":
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    tensor = torch.empty(val.shape, dtype=val.dtype)
                    if note.requires_grad and tensor.is_floating_point():
                        tensor.requires_grad_(True)
                    owner[storage_id(tensor)] = node.name
                    val = tensor
                values[node.name] = val
                continue
            if node.op != "call_function" or not note.outputs:
                continue
            copied = copies.representative.get(node.name)
            kept: list[torch.Tensor] = []
            if copied is not None:
                value = _like(values[copied], fake)
            else:

                def pack(tensor: torch.Tensor, kept: list[torch.Tensor] = kept) -> torch.Tensor:
                    kept.append(tensor)
                    return tensor

                args, kwargs = torch.fx.node.map_aggregate(
                    (node.args, node.kwargs), _on_cpu(values)
                )
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    value = node.target(*args, **kwargs)  # type: ignore[operator]
            values[node.name] = value
            for out in tensor_leaves(value):
                owner.setdefault(storage_id(out), node.name)
            if copied is not None:
                events = [e.moved(copies, node.name) for e in kept_by[copied]]
            else:
                events = kept_by[node.name] = _classify(kept, owner, casts, params)
            floating = {str(t.dtype) for t in tensor_leaves(value) if t.is_floating_point()}
            if len(floating) == 1:
                found.output_dtypes[node.name] = floating.pop().removeprefix("torch.")
            for event in events:
                event.record(node.name, live, found, weight_casts, call_casts)
    return AutocastSaved(
        found.output_bytes,
        found.cast_bytes,
        found.internal_bytes,
        frozenset(weight_casts),
        found.output_dtypes,
        frozenset(call_casts),
    )


def _like(value: Any, mode: FakeTensorMode) -> Any:
    """New fake tensors shaped as ``value``'s (a gradient wanted where it was), made around
    meta tensors outside the modes: through them a tensor took 0.3 ms, a third of this run
    on a model of 96 layers."""

    def one(tensor: torch.Tensor) -> torch.Tensor:
        with no_dispatch():
            meta = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"
            )
        made = FakeTensor(mode, meta, torch.device("cpu"))
        return made.requires_grad_(tensor.requires_grad)

    return tree_map_only(torch.Tensor, one, value)


@dataclass(frozen=True)
class _Kept:
    """One storage an op keeps for backward: the value of ``source`` (``kind`` "output"),
    a 16-bit copy of it ("cast"; of a parameter, "weight", or "call_weight" where made
    from a view of it, anew each call), or neither ("internal")."""

    kind: str
    source: str
    nbytes: int

    def moved(self, copies: LayerCopies, copy: str) -> _Kept:
        """What the op ``copy`` keeps where its representative keeps this."""
        if self.kind == "internal":
            return self
        source = copies.translate(self.source, copy)
        assert source is not None, "identical layers read the same positions"
        return _Kept(self.kind, source, self.nbytes)

    def record(
        self,
        op: str,
        live: set[str],
        found: AutocastSaved,
        weight_casts: set[tuple[str, str]],
        call_casts: set[tuple[str, str]],
    ) -> None:
        """Count it in ``found`` (placeholders are held anyway; a value once)."""
        if self.kind == "output":
            if self.source not in live and self.source not in found.output_bytes:
                found.output_bytes[self.source] = self.nbytes
        elif self.kind in ("weight", "call_weight"):
            weight_casts.add((self.source, op))
            if self.kind == "call_weight":
                call_casts.add((self.source, op))
        elif self.kind == "cast" and self.source not in live:
            found.cast_bytes[self.source] = found.cast_bytes.get(self.source, 0) + self.nbytes
        else:
            found.internal_bytes[op] = found.internal_bytes.get(op, 0) + self.nbytes


def _classify(
    kept: list[torch.Tensor], owner: dict[int, str], casts: _Casts, params: set[str]
) -> list[_Kept]:
    """What an op kept, each storage once, by what it holds (``_Kept``)."""
    found: list[_Kept] = []
    seen: set[int] = set()
    for tensor in kept:
        storage = storage_id(tensor)
        if storage in seen:
            continue
        seen.add(storage)
        nbytes = tensor.untyped_storage().nbytes()
        source = owner.get(storage)
        if source is not None:
            found.append(_Kept("output", source, nbytes))
            continue
        source = casts.cast_of.get(storage)
        if source in params:
            kind = "call_weight" if storage in casts.of_view else "weight"
            found.append(_Kept(kind, source, 0))
        elif source is not None:
            found.append(_Kept("cast", source, nbytes))
        else:
            found.append(_Kept("internal", "", nbytes))
    return found
