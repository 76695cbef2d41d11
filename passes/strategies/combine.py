"""Build strategies axis by axis: each mesh axis picks one ``AxisChoice``; the product of
the picks over all axes is a strategy, kept if every tensor splits evenly.

Most rules are written this way: they list what one mesh axis may do to the op (replicate
it, shard this dim of these inputs and the output, hold partial sums), and ``combine``
makes the strategies for any mesh rank.

>>> batch = AxisChoice(inputs=(Shard(0),), outputs=(Shard(0),), splits_work=True)
>>> [s.name for s in combine([REPLICATE_CHOICE(1, 1), batch], call, (2, 2))]  # doctest: +SKIP
['RR->RR', 'RS(0)->RS(0)', 'S(0)R->S(0)R', 'S(0)S(0)->S(0)S(0)']
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar_passes.strategies.types import SAME, Local, OpCall, Strategy, all_fit
from autopar_plans.placement import REPLICATE, Layout, Placement


@dataclass(frozen=True, slots=True)
class AxisChoice:
    """What one mesh axis does: a placement per input and per output, and whether the
    devices along the axis divide the work (``False``: they repeat it). ``tag`` lets a
    rule's ``local`` callback tell choices apart (for example, a mean over a sharded dim)."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    splits_work: bool = True
    tag: str = ""


def replicate_choice(n_inputs: int, n_outputs: int) -> AxisChoice:
    """The axis replicates everything and every device on it repeats the work."""
    return AxisChoice((REPLICATE,) * n_inputs, (REPLICATE,) * n_outputs, splits_work=False)


LocalOf = Callable[[tuple[AxisChoice, ...], tuple[int, ...]], Local]


def combine(
    choices: Sequence[AxisChoice],
    call: OpCall,
    mesh_shape: tuple[int, ...],
    local_of: LocalOf | None = None,
    valid: Callable[[Strategy], bool] | None = None,
) -> list[Strategy]:
    """Every product of ``choices`` over the mesh axes that splits all tensors evenly.

    Duplicate strategies (same layouts) are dropped, keeping the first. ``local_of`` picks
    the local lowering from the axis choices; ``valid`` lets a rule veto a combination.
    """
    unique = list(dict.fromkeys(choices))
    seen: set[tuple[tuple[Layout, ...], tuple[Layout, ...]]] = set()
    strategies: list[Strategy] = []
    n_in, n_out = len(call.inputs), len(call.outputs)
    for picks in itertools.product(unique, repeat=len(mesh_shape)):
        inputs = tuple(Layout(*(p.inputs[i] for p in picks)) for i in range(n_in))
        outputs = tuple(Layout(*(p.outputs[j] for p in picks)) for j in range(n_out))
        key = (inputs, outputs)
        if key in seen:
            continue
        split = 1
        for pick, size in zip(picks, mesh_shape, strict=True):
            if pick.splits_work:
                split *= size
        local = local_of(picks, mesh_shape) if local_of is not None else SAME
        strategy = Strategy(inputs=inputs, outputs=outputs, split=split, local=local)
        if not all_fit(strategy, call, mesh_shape):
            continue
        if valid is not None and not valid(strategy):
            continue
        seen.add(key)
        strategies.append(strategy)
    return strategies
