"""Roofline compute time (Williams et al. 2009): max(FLOPs / peak, bytes / bandwidth)."""

from __future__ import annotations

import pytest
import torch

from cost_model import (
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
