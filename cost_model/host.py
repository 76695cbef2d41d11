"""What the host costs: copies over the device-host link and an optimizer step on the CPU.

The groundwork of offload (issue 25): a tensor moved between a device and its host's
memory crosses the device's link (PCIe, NVLink-C2C) at the preset's ``HostLink`` figures,

    t = latency + S / (bandwidth x efficiency)

and an optimizer stepped on the CPU (ZeRO-Offload) streams its weights, gradients and
states through host memory, shared by the node's devices' processes, with the same
passes per value as on a device (``autopar_cost_model.optimizer.STEP_TRAFFIC``):

    t = N x passes x itemsize / (host memory bandwidth x e_memory / devices per node)

(``e_memory``: the preset's STREAM-like fraction of peak memory bandwidth, taken for the
host's DRAM too). Where ``autopar calibrate`` measured the host's optimizer step
(``HostLink.optimizer_bandwidth``: an AdamW step's traffic over its seconds) that figure
replaces ``host memory bandwidth x e_memory``: what a step's chain of element-wise ops
reaches on that CPU, its threads and caches included, not a copy's fraction of a datasheet.

>>> from autopar_cost_model.hardware import load_preset
>>> h100 = load_preset("h100-sxm")
>>> round(host_copy_time(1e9, h100, "to_device") * 1e3, 1)   # 1 GB over PCIe Gen5 x16
19.9
>>> round(host_step_time(1e9, "adamw", 4, h100), 2)   # AdamW over 1B fp32 values, 8 GPUs' share
1.23
"""

from __future__ import annotations

from typing import Literal

from autopar_cost_model.hardware import DevicePreset, HostLink
from autopar_cost_model.optimizer import STEP_TRAFFIC
from autopar_plans.errors import PresetError, UsageError

Direction = Literal["to_device", "from_device"]


def host_of(preset: DevicePreset) -> HostLink:
    """The preset's host, or ``PresetError`` saying how to add one."""
    if preset.host is None:
        raise PresetError(
            f"preset {preset.name!r} says nothing of its host: add host: {{memory_bytes, "
            "memory_bandwidth, to_device, from_device}} to it (see the shipped presets)"
        )
    return preset.host


def host_copy_time(nbytes: float, preset: DevicePreset, direction: Direction) -> float:
    """Seconds to copy ``nbytes`` between a device and the host, one way."""
    if nbytes <= 0:
        return 0.0
    host = host_of(preset)
    bandwidth = host.to_device if direction == "to_device" else host.from_device
    return host.latency + nbytes / (bandwidth * host.efficiency)


def host_step_time(
    numel: float, optimizer: str, itemsize: int, preset: DevicePreset, sharing: int | None = None
) -> float:
    """Seconds of one optimizer step over ``numel`` values on the host, its memory shared
    by ``sharing`` processes (default: the node's devices, each stepping its own piece)."""
    if optimizer not in STEP_TRAFFIC:
        raise UsageError(f"unknown optimizer {optimizer!r}; one of {', '.join(STEP_TRAFFIC)}")
    if numel <= 0:
        return 0.0
    host = host_of(preset)
    share = sharing if sharing is not None else preset.gpus_per_node
    bandwidth = host_step_bandwidth(host, preset) / max(share, 1)
    return numel * STEP_TRAFFIC[optimizer].passes * itemsize / bandwidth


def host_step_bandwidth(host: HostLink, preset: DevicePreset) -> float:
    """Bytes/s of step traffic the whole host reaches: measured where calibrated (the
    measured step, not a copy, is what an offloaded step runs), else its DRAM's peak times
    the preset's memory efficiency."""
    if host.optimizer_bandwidth is not None:
        return host.optimizer_bandwidth
    return host.memory_bandwidth * preset.efficiency.memory
