"""``node.meta["autopar"]``: the one annotation the analyses write on each traced node.

Written by ``autopar_passes.annotate.annotate_graph``; read by strategies, the solver, the lowering
and the CLI. One frozen record per node:

==================  ==================================================================
field               meaning
==================  ==================================================================
kind                "param", "buffer", "input", "op", "view", "output", "constant"
op                  the ATen op (``aten.linear.default``) or the placeholder kind
outputs             shape and dtype of each output tensor (one for most ops)
fwd_flops           forward FLOPs (matmul-like ops; pointwise ops count 0, as Megatron does)
bwd_flops           backward FLOPs of the op, measured by running its backward
bytes_read          forward bytes read from memory (0 for a view: it moves nothing)
bytes_written       forward bytes written
param               the parameter's name, for a parameter placeholder
module              the module path of the code that made the node (``layers.3.attn``)
layer               index of the repeated layer the node belongs to, or None
saved_bytes         bytes autograd keeps for backward that belong to this node: its output
                    storage if any op saves it (counted once, at the node that owns the
                    storage: views and aliases point at their base, see ``alias_of``), plus
                    the intermediates the op itself keeps (statistics, masks)
internal_saved_bytes  the part of ``saved_bytes`` the op keeps that is not a tensor of the
                    graph (a norm's statistics, attention's log-sum-exp, a dropout mask)
saved_inputs        positions (flattened tensor-input order) of the inputs the op's backward
                    keeps; where the input arrives resharded, the reshard's copy is what is kept
alias_of            the node whose storage this node's output views, or None
requires_grad       whether the output needs a gradient in training
==================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

META_KEY = "autopar"

NodeKind = Literal["param", "buffer", "input", "op", "view", "output", "constant"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class NodeAnnotation:
    kind: NodeKind
    op: str
    outputs: tuple[TensorInfo, ...]
    fwd_flops: int = 0
    bwd_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    param: str | None = None
    module: str = ""
    layer: int | None = None
    saved_bytes: int = 0
    internal_saved_bytes: int = 0
    saved_inputs: tuple[int, ...] = ()
    alias_of: str | None = None
    requires_grad: bool = False

    @property
    def keeps_tensor(self) -> bool:
        """Whether the op keeps a tensor for its backward (an input, or one it makes): where
        ``torch.utils.checkpoint``'s replay of a region may stop."""
        return bool(self.saved_inputs) or self.internal_saved_bytes > 0

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The output shape when the node has exactly one tensor output."""
        return self.outputs[0].shape if len(self.outputs) == 1 else None

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


def annotation(node: torch.fx.Node) -> NodeAnnotation:
    """The node's annotation; a clear error if the annotate pass has not run."""
    try:
        return node.meta[META_KEY]
    except KeyError:
        raise KeyError(
            f"node {node.name} has no {META_KEY!r} annotation; run trace() first"
        ) from None


def dtype_itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
