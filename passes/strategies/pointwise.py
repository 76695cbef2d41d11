"""Sharding rules: the pointwise family (elementwise ops, casts, scans, creation, dropout).

Per mesh axis an elementwise op may: replicate everything; shard an output dim ``d``, every
input that has ``d`` (torch broadcasting: aligned at the right, size > 1) sharded on its
matching dim and every input that broadcasts along ``d`` replicated; or hold ``Partial``
sums where the op is linear in the partial inputs (the rest replicated).

===========================================  ================================================
ops                                          rule
===========================================  ================================================
exp, log, sqrt, gelu, silu, abs, clamp, ...  ``nonlinear_rule``: shard any dim, never partial
eq/ne/lt/le/gt/ge, logical_*, __and__, ...   ``nonlinear_rule``: bool output, never partial
add, sub (.Tensor, .Scalar), rsub            ``additive_rule``: all tensors partial -> partial
                                             if no non-zero constant is added
mul (.Tensor, .Scalar)                       ``mul_rule``: one operand partial -> partial
div (.Tensor, .Scalar)                       ``div_rule``: numerator partial -> partial
neg, clone, to, _to_copy, detach, alias, ..  ``linear_unary_rule``: partial -> partial (floats)
where, masked_fill, lerp                     linear in the values, never in the condition
type_as                                      ``type_as_rule``: the second input gives a dtype
cumsum, diff                                 ``cumsum_rule``/``diff_rule``: dim kept whole
pad, constant_pad_nd                         ``pad_rule``: padded dims kept whole
topk, sort                                   ``topk_rule``/``sort_rule``: dim kept whole
arange, zeros, ones, full, empty, rand, ...  ``creation_rule``: replicated output only
new_zeros, zeros_like, ...                   ``like_rule``: output follows the input's layout
dropout, native_dropout                      ``dropout_rule``: local kind ``"dropout"``
===========================================  ================================================

``aten._assert_tensor_metadata`` has no tensor output and so no rule.

Dropout follows Megatron's random-number policy: devices holding the same piece of the
activation (a replicated or partial axis) draw the same mask, devices holding different
shards independent masks. Every rank is seeded alike and runs the same program, so one base
seed drawn from torch's global generator is the same everywhere; each device adds its linear
index over the axes that shard the output and draws its mask from a private generator
seeded with that (``dropout_on_device``).

>>> from autopar_passes.strategies.validate import op_call
>>> x = torch.ones(4, 8, dtype=torch.float64)
>>> [s.name for s in additive_rule(op_call(aten.add.Tensor, (x, x), {}), (2,))]
['R,R->R', 'S(0),S(0)->S(0)', 'S(1),S(1)->S(1)', 'P,P->P']
"""

from __future__ import annotations

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

DROPOUT = Local("dropout")


# --- helpers ---------------------------------------------------------------------------


def _arg(call: OpCall, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (position ``index`` when passed positionally) of the call."""
    if index < len(call.args):
        return call.args[index]
    return call.kwargs.get(name, default)


def _is_float(info: TensorInfo) -> bool:
    dtype = dtype_of(info.dtype)
    return dtype.is_floating_point or dtype.is_complex


def _aligned(shape: tuple[int, ...], out: tuple[int, ...], dim: int) -> Placement:
    """Placement of an input of ``shape`` when the output is sharded on ``dim``: sharded on
    the matching dim (aligned at the right), or replicated where the input broadcasts."""
    own = dim - (len(out) - len(shape))
    if own >= 0 and shape[own] == out[dim]:
        return Shard(own)
    return REPLICATE


def _shard_choices(call: OpCall, keep_whole: Sequence[int] = ()) -> list[AxisChoice]:
    """One choice per output dim of size > 1 not in ``keep_whole``: shard it everywhere it
    appears (every output has the first output's shape)."""
    out = call.out.shape
    choices = []
    for dim, size in enumerate(out):
        if size == 1 or dim in keep_whole:
            continue
        inputs = tuple(_aligned(info.shape, out, dim) for info in call.inputs)
        outputs = (Shard(dim),) * len(call.outputs)
        choices.append(AxisChoice(inputs, outputs, tag=f"shard:{dim}"))
    return choices


def _partial_choice(call: OpCall, partial: Sequence[int]) -> list[AxisChoice]:
    """The axis holds partial sums of the inputs at ``partial`` (the others replicated) and of
    every output. Only floating tensors hold partial sums (a sum of casts is not a cast)."""
    if not partial:
        return []
    tensors = [call.inputs[i] for i in partial] + list(call.outputs)
    if not all(_is_float(t) for t in tensors):
        return []
    inputs = tuple(PARTIAL if i in partial else REPLICATE for i in range(len(call.inputs)))
    return [AxisChoice(inputs, (PARTIAL,) * len(call.outputs), splits_work=False, tag="partial")]


def _elementwise(
    call: OpCall,
    mesh_shape: tuple[int, ...],
    partial: Sequence[Sequence[int]] = (),
    keep_whole: Sequence[int] = (),
) -> list[Strategy]:
    """Replicate, shard any output dim not in ``keep_whole``, or hold partial sums of the
    inputs listed in one of ``partial``."""
    choices = [replicate_choice(len(call.inputs), len(call.outputs))]
    choices += _shard_choices(call, keep_whole)
    for inputs in partial:
        choices += _partial_choice(call, inputs)
    return combine(choices, call, mesh_shape)


def _all_inputs(call: OpCall) -> tuple[int, ...]:
    return tuple(range(len(call.inputs)))


def _is_zero(value: Any) -> bool:
    return value is None or value == 0


# --- elementwise ops -------------------------------------------------------------------


def nonlinear_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """Any elementwise op: every output dim may be sharded (inputs that broadcast along it
    replicated), since each element depends only on the elements at the same index. Never
    partial: the op is not linear (or its output is bool or integer)."""
    return _elementwise(call, mesh_shape)


def linear_unary_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """neg and the identity-like copies and casts (to, _to_copy, clone, contiguous, alias,
    detach, lift_fresh_copy): any dim may be sharded; a partial float input gives a partial
    float output, since the op is linear (a float-to-float cast up to rounding)."""
    return _elementwise(call, mesh_shape, partial=[(0,)])


def additive_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """add/sub (``self + alpha * other``): any non-broadcast dim may be sharded. Partial when
    every tensor operand is partial and no constant is added: a non-zero scalar ``other``
    would be added once per device (``alpha`` only scales, so it is fine)."""
    other = _arg(call, 1, "other")
    constant = 0 if isinstance(other, TensorInfo) else other * _arg(call, 2, "alpha", 1)
    partial = [_all_inputs(call)] if _is_zero(constant) else []
    return _elementwise(call, mesh_shape, partial=partial)


def rsub_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """rsub (``other - alpha * self``): as add; partial unless ``other`` is a non-zero
    scalar."""
    other = _arg(call, 1, "other")
    constant = 0 if isinstance(other, TensorInfo) else other
    partial = [_all_inputs(call)] if _is_zero(constant) else []
    return _elementwise(call, mesh_shape, partial=partial)


def mul_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """mul: any non-broadcast dim may be sharded. A product is linear in each factor, so
    exactly one tensor operand may be partial (the others replicated) for a partial output."""
    return _elementwise(call, mesh_shape, partial=[(i,) for i in _all_inputs(call)])


def div_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """div: any non-broadcast dim may be sharded. Linear in the numerator only: a partial
    numerator over a replicated denominator gives a partial quotient."""
    return _elementwise(call, mesh_shape, partial=[(0,)])


def where_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """where(condition, self, other): any non-broadcast dim may be sharded. Linear in the two
    values together (condition replicated), when a scalar value is zero."""
    scalars = [
        v for v in (_arg(call, 1, "self"), _arg(call, 2, "other")) if not isinstance(v, TensorInfo)
    ]
    values = tuple(range(1, len(call.inputs)))
    partial = [values] if values and all(_is_zero(v) for v in scalars) else []
    return _elementwise(call, mesh_shape, partial=partial)


def triangle_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """triu/tril: which elements survive depends on the row and column index, so the last
    two dims stay whole; leading (batch) dims may be sharded. Linear: partial in, partial
    out."""
    ndim = len(call.out.shape)
    return _elementwise(call, mesh_shape, partial=[(0,)], keep_whole=(ndim - 2, ndim - 1))


def masked_fill_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """masked_fill(self, mask, value): any non-broadcast dim may be sharded. Linear in self
    and a tensor value together (mask replicated); a scalar value must be zero."""
    value = _arg(call, 2, "value")
    if isinstance(value, TensorInfo):
        return _elementwise(call, mesh_shape, partial=[(0, 2)])
    return _elementwise(call, mesh_shape, partial=[(0,)] if _is_zero(value) else [])


def lerp_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """lerp(self, end, weight) = self + weight * (end - self): any non-broadcast dim may be
    sharded; linear in self and end together, with a tensor weight replicated."""
    return _elementwise(call, mesh_shape, partial=[(0, 1)])


def type_as_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """type_as(self, other): a cast of self to other's dtype, so self's dims may be sharded
    and a float self may be partial. Other's values are never read: it may stay replicated,
    or have self's whole layout when it has self's shape (the usual ``y.type_as(x)`` on a
    tensor of the same shape), so that it seldom needs moving."""
    same_shape = call.inputs[0].shape == call.inputs[1].shape
    choices = [replicate_choice(2, 1)]
    for own in _shard_choices(call) + _partial_choice(call, (0,)):
        x = own.inputs[0]
        for other in [REPLICATE, x] if same_shape else [REPLICATE]:
            choices.append(AxisChoice((x, other), own.outputs, own.splits_work, own.tag))

    def valid(strategy: Strategy) -> bool:
        x, other = strategy.inputs
        return other.is_replicated or other == x

    return combine(choices, call, mesh_shape, valid=valid)


# --- ops along a dim -------------------------------------------------------------------


def cumsum_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """cumsum(self, dim): the scan dim stays whole (each element needs all before it); other
    dims may be sharded. A cumulative sum is linear: partial -> partial for floats."""
    dim = normalize_dim(_arg(call, 1, "dim"), len(call.out.shape))
    return _elementwise(call, mesh_shape, partial=[(0,)], keep_whole=[dim])


def diff_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """diff(self, n, dim, prepend, append): the dim stays whole (neighbours are subtracted
    across it); other dims may be sharded, prepend/append like self. Linear in all tensors
    together."""
    dim = normalize_dim(_arg(call, 2, "dim", -1), len(call.out.shape))
    return _elementwise(call, mesh_shape, partial=[_all_inputs(call)], keep_whole=[dim])


def _padded_dims(pad: Sequence[int], ndim: int) -> list[int]:
    """Dims a pad list changes: pairs (before, after) from the last dim backwards."""
    return [ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]]


def pad_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """pad(self, pad, mode, value): padded dims stay whole (the pad sits at the ends of the
    whole tensor); other dims may be sharded. Partial unless a non-zero constant is padded
    in (it would be counted once per device); reflect/replicate/circular copy elements, so
    they are linear."""
    mode = _arg(call, 2, "mode", "constant")
    linear = mode != "constant" or _is_zero(_arg(call, 3, "value"))
    padded = _padded_dims(_arg(call, 1, "pad"), len(call.out.shape))
    return _elementwise(call, mesh_shape, partial=[(0,)] if linear else [], keep_whole=padded)


def constant_pad_nd_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """constant_pad_nd(self, pad, value): as pad in constant mode."""
    linear = _is_zero(_arg(call, 2, "value", 0))
    padded = _padded_dims(_arg(call, 1, "pad"), len(call.out.shape))
    return _elementwise(call, mesh_shape, partial=[(0,)] if linear else [], keep_whole=padded)


def topk_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """topk(self, k, dim) -> (values, indices): the dim stays whole (the top k of each slice
    need all of it); other dims may be sharded, both outputs alike. Never partial."""
    dim = normalize_dim(_arg(call, 2, "dim", -1), len(call.out.shape))
    return _elementwise(call, mesh_shape, keep_whole=[dim])


def sort_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """sort(self, dim) -> (values, indices): as topk."""
    dim = normalize_dim(_arg(call, 1, "dim", -1), len(call.out.shape))
    return _elementwise(call, mesh_shape, keep_whole=[dim])


# --- creation ----------------------------------------------------------------------------


def creation_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """arange, zeros, ones, full, empty, scalar_tensor, rand, randn: no tensor input, the
    output replicated only (a consumer that wants it sharded slices it for free). Random
    ops agree across devices because every rank is seeded alike and runs the same program."""
    return combine([replicate_choice(len(call.inputs), len(call.outputs))], call, mesh_shape)


def like_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """new_zeros/ones/full/empty and zeros/ones/full/empty_like: only the input's dtype and
    device are read, so the input may arrive in any layout and the output follows it: an
    axis sharding input dim e shards output dim e when the output has that dim at the same
    size (always for ``*_like``, whose shape is the input's; ``new_*`` get their size made
    local by localize), else the output is replicated; a partial input gives a replicated
    output (never a partial one: ones would be summed)."""
    x, out = call.inputs[0].shape, call.out.shape
    choices = [replicate_choice(1, 1)]
    for dim, size in enumerate(x):
        if size == 1:
            continue
        follows = dim < len(out) and out[dim] == size
        output = Shard(dim) if follows else REPLICATE
        choices.append(AxisChoice((Shard(dim),), (output,), splits_work=follows))
    if _is_float(call.inputs[0]):
        choices.append(AxisChoice((PARTIAL,), (REPLICATE,), splits_work=False))
    return combine(choices, call, mesh_shape)


# --- dropout -----------------------------------------------------------------------------


def dropout_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """dropout / native_dropout: any dim may be sharded; each device draws the mask of its own
    piece (local kind ``"dropout"``, see ``dropout_on_device``). A partial input is allowed:
    for a fixed mask dropout is linear, and the devices of a partial axis draw the same mask
    (the axis is seeded like a replicated one), so the summands are masked alike. The mask
    output of native_dropout is bool: replicated on partial axes."""
    choices = [replicate_choice(1, len(call.outputs)), *_shard_choices(call)]
    if _is_float(call.inputs[0]):
        outputs = (PARTIAL,) + (REPLICATE,) * (len(call.outputs) - 1)
        choices.append(AxisChoice((PARTIAL,), outputs, splits_work=False, tag="partial"))
    return combine(choices, call, mesh_shape, local_of=lambda picks, mesh: DROPOUT)


def _draw_seed() -> int:
    """A seed from torch's global (CPU) generator: the same on every rank, which all start
    from the same seed and run the same program."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def _keep_mask(x: torch.Tensor, keep: float, seed: int) -> torch.Tensor:
    """A 0/1 mask like ``x`` with each element 1 with probability ``keep``."""
    mask = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.device.type == "meta":
        return mask
    generator = torch.Generator(device=x.device).manual_seed(seed)
    return mask.bernoulli_(keep, generator=generator)


def dropout_on_device(
    x: torch.Tensor, p: float, train: bool | None, offset: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Megatron's dropout random-number policy, on one device.

    One base seed is drawn from the global generator on every call, whatever ``p`` and
    ``train`` (so every device consumes the same random numbers and replicated random ops
    downstream stay in step); the mask comes from a private generator seeded with
    ``base + offset``. ``offset`` is the device's linear index over the mesh axes that shard
    the output: devices holding the same piece (replicated or partial axes) draw the same
    mask, devices holding different shards independent ones. Returns the output and the
    kept mask (``None`` when the op is the identity).
    """
    seed = _draw_seed() + offset
    if train is False or p == 0:
        return x, None
    mask = _keep_mask(x, 1.0 - p, seed)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


def dropout_local(x: torch.Tensor, p: float, train: bool, offset: int) -> torch.Tensor:
    """``aten.dropout`` on one device (see ``dropout_on_device``)."""
    return dropout_on_device(x, p, train, offset)[0]


def native_dropout_local(
    x: torch.Tensor, p: float, train: bool | None, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` on one device: the output and the bool keep-mask."""
    out, mask = dropout_on_device(x, p, train, offset)
    if mask is None:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    return out, mask.bool()


def _dropout_offset(
    strategy: Strategy, coords: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> int:
    """The device's linear index over the axes that shard the output (mesh order, the
    earlier axis outer); replicated and partial axes do not change it."""
    offset = 0
    for axis, placement in enumerate(strategy.outputs[0]):
        if isinstance(placement, Shard):
            offset = offset * mesh_shape[axis] + coords[axis]
    return offset


def localize_dropout(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The ``"dropout"`` local kind: the device's offset baked in as a constant."""
    values = dict(zip(("input", "p", "train"), args, strict=False)) | kwargs
    offset = _dropout_offset(strategy, coords, mesh_shape)
    train = values.get("train", True if call.target == aten.dropout.default else None)
    local = dropout_local if call.target == aten.dropout.default else native_dropout_local
    return local, (values["input"], float(values["p"]), train, offset), {}


# --- the table ---------------------------------------------------------------------------

NONLINEAR = (
    aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.exp.default,
    aten.log.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
    aten.gelu.default, aten.relu.default, aten.sin.default, aten.cos.default, aten.abs.default,
    aten.erf.default, aten.square.default, aten.log1p.default, aten.expm1.default,
    aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
    aten.sign.default, aten.tan.default, aten.atan.default, aten.atan2.default,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_min.Tensor,
    aten.clamp_max.default, aten.clamp_max.Tensor, aten.minimum.default, aten.maximum.default,
    aten.min.other, aten.max.other,
    aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default, aten.softplus.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.mish.default,
    aten.div.Tensor_mode, aten.floor_divide.default, aten.floor_divide.Scalar,
    aten.remainder.Tensor, aten.remainder.Scalar, aten.fmod.Tensor, aten.fmod.Scalar,
    aten.where.Scalar,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
    aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
    aten.ge.Tensor, aten.ge.Scalar, aten.isnan.default, aten.isinf.default,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.bitwise_not.default, aten.logical_not.default, aten.logical_and.default,
    aten.logical_or.default, aten.logical_xor.default,
)  # fmt: skip

LINEAR_UNARY = (
    aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default,
)  # fmt: skip

CREATION = (
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
    aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.rand.default, aten.randn.default, aten.eye.default, aten.eye.m,
    # random draws into a tensor's shape (a write made functional: ``x.uniform_()``), whole
    # on every device as ``rand`` is, so that every rank draws the same numbers
    aten.uniform.default, aten.normal_functional.default,
)  # fmt: skip

LIKE = (
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.empty_like.default,
)  # fmt: skip

RULES: dict[object, Rule] = {
    **dict.fromkeys(NONLINEAR, nonlinear_rule),
    **dict.fromkeys(LINEAR_UNARY, linear_unary_rule),
    **dict.fromkeys(CREATION, creation_rule),
    **dict.fromkeys(LIKE, like_rule),
    aten.add.Tensor: additive_rule,
    aten.add.Scalar: additive_rule,
    aten.sub.Tensor: additive_rule,
    aten.sub.Scalar: additive_rule,
    aten.rsub.Tensor: rsub_rule,
    aten.rsub.Scalar: rsub_rule,
    aten.mul.Tensor: mul_rule,
    aten.mul.Scalar: mul_rule,
    aten.div.Tensor: div_rule,
    aten.div.Scalar: div_rule,
    aten.where.self: where_rule,
    aten.where.ScalarOther: where_rule,
    aten.where.ScalarSelf: where_rule,
    aten.triu.default: triangle_rule,
    aten.tril.default: triangle_rule,
    aten.masked_fill.Scalar: masked_fill_rule,
    aten.masked_fill.Tensor: masked_fill_rule,
    aten.lerp.Scalar: lerp_rule,
    aten.lerp.Tensor: lerp_rule,
    aten.type_as.default: type_as_rule,
    aten.cumsum.default: cumsum_rule,
    aten.diff.default: diff_rule,
    aten.pad.default: pad_rule,
    aten.constant_pad_nd.default: constant_pad_nd_rule,
    aten.topk.default: topk_rule,
    aten.sort.default: sort_rule,
    aten.sort.stable: sort_rule,
    aten.dropout.default: dropout_rule,
    aten.native_dropout.default: dropout_rule,
}

LOCALS: dict[str, LocalKind] = {"dropout": localize_dropout}
