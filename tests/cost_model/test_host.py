"""The host a node's devices hang off (``autopar_cost_model.host``): the presets' host memory
and links, with the arithmetic from their datasheets, and the two prices built on them."""

from __future__ import annotations

import pytest

from autopar_cost_model.hardware import HostLink, load_preset
from autopar_cost_model.host import host_copy_time, host_step_time
from autopar_cost_model.optimizer import STEP_TRAFFIC
from autopar_plans.errors import PresetError


@pytest.mark.parametrize(
    ("name", "link", "dram"),
    [
        # PCIe Gen5 x16: 32 GT/s x 16 lanes x 128/130 / 8 bits; 2 sockets x 8 x DDR5-4800 x 8 B
        ("h100-sxm", 32e9 * 16 * 128 / 130 / 8, 2 * 8 * 4800e6 * 8),
        ("h200-sxm", 32e9 * 16 * 128 / 130 / 8, 2 * 8 * 4800e6 * 8),
        # PCIe Gen4 x16; 2 sockets x 8 x DDR4-3200 x 8 B
        ("a100-80gb-sxm", 16e9 * 16 * 128 / 130 / 8, 2 * 8 * 3200e6 * 8),
    ],
)
def test_gpu_presets_carry_their_nodes_host_from_the_datasheet_arithmetic(name, link, dram):
    host = load_preset(name).host
    assert host is not None
    assert host.memory_bytes == 2e12  # 2 TB a DGX node
    assert host.to_device == pytest.approx(link, rel=0.01)
    assert host.from_device == host.to_device
    assert host.memory_bandwidth == pytest.approx(dram, rel=1e-9)


def test_grace_hopper_reaches_its_host_over_nvlink_c2c():
    """GH200: each superchip's own Grace CPU over NVLink-C2C (900 GB/s both ways together),
    480 GB of LPDDR5X at 512 GB/s per superchip, four superchips a node: a gigabyte
    crosses seven times faster than over an H100's PCIe Gen5."""
    gh200 = load_preset("gh200")
    host = gh200.host
    assert host is not None
    assert host.to_device == host.from_device == 900e9 / 2
    assert host.memory_bytes == gh200.gpus_per_node * 480e9
    assert host.memory_bandwidth == gh200.gpus_per_node * 512e9
    pcie = host_copy_time(1e9, load_preset("h100-sxm"), "to_device")
    assert pcie / host_copy_time(1e9, gh200, "to_device") > 7


def test_a_copy_is_its_latency_plus_the_bytes_at_the_links_reachable_rate():
    h100 = load_preset("h100-sxm")
    host = h100.host
    assert host is not None
    one = host_copy_time(1e9, h100, "from_device")
    assert one == pytest.approx(host.latency + 1e9 / (host.from_device * host.efficiency))
    assert host_copy_time(2e9, h100, "from_device") - one == pytest.approx(one - host.latency)
    assert host_copy_time(0, h100, "to_device") == 0.0


def test_a_host_step_streams_the_optimizers_passes_through_shared_host_memory():
    h100 = load_preset("h100-sxm")
    alone = host_step_time(1e9, "adamw", 4, h100, sharing=1)
    passes = STEP_TRAFFIC["adamw"].passes
    assert h100.host is not None
    assert alone == pytest.approx(
        1e9 * passes * 4 / (h100.host.memory_bandwidth * h100.efficiency.memory)
    )
    assert host_step_time(1e9, "adamw", 4, h100) == pytest.approx(8 * alone)  # 8 GPUs share
    assert host_step_time(1e9, "sgd", 4, h100, sharing=1) < alone


def test_a_preset_without_a_host_says_how_to_add_one():
    bare = load_preset("h100-sxm").model_copy(update={"host": None, "name": "mine"})
    with pytest.raises(PresetError, match="preset 'mine' says nothing of its host: add host:"):
        host_copy_time(1e6, bare, "to_device")


def test_a_measured_optimizer_bandwidth_replaces_the_drams_peak_times_efficiency(make_preset):
    """``autopar calibrate`` measures the host's step (``HostLink.optimizer_bandwidth``, in
    the bytes ``STEP_TRAFFIC`` counts): then the step is that traffic at that rate, shared."""
    link = HostLink(
        memory_bytes=2**40,
        memory_bandwidth=400e9,
        to_device=50e9,
        from_device=50e9,
        optimizer_bandwidth=30e9,
    )
    preset = make_preset(gpus_per_node=4).model_copy(update={"host": link})
    passes = STEP_TRAFFIC["adamw"].passes
    assert host_step_time(1e9, "adamw", 4, preset, sharing=1) == pytest.approx(
        1e9 * passes * 4 / 30e9
    )
    assert host_step_time(1e9, "adamw", 4, preset, sharing=2) == pytest.approx(
        1e9 * passes * 4 / 15e9
    )
    assert host_step_time(1e9, "adamw", 4, preset) == pytest.approx(1e9 * passes * 4 / 7.5e9)
    peak = preset.model_copy(update={"host": link.model_copy(update={"optimizer_bandwidth": None})})
    assert host_step_time(1e9, "adamw", 4, peak, sharing=1) == pytest.approx(
        1e9 * passes * 4 / (400e9 * peak.efficiency.memory)
    )
