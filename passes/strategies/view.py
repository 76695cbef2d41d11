"""Sharding rules: view family (ops that move, cut or join elements without arithmetic).

Every rule here maps each input dim that may stay sharded to the output dim it becomes; a mesh
axis then either replicates, shards one such dim on the input and its image on the output, or
(for floating tensors) passes ``Partial`` through: all these ops are linear, so the sum of the
pieces' results is the result of the sum.

======================================  ===================================================
op                                      dims that may stay sharded
======================================  ===================================================
view, reshape, _unsafe_view             first dim of each group of dims of equal product
unsqueeze, squeeze, flatten, unflatten  as view (squeeze runs ``squeeze.dims`` locally)
t, transpose, permute, numpy_T          every dim, moved
repeat_interleave (.self_int)           every dim (the repeated one's blocks hold their copies)
expand                                  every dim that is not broadcast
slice, narrow                           every dim but the cut one (slice: all, if it's whole)
select                                  every dim but the selected one, shifted
split, split_with_sizes, chunk, unbind  every dim but the split one, in every output
cat, stack                              every dim but the joined one, the same in every input
index                                   unindexed dims of self; broadcast dims of the indices
index_select, gather                    every dim but ``dim`` (matching in self and index);
                                        the index's ``dim`` with self replicated
repeat, flip, roll                      every dim that is not repeated, flipped or rolled
======================================  ===================================================

>>> call = op_call(aten.view.default, (torch.zeros(4, 6, 8), [4, 6, 2, 4]), {})  # doctest: +SKIP
>>> [s.name for s in view_rule(call, (2,))]  # doctest: +SKIP
['R->R', 'S(0)->S(0)', 'S(1)->S(1)', 'S(2)->S(2)', 'P->P']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autopar_passes.annotation import TensorInfo
from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import (
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

DimMap = dict[int, int]
"""Input dim -> the output dim its shard becomes (dims left out must stay unsharded)."""


# ---------------------------------------------------------------------------- helpers


def _arg(call: OpCall, position: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of the call, given positionally or by keyword."""
    if len(call.args) > position:
        return call.args[position]
    return call.kwargs.get(name, default)


def _floating(info: TensorInfo) -> bool:
    return dtype_of(info.dtype).is_floating_point or dtype_of(info.dtype).is_complex


def _ndim(call: OpCall) -> int:
    return len(call.inputs[0].shape)


def _choices(mapping: DimMap, n_inputs: int, n_outputs: int, partial: bool) -> list[AxisChoice]:
    """Replicate; shard input dim ``d`` of every input and dim ``mapping[d]`` of every
    output; and, when ``partial``, Partial everywhere (the op is linear)."""
    choices = [replicate_choice(n_inputs, n_outputs)]
    for dim, out_dim in mapping.items():
        choices.append(
            AxisChoice((Shard(dim),) * n_inputs, (Shard(out_dim),) * n_outputs, tag=f"shard:{dim}")
        )
    if partial:
        choices.append(
            AxisChoice(
                (PARTIAL,) * n_inputs, (PARTIAL,) * n_outputs, splits_work=False, tag="partial"
            )
        )
    return choices


def _mapped(
    call: OpCall, mesh_shape: tuple[int, ...], mapping: DimMap, local: Local | None = None
) -> list[Strategy]:
    """Strategies of an op whose inputs all share one layout, mapped to every output by
    ``mapping``."""
    partial = all(_floating(info) for info in call.inputs)
    choices = _choices(mapping, len(call.inputs), len(call.outputs), partial)
    local_of = None if local is None else (lambda picks, mesh: local)
    return combine(choices, call, mesh_shape, local_of)


def _keep_all_but(ndim: int, cut: Sequence[int]) -> DimMap:
    """Every dim maps to itself except the ``cut`` ones."""
    return {d: d for d in range(ndim) if d not in cut}


def _drop(ndim: int, removed: int) -> DimMap:
    """Dim ``removed`` disappears; the dims after it shift down by one."""
    return {d: d - (d > removed) for d in range(ndim) if d != removed}


def view_dim_map(src: Sequence[int], dst: Sequence[int]) -> DimMap:
    """For a reshape ``src -> dst``: the first dim of each group maps to the first dim of the
    matching group, where groups are the smallest runs of non-1 dims with equal products.

    A device's shard of the first dim of a group is a contiguous block of the group's
    flattened elements, which is a shard of the first dim of the output group as long as
    that dim divides too (``combine`` checks it). An inner dim of a group is strided in the
    flattened order, so it never maps. Size-1 dims are left out: they are never sharded.

    >>> view_dim_map((2, 3, 8), (6, 2, 4))
    {0: 0, 2: 1}
    """
    if math.prod(src) != math.prod(dst) or 0 in src:
        return {}
    ins = [d for d, size in enumerate(src) if size != 1]
    outs = [d for d, size in enumerate(dst) if size != 1]
    mapping: DimMap = {}
    i = j = 0
    while i < len(ins) and j < len(outs):
        mapping[ins[i]] = outs[j]
        in_size, out_size = src[ins[i]], dst[outs[j]]
        i, j = i + 1, j + 1
        while in_size != out_size:
            if in_size < out_size:
                in_size *= src[ins[i]]
                i += 1
            else:
                out_size *= dst[outs[j]]
                j += 1
    return mapping


# ---------------------------------------------------------------------------- reshapes


def view_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """view/reshape/_unsafe_view/flatten/unflatten/unsqueeze: the first dim of each group of
    dims with equal products may stay sharded (``view_dim_map``); -1 in the size argument is
    already resolved in the output shape, and ``localize`` rewrites the size to the local
    output shape."""
    return _mapped(call, mesh_shape, view_dim_map(call.inputs[0].shape, call.out.shape))


def squeeze_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """squeeze (.default, .dim, .dims): as a view. A dim of size n > 1 sharded n ways has
    local size 1, and the local squeeze would drop it; so when the call names dims that are
    not of size 1 (or names none), the device runs ``squeeze.dims`` on exactly the dims that
    are of size 1 globally (local kind ``squeeze_dims``)."""
    shape = call.inputs[0].shape
    requested = _arg(call, 1, "dim", None)
    if call.target == aten.squeeze.default or requested is None:
        named = list(range(len(shape)))
    elif isinstance(requested, int):
        named = [normalize_dim(requested, len(shape))]
    else:
        named = [normalize_dim(d, len(shape)) for d in requested]
    ones = tuple(d for d in named if shape[d] == 1)
    local = None if len(ones) == len(named) else Local("squeeze_dims", ones)
    return _mapped(call, mesh_shape, view_dim_map(shape, call.out.shape), local)


def expand_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """expand: a dim that keeps its size keeps its shard (moved right by the new leading
    dims). A broadcast dim (size 1 to n, or a new leading dim) is Replicate on both sides:
    the input holds one copy of it."""
    src, dst = call.inputs[0].shape, call.out.shape
    lead = len(dst) - len(src)
    mapping = {d: d + lead for d, size in enumerate(src) if size != 1 and dst[d + lead] == size}
    return _mapped(call, mesh_shape, mapping)


# ---------------------------------------------------------------------------- dim moves


def t_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """t: a 2-d transpose (a no-op below 2 dims); every dim keeps its shard, swapped."""
    ndim = _ndim(call)
    mapping = {0: 1, 1: 0} if ndim == 2 else _keep_all_but(ndim, ())
    return _mapped(call, mesh_shape, mapping)


def transpose_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """transpose.int(x, a, b): every dim keeps its shard; a and b swap places."""
    ndim = _ndim(call)
    a, b = (normalize_dim(d, ndim) for d in (call.args[1], call.args[2]))
    mapping = _keep_all_but(ndim, ())
    mapping[a], mapping[b] = b, a
    return _mapped(call, mesh_shape, mapping)


def permute_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """permute(x, dims): output dim j is input dim dims[j]; every dim keeps its shard."""
    ndim = _ndim(call)
    order = [normalize_dim(d, ndim) for d in _arg(call, 1, "dims")]
    return _mapped(call, mesh_shape, {d: j for j, d in enumerate(order)})


def repeat_interleave_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """repeat_interleave.self_int(x, repeats, dim): each element of ``dim`` repeated in
    place, so a block of ``dim`` gives the block of the output that holds its copies: every
    dim keeps its shard (``dim`` too, unless the call fixes the global ``output_size``).
    Without ``dim`` the input is flattened first: replicated."""
    dim = _arg(call, 2, "dim")
    if dim is None:
        return _mapped(call, mesh_shape, {})
    ndim = _ndim(call)
    fixed = _arg(call, 3, "output_size") is not None
    return _mapped(call, mesh_shape, _keep_all_but(ndim, [normalize_dim(dim, ndim)] * fixed))


def numpy_t_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """numpy_T (``x.T``): every dim reversed, each keeping its shard."""
    ndim = _ndim(call)
    return _mapped(call, mesh_shape, {d: ndim - 1 - d for d in range(ndim)})


# ---------------------------------------------------------------------------- cuts


def slice_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """slice.Tensor(x, dim, start, end, step): the sliced dim is cut at global indices, so it
    must be unsharded; the others keep their shards. A slice over the whole dim with step 1
    is an identity (the clamped local slice keeps the local piece), so every dim may stay."""
    ndim = _ndim(call)
    dim = normalize_dim(_arg(call, 1, "dim", 0), ndim)
    step = _arg(call, 4, "step", 1)
    whole = step == 1 and call.out.shape[dim] == call.inputs[0].shape[dim]
    return _mapped(call, mesh_shape, _keep_all_but(ndim, () if whole else (dim,)))


def narrow_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """narrow(x, dim, start, length): the narrowed dim takes global indices, so it must be
    unsharded (even when whole: a local narrow of the global length would overrun)."""
    ndim = _ndim(call)
    return _mapped(call, mesh_shape, _keep_all_but(ndim, (normalize_dim(call.args[1], ndim),)))


def select_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """select.int(x, dim, index): the selected dim takes a global index, so it must be
    unsharded; it disappears and the dims after it shift down."""
    ndim = _ndim(call)
    return _mapped(call, mesh_shape, _drop(ndim, normalize_dim(call.args[1], ndim)))


def split_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """split.Tensor, split_with_sizes, chunk, tensor_split: cut along ``dim`` (argument 2) at global
    offsets, so it must be unsharded; every output keeps the shards of the other dims."""
    ndim = _ndim(call)
    dim = normalize_dim(_arg(call, 2, "dim", 0), ndim)
    return _mapped(call, mesh_shape, _keep_all_but(ndim, (dim,)))


def unbind_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """unbind.int(x, dim): one output per index along ``dim``, which must be unsharded; the
    other dims keep their shards, shifted down past ``dim``, in every output."""
    ndim = _ndim(call)
    return _mapped(call, mesh_shape, _drop(ndim, normalize_dim(_arg(call, 1, "dim", 0), ndim)))


# ---------------------------------------------------------------------------- joins


def cat_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """cat(tensors, dim): the joined dim must be unsharded (its pieces would interleave);
    every input has the same layout, which the output keeps. Partial when all inputs are
    Partial. Legacy calls with 1-d empty inputs of another rank are left replicated."""
    ndim = len(call.out.shape)
    if any(len(info.shape) != ndim for info in call.inputs):
        return []
    dim = normalize_dim(_arg(call, 1, "dim", 0), ndim)
    return _mapped(call, mesh_shape, _keep_all_but(ndim, (dim,)))


def stack_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """stack(tensors, dim): a new dim at ``dim``; every input has the same layout and each
    of its dims keeps its shard, shifted up past the new one."""
    ndim = _ndim(call)
    dim = normalize_dim(_arg(call, 1, "dim", 0), ndim + 1)
    return _mapped(call, mesh_shape, {d: d + (d >= dim) for d in range(ndim)})


# ---------------------------------------------------------------------------- indexing


def index_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """index.Tensor(self, indices): indexed dims of self must be unsharded (indices are
    global). Torch puts the broadcast index dims where the indexed dims were when these are
    adjacent, else in front; every unindexed dim of self keeps its shard at its new place
    (indices replicated). Alternatively self replicated and every index tensor sharded on
    the same broadcast dim (replicated where it broadcasts) shards that output dim. Boolean
    masks are left replicated."""
    self_info = call.inputs[0]
    entries = list(call.args[1])
    indices = call.inputs[1:]
    if any(info.dtype in ("bool", "uint8") for info in indices):
        return []
    ndim = len(self_info.shape)
    indexed = [k for k, entry in enumerate(entries) if entry is not None]
    if not indexed:
        return []
    broadcast = tuple(torch.broadcast_shapes(*(info.shape for info in indices)))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    offset = indexed[0] if adjacent else 0
    kept = [d for d in range(ndim) if d not in indexed]
    if adjacent:
        mapping = {d: d if d < offset else d - len(indexed) + len(broadcast) for d in kept}
    else:
        mapping = {d: len(broadcast) + rank for rank, d in enumerate(kept)}
    rest = (REPLICATE,) * len(indices)
    choices = [replicate_choice(len(call.inputs), 1)]
    for dim, out_dim in mapping.items():
        choices.append(AxisChoice((Shard(dim), *rest), (Shard(out_dim),), tag=f"self:{dim}"))
    for b, size in enumerate(broadcast):
        if size == 1:
            continue
        placements: list[Placement] = [REPLICATE]
        for info in indices:
            k = b - (len(broadcast) - len(info.shape))
            placements.append(Shard(k) if k >= 0 and info.shape[k] == size else REPLICATE)
        choices.append(AxisChoice(tuple(placements), (Shard(offset + b),), tag=f"index:{b}"))
    if _floating(self_info):
        choices.append(AxisChoice((PARTIAL, *rest), (PARTIAL,), splits_work=False, tag="partial"))
    return combine(choices, call, mesh_shape)


def index_select_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """index_select(self, dim, index): ``dim`` of self must be unsharded (the index is
    global); other dims keep their shards with the index replicated. Or self replicated and
    a 1-d index sharded, which shards the output's ``dim``."""
    self_info, index = call.inputs
    ndim = len(self_info.shape)
    dim = normalize_dim(call.args[1], max(ndim, 1))
    choices = [replicate_choice(2, 1)]
    for d in range(ndim):
        if d != dim:
            choices.append(AxisChoice((Shard(d), REPLICATE), (Shard(d),), tag=f"self:{d}"))
    if len(index.shape) == 1 and ndim > 0:
        choices.append(AxisChoice((REPLICATE, Shard(0)), (Shard(dim),), tag="index"))
    if _floating(self_info):
        choices.append(
            AxisChoice((PARTIAL, REPLICATE), (PARTIAL,), splits_work=False, tag="partial")
        )
    return combine(choices, call, mesh_shape)


def gather_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """gather(self, dim, index): out[p] = self[p with p[dim] = index[p]]. A dim other than
    ``dim`` may be sharded in self and index alike when both have the same size there (so
    their shards line up). The index may be sharded on ``dim`` with self replicated (each
    output position depends only on its own index). Partial self with replicated index."""
    self_info, index = call.inputs
    ndim = len(self_info.shape)
    dim = normalize_dim(call.args[1], max(ndim, 1))
    choices = [replicate_choice(2, 1)]
    for d in range(ndim):
        if d != dim and self_info.shape[d] == index.shape[d]:
            choices.append(AxisChoice((Shard(d), Shard(d)), (Shard(d),), tag=f"both:{d}"))
    if ndim > 0:
        choices.append(AxisChoice((REPLICATE, Shard(dim)), (Shard(dim),), tag="index"))
    if _floating(self_info):
        choices.append(
            AxisChoice((PARTIAL, REPLICATE), (PARTIAL,), splits_work=False, tag="partial")
        )
    return combine(choices, call, mesh_shape)


# ---------------------------------------------------------------------------- copies


def repeat_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """repeat(x, repeats): a dim repeated once keeps its shard (moved right by new leading
    dims); a dim repeated more must be unsharded (the copies would interleave the pieces)."""
    repeats = list(call.args[1])
    ndim = _ndim(call)
    lead = len(repeats) - ndim
    return _mapped(call, mesh_shape, {d: d + lead for d in range(ndim) if repeats[d + lead] == 1})


def flip_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """flip(x, dims): a flipped dim must be unsharded (its pieces would swap devices); the
    others keep their shards."""
    ndim = _ndim(call)
    flipped = [normalize_dim(d, ndim) for d in _arg(call, 1, "dims")]
    return _mapped(call, mesh_shape, _keep_all_but(ndim, flipped))


def roll_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """roll(x, shifts, dims): a rolled dim must be unsharded (elements cross devices); the
    others keep their shards. Without dims the flattened tensor rolls: nothing may stay
    sharded."""
    ndim = _ndim(call)
    dims = list(_arg(call, 2, "dims", []) or [])
    rolled = [normalize_dim(d, ndim) for d in dims] if dims else list(range(ndim))
    return _mapped(call, mesh_shape, _keep_all_but(ndim, rolled))


# ---------------------------------------------------------------------------- local kinds


def _local_squeeze(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``squeeze_dims``: squeeze exactly the dims of global size 1 (``Local.params``)."""
    return aten.squeeze.dims, (args[0], list(strategy.local.params)), {}


RULES: dict[object, Rule] = {
    aten.view.default: view_rule,
    aten.reshape.default: view_rule,
    aten._unsafe_view.default: view_rule,
    aten.unsqueeze.default: view_rule,
    aten.flatten.using_ints: view_rule,
    aten.unflatten.int: view_rule,
    aten.squeeze.default: squeeze_rule,
    aten.squeeze.dim: squeeze_rule,
    aten.squeeze.dims: squeeze_rule,
    aten.expand.default: expand_rule,
    aten.t.default: t_rule,
    aten.transpose.int: transpose_rule,
    aten.permute.default: permute_rule,
    aten.numpy_T.default: numpy_t_rule,
    aten.repeat_interleave.self_int: repeat_interleave_rule,
    aten.slice.Tensor: slice_rule,
    aten.narrow.default: narrow_rule,
    aten.select.int: select_rule,
    aten.split.Tensor: split_rule,
    aten.split_with_sizes.default: split_rule,
    aten.tensor_split.indices: split_rule,
    aten.tensor_split.sections: split_rule,
    aten.chunk.default: split_rule,
    aten.unbind.int: unbind_rule,
    aten.cat.default: cat_rule,
    aten.stack.default: stack_rule,
    aten.index.Tensor: index_rule,
    aten.index_select.default: index_select_rule,
    aten.gather.default: gather_rule,
    aten.repeat.default: repeat_rule,
    aten.flip.default: flip_rule,
    aten.roll.default: roll_rule,
}
LOCALS: dict[str, LocalKind] = {"squeeze_dims": _local_squeeze}
