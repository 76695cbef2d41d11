"""Roofline compute time (Williams et al. 2009): max(FLOPs / peak, bytes / bandwidth)."""

from __future__ import annotations

import pytest
import torch

from autopar_cost_model import (
    backward_flops,
    backward_time,
    is_compute_bound,
    load_preset,
    matmul_flops,
    op_time,
    peak_flops,
)

GPU_PRESETS = ["a100-80gb-sxm", "h100-sxm", "h200-sxm"]


def matmul(n: int, itemsize: int) -> tuple[int, int]:
    """FLOPs and bytes (read A and B, write C) of an n x n x n matmul."""
    return matmul_flops(n, n, n), 3 * n * n * itemsize


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_big_matmul_is_compute_bound(name):
    preset = load_preset(name)
    flops, nbytes = matmul(8192, 2)
    assert is_compute_bound(flops, nbytes, "bfloat16", preset)
    expected = flops / (preset.peak_flops["bfloat16"] * preset.efficiency.compute)
    assert op_time(flops, nbytes, torch.bfloat16, preset) == pytest.approx(expected)


@pytest.mark.parametrize("name", [*GPU_PRESETS, "cpu"])
def test_pointwise_op_is_memory_bound(name):
    preset = load_preset(name)
    numel = 64 * 2**20
    flops, nbytes = numel, 3 * numel * 2  # an add: one FLOP per value, two reads one write
    assert not is_compute_bound(flops, nbytes, "bfloat16", preset)
    expected = nbytes / (preset.memory_bandwidth * preset.efficiency.memory)
    assert op_time(flops, nbytes, "bfloat16", preset) == pytest.approx(expected)


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_bf16_matmul_is_faster_than_fp32_on_gpus(name):
    preset = load_preset(name)
    flops, _ = matmul(8192, 4)
    bf16 = op_time(flops, 3 * 8192**2 * 2, "bfloat16", preset)
    fp32 = op_time(flops, 3 * 8192**2 * 4, "float32", preset)
    tf32 = op_time(flops, 3 * 8192**2 * 4, "tfloat32", preset)
    assert bf16 < tf32 < fp32
    peaks = preset.peak_flops
    assert fp32 / bf16 == pytest.approx(peaks["bfloat16"] / peaks["float32"])


def test_ops_without_flops_and_integer_ops_are_memory_bound(make_preset):
    preset = make_preset()  # 2 TB/s, efficiencies 1
    assert op_time(0, 4e9, "float32", preset) == pytest.approx(2e-3)
    assert op_time(1e15, 4e9, torch.int64, preset) == pytest.approx(2e-3)
    assert op_time(1e15, 4e9, "bool", preset) == pytest.approx(2e-3)


def test_dtype_fallbacks(make_preset):
    preset = make_preset()  # float32 100 TFLOP/s, bfloat16 400; nothing else
    assert peak_flops(preset, torch.float16) == 400e12  # as bfloat16
    assert peak_flops(preset, "float64") == 50e12  # half of float32
    assert peak_flops(preset, "tf32") == 100e12  # as float32
    assert peak_flops(preset, torch.float8_e4m3fn) == 400e12
    assert peak_flops(preset, torch.int8) is None
    assert peak_flops(load_preset("h100-sxm"), "float8_e5m2") == pytest.approx(1978.9e12)


def test_matmul_backward_is_twice_the_forward(make_preset):
    # Narayanan et al. 2021, Sec. 5.1: backward = 2x forward FLOPs for the GEMMs
    assert backward_flops(1e12) == 2e12
    assert backward_flops(1e9, "other") == 1e9
    preset = make_preset()
    flops, nbytes = matmul(8192, 2)
    assert backward_time(flops, nbytes, "bfloat16", preset) == pytest.approx(
        2 * op_time(flops, nbytes, "bfloat16", preset)
    )


def test_a_measured_matmul_curve_replaces_the_peak_read_between_its_points(make_preset):
    """``op_rates``: 10 TFLOP/s at 1 GFLOP a call, 40 at 100 GFLOP; halfway on the log
    scale (10 GFLOP) 25 TFLOP/s. Beyond the ends, the end's rate; other families and
    dtypes keep the peak (100 TFLOP/s fp32 in the synthetic preset)."""
    preset = make_preset().model_copy(
        update={"op_rates": {"matmul": {"float32": [(1e9, 10e12), (100e9, 40e12)]}}}
    )
    assert op_time(10e9, 0, "float32", preset, "matmul") == pytest.approx(10e9 / 25e12)
    assert op_time(1e6, 0, "float32", preset, "matmul") == pytest.approx(1e6 / 10e12)
    assert op_time(1e12, 0, "float32", preset, "matmul") == pytest.approx(1e12 / 40e12)
    # the backward of a call of 10 GFLOP does 20 GFLOP at that call's rate
    assert op_time(20e9, 0, "float32", preset, "matmul", 10e9) == pytest.approx(20e9 / 25e12)
    assert op_time(10e9, 0, "float32", preset, "attention") == pytest.approx(10e9 / 100e12)
    assert op_time(10e9, 0, "bfloat16", preset, "matmul") == pytest.approx(10e9 / 400e12)


def test_op_rates_refuse_unknown_families_dtypes_and_unordered_sizes(make_preset):
    from pydantic import ValidationError

    for bad in (
        {"conv": {"float32": [(1.0, 1.0)]}},
        {"matmul": {"fp32": [(1.0, 1.0)]}},
        {"matmul": {"float32": [(2.0, 1.0), (1.0, 1.0)]}},
        {"matmul": {"float32": [(1.0, 0.0)]}},
    ):
        with pytest.raises(ValidationError):
            type(make_preset()).model_validate({**make_preset().model_dump(), "op_rates": bad})


def test_in_step_scales_the_roofline_time_of_every_op():
    """``in_step`` (fitted by ``autopar calibrate``): ops inside a step run that much slower
    than alone, compute-bound and memory-bound alike."""
    from autopar_cost_model.compute import op_time
    from autopar_cost_model.hardware import load_preset

    cpu = load_preset("cpu")
    slower = cpu.model_copy(update={"in_step": 1.5})
    for flops, moved in ((2 * 4096**3, 3 * 4 * 4096**2), (0.0, 8e6)):
        assert op_time(flops, moved, "float32", slower) == pytest.approx(
            1.5 * op_time(flops, moved, "float32", cpu)
        )
