"""An exposed projection runs as eager runs it: one matmul with the bias in it.

``autopar_passes.expose`` plans GPT's fused q/k/v projection as an einsum over the weight seen as
``[K, C, Cin]`` plus a bias ``[K, C]``, so that the solver can shard heads::

    einsum = einsum("abi,kci->abkc", x, W3)
    add = add(einsum, b3)

On each device that einsum runs as permutes and a batched matmul, and the bias as an add
of its own, which under autocast also promotes the bf16 product to fp32 (``add`` is not an
autocast op): a copy of the projection's output in fp32, cast back for attention, and the
same in backward. Eager PyTorch runs one ``addmm`` with the bias folded in. Every device's
weight piece keeps its dims in that order, whichever of ``C`` and ``Cin`` is split (its
local tensor is contiguous), so the local einsum is the same arithmetic as::

    add = projection(x, W3, b3)  =  linear(x, W3.flatten(0, 1), b3.flatten()).unflatten(-1, (K, C))

Hugging Face's Conv1D (weight ``[Cin, K, C]``, ``x`` flattened to rows): ``addmm(b3.flatten(),
x, W3.flatten(1))`` viewed as ``[N, K, C]``, as its own forward does. The add node keeps its
name, so recompute regions (named by node) still find it.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

aten = torch.ops.aten

# expose's equations: batch letters, then the contraction i; weight [K, C, I] or [I, K, C]
_EQUATION = re.compile(r"^([a-h]*)i,(kci|ikc)->\1kc$")


def projection(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool
) -> torch.Tensor:
    """``einsum(x, weight) + bias`` of an exposed projection, as one matmul (module
    docstring); ``weight`` is ``[I, K, C]`` when ``conv1d``, else ``[K, C, I]``."""
    parts, block = (weight.shape[1], weight.shape[2]) if conv1d else weight.shape[:2]
    if bias is not None and tuple(bias.shape) != (parts, block):
        # a bias broadcast some other way: keep the einsum's own arithmetic
        equation = "...i,ikc->...kc" if conv1d else "...i,kci->...kc"
        return torch.einsum(equation, x, weight) + bias
    flat_bias = bias.flatten() if bias is not None else None
    if conv1d:
        rows = x.reshape(-1, x.shape[-1])
        flat = weight.flatten(1)
        out = rows @ flat if flat_bias is None else torch.addmm(flat_bias, rows, flat)
        return out.view(*x.shape[:-1], parts, block)
    return F.linear(x, weight.flatten(0, 1), flat_bias).unflatten(-1, (parts, block))


def fuse_projections(graph: torch.fx.Graph) -> int:
    """Rewrite, in place, each exposed projection of a rank's ``graph`` (an einsum of
    ``autopar_passes.expose``'s form and the bias add that alone reads it) as one ``projection``
    call; returns how many."""
    fused = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.einsum.default:
            continue
        equation, operands = node.args
        match = _EQUATION.match(str(equation).replace(" ", ""))
        if match is None or len(operands) != 2:  # type: ignore[arg-type]
            continue
        x, weight = operands  # type: ignore[misc]
        conv1d = match.group(2) == "ikc"
        users = list(node.users)
        add = users[0] if len(users) == 1 else None
        if (
            add is not None
            and add.target is aten.add.Tensor
            and add.args[0] is node
            and isinstance(add.args[1], torch.fx.Node)
            and add.kwargs.get("alpha", 1) == 1
        ):
            # the add becomes the projection (keeping its name); the einsum goes
            add.target = projection
            add.args = (x, weight, add.args[1], conv1d)
            add.kwargs = {}
            graph.erase_node(node)
        else:
            node.target = projection
            node.args = (x, weight, None, conv1d)
        fused += 1
    if fused:
        graph.lint()
    return fused
