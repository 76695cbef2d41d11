"""Sharding rules: mixture-of-experts ops as transformers 5 writes them.

A transformers-5 expert block sorts its (token, expert) pairs by expert, counts them per
expert (``histc``), and runs every expert's rows in one **grouped matmul**:
``grouped_mm(x [S, d_in], w [E, d_in, d_out], offs [E]) -> [S, d_out]``, rows
``offs[e-1] .. offs[e]`` of ``x`` times ``w[e]`` (``transformers.grouped_mm_fallback``, or
``aten._grouped_mm``). An ``index_put_`` makes the inverse permutation that puts rows back.

=====================  ===========================================================
op                     what a mesh axis may shard
=====================  ===========================================================
grouped_mm             the experts (``w`` dim 0): each device runs its experts' rows,
                       zeros elsewhere, a ``Partial`` output (``grouped_experts``:
                       expert parallelism); the rows (``x`` dim 0): each device its
                       block of the sorted rows, whichever experts they go to
                       (``grouped_rows``); the output features (``w`` dim 2); the
                       input features (``x`` dim 1, ``w`` dim 1): ``Partial``; a
                       ``Partial`` ``x`` or ``w``. ``offs`` is always whole
histc                  any dim of the input: partial counts add up (``Partial``)
index_put (_)          the dims after the indexed ones, in ``self`` and ``values``
=====================  ===========================================================

Expert parallelism here replicates the routed rows over the expert axis and sums the
experts' outputs (an all-reduce), where GShard's dispatch sends each row to its expert
(an all-to-all): the grouped matmul's groups are sized by the data, which a plan cannot
cut statically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import SAME, Local, LocalKind, OpCall, Rule, Strategy
from autopar_plans.placement import PARTIAL, REPLICATE, Shard

aten = torch.ops.aten

EXPERTS, ROWS = "grouped_experts", "grouped_rows"
GROUPED_NAMES = ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")


def grouped_mm_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """grouped_mm(x, w, offs): see the module docstring. Only the 2-d x 3-d form with
    ``offs`` (the experts' row groups)."""
    if len(call.inputs) < 3 or len(call.inputs[0].shape) != 2 or len(call.inputs[1].shape) != 3:
        return []
    rest = (REPLICATE,) * (len(call.inputs) - 2)  # offs (and a bias) whole
    choices = [
        replicate_choice(len(call.inputs), 1),
        AxisChoice((Shard(0), REPLICATE, *rest), (Shard(0),), tag=ROWS),
    ]
    if len(call.inputs) == 3:  # with a bias, a partial output would add it on every device
        choices += [
            AxisChoice((REPLICATE, Shard(0), *rest), (PARTIAL,), tag=EXPERTS),
            AxisChoice((Shard(1), Shard(1), *rest), (PARTIAL,), tag="inner"),
            AxisChoice((REPLICATE, Shard(2), *rest), (Shard(1),), tag="out"),
            AxisChoice((PARTIAL, REPLICATE, *rest), (PARTIAL,), splits_work=False, tag="p:x"),
            AxisChoice((REPLICATE, PARTIAL, *rest), (PARTIAL,), splits_work=False, tag="p:w"),
        ]
    return combine(choices, call, mesh_shape, local_of=_grouped_local)


def _grouped_local(picks: tuple[AxisChoice, ...], mesh_shape: tuple[int, ...]) -> Local:
    experts = any(p.tag == EXPERTS for p in picks)
    rows = any(p.tag == ROWS for p in picks)
    if experts and rows:
        return Local("grouped_both")
    if experts:
        return Local(EXPERTS)
    return Local(ROWS) if rows else SAME


def _block(
    strategy: Strategy,
    operand: int,
    dim: int,
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[int, int]:
    """This device's block of ``dim`` of input ``operand`` and how many blocks there are
    (mixed radix over the splitting axes, the earlier axis the most significant)."""
    block, pieces = 0, 1
    for axis in strategy.inputs[operand].sharded_dims().get(dim, []):
        block = block * mesh_shape[axis] + coords[axis]
        pieces *= mesh_shape[axis]
    return block, pieces


def _grouped_local_kind(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The grouped matmul of this device's experts (``w`` split on dim 0) and/or of its
    block of the sorted rows (``x`` split on dim 0)."""
    expert_block, expert_pieces = _block(strategy, 1, 0, coords, mesh_shape)
    row_block, row_pieces = _block(strategy, 0, 0, coords, mesh_shape)
    experts = call.inputs[1].shape[0] // expert_pieces
    rows = call.inputs[0].shape[0] // row_pieces
    first, row_start = expert_block * experts, row_block * rows

    def run(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *rest: Any) -> torch.Tensor:
        return grouped_block(call.target, x, w, offs, first, row_start, *rest)

    return run, args, kwargs


def grouped_block(
    op: Any,
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    first: int,
    row_start: int,
    *rest: Any,
) -> torch.Tensor:
    """``op`` (a grouped matmul) on rows ``row_start .. row_start + len(x)`` of the sorted
    rows, with experts ``first .. first + len(w)`` of the global ``offs``: rows of other
    experts come out zero. The groups' ends are taken relative to this block and clamped to
    it, so the rows of the block's experts are all it multiplies."""
    ends = offs[first : first + w.shape[0]]
    start = offs[first - 1] if first > 0 else offs.new_zeros(())
    local_start = int((start - row_start).clamp(0, x.shape[0]))
    local_stop = max(int((ends[-1] - row_start).clamp(0, x.shape[0])), local_start)
    local_ends = (ends - row_start).clamp(local_start, local_stop) - local_start
    part = op(x[local_start:local_stop], w, local_ends, *rest)  # empty: w's gradient is zero
    out = x.new_zeros(x.shape[0], w.shape[-1])
    return torch.cat([out[:local_start], part, out[local_stop:]])


def histc_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """histc(x, bins, min, max): counts over every element, so a split input gives partial
    counts that add up to the whole histogram."""
    choices = [replicate_choice(1, 1)]
    for dim in range(len(call.inputs[0].shape)):
        choices.append(AxisChoice((Shard(dim),), (PARTIAL,), tag=f"count:{dim}"))
    return combine(choices, call, mesh_shape)


def index_put_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """index_put(self, indices, values, accumulate): the dims of ``self`` after the ``k``
    indexed ones hold whole rows of the write, so they shard in ``self``, ``values`` (its
    trailing dims) and the output alike; the indices stay whole."""
    self_shape = call.inputs[0].shape
    indices = call.args[1]
    k = len(indices) if isinstance(indices, list | tuple) else 1
    values = call.inputs[-1].shape
    n_in = len(call.inputs)
    choices = [replicate_choice(n_in, 1)]
    for dim in range(k, len(self_shape)):
        value_dim = len(values) - (len(self_shape) - dim)
        if value_dim < 0 or values[value_dim] != self_shape[dim]:
            continue
        inputs = (Shard(dim),) + (REPLICATE,) * (n_in - 2) + (Shard(value_dim),)
        choices.append(AxisChoice(inputs, (Shard(dim),)))
    return combine(choices, call, mesh_shape)


RULES: dict[object, Rule] = {
    aten.histc.default: histc_rule,
    aten.index_put.default: index_put_rule,
    aten.index_put_.default: index_put_rule,
    aten._grouped_mm.default: grouped_mm_rule,
}
# custom ops registered by a library that may be imported after the table is made
NAMED_RULES: dict[str, Rule] = {name: grouped_mm_rule for name in GROUPED_NAMES}
LOCALS: dict[str, LocalKind] = {
    EXPERTS: _grouped_local_kind,
    ROWS: _grouped_local_kind,
    "grouped_both": _grouped_local_kind,
}
