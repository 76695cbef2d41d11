"""Trace-time dtype checks: what eager PyTorch refuses and the meta device lets through.

autopar traces on fake tensors, which run each op's meta function, and several meta functions
check shapes but not dtypes: ``aten.linear`` of an int64 batch and a float32 weight traces (and
would plan), while eager raises ``expected m1 and m2 to have the same dtype``. ``check_dtypes``
applies, op by op, the rule the eager kernels apply to the dtypes export recorded in
``node.meta["val"]``, and refuses the model with one message naming the module, the op, the
dtypes and what to change.

>>> check_dtypes(traced_graph)                                 # doctest: +SKIP
UntraceableModelError: cannot plan the model: module 'layers.0.mlp.up_proj' (Linear) calls
aten.linear on input int64, weight float32 ...

The rules, by family (``tests/passes/test_dtype_checks.py`` runs each against the eager CPU
kernel over every pair of dtypes, and asserts no rule refuses what eager runs):

- matmul and convolution: every tensor operand has one dtype, not bool. ATen's
  ``addmm_impl_cpu_`` and ``addmm`` meta function in ``aten/src/ATen/native/LinearAlgebra.cpp``
  ("expected m1 and m2 to have the same dtype", "self and mat2 must have the same dtype"),
  and ``check_input_same_type_as_parameters`` in ``aten/src/ATen/native/Convolution.cpp``.
- normalisation: weight, bias and running statistics have the input's dtype, or the input is
  16-bit floating and they are all float32 (``aten/src/ATen/native/mixed_type.h``:
  "mixed dtype (CPU): expect parameter to have scalar type of Float").
- the index of ``index_select``, ``index_add``, ``index_copy`` and ``index_fill`` is int64 or
  int32 (``aten/src/ATen/native/TensorAdvancedIndexing.cpp``: "Expected dtype int32/int64
  for index").
- softmax and the smooth activations (gelu, silu, mish, hardswish) take a floating input: their
  kernels dispatch on floating types only ("not implemented for 'Long'").

Under ``torch.autocast`` the matmul family casts its floating operands to one dtype and the
norms run in float32, so there only an integer operand among floating ones is refused. An
autocast block inside ``forward`` is traced as a ``wrap_with_autocast`` submodule, which is
not walked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from autopar_passes.layers import module_path
from autopar_plans.errors import UntraceableModelError

aten = torch.ops.aten


class Refusal(NamedTuple):
    """Why eager refuses an op's dtypes (``rule``) and what the user can do (``advice``)."""

    rule: str
    advice: str


# A rule reads an op's tensor operands (schema name -> dtype) and its other arguments, and
# says why eager would refuse them, or None when eager runs them.
Rule = Callable[[Mapping[str, torch.dtype], Mapping[str, Any]], Refusal | None]

_INTEGER_ADVICE = (
    "feed float tensors, or cast the input with .float(); token ids go to an nn.Embedding first"
)
_FLOAT_ADVICE = (
    "give the inputs the parameters' dtype (x.to(weight.dtype)) or the model the inputs' "
    "(model.to(dtype)); for mixed precision trace in one dtype and choose the plan's "
    "precision (for example precision='bf16_mixed')"
)
_INDEX_ADVICE = "index with an integer tensor: cast it with .long()"
_HALF = (torch.float16, torch.bfloat16)


_MATMUL_FAMILY = (
    aten.linear,
    aten.matmul,
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten.addbmm,
    aten.mv,
    aten.addmv,
    aten.dot,
    aten.conv1d,
    aten.conv2d,
    aten.conv3d,
    aten.conv_transpose1d,
    aten.conv_transpose2d,
    aten.conv_transpose3d,
    aten.convolution,
    aten._convolution,
)
_NORM_FAMILY = (
    aten.layer_norm,
    aten.native_layer_norm,
    aten.group_norm,
    aten.native_group_norm,
    aten.batch_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit_functional,
    aten.instance_norm,
)
_INDEX_FAMILY = (aten.index_select, aten.index_add, aten.index_copy, aten.index_fill)
_FLOATING_ONLY = (aten.softmax, aten.log_softmax, aten.gelu, aten.silu, aten.mish, aten.hardswish)


def check_dtypes(graph: torch.fx.Graph, *, autocast: bool = False) -> None:
    """Raise ``UntraceableModelError`` at the first op whose dtypes eager would refuse.

    ``autocast``: the graph was traced under ``torch.autocast``, whose casts the graph does
    not show (the operands keep their dtypes, the outputs take autocast's).
    """
    rules = _rules(autocast)
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        rule = rules.get(node.target.overloadpacket)
        if rule is None:
            continue
        tensors, others = _operands(node)
        refusal = rule(tensors, others)
        if refusal is not None:
            raise UntraceableModelError(_message(node, tensors, refusal))


def _rules(autocast: bool) -> dict[torch._ops.OpOverloadPacket, Rule]:
    """The op table: each op packet and the rule its eager kernels apply."""
    matmul: Rule = _no_integer_among_floats if autocast else _one_dtype
    table: dict[torch._ops.OpOverloadPacket, Rule] = {}
    for packet in _MATMUL_FAMILY:
        table[packet] = matmul
    if not autocast:
        for packet in _NORM_FAMILY:
            table[packet] = _norm_parameters
    for packet in _INDEX_FAMILY:
        table[packet] = _integer_index
    for packet in _FLOATING_ONLY:
        table[packet] = _floating_input
    return table


def _one_dtype(tensors: Mapping[str, torch.dtype], _others: Mapping[str, Any]) -> Refusal | None:
    """Matmul and convolution: one dtype for every tensor operand, and not bool."""
    if len(set(tensors.values())) > 1:
        return Refusal("its operands must share one dtype", _advice(tensors))
    return _no_bool(tensors)


def _no_integer_among_floats(
    tensors: Mapping[str, torch.dtype], _others: Mapping[str, Any]
) -> Refusal | None:
    """Matmul under autocast: floating operands are cast to one dtype, integer ones are not."""
    floating = [d for d in tensors.values() if d.is_floating_point]
    integer = [d for d in tensors.values() if not (d.is_floating_point or d.is_complex)]
    if floating and integer:
        return Refusal("autocast casts only floating operands", _INTEGER_ADVICE)
    return _no_bool(tensors)


def _no_bool(tensors: Mapping[str, torch.dtype]) -> Refusal | None:
    """No matmul or convolution kernel takes bool, on CPU or CUDA."""
    if torch.bool in tensors.values():
        return Refusal("no matmul or convolution kernel takes bool", _INTEGER_ADVICE)
    return None


def _norm_parameters(
    tensors: Mapping[str, torch.dtype], _others: Mapping[str, Any]
) -> Refusal | None:
    """Norms: parameters in the input's dtype, or float32 ones for a 16-bit input."""
    given = dict(tensors)
    data = given.pop("input", None)
    params = set(given.values())
    if data is None or params <= {data} or (data in _HALF and params <= {torch.float32}):
        return None
    return Refusal(
        "its weight, bias and statistics must have the input's dtype (or float32 for a "
        "16-bit input)",
        _advice(tensors),
    )


def _integer_index(
    tensors: Mapping[str, torch.dtype], _others: Mapping[str, Any]
) -> Refusal | None:
    """Index ops: an int64 or int32 index."""
    index = tensors.get("index")
    if index is None or index in (torch.int64, torch.int32):
        return None
    return Refusal("its index must be int64 or int32", _INDEX_ADVICE)


def _floating_input(
    tensors: Mapping[str, torch.dtype], others: Mapping[str, Any]
) -> Refusal | None:
    """Softmax and smooth activations: a floating input, unless softmax is told a dtype."""
    data = tensors.get("self")
    if data is None or data.is_floating_point or data.is_complex or others.get("dtype"):
        return None
    return Refusal("its kernels are written for floating inputs only", _INTEGER_ADVICE)


def _advice(tensors: Mapping[str, torch.dtype]) -> str:
    integer = any(not (d.is_floating_point or d.is_complex) for d in tensors.values())
    return _INTEGER_ADVICE if integer else _FLOAT_ADVICE


def _operands(node: torch.fx.Node) -> tuple[dict[str, torch.dtype], dict[str, Any]]:
    """The node's arguments by schema name: tensors (as their dtypes) and the others."""
    tensors: dict[str, torch.dtype] = {}
    others: dict[str, Any] = {}
    schema = node.target._schema  # type: ignore[union-attr]
    for position, argument in enumerate(schema.arguments):
        if position < len(node.args):
            value = node.args[position]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        else:
            continue
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            tensors[argument.name] = val.dtype
        else:
            others[argument.name] = value
    return tensors, others


def _message(node: torch.fx.Node, tensors: Mapping[str, torch.dtype], refusal: Refusal) -> str:
    operands = ", ".join(f"{name} {_dtype_name(dtype)}" for name, dtype in tensors.items())
    op = node.target.overloadpacket  # type: ignore[union-attr]
    return (
        f"cannot plan the model: {_module(node)} calls aten.{op.__name__} on {operands}; "
        f"eager PyTorch refuses that ({refusal.rule}), though the meta tensors autopar traces "
        f"on let it through: {refusal.advice}"
    )


def _module(node: torch.fx.Node) -> str:
    """``module 'layers.0.mlp.up_proj' (Linear)``, or the root module's own forward."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "the model's own forward"
    _path, kind = list(stack.values())[-1]
    name = kind.rsplit(".", 1)[-1] if isinstance(kind, str) else getattr(kind, "__name__", "")
    return f"module '{module_path(node) or '(root)'}' ({name})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
