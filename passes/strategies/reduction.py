"""Sharding rules: reductions and softmax.

==========================================  =====================================================
op                                          what a mesh axis may shard
==========================================  =====================================================
sum(.default, .dim_IntList)                 any dim; a reduced dim gives a ``Partial`` output
mean(.default, .dim)                        as sum, each device scaling its local mean (``scale``)
amax, amin, max.dim, min.dim                kept dims only (a max of maxes needs a collective)
max.default, min.default                    nothing (every dim is reduced)
argmax, argmin                              kept dims only; ``dim=None`` (flat index): nothing
var, std (.correction, .dim, .default)      kept dims only
var_mean, std_mean (.correction)            kept dims only
logsumexp                                   kept dims only
prod(.default, .dim_int)                    kept dims only
any, all (.default, .dim, .dims)            kept dims only
softmax.int, _softmax, log_softmax.int,     every dim but the softmax dim
_log_softmax
==========================================  =====================================================

Per mesh axis a reduction may: replicate; shard a dim it keeps (the output keeps the shard at
the dim's new position: reduced dims before it vanish unless ``keepdim``); for the linear
reductions (sum, mean) shard a reduced dim, each device reducing its slice into a summand of
a ``Partial`` output, or take a ``Partial`` floating input to a ``Partial`` output.

A mean over a sharded dim: device ``k`` computes the mean of its ``n / p`` elements, which
is ``p`` times its share of the global mean, so it scales by ``1 / p``, ``p`` the product of
the sizes of the axes that shard reduced dims (``Local("scale", (1 / p,))``).

Also the small helpers the norm and loss families share: ``schema_args`` (an op's arguments
by name, defaults filled in), ``input_roles`` (the argument each tensor input came from) and
``role_choice`` (an ``AxisChoice`` spelled by argument name).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autopar_passes.annotation import TensorInfo
from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import (
    SAME,
    Local,
    LocalKind,
    OpCall,
    Rule,
    Strategy,
    dtype_of,
    normalize_dim,
)
from autopar_plans.placement import PARTIAL, REPLICATE, Placement, Shard

aten = torch.ops.aten

REDUCED = "reduced"  # tag of an axis choice that shards a reduced dim


# -- shared helpers (norm and loss use them too) ------------------------------------------


def schema_args(call: OpCall) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in (tensors as ``TensorInfo``).

    >>> schema_args(op_call(aten.sum.dim_IntList, (x, [1]), {}))  # doctest: +SKIP
    {'self': TensorInfo(...), 'dim': [1], 'keepdim': False, 'dtype': None}
    """
    bound: dict[str, Any] = {}
    for index, argument in enumerate(call.target._schema.arguments):
        if index < len(call.args):
            bound[argument.name] = call.args[index]
        elif argument.name in call.kwargs:
            bound[argument.name] = call.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            bound[argument.name] = None
    return bound


def input_roles(call: OpCall) -> tuple[str, ...]:
    """For each tensor input (``call.inputs`` order), the schema argument it came from."""
    names = [argument.name for argument in call.target._schema.arguments]
    roles: list[str] = []
    for index, value in enumerate(call.args):
        roles += [names[index]] * _count_tensors(value)
    for name, value in call.kwargs.items():
        roles += [name] * _count_tensors(value)
    if len(roles) != len(call.inputs):
        raise ValueError(f"{call.target}: {len(roles)} tensor arguments, {len(call.inputs)} inputs")
    return tuple(roles)


def role_choice(
    roles: Sequence[str],
    placements: Mapping[str, Placement],
    outputs: Sequence[Placement],
    *,
    splits_work: bool = True,
    tag: str = "",
) -> AxisChoice:
    """An ``AxisChoice`` given by argument name; inputs not named are replicated."""
    inputs = tuple(placements.get(role, REPLICATE) for role in roles)
    return AxisChoice(inputs, tuple(outputs), splits_work=splits_work, tag=tag)


def is_floating(info: TensorInfo) -> bool:
    return dtype_of(info.dtype).is_floating_point


def _count_tensors(value: Any) -> int:
    if isinstance(value, TensorInfo):
        return 1
    if isinstance(value, list | tuple):
        return sum(_count_tensors(v) for v in value)
    return 0


# -- reductions ----------------------------------------------------------------------------


def reduced_dims(dim: Any, ndim: int, *, empty_means_all: bool = True) -> frozenset[int]:
    """The dims a reduction removes: ``dim`` may be an int, a list, or None (all dims). An
    empty list means all dims for most reductions, none for ``any.dims``/``all.dims``."""
    if dim is None:
        return frozenset(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return frozenset(range(ndim)) if empty_means_all else frozenset()
    return frozenset(normalize_dim(d, max(ndim, 1)) for d in dims)


def reduction_choices(
    call: OpCall, reduced: frozenset[int], keepdim: bool, *, linear: bool
) -> list[AxisChoice]:
    """The choices of one mesh axis for a reduction of ``call.inputs[0]`` over ``reduced``.

    Kept dims shard through to the output. A ``linear`` reduction may also shard a reduced
    dim (output ``Partial``, tagged ``REDUCED``) or take a ``Partial`` floating input.
    """
    ndim = len(call.inputs[0].shape)
    n_out = len(call.outputs)
    choices = [replicate_choice(1, n_out)]
    for dim in range(ndim):
        if dim in reduced:
            if linear:
                choices.append(AxisChoice((Shard(dim),), (PARTIAL,) * n_out, tag=REDUCED))
            continue
        position = dim if keepdim else dim - sum(1 for r in reduced if r < dim)
        choices.append(AxisChoice((Shard(dim),), (Shard(position),) * n_out))
    if linear and is_floating(call.inputs[0]):
        choices.append(AxisChoice((PARTIAL,), (PARTIAL,) * n_out, splits_work=False))
    return choices


def mean_local(picks: tuple[AxisChoice, ...], mesh_shape: tuple[int, ...]) -> Local:
    """Scale each device's local mean by ``1 / p``, ``p`` the number of pieces the reduced
    dims are cut into."""
    pieces = 1
    for pick, size in zip(picks, mesh_shape, strict=True):
        if pick.tag == REDUCED:
            pieces *= size
    return SAME if pieces == 1 else Local("scale", (1.0 / pieces,))


def _reduce(
    call: OpCall,
    mesh_shape: tuple[int, ...],
    dim: Any,
    keepdim: bool,
    *,
    linear: bool = False,
    mean: bool = False,
    empty_means_all: bool = True,
) -> list[Strategy]:
    ndim = len(call.inputs[0].shape)
    reduced = reduced_dims(dim, ndim, empty_means_all=empty_means_all)
    choices = reduction_choices(call, reduced, keepdim, linear=linear or mean)
    return combine(choices, call, mesh_shape, local_of=mean_local if mean else None)


def sum_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """sum(.default, .dim_IntList): linear, so every dim may be sharded (a reduced one gives
    a ``Partial`` output) and a ``Partial`` input stays ``Partial``."""
    bound = schema_args(call)
    return _reduce(call, mesh_shape, bound.get("dim"), bool(bound.get("keepdim")), linear=True)


def mean_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """mean(.default, .dim): as sum; over a sharded dim each device scales its local mean by
    the fraction of the elements it holds."""
    bound = schema_args(call)
    return _reduce(call, mesh_shape, bound.get("dim"), bool(bound.get("keepdim")), mean=True)


def extremum_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """amax, amin, max.dim, min.dim, max.default, min.default: only kept dims may be
    sharded (the extremum of a slice is not a summand; values and indices alike)."""
    bound = schema_args(call)
    return _reduce(call, mesh_shape, bound.get("dim"), bool(bound.get("keepdim")))


def arg_extremum_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """argmax, argmin: only kept dims; with ``dim=None`` the index is into the flattened
    tensor, which every sharding changes, so nothing is sharded."""
    bound = schema_args(call)
    return _reduce(call, mesh_shape, bound.get("dim"), bool(bound.get("keepdim")))


def moment_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """var, std, var_mean, std_mean (all overloads): only kept dims (the variance of the
    whole is not a sum of the slices' variances)."""
    bound = schema_args(call)
    return _reduce(call, mesh_shape, bound.get("dim"), bool(bound.get("keepdim")))


def logsumexp_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """logsumexp: only kept dims (an empty dim list is not a reduction torch accepts)."""
    bound = schema_args(call)
    if isinstance(bound["dim"], list | tuple) and not bound["dim"]:
        return []
    return _reduce(call, mesh_shape, bound["dim"], bool(bound.get("keepdim")))


def prod_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """prod(.default, .dim_int): only kept dims (a product of slices is not a sum)."""
    bound = schema_args(call)
    return _reduce(call, mesh_shape, bound.get("dim"), bool(bound.get("keepdim")))


def any_all_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """any, all (.default, .dim, .dims): only kept dims. For ``.dims`` an empty list
    reduces nothing (every dim is kept); None reduces all."""
    bound = schema_args(call)
    return _reduce(
        call, mesh_shape, bound.get("dim"), bool(bound.get("keepdim")), empty_means_all=False
    )


def softmax_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """softmax.int, _softmax, log_softmax.int, _log_softmax: every dim but the softmax dim
    (its normaliser sums over the whole dim); never ``Partial`` (not linear)."""
    ndim = len(call.inputs[0].shape)
    dim = normalize_dim(int(schema_args(call)["dim"]), max(ndim, 1))
    choices = [replicate_choice(1, 1)]
    choices += [AxisChoice((Shard(d),), (Shard(d),)) for d in range(ndim) if d != dim]
    return combine(choices, call, mesh_shape)


def _table(groups: Sequence[tuple[Rule, Sequence[Callable[..., Any]]]]) -> dict[object, Rule]:
    return {op: rule for rule, ops in groups for op in ops}


RULES: dict[object, Rule] = _table(
    [
        (sum_rule, [aten.sum.default, aten.sum.dim_IntList]),
        (mean_rule, [aten.mean.default, aten.mean.dim]),
        (
            extremum_rule,
            [
                aten.amax.default,
                aten.amin.default,
                aten.max.dim,
                aten.min.dim,
                aten.max.default,
                aten.min.default,
            ],
        ),
        (arg_extremum_rule, [aten.argmax.default, aten.argmin.default]),
        (
            moment_rule,
            [
                aten.var.correction,
                aten.var.dim,
                aten.var.default,
                aten.std.correction,
                aten.std.dim,
                aten.std.default,
                aten.var_mean.correction,
                aten.std_mean.correction,
            ],
        ),
        (logsumexp_rule, [aten.logsumexp.default]),
        (prod_rule, [aten.prod.default, aten.prod.dim_int]),
        (
            any_all_rule,
            [
                aten.any.default,
                aten.any.dim,
                aten.any.dims,
                aten.all.default,
                aten.all.dim,
                aten.all.dims,
            ],
        ),
        (
            softmax_rule,
            [
                aten.softmax.int,
                aten._softmax.default,
                aten.log_softmax.int,
                aten._log_softmax.default,
            ],
        ),
    ]
)
LOCALS: dict[str, LocalKind] = {}
