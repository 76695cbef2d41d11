"""Matmul family: every rule is one einsum (``autopar_passes.strategies.einsum``).

=====================  =====================================
op                     einsum
=====================  =====================================
linear(x, w[, b])      ``...h,fh(,f) -> ...f``
mm(a, b)               ``mk,kn -> mn``
addmm(c, a, b)         ``(n,) mk,kn -> mn`` (c broadcast, additive)
bmm(a, b)              ``bmk,bkn -> bmn``
baddbmm(c, a, b)       ``(bmn) bmk,bkn -> bmn``
matmul(a, b)           batch dims broadcast, as torch.matmul
einsum(eq, operands)   its own equation, every operand multiplicative
outer(a, b)            ``i,j -> ij``
=====================  =====================================
"""

from __future__ import annotations

import torch

from autopar_passes.strategies.einsum import Operand, batch_letters, einsum_strategies
from autopar_passes.strategies.types import OpCall, Rule, Strategy

aten = torch.ops.aten


def linear_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    x, w = call.inputs[0], call.inputs[1]
    lead = batch_letters(len(x.shape) - 1, "hf")
    operands: list[Operand] = [(lead + "h", "mul"), ("fh", "mul")]
    if len(call.inputs) == 3:
        operands.append(("f", "add"))
    del w
    return einsum_strategies(operands, lead + "f", call, mesh_shape)


def mm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    return einsum_strategies([("mk", "mul"), ("kn", "mul")], "mn", call, mesh_shape)


def addmm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    bias = _broadcast_subscripts(call.inputs[0].shape, "mn")
    return einsum_strategies([(bias, "add"), ("mk", "mul"), ("kn", "mul")], "mn", call, mesh_shape)


def bmm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    return einsum_strategies([("bmk", "mul"), ("bkn", "mul")], "bmn", call, mesh_shape)


def baddbmm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    bias = _broadcast_subscripts(call.inputs[0].shape, "bmn")
    return einsum_strategies(
        [(bias, "add"), ("bmk", "mul"), ("bkn", "mul")], "bmn", call, mesh_shape
    )


def matmul_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """torch.matmul: 1-d operands are vectors; leading dims broadcast."""
    a, b = call.inputs[0].shape, call.inputs[1].shape
    if len(a) == 1 and len(b) == 1:
        return einsum_strategies([("k", "mul"), ("k", "mul")], "", call, mesh_shape)
    if len(b) == 1:
        lead = batch_letters(len(a) - 1, "k")
        return einsum_strategies([(lead + "k", "mul"), ("k", "mul")], lead, call, mesh_shape)
    if len(a) == 1:
        lead = batch_letters(len(b) - 2, "kn")
        return einsum_strategies([("k", "mul"), (lead + "kn", "mul")], lead + "n", call, mesh_shape)
    batch = max(len(a), len(b)) - 2
    out_batch = batch_letters(batch, "mkn")
    a_sub = _batch_for(a[:-2], out_batch) + "mk"
    b_sub = _batch_for(b[:-2], out_batch) + "kn"
    return einsum_strategies([(a_sub, "mul"), (b_sub, "mul")], out_batch + "mn", call, mesh_shape)


def einsum_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """aten.einsum(equation, [operands]): every operand multiplicative. Equations with
    ellipses or repeated letters in one operand (traces, diagonals) are replicated."""
    equation = str(call.args[0]).replace(" ", "")
    if "..." in equation or "->" not in equation:
        return []
    left, output = equation.split("->")
    subscripts = left.split(",")
    if any(len(set(s)) != len(s) for s in subscripts) or len(subscripts) != len(call.inputs):
        return []
    return einsum_strategies([(s, "mul") for s in subscripts], output, call, mesh_shape)


def outer_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """torch.outer(a, b): ``i,j->ij`` (rotary embeddings' positions x frequencies)."""
    return einsum_strategies([("i", "mul"), ("j", "mul")], "ij", call, mesh_shape)


def _batch_for(dims: tuple[int, ...], out_batch: str) -> str:
    """Subscripts of an operand's batch dims, aligned right against the output's. A
    broadcast dim (size 1) gets an upper-case letter of its own, so it is never sharded."""
    letters = out_batch[len(out_batch) - len(dims) :]
    return "".join(c.upper() if size == 1 else c for c, size in zip(letters, dims, strict=True))


def _broadcast_subscripts(shape: tuple[int, ...], output: str) -> str:
    """Subscripts of an additive operand broadcast against ``output``: size-1 and missing
    leading dims never take a sharded letter."""
    letters = output[len(output) - len(shape) :]
    return "".join(c.upper() if size == 1 else c for c, size in zip(letters, shape, strict=True))


RULES: dict[object, Rule] = {
    aten.linear.default: linear_rule,
    aten.mm.default: mm_rule,
    aten.addmm.default: addmm_rule,
    aten.bmm.default: bmm_rule,
    aten.baddbmm.default: baddbmm_rule,
    aten.matmul.default: matmul_rule,
    aten.einsum.default: einsum_rule,
    aten.outer.default: outer_rule,
}
