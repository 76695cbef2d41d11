"""Sharding rules: embedding family.

===========================  ==================================================================
op                           what a mesh axis may shard
===========================  ==================================================================
embedding(weight, indices)   a dim of the indices, the embedding dim ``D``, or the rows ``V``
===========================  ==================================================================

``out[..., :] = weight[indices[...], :]`` with ``weight [V, D]``. Per mesh axis, one of:

- replicate everything;
- split a dim of ``indices`` (``weight`` replicated): the output is split on the same dim;
- split ``D`` (``weight`` ``Shard(1)``, ``indices`` replicated): the output is split on its
  last dim;
- vocabulary-parallel (Megatron): ``weight`` ``Shard(0)``, ``indices`` replicated; each
  device looks up the rows it holds and writes zeros for the others, so the output is
  ``Partial``. It runs as the local kind ``"vocab_embedding"``: the device's row range
  ``[start, end)`` comes from its coordinates on the axes that split dim 0 of ``weight``
  (in mesh order, the outer axis first, as ``Shard`` stacks them).

Training: the gradient of ``weight`` follows from the forward by autograd, so the forward
rule must also be right for the backward:

- ``padding_idx >= 0`` (the padding row gets no gradient) holds as is for the first three
  choices (row numbers are unchanged). Vocabulary-parallel runs
  ``vocab_parallel_embedding_padded``, which cuts the gradient of the output rows whose
  index is ``padding_idx``; the forward is unchanged.
- ``scale_grad_by_freq`` divides each row's gradient by how often its index occurs in the
  *whole* batch of indices. A device that sees only a slice of the indices, or counts every
  out-of-range index as its local row 0, would divide by the wrong count: only the
  replicated and ``D``-split choices are offered.
- ``sparse`` gradients: vocabulary-parallel would give a dense gradient, so it is not
  offered; the other choices run the op itself and keep the sparse gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopar_passes import local_ops
from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import Local, LocalKind, OpCall, Rule, Strategy
from autopar_plans.placement import PARTIAL, REPLICATE, Shard

aten = torch.ops.aten

VOCAB = "vocab_embedding"


def embedding_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """``embedding(weight [V, D], indices [...], padding_idx, scale_grad_by_freq, sparse)
    -> [..., D]``.

    ``D`` may be split (each column is independent), any dim of ``indices`` (each lookup is
    independent) and ``V`` with a ``Partial`` output (each index hits exactly one device's
    rows). The last two are not offered with ``scale_grad_by_freq`` (the gradient needs
    counts over all the indices), nor ``V`` with ``sparse`` (see the module docstring).
    """
    indices = call.inputs[1]
    out_ndim = len(call.out.shape)
    by_freq = bool(_argument(call, 3, "scale_grad_by_freq", False))
    sparse = bool(_argument(call, 4, "sparse", False))
    choices = [replicate_choice(2, 1)]
    choices.append(AxisChoice((Shard(1), REPLICATE), (Shard(out_ndim - 1),), tag="dim"))
    if not by_freq:
        for dim in range(len(indices.shape)):
            choices.append(AxisChoice((REPLICATE, Shard(dim)), (Shard(dim),), tag="indices"))
    if not by_freq and not sparse:
        # Every device looks up (and writes) all of the output: the work is not divided.
        choices.append(
            AxisChoice((Shard(0), REPLICATE), (PARTIAL,), splits_work=False, tag="vocab")
        )
    return combine(choices, call, mesh_shape, local_of=_local_of)


def _local_of(picks: tuple[AxisChoice, ...], mesh_shape: tuple[int, ...]) -> Local:
    del mesh_shape
    return Local(VOCAB) if any(p.tag == "vocab" for p in picks) else Local()


def vocab_embedding_local(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The ``"vocab_embedding"`` local kind: ``weight`` holds rows ``[start, end)`` here.

    The device's block along dim 0 numbers its coordinates on the splitting axes in mixed
    radix, the earlier mesh axis the most significant (``torch.chunk`` order of a split of
    a split). Only the device that holds the padding row needs to know ``padding_idx``;
    it stays global there, compared with the global indices.
    """
    del kwargs
    weight, indices = args[0], args[1]
    axes = strategy.inputs[0].sharded_dims().get(0, [])
    block, pieces = 0, 1
    for axis in axes:
        block = block * mesh_shape[axis] + coords[axis]
        pieces *= mesh_shape[axis]
    rows = call.inputs[0].shape[0] // pieces
    start, end = block * rows, (block + 1) * rows
    padding_idx = int(_argument(call, 2, "padding_idx", -1))
    if not start <= padding_idx < end:
        return local_ops.vocab_parallel_embedding, (weight, indices, start, end), {}
    return vocab_parallel_embedding_padded, (weight, indices, start, end, padding_idx), {}


def vocab_parallel_embedding_padded(
    weight: torch.Tensor, indices: torch.Tensor, start: int, end: int, padding_idx: int
) -> torch.Tensor:
    """``local_ops.vocab_parallel_embedding`` with a global ``padding_idx``: the output rows
    of padding tokens are detached, so the padding row of the table (held here) gets no
    gradient. The values are unchanged, as ``embedding``'s forward ignores ``padding_idx``."""
    rows = local_ops.vocab_parallel_embedding(weight, indices, start, end)
    is_padding = (indices == padding_idx).unsqueeze(-1)
    return torch.where(is_padding, rows.detach(), rows)


def _argument(call: OpCall, position: int, name: str, default: Any) -> Any:
    if len(call.args) > position:
        return call.args[position]
    return call.kwargs.get(name, default)


RULES: dict[object, Rule] = {
    aten.embedding.default: embedding_rule,
}
LOCALS: dict[str, LocalKind] = {
    VOCAB: vocab_embedding_local,
}
