"""View family: every strategy checked against the unsharded op on simulated meshes, and the
strategies a transformer needs present, the wrong ones absent."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from autopar_passes.strategies import view
from autopar_passes.strategies.table import local_kinds, rules
from autopar_passes.strategies.types import Strategy
from autopar_passes.strategies.validate import check_rule, describe_failures
from autopar_plans.placement import Partial, Shard

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (2, 3)]
_GEN = torch.Generator().manual_seed(0)


def f(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=_GEN)


def ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_GEN)


def check(
    target: Any,
    args: tuple[Any, ...],
    mesh: tuple[int, ...] = (2,),
    kwargs: dict[str, Any] | None = None,
) -> list[Strategy]:
    """The rule's strategies for this call, after asserting every one of them is right."""
    strategies, failures = check_rule(view.RULES[target], target, args, kwargs, mesh)
    assert not failures, describe_failures(failures)
    assert len({(s.inputs, s.outputs) for s in strategies}) == len(strategies)
    return strategies


def names(
    target: Any,
    args: tuple[Any, ...],
    mesh: tuple[int, ...] = (2,),
    kwargs: dict[str, Any] | None = None,
) -> set[str]:
    return {s.name for s in check(target, args, mesh, kwargs)}


def input_shards(strategy: Strategy, index: int = 0) -> set[int]:
    return {p.dim for p in strategy.inputs[index] if isinstance(p, Shard)}


def output_shards(strategy: Strategy, index: int = 0) -> set[int]:
    return {p.dim for p in strategy.outputs[index] if isinstance(p, Shard)}


# (target, args) for every op of the family, negative dims included. Shapes divide by 2, 4
# and (mostly) 3, so every mesh has something to shard.
CASES: dict[str, tuple[Any, Callable[[], tuple[Any, ...]]]] = {
    "view_split": (aten.view.default, lambda: (f(4, 8, 12), [4, 8, 3, 4])),
    "view_minus_one": (aten.view.default, lambda: (f(4, 8, 12), [4, -1])),
    "view_regroup": (aten.view.default, lambda: (f(4, 6, 8), [8, 3, 8])),
    "view_scalar": (aten.view.default, lambda: (f(1), [])),
    "reshape_merge": (aten.reshape.default, lambda: (f(4, 8, 12), [32, 12])),
    "reshape_size_one": (aten.reshape.default, lambda: (f(4, 1, 12), [4, 12, 1])),
    "unsafe_view": (aten._unsafe_view.default, lambda: (f(4, 8, 12), [4, 96])),
    "unsqueeze_front": (aten.unsqueeze.default, lambda: (f(4, 12), 0)),
    "unsqueeze_neg": (aten.unsqueeze.default, lambda: (f(4, 12), -1)),
    "squeeze_default": (aten.squeeze.default, lambda: (f(4, 1, 12),)),
    "squeeze_dim_neg": (aten.squeeze.dim, lambda: (f(4, 1, 12), -2)),
    "squeeze_dim_noop": (aten.squeeze.dim, lambda: (f(4, 12), 0)),
    "squeeze_dims": (aten.squeeze.dims, lambda: (f(4, 1, 12, 1), [1, -1, 0])),
    "flatten": (aten.flatten.using_ints, lambda: (f(4, 8, 12), 0, 1)),
    "flatten_neg": (aten.flatten.using_ints, lambda: (f(4, 8, 12), -2, -1)),
    "unflatten": (aten.unflatten.int, lambda: (f(4, 96), 1, [8, 12])),
    "unflatten_neg": (aten.unflatten.int, lambda: (f(4, 96), -1, [-1, 12])),
    "expand_broadcast": (aten.expand.default, lambda: (f(1, 12), [4, 12])),
    "expand_lead": (aten.expand.default, lambda: (f(12), [4, 8, -1])),
    "expand_middle": (aten.expand.default, lambda: (f(4, 1, 12), [-1, 8, 12])),
    "t": (aten.t.default, lambda: (f(4, 12),)),
    "t_1d": (aten.t.default, lambda: (f(12),)),
    "transpose": (aten.transpose.int, lambda: (f(4, 8, 12), 1, 2)),
    "transpose_neg": (aten.transpose.int, lambda: (f(4, 8, 12), -1, -3)),
    "permute": (aten.permute.default, lambda: (f(4, 8, 12), [2, 0, 1])),
    "permute_neg": (aten.permute.default, lambda: (f(4, 8, 12), [-1, 0, -2])),
    "slice": (aten.slice.Tensor, lambda: (f(4, 8, 12), 1, 2, 6)),
    "slice_step_neg": (aten.slice.Tensor, lambda: (f(4, 8, 12), -1, 0, 12, 2)),
    "slice_whole": (aten.slice.Tensor, lambda: (f(4, 8, 12), 1, 0, 9223372036854775807)),
    "slice_whole_neg_start": (aten.slice.Tensor, lambda: (f(4, 8, 12), -1, -12)),
    "narrow": (aten.narrow.default, lambda: (f(4, 8, 12), 2, 4, 4)),
    "narrow_whole_neg": (aten.narrow.default, lambda: (f(4, 8, 12), -1, 0, 12)),
    "select": (aten.select.int, lambda: (f(4, 8, 12), 1, 3)),
    "select_neg": (aten.select.int, lambda: (f(4, 8, 12), -1, -5)),
    "split": (aten.split.Tensor, lambda: (f(4, 8, 12), 4, 1)),
    "split_neg": (aten.split.Tensor, lambda: (f(4, 8, 12), 6, -1)),
    "split_with_sizes": (aten.split_with_sizes.default, lambda: (f(4, 8, 12), [4, 8], -1)),
    "chunk": (aten.chunk.default, lambda: (f(4, 8, 12), 2, 1)),
    "tensor_split.indices": (aten.tensor_split.indices, lambda: (f(4, 8, 12), [1, 5], 2)),
    "tensor_split.sections": (aten.tensor_split.sections, lambda: (f(4, 8, 12), 3, 1)),
    "chunk_neg": (aten.chunk.default, lambda: (f(4, 8, 12), 3, -1)),
    "unbind": (aten.unbind.int, lambda: (f(4, 2, 12), 1)),
    "unbind_neg": (aten.unbind.int, lambda: (f(4, 8, 2), -1)),
    "cat": (aten.cat.default, lambda: ([f(4, 12), f(8, 12)], 0)),
    "cat_neg": (aten.cat.default, lambda: ([f(4, 12), f(4, 4), f(4, 8)], -1)),
    "stack": (aten.stack.default, lambda: ([f(4, 12), f(4, 12)], 0)),
    "stack_neg": (aten.stack.default, lambda: ([f(4, 12), f(4, 12)], -1)),
    "index_adjacent": (aten.index.Tensor, lambda: (f(4, 8, 12), [None, ints(8, 4)])),
    "index_pair": (aten.index.Tensor, lambda: (f(4, 8, 12), [None, ints(8, 4, 1), ints(12, 1, 6)])),
    "index_apart": (aten.index.Tensor, lambda: (f(4, 8, 12), [ints(4, 4), None, ints(12, 4)])),
    "index_front": (aten.index.Tensor, lambda: (f(8, 4, 12), [ints(8, 2, 4)])),
    "index_select": (aten.index_select.default, lambda: (f(4, 8, 12), 1, ints(8, 4))),
    "index_select_neg": (aten.index_select.default, lambda: (f(4, 8, 12), -1, ints(12, 6))),
    "gather": (aten.gather.default, lambda: (f(4, 8, 12), 1, ints(8, 4, 4, 12))),
    "gather_neg": (aten.gather.default, lambda: (f(4, 8, 12), -1, ints(12, 4, 8, 6))),
    "gather_short": (aten.gather.default, lambda: (f(4, 8, 12), 2, ints(12, 2, 8, 6))),
    "repeat": (aten.repeat.default, lambda: (f(4, 12), [2, 1])),
    "repeat_lead": (aten.repeat.default, lambda: (f(4, 12), [3, 1, 2])),
    "flip": (aten.flip.default, lambda: (f(4, 8, 12), [0, -1])),
    "roll": (aten.roll.default, lambda: (f(4, 8, 12), [1], [1])),
    "roll_neg": (aten.roll.default, lambda: (f(4, 8, 12), [1, 2], [0, -1])),
    "roll_flat": (aten.roll.default, lambda: (f(4, 12), [3])),
    "numpy_T": (aten.numpy_T.default, lambda: (f(4, 8, 12),)),
    "repeat_interleave": (aten.repeat_interleave.self_int, lambda: (f(4, 8, 12), 2, 1)),
    "repeat_interleave_neg": (aten.repeat_interleave.self_int, lambda: (f(4, 8, 12), 3, -1)),
    "repeat_interleave_flat": (aten.repeat_interleave.self_int, lambda: (f(4, 12), 2)),
}


def test_every_op_has_a_case():
    assert set(view.RULES) == {target for target, _ in CASES.values()}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_every_strategy_is_right(case, mesh):
    target, make = CASES[case]
    strategies = check(target, make(), mesh)
    assert any(all(layout.is_replicated for layout in s.inputs) for s in strategies)


@pytest.mark.parametrize("case", CASES)
def test_partial_passes_through(case):
    """Every op here is linear in its float input: Partial in, Partial out."""
    target, make = CASES[case]
    strategies = check(target, make(), (2,))
    assert any(
        isinstance(s.inputs[0][0], Partial) and all(isinstance(o[0], Partial) for o in s.outputs)
        for s in strategies
    )


def test_rules_are_in_the_table():
    assert rules()[aten.view.default] is view.view_rule
    assert local_kinds()["squeeze_dims"] is view.LOCALS["squeeze_dims"]


# ---------------------------------------------------------------------------- reshapes


def test_view_dim_map_groups():
    assert view.view_dim_map((2, 3, 8), (6, 2, 4)) == {0: 0, 2: 1}
    assert view.view_dim_map((4, 1, 6), (1, 24)) == {0: 1}
    assert view.view_dim_map((4, 6), (6, 4)) == {0: 0}


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
def test_view_regroup_shards_first_dims_only(mesh):
    # [4, 6] -> [6, 4]: one group; dim 0 of each side maps, dim 1 never.
    strategies = check(aten.view.default, (f(4, 6), [6, 4]), mesh)
    assert all(input_shards(s) <= {0} and output_shards(s) <= {0} for s in strategies)
    assert any(input_shards(s) == {0} for s in strategies)


def test_attention_split_heads_batch_and_heads():
    """Llama/GPT: [B, T, C] -> [B, T, H, D], batch on one axis, heads on the other."""
    got = names(aten.view.default, (f(4, 4, 32), [4, 4, 4, 8]), (2, 2))
    assert "S(0)S(2)->S(0)S(2)" in got
    assert "S(2)S(0)->S(2)S(0)" in got
    assert "S(2)S(2)->S(2)S(2)" in got  # H = 4 splits 4 ways
    assert "RS(1)->RS(1)" in got
    assert not any("S(3)" in name for name in got)  # D is never sharded


def test_attention_split_heads_needs_heads_to_divide():
    # C = 16 splits 4 ways but H = 2 does not: C may not be sharded by both axes.
    got = names(aten.reshape.default, (f(4, 4, 16), [4, 4, 2, 8]), (2, 2))
    assert "S(0)S(2)->S(0)S(2)" in got
    assert "RS(2)->RS(2)" in got
    assert not any(name.startswith("S(2)S(2)") for name in got)


def test_attention_split_heads_on_a_mesh_of_three():
    # H = 6 divides by 3 (C = 24 too); H = 4 would not.
    got = names(aten.view.default, (f(2, 4, 24), [2, 4, 6, 4]), (2, 3))
    assert "S(0)S(2)->S(0)S(2)" in got
    got = names(aten.view.default, (f(2, 4, 24), [2, 4, 4, 6]), (2, 3))
    assert "S(0)S(2)->S(0)S(2)" not in got
    assert "S(0)R->S(0)R" in got


def test_attention_transpose_heads():
    """[B, T, H, D] -> [B, H, T, D]: batch stays, heads move from dim 2 to dim 1."""
    got = names(aten.transpose.int, (f(4, 4, 4, 8), 1, 2), (2, 2))
    assert "S(0)S(2)->S(0)S(1)" in got
    assert "S(1)S(2)->S(2)S(1)" in got


def test_attention_merge_heads():
    """[B, H, T, D] -> transpose -> [B, T, H, D] -> reshape [B, T, C]: heads shard C."""
    x = f(4, 4, 4, 8)
    assert "S(0)S(1)->S(0)S(2)" in names(aten.transpose.int, (x, 1, 2), (2, 2))
    got = names(aten.reshape.default, (x.transpose(1, 2), [4, 4, 32]), (2, 2))
    assert "S(0)S(2)->S(0)S(2)" in got
    assert "S(2)S(2)->S(2)S(2)" in got
    assert not any("S(3)" in name for name in got)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
def test_merge_never_shards_the_inner_dim(mesh):
    """[B, T, C] -> [B*T, C]: a shard of B is a block of rows; a shard of T is not."""
    strategies = check(aten.reshape.default, (f(4, 8, 12), [32, 12]), mesh)
    assert all(1 not in input_shards(s) for s in strategies)
    assert any(input_shards(s) == {0} and output_shards(s) == {0} for s in strategies)
    assert any(input_shards(s) == {2} and output_shards(s) == {1} for s in strategies)


def test_view_minus_one_is_resolved():
    got = names(aten.view.default, (f(4, 8, 12), [-1, 12]), (2, 2))
    assert "S(0)S(0)->S(0)S(0)" in got
    assert "RS(2)->RS(1)" in got


def test_squeeze_keeps_a_dim_sharded_down_to_one():
    """[2, 1, 4].squeeze() with dim 0 split 2 ways: each device holds [1, 1, 4], and must
    still keep dim 0 (local kind squeeze_dims)."""
    strategies = check(aten.squeeze.default, (f(2, 1, 4),), (2,))
    sharded = next(s for s in strategies if s.name == "S(0)->S(0)")
    assert sharded.local.kind == "squeeze_dims"
    assert sharded.local.params == (1,)
    kept = check(aten.squeeze.dim, (f(2, 4), 0), (2,))
    assert "S(0)->S(0)" in {s.name for s in kept}


def test_squeeze_of_size_one_dims_runs_the_same_op():
    strategies = check(aten.squeeze.dims, (f(4, 1, 12, 1), [1, 3]), (2,))
    assert {s.local.kind for s in strategies} == {"same"}


def test_expand_mask_never_shards_the_broadcast_dim():
    """A [1, T] boolean mask expanded to [B, T]: the broadcast dim is replicated on both
    sides; T keeps its shard; a boolean mask is never Partial."""
    mask = torch.ones(1, 8, dtype=torch.bool).tril()
    strategies = check(aten.expand.default, (mask, [4, 8]), (2, 2))
    assert all(0 not in input_shards(s) and 0 not in output_shards(s) for s in strategies)
    assert "RS(1)->RS(1)" in {s.name for s in strategies}
    assert not any("P" in s.name for s in strategies)


def test_expand_new_leading_dims_shift_shards():
    got = names(aten.expand.default, (f(8, 12), [4, 8, 12]), (2, 2))
    assert "S(0)S(1)->S(1)S(2)" in got
    assert not any("->S(0)" in name or "->RS(0)" in name for name in got)


# ---------------------------------------------------------------------------- cuts, joins


def test_slice_never_shards_the_cut_dim():
    strategies = check(aten.slice.Tensor, (f(4, 8, 12), 1, 2, 6), (2, 2))
    assert all(1 not in input_shards(s) for s in strategies)
    assert "S(0)S(2)->S(0)S(2)" in {s.name for s in strategies}


def test_whole_slice_is_an_identity():
    got = names(aten.slice.Tensor, (f(4, 8, 12), 1, 0, 9223372036854775807), (2, 2))
    assert "S(1)S(1)->S(1)S(1)" in got
    strided = names(aten.slice.Tensor, (f(4, 8, 12), 1, 0, 8, 2), (2,))
    assert "S(1)->S(1)" not in strided


def test_narrow_never_shards_the_cut_dim():
    got = names(aten.narrow.default, (f(4, 8, 12), -1, 0, 12), (2,))
    assert "S(2)->S(2)" not in got
    assert {"S(0)->S(0)", "S(1)->S(1)"} <= got


def test_select_shifts_later_dims():
    got = names(aten.select.int, (f(4, 8, 12), 1, 3), (2, 2))
    assert "S(0)S(2)->S(0)S(1)" in got
    assert not any(name.startswith("S(1)") or name.startswith("RS(1)") for name in got)


@pytest.mark.parametrize(
    ("target", "pieces"),
    [(aten.split.Tensor, 6), (aten.chunk.default, 2), (aten.split_with_sizes.default, [4, 8])],
)
def test_split_keeps_other_shards_in_every_output(target, pieces):
    strategies = check(target, (f(4, 8, 12), pieces, -1), (2, 2))
    assert all(2 not in input_shards(s) for s in strategies)
    both = [s for s in strategies if input_shards(s) == {0, 1}]
    assert both
    assert all(len(s.outputs) == 2 and s.outputs == (s.inputs[0],) * 2 for s in both)


def test_unbind_shifts_later_dims_in_every_output():
    strategies = check(aten.unbind.int, (f(4, 2, 12), 1), (2, 2))
    assert len(strategies[0].outputs) == 2
    found = next(s for s in strategies if s.name.startswith("S(0)S(2)->"))
    assert found.name == "S(0)S(2)->S(0)S(1),S(0)S(1)"


def test_cat_inputs_share_one_layout():
    got = names(aten.cat.default, ([f(4, 12), f(8, 12)], 0), (2,))
    assert "S(1),S(1)->S(1)" in got
    assert "P,P->P" in got
    assert not any("S(0)" in name for name in got)
    assert not any(name.startswith("P,R") or name.startswith("R,P") for name in got)


def test_stack_inserts_a_dim():
    got = names(aten.stack.default, ([f(4, 12), f(4, 12)], 1), (2, 2))
    assert "S(0)S(1),S(0)S(1)->S(0)S(2)" in got
    assert "PR,PR->PR" in got


# ---------------------------------------------------------------------------- indexing


def test_index_adjacent_keeps_unindexed_dims_in_place():
    """x[:, idx] with idx [4]: out [4, 4, 12]; dims 0 and 2 of x keep their shards; idx
    sharded shards out dim 1."""
    got = names(aten.index.Tensor, (f(4, 8, 12), [None, ints(8, 4)]), (2,))
    assert {"S(0),R->S(0)", "S(2),R->S(2)", "R,S(0)->S(1)", "P,R->P"} <= got
    assert "S(1),R->S(1)" not in got


def test_index_apart_moves_broadcast_dims_first():
    """x[i, :, j] with i, j [4]: out [4, 8]; dim 1 of x becomes out dim 1."""
    got = names(aten.index.Tensor, (f(4, 8, 12), [ints(4, 4), None, ints(12, 4)]), (2, 2))
    assert "S(1)R,RR,RR->S(1)R" in got
    assert "RR,S(0)R,S(0)R->S(0)R" in got
    assert not any(name.startswith("S(0)") or name.startswith("S(2)") for name in got)


def test_index_broadcast_index_replicated_where_it_broadcasts():
    # idx0 [4, 1], idx1 [1, 6]: broadcast [4, 6] at dims 1, 2 of the output.
    got = names(aten.index.Tensor, (f(4, 8, 12), [None, ints(8, 4, 1), ints(12, 1, 6)]), (2,))
    assert {"R,S(0),R->S(1)", "R,R,S(1)->S(2)", "S(0),R,R->S(0)"} <= got


def test_index_with_a_mask_is_left_replicated():
    mask = torch.tensor([True, False, True, True])
    strategies, failures = check_rule(
        view.index_rule, aten.index.Tensor, (f(4, 8), [mask]), None, (2,)
    )
    assert strategies == [] and failures == []


def test_index_select_and_gather():
    got = names(aten.index_select.default, (f(4, 8, 12), 1, ints(8, 4)), (2,))
    assert {"S(0),R->S(0)", "S(2),R->S(2)", "R,S(0)->S(1)", "P,R->P"} <= got
    assert "S(1),R->S(1)" not in got
    got = names(aten.gather.default, (f(4, 8, 12), 1, ints(8, 4, 4, 12)), (2,))
    assert {"S(0),S(0)->S(0)", "S(2),S(2)->S(2)", "R,S(1)->S(1)", "P,R->P"} <= got
    assert "S(1),S(1)->S(1)" not in got
    short = names(aten.gather.default, (f(4, 8, 12), 2, ints(12, 2, 8, 6)), (2,))
    assert "S(0),S(0)->S(0)" not in short  # index dim 0 is shorter: shards would not line up
    assert "S(1),S(1)->S(1)" in short


# ---------------------------------------------------------------------------- copies


def test_repeat_flip_roll_leave_their_dims_unsharded():
    got = names(aten.repeat.default, (f(4, 12), [3, 1, 2]), (2,))
    assert "S(0)->S(1)" in got
    assert "S(1)->S(2)" not in got
    got = names(aten.flip.default, (f(4, 8, 12), [0, -1]), (2,))
    assert got == {"R->R", "S(1)->S(1)", "P->P"}
    got = names(aten.roll.default, (f(4, 8, 12), [1], [-2]), (2,))
    assert got == {"R->R", "S(0)->S(0)", "S(2)->S(2)", "P->P"}
    assert names(aten.roll.default, (f(4, 12), [3]), (2,)) == {"R->R", "P->P"}
