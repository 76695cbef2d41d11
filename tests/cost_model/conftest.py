"""Fixtures for the cost-model tests: synthetic presets with round numbers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from autopar_cost_model import DevicePreset, Efficiency, Link


def synthetic_preset(
    intra_bw: float = 100e9,
    inter_bw: float = 10e9,
    intra_lat: float = 0.0,
    inter_lat: float = 0.0,
    launch: float = 0.0,
    gpus_per_node: int = 8,
) -> DevicePreset:
    """A device with efficiencies of 1 and the given links, so formulas can be checked exactly."""
    return DevicePreset(
        name="synthetic",
        peak_flops={"float32": 100e12, "bfloat16": 400e12},
        memory_bytes=80 * 2**30,
        memory_bandwidth=2e12,
        gpus_per_node=gpus_per_node,
        intra_node=Link(bandwidth=intra_bw, latency=intra_lat),
        inter_node=Link(bandwidth=inter_bw, latency=inter_lat),
        launch_overhead=launch,
        efficiency=Efficiency(compute=1.0, memory=1.0, network=1.0),
    )


@pytest.fixture
def make_preset() -> Callable[..., DevicePreset]:
    return synthetic_preset
