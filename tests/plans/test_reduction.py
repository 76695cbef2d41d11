"""The gradient-reduction policy's step lists (``autopar_plans.reduction``)."""

from __future__ import annotations

from autopar_plans.reduction import (
    GradReduction,
    ReduceStep,
    hierarchical_steps,
    padded_numel,
    reduce_steps,
)


def test_per_axis_is_one_all_reduce_per_axis_of_more_than_one_device():
    policy = GradReduction(form="per_axis")
    assert reduce_steps(policy, [("dp", 4), ("one", 1), ("tp", 2)]) == [
        ReduceStep("all_reduce", "dp", 1),
        ReduceStep("all_reduce", "tp", 1),
    ]


def test_the_hierarchical_form_shrinks_the_piece_down_and_gathers_it_back():
    assert hierarchical_steps([("gpu", 8), ("rack", 4), ("node", 2)]) == [
        ReduceStep("reduce_scatter", "gpu", 1),
        ReduceStep("reduce_scatter", "rack", 8),
        ReduceStep("all_reduce", "node", 32),
        ReduceStep("all_gather", "rack", 8),
        ReduceStep("all_gather", "gpu", 1),
    ]


def test_the_policy_orders_axes_fastest_first_and_keeps_one_axis_flat():
    policy = GradReduction(form="hierarchical", axis_order=("gpu", "node"))
    steps = reduce_steps(policy, [("node", 2), ("gpu", 8)])
    assert [(s.kind, s.axis) for s in steps] == [
        ("reduce_scatter", "gpu"),
        ("all_reduce", "node"),
        ("all_gather", "gpu"),
    ]
    assert reduce_steps(policy, [("node", 2), ("gpu", 1)]) == [ReduceStep("all_reduce", "node", 1)]


def test_a_bucket_pads_to_split_evenly_over_the_reduce_scatters():
    steps = hierarchical_steps([("gpu", 8), ("node", 2)])
    assert padded_numel(1001, steps, [("gpu", 8), ("node", 2)]) == 1008
    assert padded_numel(1001, [ReduceStep("all_reduce", "dp", 1)], [("dp", 4)]) == 1001


def test_local_sgd_syncs_through_the_warm_up_then_averages_every_period():
    policy = GradReduction(sync="local_sgd", period=3, warmup=2)
    assert [policy.syncs_every_step(s) for s in range(4)] == [True, True, False, False]
    assert [s for s in range(12) if policy.averages_after(s)] == [4, 7, 10]


def test_a_casting_scheme_sums_in_16_bits_but_never_widens():
    bf16 = GradReduction(compression={"scheme": "bf16"})
    assert bf16.wire_dtype("float32", None) == "bfloat16"
    assert bf16.wire_dtype("float32", "float16") == "float16"  # mixed fp16: already 2 bytes
    assert GradReduction().wire_dtype("float32", "bfloat16") == "bfloat16"
    assert GradReduction().wire_dtype("int64", None) == "int64"
