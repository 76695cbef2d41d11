"""Measure the machine this runs on and write what it found as a preset.

- **Matmul FLOP/s** per dtype (float32, bfloat16, float16, float64; on a GPU also
  tfloat32): square matmuls of a size that grows until one call takes a measurable time,
  ``2 n^3`` FLOPs each, timed for a fixed budget.
- **Memory bandwidth**: ``dst.copy_(src)`` of a large buffer, ``2 x`` its size per copy
  (read + write), as STREAM's copy kernel counts it.
- **Collective bus bandwidth** and step latency: ``collective_bench`` on 2 local processes
  with gloo on a CPU, or NCCL across the visible GPUs when there are at least two.

The numbers are achieved, not peaks, so the preset's efficiencies are 1. What one machine
cannot measure (the inter-node link, the intra-node one on a single GPU, the node size,
float8) comes from the closest shipped preset times that preset's efficiencies, and the
file's header says which figures those are.

>>> result = calibrate(quick=True)                             # doctest: +SKIP
>>> save_preset(result.preset, "local.yaml", "\\n".join(result.notes))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.multiprocessing as mp

from cost_model.collective_bench import measure_collectives
from cost_model.hardware import DevicePreset, Efficiency, Link, load_preset
from plans.errors import UsageError


class Budget(NamedTuple):
    """How long each measurement may take, and how big it may get."""

    seconds: float
    max_matmul: int
    copy_bytes: int
    comm_bytes: int
    comm_iters: int


QUICK = Budget(seconds=0.1, max_matmul=4096, copy_bytes=32 << 20, comm_bytes=4 << 20, comm_iters=3)
FULL = Budget(
    seconds=0.5, max_matmul=8192, copy_bytes=512 << 20, comm_bytes=64 << 20, comm_iters=10
)


class Calibration(NamedTuple):
    """The measured preset and notes on how each figure was obtained."""

    preset: DevicePreset
    notes: tuple[str, ...]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch_seconds(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Mean seconds per call over one batch of ``calls`` back-to-back calls."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def time_call(fn: Callable[[], object], seconds: float, device: torch.device) -> float:
    """Seconds per ``fn()``: the fastest of the batches that fit in ``seconds``.

    Batches grow until one takes a tenth of the budget; the minimum over batches is the
    figure least disturbed by other load (the advice of Python's ``timeit``).
    """
    fn()  # warm-up: allocation, kernel selection, thread pools
    calls = 1
    best = _batch_seconds(fn, calls, device)
    while best * calls < seconds / 10 and calls < 1 << 16:
        calls *= 2
        best = _batch_seconds(fn, calls, device)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        best = min(best, _batch_seconds(fn, calls, device))
    return best


def measure_matmul(dtype: torch.dtype, device: torch.device, budget: Budget) -> float:
    """Achieved FLOP/s of square ``dtype`` matmuls; ``n`` doubles while one call is short."""
    n = 128
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        probe = time_call(lambda a=a, b=b: a @ b, budget.seconds / 10, device)
        if probe * 20 >= budget.seconds:
            break
        if 2 * n > budget.max_matmul:
            break
        n *= 2
    seconds = time_call(lambda: a @ b, budget.seconds, device)
    return 2 * n**3 / seconds


def measure_memory_bandwidth(device: torch.device, budget: Budget) -> float:
    """Achieved bytes/s of a large copy, counting the read and the write."""
    src = torch.ones(budget.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), budget.seconds, device)
    return 2 * budget.copy_bytes / seconds


def _device_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _base_preset(device: torch.device) -> DevicePreset:
    """The shipped preset closest to this device, for what cannot be measured here."""
    if device.type != "cuda":
        return load_preset("cpu")
    name = torch.cuda.get_device_name(device).upper()
    for marker, preset in (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-80gb-sxm")):
        if marker in name:
            return load_preset(preset)
    return load_preset("h100-sxm")


def default_name(device: torch.device | None = None) -> str:
    """``local-cpu``, or ``local-`` and the GPU's name in lower case (``local-nvidia-h200``)."""
    device = device or _default_device()
    if device.type != "cuda":
        return "local-cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"local-{slug}"


def _default_device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def _dtypes(device: torch.device) -> dict[str, torch.dtype]:
    """Every dtype is measured; a slow one (fp16 on most CPUs) just gets a small matmul."""
    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float64": torch.float64,
    }


def _rounded(value: float) -> float:
    """Four significant digits: measurements are not more precise than that."""
    return float(f"{value:.4g}")


def _measure_peaks(device: torch.device, budget: Budget) -> dict[str, float]:
    peaks = {key: measure_matmul(dtype, device, budget) for key, dtype in _dtypes(device).items()}
    if device.type == "cuda":
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            peaks["tfloat32"] = measure_matmul(torch.float32, device, budget)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    return {key: _rounded(value) for key, value in peaks.items()}


def _achievable(link: Link, base: DevicePreset) -> Link:
    """A base preset's peak link scaled by its network efficiency, to sit among measurements."""
    return Link(bandwidth=link.bandwidth * base.efficiency.network, latency=link.latency)


def _measure_links(
    device: torch.device, budget: Budget, base: DevicePreset, notes: list[str]
) -> tuple[Link, float]:
    """The intra-node link, measured when there is a second rank to talk to."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus < 2:
        notes.append(f"intra-node link: one GPU visible, kept from {base.name}")
        return _achievable(base.intra_node, base), base.launch_overhead
    backend, world = ("nccl", gpus) if device.type == "cuda" else ("gloo", 2)
    try:
        comm = measure_collectives(backend, world, budget.comm_bytes, budget.comm_iters)
    except (RuntimeError, OSError, mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]  # not the traceback
        notes.append(
            f"intra-node link: {backend} benchmark failed ({reason}); kept from {base.name}"
        )
        return _achievable(base.intra_node, base), base.launch_overhead
    busbw = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in comm.bus_bandwidth.items())
    notes.append(
        f"intra-node link: {backend} on {world} ranks, {comm.nbytes >> 20} MiB: bus "
        f"bandwidth {busbw}; 1-value all-reduce {comm.small_message_s * 1e6:.0f} us, "
        "counted as per-step latency (launch overhead 0)"
    )
    return Link(bandwidth=_rounded(comm.bandwidth), latency=_rounded(comm.step_latency)), 0.0


def calibrate(
    name: str | None = None,
    quick: bool = False,
    collectives: bool = True,
    device: torch.device | str | None = None,
    ranks: int = 1,
) -> Calibration:
    """Measure this machine (its first GPU if any, else the CPU) and describe it as a preset.

    ``ranks`` (CPU only): the device is one of that many ranks sharing the machine, as
    ``autopar.testing.run_ranks`` runs them (one torch thread each): compute is measured on
    ``cores // ranks`` threads (at least one) and divided by how many ranks share each
    thread's core; memory and its bandwidth are divided among the ranks."""
    device = torch.device(device) if device is not None else _default_device()
    if ranks < 1 or (ranks > 1 and device.type != "cpu"):
        raise UsageError(f"ranks={ranks}: one or more, and more than one only on a CPU")
    budget = QUICK if quick else FULL
    base = _base_preset(device)
    cores = os.cpu_count() or 1
    threads = max(1, cores // ranks) if ranks > 1 else torch.get_num_threads()
    share = min(1.0, cores / (ranks * threads)) if ranks > 1 else 1.0
    notes: list[str] = [
        f"measured by `autopar calibrate{' --quick' if quick else ''}"
        f"{f' --ranks {ranks}' if ranks > 1 else ''}` on "
        f"{_describe(device)} with torch {torch.__version__}"
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peaks = {k: _rounded(v * share) for k, v in _measure_peaks(device, budget).items()}
    finally:
        torch.set_num_threads(before)
    memory_bandwidth = _rounded(measure_memory_bandwidth(device, budget) / ranks)
    notes.append(
        "peak_flops: achieved square-matmul FLOP/s; memory_bandwidth: achieved copy "
        f"bandwidth of {budget.copy_bytes >> 20} MiB (read + write)"
    )
    if ranks > 1:
        notes.append(
            f"one of {ranks} ranks on {cores} cores: matmuls on {threads} thread(s), times "
            f"{share:.2f} (the ranks sharing a core); memory and its bandwidth divided by "
            f"{ranks}; the collectives as measured on 2 processes"
        )
    if collectives:
        intra, launch = _measure_links(device, budget, base, notes)
    else:
        intra, launch = _achievable(base.intra_node, base), base.launch_overhead
        notes.append(f"intra-node link: not measured (collectives skipped), kept from {base.name}")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    gpus_per_node = gpus if gpus > 1 else base.gpus_per_node
    borrowed = {
        k: v * base.efficiency.compute for k, v in base.peak_flops.items() if k not in peaks
    }
    notes.append(
        f"from {base.name}, times its efficiencies: the inter-node link"
        f"{'' if gpus > 1 else ', gpus_per_node'}"
        f"{''.join(f', {k} peak' for k in borrowed)}, and any link kept above; "
        "efficiencies 1 (every figure is an achieved one)"
    )
    preset = DevicePreset(
        name=name or default_name(device),
        description=f"calibrated on {_describe(device)}",
        peak_flops={**peaks, **{k: _rounded(v) for k, v in borrowed.items()}},
        memory_bytes=_device_memory(device) / ranks,
        memory_bandwidth=memory_bandwidth,
        gpus_per_node=gpus_per_node,
        intra_node=intra,
        inter_node=_achievable(base.inter_node, base),
        launch_overhead=launch,
        efficiency=Efficiency(compute=1.0, memory=1.0, network=1.0),
    )
    return Calibration(preset, tuple(notes))


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def summary_rows(preset: DevicePreset) -> list[tuple[str, str]]:
    """Figure name and value, for printing a preset."""
    rows = [
        (f"{k} matmul", f"{v / 1e12:.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.1f} GFLOP/s")
        for k, v in preset.peak_flops.items()
    ]
    rows += [
        ("memory", f"{preset.memory_bytes / 2**30:.1f} GiB"),
        ("memory bandwidth", f"{preset.memory_bandwidth / 1e9:.1f} GB/s"),
        ("intra-node bus bandwidth", f"{preset.intra_node.bandwidth / 1e9:.2f} GB/s"),
        ("intra-node step latency", f"{preset.intra_node.latency * 1e6:.1f} us"),
        ("inter-node bus bandwidth", f"{preset.inter_node.bandwidth / 1e9:.2f} GB/s"),
    ]
    return rows
