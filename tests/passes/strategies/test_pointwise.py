"""The pointwise family's rules, brute-forced against the unsharded ops on simulated meshes.

Every op of ``pointwise.RULES`` has at least one case below. Each case is checked on the
meshes (2,), (4,), (2, 2) and (2, 3): no strategy may give a wrong value, the partial
strategies on a (2,) mesh must be exactly the ones the op's linearity allows, and the
strategies a case names must be offered. Dropout's randomness is checked separately.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from autopar_passes.strategies import pointwise
from autopar_passes.strategies.localize import localize
from autopar_passes.strategies.table import rules
from autopar_passes.strategies.types import Strategy
from autopar_passes.strategies.validate import check_rule, describe_failures, op_call
from autopar_plans.placement import Layout, Partial, Replicate, Shard

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (2, 3)]

_gen = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_gen, dtype=torch.float64)


def _bool(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=_gen) > 0.5


def _ints(*shape: int) -> torch.Tensor:
    return torch.randint(0, 5, shape, generator=_gen)


X = _randn(4, 6, 8)  # (B, T, H): dims split by 2 and 4; dim 1 also by 3
Y = _randn(4, 6, 8)
POS = X.abs() + 0.5
ROW = _randn(8)  # broadcasts along dims 0 and 1
COL = _randn(6, 1)  # broadcasts along dims 0 and 2
SCALAR = _randn()
MASK = _bool(4, 6, 8)
MASK_ROW = _bool(8)
INTS = _ints(4, 6, 8)
INTS2 = _ints(4, 6, 8)


def _seeded(op: Any) -> Callable[..., Any]:
    """``op`` run from a fixed global seed, as every rank of a run is seeded alike."""

    def run(*args: Any, **kwargs: Any) -> Any:
        torch.manual_seed(0)
        return op(*args, **kwargs)

    return run


@dataclass(frozen=True)
class Case:
    """One call of ``op``; ``partial``: exactly the strategies with a partial layout on a (2,)
    mesh; ``expect``: strategies that must be offered on a (2,) mesh; ``whole``: output dims
    no strategy may shard."""

    id: str
    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    partial: frozenset[str] = frozenset()
    expect: frozenset[str] = frozenset()
    whole: tuple[int, ...] = ()
    target: Any = None
    rtol: float = 1e-7
    fill_empty: bool = False


def case(
    id: str,
    op: Any,
    *args: Any,
    partial: tuple[str, ...] = (),
    expect: tuple[str, ...] = (),
    whole: tuple[int, ...] = (),
    **options: Any,
) -> Case:
    kwargs = options.pop("kwargs", {})
    return Case(id, op, args, kwargs, frozenset(partial), frozenset(expect), whole, **options)


UNARY = [
    aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.exp.default,
    aten.log.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
    aten.gelu.default, aten.relu.default, aten.sin.default, aten.cos.default, aten.abs.default,
    aten.erf.default, aten.square.default, aten.log1p.default, aten.expm1.default,
    aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
    aten.sign.default, aten.tan.default, aten.atan.default, aten.hardtanh.default,
    aten.leaky_relu.default, aten.elu.default, aten.softplus.default, aten.hardswish.default,
    aten.hardsigmoid.default, aten.mish.default, aten.isnan.default, aten.isinf.default,
    aten.logical_not.default,
]  # fmt: skip

CASES: list[Case] = [
    *(case(str(op), op, POS, expect=("S(0)->S(0)", "S(1)->S(1)", "S(2)->S(2)")) for op in UNARY),
    case("gelu-tanh", aten.gelu.default, X, kwargs={"approximate": "tanh"}),
    case("neg", aten.neg.default, X, partial=("P->P",)),
    # add/sub: partial only with every tensor partial and no constant added
    case("add", aten.add.Tensor, X, Y, partial=("P,P->P",), expect=("S(0),S(0)->S(0)",)),
    case("add-row-alpha", aten.add.Tensor, X, ROW, kwargs={"alpha": 2}, partial=("P,P->P",),
         expect=("S(0),R->S(0)", "S(2),S(0)->S(2)")),
    case("add-col", aten.add.Tensor, X, COL, partial=("P,P->P",),
         expect=("S(1),S(0)->S(1)", "S(2),R->S(2)")),
    case("add-number", aten.add.Tensor, X, 2.0),
    case("add-zero", aten.add.Tensor, X, 0, partial=("P->P",)),
    case("add-ints", aten.add.Tensor, INTS, INTS2, expect=("S(0),S(0)->S(0)",)),
    case("add.Scalar", aten.add.Scalar, X, 1.5),
    case("add.Scalar-zero", aten.add.Scalar, X, 0.0, partial=("P->P",)),
    case("add.Scalar-alpha0", aten.add.Scalar, X, 3.0, 0, partial=("P->P",)),
    case("sub", aten.sub.Tensor, X, COL, partial=("P,P->P",)),
    case("sub.Scalar", aten.sub.Scalar, X, 1.0),
    case("rsub", aten.rsub.Tensor, X, Y, kwargs={"alpha": 3}, partial=("P,P->P",)),
    case("rsub.Scalar", aten.rsub.Scalar, X, 1.0),
    case("rsub.Scalar-zero", aten.rsub.Scalar, X, 0, partial=("P->P",)),
    # mul: one factor partial; div: the numerator only
    case("mul", aten.mul.Tensor, X, Y, partial=("P,R->P", "R,P->P")),
    case("mul-0d", aten.mul.Tensor, X, SCALAR, partial=("P,R->P", "R,P->P"),
         expect=("S(0),R->S(0)",)),
    case("mul-mask", aten.mul.Tensor, X, MASK, partial=("P,R->P",)),
    case("mul.Scalar", aten.mul.Scalar, X, 3.0, partial=("P->P",)),
    case("div", aten.div.Tensor, X, POS, partial=("P,R->P",)),
    case("div-col", aten.div.Tensor, X, COL.abs() + 1, partial=("P,R->P",)),
    case("div.Scalar", aten.div.Scalar, X, 4.0, partial=("P->P",)),
    case("div-mode", aten.div.Tensor_mode, X, POS, kwargs={"rounding_mode": "floor"}),
    case("pow.Tensor_Scalar", aten.pow.Tensor_Scalar, X, 2),
    case("pow.Scalar", aten.pow.Scalar, 2.0, X),
    case("pow.Tensor_Tensor", aten.pow.Tensor_Tensor, POS, COL),
    case("atan2", aten.atan2.default, X, Y),
    case("clamp", aten.clamp.default, X, -0.5, 0.5),
    case("clamp-min", aten.clamp.default, X, kwargs={"min": -0.5}),
    case("clamp.Tensor", aten.clamp.Tensor, X, ROW - 1, ROW + 1),
    case("clamp_min", aten.clamp_min.default, X, 0.1),
    case("clamp_min.Tensor", aten.clamp_min.Tensor, X, ROW),
    case("clamp_max", aten.clamp_max.default, X, 0.1),
    case("clamp_max.Tensor", aten.clamp_max.Tensor, X, COL),
    case("minimum", aten.minimum.default, X, ROW),
    case("min.other", aten.min.other, X, ROW),
    case("max.other", aten.max.other, X, Y),
    case("maximum", aten.maximum.default, X, COL),
    case("floor_divide", aten.floor_divide.default, X, POS),
    case("floor_divide.Scalar", aten.floor_divide.Scalar, X, 0.7),
    case("remainder", aten.remainder.Tensor, X, POS),
    case("remainder.Scalar", aten.remainder.Scalar, X, 0.7),
    case("fmod", aten.fmod.Tensor, X, POS),
    case("fmod.Scalar", aten.fmod.Scalar, X, 0.7),
    # comparisons and logic: bool outputs, never partial
    *(case(f"{name}.Tensor", getattr(aten, name).Tensor, X, ROW, expect=("S(2),S(0)->S(2)",))
      for name in ("eq", "ne", "lt", "le", "gt", "ge")),
    *(case(f"{name}.Scalar", getattr(aten, name).Scalar, X, 0.0)
      for name in ("eq", "ne", "lt", "le", "gt", "ge")),
    case("eq-ints", aten.eq.Tensor, INTS, INTS2),
    case("__and__", aten.__and__.Tensor, MASK, MASK_ROW),
    case("__or__", aten.__or__.Tensor, MASK, MASK_ROW),
    case("bitwise_and", aten.bitwise_and.Tensor, INTS, INTS2),
    case("bitwise_or", aten.bitwise_or.Tensor, INTS, INTS2),
    case("bitwise_not", aten.bitwise_not.default, INTS),
    case("bitwise_not-bool", aten.bitwise_not.default, MASK),
    case("logical_and", aten.logical_and.default, MASK, X),
    case("logical_or", aten.logical_or.default, MASK, MASK_ROW),
    case("logical_xor", aten.logical_xor.default, X, MASK),
    # where / masked_fill / lerp: linear in the values, never in the condition
    case("where", aten.where.self, MASK, X, Y, partial=("R,P,P->P",)),
    case("where-broadcast", aten.where.self, MASK_ROW, X, COL, partial=("R,P,P->P",),
         expect=("S(0),S(2),R->S(2)", "R,S(1),S(0)->S(1)")),
    case("where.ScalarOther-zero", aten.where.ScalarOther, MASK, X, 0.0, partial=("R,P->P",)),
    case("where.ScalarOther", aten.where.ScalarOther, MASK, X, 1.0),
    case("where.ScalarSelf-zero", aten.where.ScalarSelf, MASK, 0.0, X, partial=("R,P->P",)),
    case("where.ScalarSelf", aten.where.ScalarSelf, MASK, 2.0, X),
    case("where.Scalar", aten.where.Scalar, MASK, 1.0, 0.0),
    case("masked_fill-zero", aten.masked_fill.Scalar, X, MASK, 0.0, partial=("P,R->P",)),
    case("masked_fill-inf", aten.masked_fill.Scalar, X, MASK_ROW, float("-inf"),
         expect=("S(2),S(0)->S(2)", "S(0),R->S(0)")),
    case("masked_fill.Tensor", aten.masked_fill.Tensor, X, MASK, SCALAR,
         partial=("P,R,P->P",)),
    # triu / tril: the last two dims whole (which elements survive depends on both)
    case("triu", aten.triu.default, X, 1, partial=("P->P",), expect=("S(0)->S(0)",)),
    case("tril", aten.tril.default, X, partial=("P->P",), expect=("S(0)->S(0)",)),
    case("lerp", aten.lerp.Scalar, X, Y, 0.3, partial=("P,P->P",)),
    case("lerp.Tensor", aten.lerp.Tensor, X, Y, ROW, partial=("P,P,R->P",)),
    # casts and copies: partial only float to float
    case("to.dtype-f32", aten.to.dtype, X, torch.float32, partial=("P->P",), rtol=1e-6),
    case("to.dtype-int", aten.to.dtype, X, torch.int64),
    case("to.dtype-bool-f64", aten.to.dtype, MASK, torch.float64),
    case("to.dtype_layout", aten.to.dtype_layout, X, kwargs={"dtype": torch.float64},
         partial=("P->P",)),
    case("to.device", aten.to.device, X, torch.device("cpu"), torch.float64,
         partial=("P->P",)),
    case("_to_copy", aten._to_copy.default, X, kwargs={"dtype": torch.float32},
         partial=("P->P",), rtol=1e-6),
    *(case(str(op), op, X, partial=("P->P",), expect=("S(0)->S(0)",))
      for op in (aten.clone.default, aten.contiguous.default, aten.alias.default,
                 aten.detach.default, aten.lift_fresh_copy.default)),
    case("type_as", aten.type_as.default, X, Y.float(), partial=("P,R->P", "P,P->P"),
         expect=("S(0),S(0)->S(0)", "S(0),R->S(0)"), rtol=1e-6),
    case("type_as-other-shape", aten.type_as.default, X, ROW.float(), partial=("P,R->P",),
         expect=("S(1),R->S(1)",), rtol=1e-6),
    case("type_as-int", aten.type_as.default, X, INTS),
    # scans, shifts, pads, selections: their dim stays whole
    case("cumsum", aten.cumsum.default, X, 1, partial=("P->P",), whole=(1,),
         expect=("S(0)->S(0)", "S(2)->S(2)")),
    case("cumsum-neg-dim", aten.cumsum.default, X, -1, partial=("P->P",), whole=(2,)),
    case("cumsum-ints", aten.cumsum.default, INTS, 0, whole=(0,)),
    case("diff", aten.diff.default, X, partial=("P->P",), whole=(2,)),
    case("diff-dim", aten.diff.default, X, 2, 1, partial=("P->P",), whole=(1,)),
    case("diff-prepend", aten.diff.default, X, 1, 0, _randn(1, 6, 8), _randn(3, 6, 8),
         partial=("P,P,P->P",), whole=(0,), expect=("S(1),S(1),S(1)->S(1)",)),
    case("pad", aten.pad.default, X, [1, 3], partial=("P->P",), whole=(2,)),
    case("pad-reflect", aten.pad.default, X, [0, 0, 2, 1], "reflect", partial=("P->P",),
         whole=(1,), expect=("S(2)->S(2)",)),
    case("pad-value", aten.pad.default, X, [1, 1], "constant", 2.0, whole=(2,)),
    case("pad-crop", aten.pad.default, X, [-2, -2], partial=("P->P",), whole=(2,)),
    case("constant_pad_nd", aten.constant_pad_nd.default, X, [0, 0, 1, 1],
         partial=("P->P",), whole=(1,)),
    case("constant_pad_nd-value", aten.constant_pad_nd.default, X, [2, 0], 1.5, whole=(2,)),
    case("topk", aten.topk.default, X, 3, whole=(2,), expect=("S(0)->S(0),S(0)",)),
    case("topk-dim", aten.topk.default, X, 2, 1, whole=(1,), expect=("S(2)->S(2),S(2)",)),
    case("sort", aten.sort.default, X, whole=(2,)),
    case("sort-dim", aten.sort.default, X, 0, True, whole=(0,)),
    case("sort.stable", aten.sort.stable, X, kwargs={"stable": True, "dim": -2}, whole=(1,)),
    # creation: replicated only
    case("arange", aten.arange.default, 8),
    case("arange.start", aten.arange.start, 1, 9),
    case("arange.start_step", aten.arange.start_step, 0, 16, 2),
    case("eye", aten.eye.default, 4),
    case("eye.m", aten.eye.m, 4, 6),
    case("zeros", aten.zeros.default, [4, 8]),
    case("ones", aten.ones.default, [4, 8], kwargs={"dtype": torch.float64}),
    case("full", aten.full.default, [4, 8], 2.0),
    case("empty", aten.empty.memory_format, [4, 8], fill_empty=True),
    case("scalar_tensor", aten.scalar_tensor.default, 3.0),
    case("rand", aten.rand.default, [4, 8], target=_seeded(aten.rand.default)),
    case("randn", aten.randn.default, [4, 8], target=_seeded(aten.randn.default)),
    case("uniform", aten.uniform.default, X, target=_seeded(aten.uniform.default)),
    case(
        "normal_functional",
        aten.normal_functional.default,
        X,
        target=_seeded(aten.normal_functional.default),
    ),
    # new_* and *_like: the output follows the input's layout
    case("new_zeros", aten.new_zeros.default, X, [4, 6, 8, 2], partial=("P->R",),
         expect=("S(2)->S(2)", "S(0)->S(0)")),
    case("new_ones", aten.new_ones.default, X, [8, 4], partial=("P->R",),
         expect=("S(0)->R", "R->R")),
    case("new_full", aten.new_full.default, X, [4, 6], 2.0, partial=("P->R",),
         expect=("S(1)->S(1)", "S(2)->R")),
    case("new_empty", aten.new_empty.default, X, [4, 6, 8], partial=("P->R",),
         fill_empty=True),
    case("new_zeros-ints", aten.new_zeros.default, INTS, [4, 6]),
    *(case(str(op), op, X, *extra, partial=("P->R",), expect=("S(1)->S(1)",),
           fill_empty=op == aten.empty_like.default)
      for op, extra in ((aten.zeros_like.default, ()), (aten.ones_like.default, ()),
                        (aten.full_like.default, (7.0,)), (aten.empty_like.default, ()))),
    # dropout as the identity (its randomness is tested below)
    case("dropout-eval", aten.dropout.default, X, 0.5, False, partial=("P->P",),
         expect=("S(0)->S(0)",)),
    case("dropout-p0", aten.dropout.default, X, 0.0, True, partial=("P->P",)),
    case("native_dropout-eval", aten.native_dropout.default, X, 0.5, False,
         partial=("P->P,R",), expect=("S(1)->S(1),S(1)",)),
    case("native_dropout-p0", aten.native_dropout.default, X, 0.0, True,
         partial=("P->P,R",)),
]  # fmt: skip


@contextmanager
def _filled_empty(enabled: bool) -> Iterator[None]:
    """Deterministic mode fills uninitialised memory (NaN for floats), so empty ops compare."""
    if not enabled:
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _has_partial(strategy: Strategy) -> bool:
    layouts = strategy.inputs + strategy.outputs
    return any(isinstance(p, Partial) for layout in layouts for p in layout)


def _check(c: Case, mesh: tuple[int, ...]) -> list[Strategy]:
    with _filled_empty(c.fill_empty):
        strategies, failures = check_rule(
            rules()[c.op], c.target or c.op, c.args, c.kwargs, mesh, rtol=c.rtol
        )
    assert not failures, describe_failures(failures)
    return strategies


def test_every_op_has_a_case() -> None:
    assert set(pointwise.RULES) <= {c.op for c in CASES}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_rule_matches_unsharded_op(c: Case, mesh: tuple[int, ...]) -> None:
    strategies = _check(c, mesh)
    assert strategies, "a rule offers at least the replicated strategy"
    assert len({(s.inputs, s.outputs) for s in strategies}) == len(strategies)
    for strategy in strategies:
        for layout in strategy.outputs:
            for dim in c.whole:
                assert Shard(dim) not in layout, f"{strategy.name} shards dim {dim}"
    if mesh == (2,):
        names = {s.name for s in strategies}
        assert {s.name for s in strategies if _has_partial(s)} == c.partial
        assert c.expect <= names, sorted(names)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
def test_elementwise_shards_every_dim_on_a_2d_mesh(mesh: tuple[int, ...]) -> None:
    """x (4, 6, 8) + row (8,): each axis replicates, shards one of the three dims (row
    sharded only with dim 2), or holds partial sums: 5 x 5 choices on two axes, less S(1)
    twice (6 does not split in 4)."""
    strategies = _check(case("add", aten.add.Tensor, X, ROW), mesh)
    names = {s.name for s in strategies}
    if mesh == (2,):
        assert names == {"R,R->R", "S(0),R->S(0)", "S(1),R->S(1)", "S(2),S(0)->S(2)", "P,P->P"}
    else:
        assert "S(0)S(2),RS(0)->S(0)S(2)" in names
        assert "S(2)S(2),S(0)S(0)->S(2)S(2)" in names
        assert "PS(1),PR->PS(1)" in names
        assert len(strategies) == 24


def test_odd_mesh_axis_shards_only_divisible_dims() -> None:
    strategies = _check(case("exp", aten.exp.default, X), (2, 3))
    second_axis = {s.outputs[0][1] for s in strategies}
    assert second_axis == {Replicate(), Shard(1)}


def test_broadcast_dims_are_never_sharded() -> None:
    """A size-1 dim of an input is repeated along the output: it stays whole."""
    for mesh in [(2,), (2, 2)]:
        for strategy in _check(case("mul", aten.mul.Tensor, X, COL), mesh):
            assert Shard(1) not in strategy.inputs[1]


def test_comparisons_and_nonlinear_ops_never_partial() -> None:
    calls = [
        (aten.exp.default, (X,)),
        (aten.gt.Tensor, (X, Y)),
        (aten.pow.Tensor_Scalar, (X, 2)),
        (aten.relu.default, (X,)),
    ]
    for op, args in calls:
        strategies = rules()[op](op_call(op, args, {}), (2, 2))
        assert not any(_has_partial(s) for s in strategies)


def test_creation_ops_are_replicated_only() -> None:
    for op, args in ((aten.arange.default, (8,)), (aten.zeros.default, ([4, 8],))):
        (strategy,) = rules()[op](op_call(op, args, {}), (2, 2))
        assert strategy.outputs[0].is_replicated and strategy.split == 1


# --- dropout's random-number policy -------------------------------------------------------


def _strategy(op: Any, args: tuple[Any, ...], mesh: tuple[int, ...], name: str) -> Strategy:
    strategies = rules()[op](op_call(op, args, {}), mesh)
    (strategy,) = [s for s in strategies if s.name == name]
    assert strategy.local.kind == "dropout"
    return strategy


def _run_devices(
    op: Any,
    x: torch.Tensor,
    p: float,
    mesh: tuple[int, ...],
    name: str,
    summands: dict[int, torch.Tensor] | None = None,
) -> dict[tuple[int, ...], Any]:
    """Each simulated device's local dropout from the same global seed (as every rank is
    seeded alike). ``summands``: the device's summand along the partial axis, by coordinate."""
    strategy = _strategy(op, (x, p, True), mesh, name)
    call = op_call(op, (x, p, True), {})
    outputs = {}
    for coords in itertools.product(*(range(n) for n in mesh)):
        piece = x
        for axis, placement in enumerate(strategy.inputs[0]):
            if isinstance(placement, Partial):
                assert summands is not None
                piece = summands[coords[axis]]
        for axis, placement in enumerate(strategy.inputs[0]):
            if isinstance(placement, Shard):
                piece = piece.chunk(mesh[axis], dim=placement.dim)[coords[axis]]
        torch.manual_seed(1234)
        fn, args, kwargs = localize(call, strategy, (piece, p, True), {}, coords, mesh)
        outputs[coords] = fn(*args, **kwargs)
    return outputs


def _mask(out: torch.Tensor) -> torch.Tensor:
    return out != 0


def test_dropout_replicated_axis_draws_the_same_mask() -> None:
    x = torch.ones(8, 16, dtype=torch.float64)
    outs = _run_devices(aten.dropout.default, x, 0.5, (2, 2), "S(0)R->S(0)R")
    assert torch.equal(_mask(outs[0, 0]), _mask(outs[0, 1]))
    assert torch.equal(_mask(outs[1, 0]), _mask(outs[1, 1]))
    assert not torch.equal(_mask(outs[0, 0]), _mask(outs[1, 0]))


def test_dropout_all_replicated_devices_agree() -> None:
    x = torch.ones(8, 16, dtype=torch.float64)
    outs = list(_run_devices(aten.dropout.default, x, 0.5, (2, 2), "RR->RR").values())
    assert all(torch.equal(outs[0], out) for out in outs)


def test_dropout_shards_draw_independent_masks() -> None:
    x = torch.ones(8, 16, dtype=torch.float64)
    outs = _run_devices(aten.dropout.default, x, 0.5, (2, 2), "S(0)S(1)->S(0)S(1)")
    masks = [_mask(out) for out in outs.values()]
    for a, b in itertools.combinations(masks, 2):
        assert not torch.equal(a, b)
    # same dim split by both axes: four distinct shards, four distinct masks
    outs = _run_devices(aten.dropout.default, x, 0.5, (2, 2), "S(1)S(1)->S(1)S(1)")
    masks = [_mask(out) for out in outs.values()]
    assert all(not torch.equal(a, b) for a, b in itertools.combinations(masks, 2))


def test_dropout_partial_axis_masks_summands_alike() -> None:
    """P on axis 1: both summands get the same mask, so the sum is the dropout of the sum."""
    x = _randn(8, 16)
    summands = {0: 0.25 * x, 1: 0.75 * x}
    outs = _run_devices(aten.dropout.default, x, 0.5, (2, 2), "S(0)P->S(0)P", summands)
    for row in (0, 1):
        assert torch.equal(_mask(outs[row, 0]), _mask(outs[row, 1]))
        total = outs[row, 0] + outs[row, 1]
        piece = x.chunk(2, dim=0)[row]
        torch.testing.assert_close(total, piece * _mask(outs[row, 0]) * 2.0)
    assert not torch.equal(_mask(outs[0, 0]), _mask(outs[1, 0]))


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_dropout_keeps_about_one_minus_p_and_rescales(p: float) -> None:
    x = torch.ones(64, 128, dtype=torch.float64)
    outs = _run_devices(aten.dropout.default, x, p, (2, 2), "S(0)S(1)->S(0)S(1)")
    values = torch.cat([out.flatten() for out in outs.values()])
    kept = values != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.03
    torch.testing.assert_close(values[kept], torch.full_like(values[kept], 1 / (1 - p)))


def test_native_dropout_returns_the_bool_mask() -> None:
    x = _randn(8, 16)
    outs = _run_devices(aten.native_dropout.default, x, 0.5, (2,), "S(0)->S(0),S(0)")
    for coords, (out, mask) in outs.items():
        assert mask.dtype == torch.bool
        piece = x.chunk(2, dim=0)[coords[0]]
        torch.testing.assert_close(out, piece * mask * 2.0)
    assert not torch.equal(outs[0,][1], outs[1,][1])


def test_dropout_consumes_the_same_global_randomness_whatever_p_and_train() -> None:
    """Every call draws one base seed, so replicated random ops after it stay in step."""
    x = _randn(8, 16)
    after = []
    for p, train in ((0.5, True), (0.0, True), (0.5, False)):
        torch.manual_seed(7)
        pointwise.dropout_local(x, p, train, offset=3)
        after.append(torch.rand(4))
    assert all(torch.equal(after[0], a) for a in after)


def test_dropout_successive_calls_draw_new_masks() -> None:
    x = torch.ones(8, 16, dtype=torch.float64)
    torch.manual_seed(0)
    first = pointwise.dropout_local(x, 0.5, True, offset=0)
    second = pointwise.dropout_local(x, 0.5, True, offset=0)
    assert not torch.equal(first, second)


def test_dropout_every_strategy_uses_the_dropout_local_kind() -> None:
    call = op_call(aten.dropout.default, (X, 0.5, True), {})
    strategies = rules()[aten.dropout.default](call, (2, 2))
    assert {s.local.kind for s in strategies} == {"dropout"}
    assert Layout(Shard(0), Shard(2)) in {s.outputs[0] for s in strategies}


def test_type_as_other_is_replicated_or_laid_out_like_self() -> None:
    strategies = _check(case("type_as", aten.type_as.default, X, Y.float(), rtol=1e-6), (2, 2))
    for strategy in strategies:
        x, other = strategy.inputs
        assert other.is_replicated or other == x
    pairs = {(s.inputs[0], s.inputs[1]) for s in strategies}
    sharded = Layout(Shard(0), Shard(2))
    assert (sharded, sharded) in pairs
    assert (sharded, Layout(Replicate(), Replicate())) in pairs
    assert len(strategies) == 2 * 24 - 1


def test_like_ops_never_make_a_partial_output() -> None:
    for op, args in ((aten.ones_like.default, (X,)), (aten.new_ones.default, (X, [4, 6]))):
        strategies = rules()[op](op_call(op, args, {}), (2, 2))
        assert not any(isinstance(p, Partial) for s in strategies for p in s.outputs[0])
