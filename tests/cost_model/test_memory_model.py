"""Memory per device: model states by optimizer, precision and layout; activations in flight."""

from __future__ import annotations

import pytest

from autopar_cost_model import (
    ParamLayouts,
    activation_memory,
    device_memory,
    microbatches_in_flight,
    model_state_memory,
    optimizer_state_values,
    param_state_bytes,
    saved_activation_bytes,
)
from autopar_plans import Layout, MeshSpec, ParamPlan, Replicate, Shard
from autopar_plans.errors import UsageError

R = Replicate()
GB = 1e9


def zero_stage_layouts(stage: int) -> tuple[Layout, Layout, Layout]:
    """(param, grad, optimizer) layouts on a 1-D data-parallel mesh for a ZeRO stage."""
    sharded, replicated = Layout(Shard(0)), Layout(R)
    return (
        sharded if stage >= 3 else replicated,
        sharded if stage >= 2 else replicated,
        sharded if stage >= 1 else replicated,
    )


@pytest.mark.parametrize(
    ("stage", "expected_gb"), [(0, 120.0), (1, 31.4), (2, 16.6 + 2 * 7.5 / 64), (3, 1.9)]
)
def test_zero_table_falls_out_of_layouts(stage, expected_gb):
    # Rajbhandari et al. 2019 (ZeRO), Figure 1 / Table 1: Psi = 7.5B, N_d = 64, mixed-precision
    # Adam with K = 12: 120 GB (DP), 31.4 (P_os), 16.6 (P_os+g), 1.9 (P_os+g+p). ZeRO-2's
    # gradient piece is fp32 here (runtime.zero: torch steps the fp32 master with a gradient
    # of its own dtype), 2 Psi / N_d more than the paper's 16-bit partition.
    mesh = MeshSpec((64,), ("dp",))
    param, grad, optimizer = zero_stage_layouts(stage)
    # 7.5B parameters in two tensors whose dim 0 splits evenly over the 64 devices
    shapes = [(64, 100_000_000), (64, 17_187_500)]
    assert sum(a * b for a, b in shapes) == 7_500_000_000
    params = [ParamLayouts(s, param, grad, optimizer) for s in shapes]
    memory = model_state_memory(params, mesh, optimizer="adam", precision="bf16_mixed")
    assert memory.total / GB == pytest.approx(expected_gb, abs=0.05)  # the table's rounding
    assert memory.total == memory.params + memory.grads + memory.optimizer


def test_zero_with_plan_param_entries():
    # plans.ParamPlan carries the three layouts directly; ZeRO-3 = everything sharded
    mesh = MeshSpec((64,), ("dp",))
    plan = ParamPlan(
        shape=(75_000, 100_000),
        dtype="bfloat16",
        param=Layout(Shard(0)),
        grad=Layout(Shard(0)),
        optimizer=Layout(Shard(0)),
    )
    memory = model_state_memory([plan], mesh, optimizer="adamw", precision="fp16_mixed")
    # as FSDP2's MixedPrecisionPolicy: the sharded fp32 parameter is the master, its gradient
    # fp32; the 16-bit copies are gathered for the layer running
    assert memory.params == pytest.approx(4 * 7.5e9 / 64)
    assert memory.grads == pytest.approx(4 * 7.5e9 / 64)
    assert memory.optimizer == pytest.approx(8 * 7.5e9 / 64)


def test_bytes_per_parameter_by_optimizer_and_precision():
    n = 1000
    # the fp32 parameter is its own master under autocast
    assert param_state_bytes((n,), "adam", "bf16_mixed") == (4 * n, 4 * n, 8 * n)
    assert param_state_bytes((n,), "adamw", "fp32") == (4 * n, 4 * n, 8 * n)
    assert param_state_bytes((n,), "adam", "bf16") == (2 * n, 2 * n, 4 * n)
    assert param_state_bytes((n,), "sgd", "fp32") == (4 * n, 4 * n, 0)
    assert param_state_bytes((n,), "sgd", "bf16_mixed") == (4 * n, 4 * n, 0)
    assert param_state_bytes((n,), "sgd_momentum", "fp32") == (4 * n, 4 * n, 4 * n)


def test_zero_holds_a_working_copy_and_a_master_piece():
    n = 1000
    # ZeRO's K = 12: a bf16 working copy and gradient, the fp32 master beside Adam's moments
    zero1 = param_state_bytes((n,), "adam", "bf16_mixed", zero=1, working_cast=True)
    assert zero1 == (2 * n, 2 * n, 12 * n)
    # ZeRO-2's gradient lands in the master's fp32 piece
    zero2 = param_state_bytes((n,), "adam", "bf16_mixed", zero=2, working_cast=True)
    assert zero2 == (2 * n, 4 * n, 12 * n)
    # a norm's weight or an embedding keeps an fp32 working copy (autocast reads it in fp32)
    kept = param_state_bytes((n,), "adam", "bf16_mixed", zero=1, working_cast=False)
    assert kept == (4 * n, 4 * n, 12 * n)
    # fp32 holds the master piece beside the whole working copy; pure bf16 all in 16 bits
    assert param_state_bytes((n,), "adam", "fp32", zero=1) == (4 * n, 4 * n, 12 * n)
    assert param_state_bytes((n,), "sgd", "bf16", zero=2) == (2 * n, 2 * n, 2 * n)


def test_adafactor_keeps_row_and_column_factors():
    # Shazeer & Stern 2018: an (r, c) matrix keeps r + c second-moment values, no momentum
    assert optimizer_state_values((4096, 1024), "adafactor") == 4096 + 1024
    assert optimizer_state_values((8, 4096, 1024), "adafactor") == 8 * (4096 + 1024)
    assert optimizer_state_values((4096,), "adafactor") == 4096
    assert param_state_bytes((4096, 1024), "adafactor", "fp32")[2] == 4 * (4096 + 1024)


def test_unknown_optimizer_and_precision_are_refused():
    with pytest.raises(UsageError, match="adamw"):
        param_state_bytes((10,), "lion", "fp32")
    with pytest.raises(UsageError, match="bf16_mixed"):
        param_state_bytes((10,), "adam", "fp8")


def test_tensor_parallel_and_data_parallel_layouts_divide_separately():
    mesh = MeshSpec((2, 4), ("dp", "tp"))
    tp_only = Layout(R, Shard(0))
    both = Layout(Shard(1), Shard(0))
    memory = model_state_memory(
        [ParamLayouts((1024, 1024), tp_only, tp_only, both)],
        mesh,
        optimizer="adam",
        precision="fp32",
    )
    numel = 1024 * 1024
    assert memory.params == 4 * numel / 4
    assert memory.grads == 4 * numel / 4
    # ZeRO-1 over dp: the fp32 master piece beside Adam's moments, split 8 ways
    assert memory.optimizer == (4 + 8) * numel / 8


def test_saved_activations_divide_by_their_layouts():
    mesh = MeshSpec((2, 4), ("dp", "tp"))
    saved = [(8e6, Layout(Shard(0), R)), (8e6, Layout(Shard(0), Shard(2))), (1e6, Layout(R, R))]
    assert saved_activation_bytes(saved, mesh) == 4e6 + 1e6 + 1e6


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (8, 32)])
def test_microbatches_in_flight_per_schedule(p, m):
    # GPipe holds every microbatch (Huang et al. 2019); 1F1B holds p - i on stage i
    # (Narayanan et al. 2021, Sec. 2.2.1), never more than m
    for i in range(p):
        assert microbatches_in_flight("gpipe", p, i, m) == m
        assert microbatches_in_flight("1f1b", p, i, m) == min(p - i, m)
        assert microbatches_in_flight("none", p, i, m) == 1


def test_interleaved_in_flight_matches_megatron_and_korthikanti():
    # Megatron-LM schedules.py: warm-up = 2 (p - i - 1) + (v - 1) p chunk-microbatches;
    # Korthikanti et al. 2022, Sec. 4.2.3: stage 0 holds p (1 + (p - 1) / (p v)) microbatches
    p, m, v = 4, 16, 2
    assert microbatches_in_flight("interleaved", p, 0, m, v) == pytest.approx(
        p * (1 + (p - 1) / (p * v))
    )
    assert microbatches_in_flight("interleaved", p, p - 1, m, v) == pytest.approx(
        ((v - 1) * p + 1) / v
    )
    # few microbatches cap it: m v chunk-forwards in all
    assert microbatches_in_flight("interleaved", 8, 0, 1, 2) == 1.0
    # one chunk is plain 1F1B
    assert microbatches_in_flight("interleaved", p, 0, m, 1) == p


def test_activation_peak_is_in_flight_times_one_microbatch_plus_transient():
    assert (
        activation_memory(2e9, schedule="1f1b", stages=4, stage=1, microbatches=8, transient=5e8)
        == 3 * 2e9 + 5e8
    )
    memory = device_memory(model_state_memory([], (1,)), 3e9)
    assert memory.activations == 3e9 and memory.total == 3e9


def test_bad_pipeline_arguments_are_refused():
    with pytest.raises(UsageError):
        microbatches_in_flight("1f1b", 4, 4, 8)
    with pytest.raises(UsageError, match="schedule"):
        microbatches_in_flight("zigzag", 4, 0, 8)
