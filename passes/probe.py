"""Run one ATen op on fake tensors to measure what it costs and what autograd keeps.

The trace gives every node's output shape, not its cost. Rather than keep a FLOP formula
per op, we *run* each op once, on ``FakeTensor`` inputs of the node's shapes (no memory is
allocated, so a 175B model's ops cost the same as a toy's), under

- ``FlopCounterMode``: forward FLOPs, then backward FLOPs from ``torch.autograd.grad``;
- ``saved_tensors_hooks``: every tensor autograd packs for backward, classified by storage
  as one of the op's inputs, its output, or an intermediate the op keeps (a softmax's
  statistics, a dropout mask).

Fake tensors live on the CPU so the CPU kernels' choices hold (scaled dot-product attention
takes the flash path, which saves q, k, v, the output and a logsumexp, as GPU flash attention
does). The CPU flash kernels have no FLOP formula in torch, so ours maps them to the formulas
torch keeps for the GPU flash kernels.

Results are cached by the op's signature (op, input shapes, strides, dtypes, which inputs
need grad, the other arguments): repeated layers are probed once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from autopar_cost_model.flops import cpu_flash_flop_mapping
from autopar_passes.strategies.inplace import mutates_first_input

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class OpProbe:
    """What running one op taught us.

    ``saved_inputs`` holds the positions (in flattened tensor-argument order) of inputs that
    autograd keeps; ``saved_outputs`` the output positions it keeps; ``internal_saved_bytes``
    what it keeps that is neither (statistics, masks). ``output_requires_grad`` per output.
    """

    fwd_flops: int
    bwd_flops: int
    saved_inputs: frozenset[int]
    saved_outputs: frozenset[int]
    internal_saved_bytes: int
    output_requires_grad: tuple[bool, ...]
    input_aliases: tuple[int | None, ...]  # per output: the input whose storage it views
    ok: bool = True
    error: str = ""


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a value (a tensor, or nested lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in tensor_leaves(item)]
    return []


def storage_id(tensor: torch.Tensor) -> int:
    """Which storage a tensor views (fake tensors too)."""
    return tensor.untyped_storage()._cdata


def _signature_of(value: Any, needs_grad: Callable[[Any], bool]) -> Hashable:
    """A hashable description of an argument: tensors by shape, stride, dtype, grad."""
    if isinstance(value, torch.fx.Node):
        meta = value.meta.get("val")
        if isinstance(meta, torch.Tensor):
            return ("T", tuple(meta.shape), tuple(meta.stride()), meta.dtype, needs_grad(value))
        return ("N", repr(meta))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_signature_of(v, needs_grad) for v in value))
    if isinstance(value, dict):
        return ("D", tuple(sorted((k, _signature_of(v, needs_grad)) for k, v in value.items())))
    return ("V", repr(value))


class OpProber:
    """Probes ops on fake tensors; one instance per trace holds the cache and the fake mode."""

    def __init__(self) -> None:
        self._mode = FakeTensorMode(allow_non_fake_inputs=False)
        self._cache: dict[Hashable, OpProbe] = {}
        self._flop_mapping = cpu_flash_flop_mapping()

    def probe(self, node: torch.fx.Node, needs_grad: Callable[[torch.fx.Node], bool]) -> OpProbe:
        """Probe the op of ``node``; ``needs_grad(arg)`` says which input nodes need grad."""
        key = (
            str(node.target),
            _signature_of(node.args, needs_grad),
            _signature_of(node.kwargs, needs_grad),
        )
        cached = self._cache.get(key)
        if cached is None:
            cached = self._run(node, needs_grad)
            self._cache[key] = cached
        return cached

    def _materialise(self, value: Any, needs_grad: Callable[[torch.fx.Node], bool]) -> Any:
        if isinstance(value, torch.fx.Node):
            meta = value.meta.get("val")
            if isinstance(meta, torch.Tensor):
                tensor = torch.empty_strided(
                    tuple(meta.shape), tuple(meta.stride()), dtype=meta.dtype, device="cpu"
                )
                if needs_grad(value) and (tensor.is_floating_point() or tensor.is_complex()):
                    tensor.requires_grad_(True)
                return tensor
            return meta
        if isinstance(value, list | tuple):
            return type(value)(self._materialise(v, needs_grad) for v in value)
        if isinstance(value, dict):
            return {k: self._materialise(v, needs_grad) for k, v in value.items()}
        if isinstance(value, torch.device):
            return torch.device("cpu")
        return value

    def _run(self, node: torch.fx.Node, needs_grad: Callable[[torch.fx.Node], bool]) -> OpProbe:
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        kwargs = dict(node.kwargs)
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        try:
            with self._mode:
                args = self._materialise(node.args, needs_grad)
                kwargs = self._materialise(kwargs, needs_grad)
                inputs = tensor_leaves(args) + tensor_leaves(kwargs)
                if mutates_first_input(node.target) and isinstance(args[0], torch.Tensor):
                    # an input that requires grad is a leaf, which autograd lets no op write
                    # into: the op writes into a copy, whose backward passes gradients on
                    args = (args[0].clone(), *args[1:])
                with (
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                    FlopCounterMode(display=False, custom_mapping=self._flop_mapping) as fwd,
                ):
                    result = node.target(*args, **kwargs)
                outputs = tensor_leaves(result)
                bwd_flops = self._backward_flops(inputs, outputs)
        except Exception as error:
            return OpProbe(
                0,
                0,
                frozenset(),
                frozenset(),
                0,
                (),
                (),
                ok=False,
                error=f"{type(error).__name__}: {error}",
            )
        input_storage = {storage_id(t): i for i, t in enumerate(inputs)}
        output_storage = {storage_id(t): i for i, t in enumerate(outputs)}
        saved_inputs, saved_outputs, internal = set(), set(), 0
        seen: set[int] = set()
        for tensor in saved:
            storage = storage_id(tensor)
            if storage in input_storage:
                saved_inputs.add(input_storage[storage])
            elif storage in output_storage:
                saved_outputs.add(output_storage[storage])
            elif storage not in seen:
                seen.add(storage)
                internal += tensor.untyped_storage().nbytes()
        return OpProbe(
            fwd_flops=int(fwd.get_total_flops()),
            bwd_flops=bwd_flops,
            saved_inputs=frozenset(saved_inputs),
            saved_outputs=frozenset(saved_outputs),
            internal_saved_bytes=internal,
            output_requires_grad=tuple(t.requires_grad for t in outputs),
            input_aliases=tuple(input_storage.get(storage_id(t)) for t in outputs),
        )

    def _backward_flops(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
        wants = [t for t in inputs if t.requires_grad]
        grads_of = [t for t in outputs if t.requires_grad]
        if not wants or not grads_of:
            return 0
        with FlopCounterMode(display=False, custom_mapping=self._flop_mapping) as bwd:
            torch.autograd.grad(
                grads_of, wants, [torch.empty_like(t) for t in grads_of], allow_unused=True
            )
        return int(bwd.get_total_flops())


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
