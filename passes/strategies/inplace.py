"""Sharding rules: in-place ops (``add_``, ``mul_``, ``copy_``, ``masked_fill_``, ...).

An in-place op writes its result into its first input and returns that tensor: its
strategies are those of the out-of-place op (``add_`` takes ``add``'s) whose output is laid
out as the first input, since the tensor keeps its layout, and that run the op itself on
each device (not a special local, which would compute a new tensor). ``copy_(self, src)`` writes
``src`` (broadcast to ``self``'s shape) into ``self``: an elementwise op whose partial
``src`` gives a partial result, ``self``'s old values dropped.

The mutated tensor must reach the op as it is, since a reshard would write into a copy: a
buffer or an input, which every rank holds whole, is mutated only replicated
(``autopar_passes.strategies.graph``).

A write through a slice or select of an intermediate tensor is made functional before the
rules run (``autopar_passes.functionalize``): the out-of-place op (``fill``, ...)
and ``slice_scatter``/``select_scatter`` (``src`` written into ``self``'s slice: any dim
but the sliced one split alike in both, or both partial), whose rules are here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from autopar_passes.strategies import pointwise, scatter
from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import SAME, OpCall, Rule, Strategy
from autopar_plans.placement import PARTIAL, REPLICATE, Shard

aten = torch.ops.aten


def mutates_first_input(target: object) -> bool:
    """Whether ``target``'s schema writes its first argument (an in-place op)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write and not schema.name.endswith("_out")


def in_place(rule: Rule) -> Rule:
    """The rule of an in-place op, from its out-of-place op's ``rule``."""

    def rule_in_place(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
        # a special local (dropout's masks, a mean's scale) runs another function, which
        # would not write into the input
        return [
            s for s in rule(call, mesh_shape) if s.outputs[0] == s.inputs[0] and s.local == SAME
        ]

    return rule_in_place


def copy_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """copy_(self, src): as an elementwise op of both, partial in both together; the
    result in ``self``'s layout."""
    return in_place(pointwise.additive_rule)(call, mesh_shape)


def fill_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """fill_(self, value): every element of ``self`` set to ``value`` (a number, or a tensor
    of one element, replicated); ``self`` may be split any way, never partial (each summand
    would hold the value)."""
    n_in = len(call.inputs)
    choices = [replicate_choice(n_in, 1)]
    for dim in range(len(call.inputs[0].shape)):
        inputs = (Shard(dim),) + (REPLICATE,) * (n_in - 1)
        choices.append(AxisChoice(inputs, (Shard(dim),)))
    return combine(choices, call, mesh_shape)


def scatter_into_slice_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """slice_scatter(self, src, dim, start, end, step): ``src`` written into a slice of
    ``self``. Every other dim has the same size in both and may be split alike; the sliced
    dim stays whole (a device's rows of ``src`` need not land in its rows of ``self``).
    Linear in both together: both partial gives the partial result."""
    dim = _dim(call, len(call.out.shape))
    return _write_choices(call, mesh_shape, dim, lambda own: own)


def scatter_into_select_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """select_scatter(self, src, dim, index): ``src`` (``self`` without ``dim``) written at
    ``index`` along ``dim``. Any other dim of ``self`` may be split, ``src``'s matching dim
    alike; both partial gives the partial result."""
    dim = _dim(call, len(call.out.shape))
    return _write_choices(call, mesh_shape, dim, lambda own: own if own < dim else own - 1)


def _write_choices(
    call: OpCall, mesh_shape: tuple[int, ...], dim: int, src_dim: Callable[[int], int]
) -> list[Strategy]:
    choices = [replicate_choice(2, 1)]
    for own, size in enumerate(call.out.shape):
        if own != dim and size > 1:
            choices.append(AxisChoice((Shard(own), Shard(src_dim(own))), (Shard(own),)))
    if "float" in call.inputs[0].dtype:
        choices.append(AxisChoice((PARTIAL, PARTIAL), (PARTIAL,), splits_work=False))
    return combine(choices, call, mesh_shape)


def _dim(call: OpCall, rank: int) -> int:
    """The ``dim`` argument (third) of a scatter into a view, normalized."""
    value = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    return int(value) % rank


def _in_place_variants(families: Iterable[Mapping[object, Rule]]) -> dict[object, Rule]:
    """``aten.add_.Tensor`` -> the rule of ``aten.add.Tensor``, for every op of
    ``families`` that has an in-place variant of the same overload."""
    found: dict[object, Rule] = {}
    for table in families:
        for op, rule in table.items():
            name = getattr(op, "_schema", None)
            if name is None or name.name.endswith("_"):
                continue
            packet = getattr(aten, name.name.removeprefix("aten::") + "_", None)
            variant = getattr(packet, op._overloadname, None) if packet is not None else None
            if variant is not None and mutates_first_input(variant):
                found[variant] = in_place(rule)
    return found


RULES: dict[object, Rule] = {
    **_in_place_variants([pointwise.RULES, scatter.RULES]),
    aten.copy_.default: copy_rule,
    aten.fill_.Tensor: fill_rule,
    aten.fill_.Scalar: fill_rule,
    # the functional forms of writes (``autopar_passes.functionalize``)
    aten.fill.Tensor: fill_rule,
    aten.fill.Scalar: fill_rule,
    aten.slice_scatter.default: scatter_into_slice_rule,
    aten.select_scatter.default: scatter_into_select_rule,
}
