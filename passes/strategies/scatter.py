"""Sharding rules: scatter family (ops that write values at indexed positions).

Sparse mixture-of-experts code (Hugging Face's Mixtral block) spreads router gates over
(token, expert) with ``scatter`` and adds each expert's outputs back into the token rows
with ``index_add``. The index holds global positions along ``dim``, so ``dim`` of ``self``
stays whole; everything else follows from linearity:

=====================  ===========================================================
op                     per mesh axis, besides replicating
=====================  ===========================================================
index_add              a dim other than ``dim`` sharded in self and source alike;
                       self and source Partial (out = self + scattered source is
                       linear in both); self Partial with the index and ``dim`` of
                       source sharded alike (each device adds its slice of rows)
scatter (src),         a dim other than ``dim`` sharded in self, index and src alike,
scatter_add            where all three have its size; self and src Partial with the
                       index replicated (positions hit take src, the others keep
                       self: linear in both)
scatter (value)        a dim other than ``dim`` sharded in self and index alike
=====================  ===========================================================

>>> call = op_call(aten.index_add.default, (torch.zeros(8, 4), 0, idx, torch.ones(3, 4)), {})
>>> [s.name for s in index_add_rule(call, (2,))]  # doctest: +SKIP
['R,R,R->R', 'S(1),R,S(1)->S(1)', 'P,R,P->P', 'P,S(0),S(0)->P']
"""

from __future__ import annotations

import torch

from autopar_passes.annotation import TensorInfo
from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import OpCall, Rule, Strategy, dtype_of, normalize_dim
from autopar_plans.placement import PARTIAL, REPLICATE, Shard

aten = torch.ops.aten


def _floating(info: TensorInfo) -> bool:
    return dtype_of(info.dtype).is_floating_point


def index_add_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """index_add(self, dim, index, source[, alpha]); tensor inputs (self, index, source)."""
    self_info, index, source = call.inputs
    ndim = len(self_info.shape)
    if ndim == 0 or len(index.shape) != 1:
        return []
    dim = normalize_dim(call.args[1], ndim)
    choices = [replicate_choice(3, 1)]
    for d in range(ndim):
        if d != dim and self_info.shape[d] == source.shape[d]:
            choices.append(
                AxisChoice((Shard(d), REPLICATE, Shard(d)), (Shard(d),), tag=f"both:{d}")
            )
    if _floating(self_info):
        choices.append(
            AxisChoice((PARTIAL, REPLICATE, PARTIAL), (PARTIAL,), splits_work=False, tag="partial")
        )
        choices.append(AxisChoice((PARTIAL, Shard(0), Shard(dim)), (PARTIAL,), tag="rows"))
    return combine(choices, call, mesh_shape)


def scatter_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """scatter(self, dim, index, src | value) and scatter_add(self, dim, index, src)."""
    self_info, index = call.inputs[0], call.inputs[1]
    ndim = len(self_info.shape)
    if ndim == 0 or len(index.shape) != ndim:
        return []
    dim = normalize_dim(call.args[1], ndim)
    with_src = len(call.inputs) == 3
    n = len(call.inputs)
    choices = [replicate_choice(n, 1)]
    for d in range(ndim):
        sizes = {info.shape[d] for info in call.inputs}
        if d != dim and len(sizes) == 1:
            choices.append(AxisChoice((Shard(d),) * n, (Shard(d),), tag=f"all:{d}"))
    if with_src and _floating(self_info):
        choices.append(
            AxisChoice((PARTIAL, REPLICATE, PARTIAL), (PARTIAL,), splits_work=False, tag="partial")
        )
    return combine(choices, call, mesh_shape)


RULES: dict[object, Rule] = {
    aten.index_add.default: index_add_rule,
    aten.scatter.src: scatter_rule,
    aten.scatter.value: scatter_rule,
    aten.scatter_add.default: scatter_rule,
}
