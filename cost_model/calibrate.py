"""Measure the machine this runs on and write what it found as a preset.

- **Matmul FLOP/s** per dtype (float32, bfloat16, float16, float64; on a GPU also
  tfloat32): square matmuls of a size that grows until one call takes a measurable time,
  ``2 n^3`` FLOPs each, timed for a fixed budget.
- **Memory bandwidth**: ``dst.copy_(src)`` of a large buffer, ``2 x`` its size per copy
  (read + write), as STREAM's copy kernel counts it.
- **Op rates**: FLOP/s of a Linear's forward and backward and of causal attention's, per
  dtype, at sizes doubling from small ones: training's matmuls are small and reach less
  than the square peak (one CPU thread here: 138 GFLOP/s in a small decoder's linears
  against 210 for a 2048-cube), and attention kernels less still.
- **Op overhead**: a chain of element-wise ops on a 4-value tensor that requires grad, as
  training records them: seconds per op forward, and per op of its backward (the autograd
  engine's node); asynchronous on a GPU (the host queues kernels), additive on a CPU.
- **A reference step**: forward and backward of a small fixed decoder
  (``autopar_cost_model.reference_step``), against which ``autopar calibrate`` fits ``in_step``,
  how much slower ops run inside a training step than each alone.
- **The host** (offload, ``autopar_cost_model.host``): an AdamW step on the CPU over fp32
  values too many for its caches (``torch.optim.AdamW`` with its default arguments, as
  ZeRO-Offload steps the optimizer there), as bytes/s of the traffic
  ``autopar_cost_model.optimizer.STEP_TRAFFIC`` counts, the median of several steps; with a
  GPU, pinned host-to-device and device-to-host copies; the machine's memory. With no GPU
  the link is the base preset's (host and device are one there).
- **Collectives**: ``collective_bench`` on 2 local processes with gloo on a CPU (on
  ``ranks`` of them with ``ranks``), or NCCL across the visible GPUs when there are at
  least two: bus bandwidth per collective as the runtime runs it, step latency, and the
  share of communication compute hides (``comm_overlap``).

With ``ranks`` (a CPU shared by that many local gloo ranks, as ``autopar.testing.run_ranks``
runs them), everything is measured by that many processes at once, one thread each (the
cores divided among them), each measurement begun together, and each figure is the median
over the processes of its mean over the window: what one rank gets while the others run,
caches and memory bus shared, not a share computed from one process alone. (The fastest
batch, kept on a machine to itself, is here one that the scheduler ran with a core alone:
with it, 4 ranks on 2 cores measured the bandwidth of one process alone, 28.6 GB/s, where
each gets 9.6 on average.) What this cannot see: a rank that waits (a pipeline's bubble)
leaves its core share to the others, so a plan whose ranks idle runs faster here than its
figures say; on GPUs, where each rank has its own device, that does not arise.

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
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.multiprocessing as mp
import torch.utils.flop_counter

from autopar_cost_model.collective_bench import PENALTY_COMPUTE_S, SMALLEST, measure_collectives
from autopar_cost_model.flops import cpu_flash_flop_mapping
from autopar_cost_model.hardware import (
    DevicePreset,
    Efficiency,
    HostLink,
    Link,
    OpOverhead,
    SharedCores,
    load_preset,
)
from autopar_cost_model.optimizer import STEP_TRAFFIC
from autopar_cost_model.reference_step import step_runner
from autopar_plans.errors import UsageError

OP_CHAIN = 64  # element-wise ops per timed chain (op overhead)
CPU_COPY_BYTES = 16 << 20  # the copy that measures a CPU's memory bandwidth (copy_bytes)
HOST_OPTIMIZER = "adamw"  # the optimizer whose step on the host is measured
MEDIAN_RUNS = 5  # the fewest calls ``median_call`` times


class Budget(NamedTuple):
    """How long each measurement may take, and how big it may get."""

    seconds: float
    max_matmul: int
    copy_bytes: int
    comm_bytes: int
    comm_iters: int
    # the fastest batch (a machine to itself: the figure least disturbed by other load), or
    # the mean over the whole window (ranks sharing the cores: what each gets, on average,
    # while the others run; the fastest batch is one the scheduler gave it a core alone)
    fastest: bool = True
    # fp32 values of the host's optimizer step: its weights, gradients and two states (16
    # bytes a value) well beyond a CPU's last-level cache, as a model's are
    host_step_values: int = 1 << 24
    host_copy_bytes: int = 256 << 20  # each pinned copy between the host and a GPU


QUICK = Budget(
    seconds=0.1,
    max_matmul=4096,
    copy_bytes=32 << 20,
    comm_bytes=4 << 20,
    comm_iters=3,
    host_step_values=1 << 22,
    host_copy_bytes=64 << 20,
)
FULL = Budget(
    seconds=0.5, max_matmul=8192, copy_bytes=512 << 20, comm_bytes=64 << 20, comm_iters=10
)


class Calibration(NamedTuple):
    """The measured preset and notes on how each figure was obtained; the seconds of the
    reference step's forward and backward (``autopar_cost_model.reference_step``), to which
    ``autopar_passes.reference_step.fit_in_step`` fits the preset's ``in_step``."""

    preset: DevicePreset
    notes: tuple[str, ...]
    reference_step_s: float
    # how the host link's figures were obtained, for ``summary_rows``: "measured", or why not
    host_link_source: str = ""


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


def time_call(
    fn: Callable[[], object], seconds: float, device: torch.device, fastest: bool = True
) -> float:
    """Seconds per ``fn()``: the fastest of the batches that fit in ``seconds``, or with
    ``fastest=False`` their mean (``Budget.fastest``).

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
    batches = []
    while time.perf_counter() < deadline:
        batches.append(_batch_seconds(fn, calls, device))
    if not fastest:
        return statistics.fmean(batches) if batches else best
    return min([best, *batches])


def median_call(
    fn: Callable[[], object], seconds: float, device: torch.device, runs: int = MEDIAN_RUNS
) -> float:
    """Median seconds of one ``fn()``, timed call by call: at least ``runs`` calls, more
    while ``seconds`` last (at most ``8 x runs``).

    For calls long enough to time alone (an optimizer step over megabytes, a copy of
    hundreds of MiB), which stream main memory: the median is the rate a long run keeps,
    where the fastest call is one that found the memory bus quiet."""
    fn()  # warm-up: the optimizer's states, pinned pages mapped
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(samples) < runs or (time.perf_counter() < deadline and len(samples) < 8 * runs):
        samples.append(_batch_seconds(fn, 1, device))
    return statistics.median(samples)


def measure_matmul(dtype: torch.dtype, device: torch.device, budget: Budget) -> float:
    """Achieved FLOP/s of square ``dtype`` matmuls; ``n`` doubles while one call is short."""
    n = 128
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        probe = time_call(lambda a=a, b=b: a @ b, budget.seconds / 10, device, budget.fastest)
        if probe * 20 >= budget.seconds:
            break
        if 2 * n > budget.max_matmul:
            break
        n *= 2
    seconds = time_call(lambda: a @ b, budget.seconds, device, budget.fastest)
    return 2 * n**3 / seconds


def copy_bytes(device: torch.device, budget: Budget) -> int:
    """The buffer the bandwidth is measured on: the budget's on a GPU; on a CPU at most
    ``CPU_COPY_BYTES``, since the models a CPU trains (small ones, in tests and on laptops)
    stream tensors that its last-level cache holds, and a copy far beyond it measures the
    memory bus instead (here 12.1 GB/s a rank at 16 MiB against 7.3 at 256 MiB, on 4
    processes; AdamW's step over a 3M-parameter model ran at 11)."""
    return budget.copy_bytes if device.type == "cuda" else min(budget.copy_bytes, CPU_COPY_BYTES)


def measure_memory_bandwidth(device: torch.device, budget: Budget) -> float:
    """Achieved bytes/s of a copy (``copy_bytes``), counting the read and the write."""
    size = copy_bytes(device, budget)
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), budget.seconds, device, budget.fastest)
    return 2 * size / seconds


def _device_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def machine_memory() -> float | None:
    """This machine's memory in bytes (the host of its GPUs, or the CPU device itself), or
    None where the system does not say (``os.sysconf`` lacks the names off Linux and
    macOS)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return float(total) if total > 0 else None


def measure_host_step(budget: Budget) -> float:
    """Bytes/s of an AdamW step on the CPU over ``budget.host_step_values`` fp32 values
    with fp32 gradients, counted as the cost model counts a step's traffic
    (``STEP_TRAFFIC["adamw"].passes`` reads and writes of 4 bytes a value), so that
    ``autopar_cost_model.host.host_step_time`` gives back the measured seconds.

    ``torch.optim.AdamW`` with its default arguments: on a CPU the per-tensor loop (its
    foreach default is for accelerators), on torch's threads (the whole machine: the
    figure is per node, shared by the processes that step there)."""
    values = budget.host_step_values
    weight = torch.nn.Parameter(torch.zeros(values))
    weight.grad = torch.full((values,), 1e-3)  # normal floats: no denormal slow paths
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    seconds = median_call(optimizer.step, budget.seconds, torch.device("cpu"))
    passes = STEP_TRAFFIC[HOST_OPTIMIZER].passes
    return passes * weight.element_size() * values / seconds


def measure_host_copies(device: torch.device, budget: Budget) -> tuple[float, float]:
    """Achieved bytes/s from pinned host memory to ``device`` and back: non-blocking copies
    of ``budget.host_copy_bytes``, each synchronised (as offload's prefetches run)."""
    size = budget.host_copy_bytes
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    to_s = median_call(lambda: on_device.copy_(pinned, non_blocking=True), budget.seconds, device)
    from_s = median_call(lambda: pinned.copy_(on_device, non_blocking=True), budget.seconds, device)
    return size / to_s, size / from_s


def _base_host(base: DevicePreset) -> HostLink:
    """The base preset's host; for a base without one (a user's file), the device as its
    own host, as on a CPU: a copy reads and writes its memory (half its bandwidth)."""
    if base.host is not None:
        return base.host
    memory = base.memory_bandwidth * base.efficiency.memory
    return HostLink(
        memory_bytes=base.memory_bytes,
        memory_bandwidth=base.memory_bandwidth,
        to_device=memory / 2,
        from_device=memory / 2,
        efficiency=1.0,
    )


class HostFigures(NamedTuple):
    """The calibrated host, and how its link's figures were obtained ("measured", or why
    they were kept)."""

    link: HostLink
    link_source: str


def calibrate_host(
    device: torch.device, budget: Budget, base: DevicePreset, notes: list[str]
) -> HostFigures:
    """The base preset's host with what this machine measures written over it: the
    optimizer step, the memory, and with a GPU the copies (achieved, so efficiency 1 and
    ``latency + S / bandwidth`` stays the copy's time; the latency is kept)."""
    kept = _base_host(base)
    step = _rounded(measure_host_step(budget))
    memory = machine_memory()
    update: dict[str, float] = {
        "optimizer_bandwidth": step,
        "memory_bytes": memory if memory is not None else kept.memory_bytes,
    }
    notes.append(
        f"host: optimizer_bandwidth: an AdamW step (torch.optim.AdamW, default arguments) "
        f"over {budget.host_step_values} fp32 values on {torch.get_num_threads()} threads, "
        f"the median of {MEDIAN_RUNS} or more steps, {step / 1e9:.1f} GB/s as "
        f"STEP_TRAFFIC counts it ({STEP_TRAFFIC[HOST_OPTIMIZER].passes} passes of 4 bytes a "
        f"value); memory_bytes: {'this machine' if memory is not None else base.name}'s; "
        f"memory_bandwidth kept from {base.name}"
    )
    source = _host_link(device, budget, base, notes, update)
    return HostFigures(HostLink.model_validate({**kept.model_dump(), **update}), source)


def _host_link(
    device: torch.device,
    budget: Budget,
    base: DevicePreset,
    notes: list[str],
    update: dict[str, float],
) -> str:
    """Measure the device's copies into ``update`` where there is a GPU; say how it went."""
    if device.type != "cuda":
        notes.append(f"host link: not measured (no GPU, host and device are one): {base.name}'s")
        return f"not measured (no GPU): {base.name}'s"
    try:
        to_device, from_device = measure_host_copies(device, budget)
    except RuntimeError as err:  # out of pinned or device memory
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        notes.append(f"host link: copies failed ({reason}); kept from {base.name}")
        return f"not measured (copies failed): {base.name}'s"
    update.update(to_device=_rounded(to_device), from_device=_rounded(from_device), efficiency=1.0)
    notes.append(
        f"host link: pinned copies of {budget.host_copy_bytes >> 20} MiB, non-blocking and "
        f"synchronised, median of {MEDIAN_RUNS} or more: to the device "
        f"{to_device / 1e9:.1f} GB/s, from it {from_device / 1e9:.1f} GB/s (efficiency 1: "
        f"achieved); latency kept from {base.name}"
    )
    return "measured"


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


def measure_op_overhead(device: torch.device, budget: Budget) -> tuple[float, float]:
    """Seconds per op forward and per op backward of a chain of tiny element-wise ops."""
    weight = torch.ones(4, device=device, requires_grad=True)

    def forward() -> torch.Tensor:
        value = weight
        for _ in range(OP_CHAIN):
            value = value * 1.0001
        return value

    forward_s = time_call(forward, budget.seconds, device, budget.fastest) / OP_CHAIN
    both = time_call(lambda: forward().sum().backward(), budget.seconds, device, budget.fastest)
    both_s = both / OP_CHAIN
    return forward_s, max(both_s - forward_s, 0.0)


Curve = list[tuple[float, float]]  # (FLOPs of one forward call, FLOP/s), growing


def _linear(n: int, dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], object], float]:
    """A Linear's forward and backward on an ``(n, n)`` input, as training runs it; the
    FLOPs of its forward."""
    x = torch.randn(n, n, device=device).to(dtype).requires_grad_()
    weight = torch.randn(n, n, device=device).to(dtype).requires_grad_()
    grad = torch.randn(n, n, device=device).to(dtype)

    def step() -> None:
        torch.nn.functional.linear(x, weight).backward(grad)
        x.grad = weight.grad = None

    return step, 2.0 * n**3


def _attention(
    length: int, dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[], object], float]:
    """Causal attention's forward and backward on 8 heads of 64 over ``length`` tokens."""
    q, k, v = (
        torch.randn(1, 8, length, 64, device=device).to(dtype).requires_grad_() for _ in range(3)
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step() -> None:
        sdpa(q, k, v, is_causal=True).sum().backward()
        q.grad = k.grad = v.grad = None

    with _counting() as counter:
        sdpa(q, k, v, is_causal=True)
    return step, float(counter.get_total_flops())


def _counting() -> torch.utils.flop_counter.FlopCounterMode:
    return torch.utils.flop_counter.FlopCounterMode(
        display=False, custom_mapping=cpu_flash_flop_mapping()
    )


def _total_flops(step: Callable[[], object]) -> float:
    with _counting() as counter:
        step()
    return float(counter.get_total_flops())


def measure_op_rates(device: torch.device, budget: Budget) -> dict[str, dict[str, Curve]]:
    """FLOP/s of a Linear's forward and backward (``matmul``) and of causal attention's
    (``attention``) per dtype, at sizes doubling from small until one call takes a tenth of
    the budget or passes its largest matmul: as the cost model prices them, by the FLOPs
    of one forward call (``DevicePreset.op_rates``); FLOPs counted as the annotation counts
    them (``FlopCounterMode``)."""
    families = {"matmul": (_linear, 64), "attention": (_attention, 128)}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if device.type == "cuda":
        dtypes["float16"] = torch.float16
    found: dict[str, dict[str, Curve]] = {}
    for family, (make, start) in families.items():
        for key, dtype in dtypes.items():
            curve: Curve = []
            size = start
            while size <= budget.max_matmul:
                step, call_flops = make(size, dtype, device)
                seconds = time_call(step, budget.seconds / 4, device, budget.fastest)
                curve.append((call_flops, _rounded(_total_flops(step) / seconds)))
                if seconds > budget.seconds / 10:
                    break
                size *= 2
            found.setdefault(family, {})[key] = curve
    return found


class DeviceFigures(NamedTuple):
    """What one process measured of its device."""

    peaks: dict[str, float]
    memory_bandwidth: float
    op_forward: float
    op_backward: float
    op_rates: dict[str, dict[str, Curve]]
    reference_step_s: float  # forward and backward of ``autopar_cost_model.reference_step``


def measure_device(
    device: torch.device,
    budget: Budget,
    threads: int,
    together: Callable[[], object] = lambda: None,
) -> DeviceFigures:
    """Matmul peaks, copy bandwidth, op overhead, op rates and the reference step, on
    ``threads`` torch threads; ``together`` is called before each (ranks measuring at
    once wait there for each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together()
        peaks = _measure_peaks(device, budget)
        together()
        bandwidth = measure_memory_bandwidth(device, budget)
        together()
        forward, backward = measure_op_overhead(device, budget)
        together()
        rates = measure_op_rates(device, budget)
        together()
        reference = time_call(step_runner(device), budget.seconds, device, budget.fastest)
    finally:
        torch.set_num_threads(before)
    return DeviceFigures(peaks, bandwidth, forward, backward, rates, reference)


def _rank_worker(rank: int, budget: Budget, threads: int, queue: Any, barrier: Any) -> None:
    queue.put(measure_device(torch.device("cpu"), budget, threads, barrier.wait))


def measure_ranks(ranks: int, budget: Budget, threads: int) -> DeviceFigures:
    """``measure_device`` in ``ranks`` processes at once, each measurement begun together
    (otherwise a process that finished early leaves the others the cores, and the fastest
    batch that ``time_call`` keeps is one measured with fewer processes than said); each
    figure the median over them. Each takes the mean over its window (``Budget.fastest``)."""
    budget = budget._replace(fastest=False)
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    barrier = context.Barrier(ranks)
    mp.start_processes(
        _rank_worker,
        args=(budget, threads, queue, barrier),
        nprocs=ranks,
        join=True,
        start_method="spawn",
    )
    found = [queue.get() for _ in range(ranks)]
    rates: dict[str, dict[str, Curve]] = {}
    for family, curves in found[0].op_rates.items():
        for dtype, curve in curves.items():
            # the sizes every process reached, each rate the median over them
            points = min(len(f.op_rates[family][dtype]) for f in found)
            rates.setdefault(family, {})[dtype] = [
                (curve[i][0], statistics.median(f.op_rates[family][dtype][i][1] for f in found))
                for i in range(points)
            ]
    return DeviceFigures(
        {k: statistics.median(f.peaks[k] for f in found) for k in found[0].peaks},
        statistics.median(f.memory_bandwidth for f in found),
        statistics.median(f.op_forward for f in found),
        statistics.median(f.op_backward for f in found),
        rates,
        statistics.median(f.reference_step_s for f in found),
    )


def _achievable(link: Link, base: DevicePreset) -> Link:
    """A base preset's peak link scaled by its network efficiency, to sit among measurements."""
    return Link(bandwidth=link.bandwidth * base.efficiency.network, latency=link.latency)


class Links(NamedTuple):
    """The intra-node link as measured (or kept), with what goes with it."""

    intra: Link
    launch_overhead: float
    overlap: float


def _measure_links(
    device: torch.device, budget: Budget, base: DevicePreset, notes: list[str], ranks: int
) -> Links:
    """The intra-node link, measured when there is a second rank to talk to."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    kept = Links(_achievable(base.intra_node, base), base.launch_overhead, base.comm_overlap)
    if device.type == "cuda" and gpus < 2:
        notes.append(f"intra-node link: one GPU visible, kept from {base.name}")
        return kept
    backend, world = ("nccl", gpus) if device.type == "cuda" else ("gloo", max(ranks, 2))
    try:
        comm = measure_collectives(backend, world, budget.comm_bytes, budget.comm_iters)
    except (RuntimeError, OSError, mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]  # not the traceback
        notes.append(
            f"intra-node link: {backend} benchmark failed ({reason}); kept from {base.name}"
        )
        return kept
    busbw = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in comm.bus_bandwidth.items())
    notes.append(
        f"intra-node link: {backend} on {world} ranks, {SMALLEST >> 10} KiB to "
        f"{comm.nbytes >> 20} MiB: bus bandwidth by size per collective (at the largest: "
        f"{busbw}); 1-value all-reduce {comm.small_message_s * 1e6:.0f} us, counted as "
        f"per-step latency; a collective after {PENALTY_COMPUTE_S * 1e3:g} ms of compute "
        f"lost {comm.penalty_s * 1e6:.0f} us more (launch_overhead); compute hid "
        f"{comm.overlap:.0%} of an all-reduce run beside it (comm_overlap)"
    )
    curves = {
        kind: [(size, _rounded(bw)) for size, bw in curve] for kind, curve in comm.curves.items()
    }
    link = Link(
        bandwidth=_rounded(comm.bandwidth),
        latency=_rounded(comm.step_latency),
        bandwidth_by_kind=curves,  # type: ignore[arg-type]
    )
    return Links(link, _rounded(comm.penalty_s), round(comm.overlap, 2))


def calibrate(
    name: str | None = None,
    quick: bool = False,
    collectives: bool = True,
    device: torch.device | str | None = None,
    ranks: int | None = None,
) -> Calibration:
    """Measure this machine (its first GPU if any, else the CPU) and describe it as a preset.

    ``ranks`` (CPU only): the device is one of that many ranks sharing the machine, as
    ``autopar.testing.run_ranks`` runs them (one torch thread each, whatever the cores):
    every figure is measured by that many processes at once (the module docstring), and
    memory is divided among them. None: the whole machine, with torch's threads."""
    device = torch.device(device) if device is not None else _default_device()
    if ranks is not None and (ranks < 1 or device.type != "cpu"):
        raise UsageError(f"ranks={ranks}: one or more, and only on a CPU")
    budget = QUICK if quick else FULL
    base = _base_preset(device)
    cores = os.cpu_count() or 1
    threads = 1 if ranks is not None else torch.get_num_threads()
    notes: list[str] = [
        f"measured by `autopar calibrate{' --quick' if quick else ''}"
        f"{f' --ranks {ranks}' if ranks is not None else ''}` on "
        f"{_describe(device)} with torch {torch.__version__}"
    ]
    if ranks is not None:
        figures = measure_ranks(ranks, budget, threads)
    else:
        figures = measure_device(device, budget, threads)
    peaks = {k: _rounded(v) for k, v in figures.peaks.items()}
    notes.append(
        "peak_flops: achieved square-matmul FLOP/s; memory_bandwidth: achieved copy "
        f"bandwidth of {copy_bytes(device, budget) >> 20} MiB (read + write); op_overhead: a chain "
        f"of {OP_CHAIN} element-wise ops on 4 values that require grad, forward "
        f"{figures.op_forward * 1e6:.1f} us and backward {figures.op_backward * 1e6:.1f} us "
        "an op; op_rates: FLOP/s of a Linear's and of causal attention's forward and backward "
        "by size (training's small matmuls reach less than the square peak)"
    )
    if ranks is not None:
        notes.append(
            f"one of {ranks} ranks on {cores} cores: every figure measured by {ranks} "
            f"processes at once, {threads} thread(s) each, the median over them; memory "
            f"divided by {ranks}; the collectives on {ranks} processes; shared_cores: a rank "
            "that waits (in a pipeline's bubble) leaves its share of the cores to the others"
        )
    if collectives:
        links = _measure_links(device, budget, base, notes, ranks or 1)
    else:
        links = Links(_achievable(base.intra_node, base), base.launch_overhead, base.comm_overlap)
        notes.append(f"intra-node link: not measured (collectives skipped), kept from {base.name}")
    host = calibrate_host(device, budget, base, notes)
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
        memory_bytes=_device_memory(device) / (ranks or 1),
        memory_bandwidth=_rounded(figures.memory_bandwidth),
        gpus_per_node=gpus_per_node,
        intra_node=links.intra,
        inter_node=_achievable(base.inter_node, base),
        launch_overhead=links.launch_overhead,
        op_overhead=OpOverhead(
            forward=_rounded(figures.op_forward),
            backward=_rounded(figures.op_backward),
            asynchronous=device.type == "cuda",
        ),
        comm_overlap=links.overlap,
        op_rates=figures.op_rates,
        shared_cores=SharedCores(ranks=ranks, cores=cores) if ranks is not None else None,
        host=host.link,
        efficiency=Efficiency(compute=1.0, memory=1.0, network=1.0),
    )
    return Calibration(preset, tuple(notes), figures.reference_step_s, host.link_source)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def summary_rows(preset: DevicePreset, host_link_source: str = "") -> list[tuple[str, str]]:
    """Figure name and value, for printing a preset; ``host_link_source`` (a calibration's)
    follows the host link's figures."""
    rows = [
        (f"{k} matmul", f"{v / 1e12:.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.1f} GFLOP/s")
        for k, v in preset.peak_flops.items()
    ]
    rows += [
        ("memory", f"{preset.memory_bytes / 2**30:.1f} GiB"),
        ("memory bandwidth", f"{preset.memory_bandwidth / 1e9:.1f} GB/s"),
        ("intra-node bus bandwidth", f"{preset.intra_node.bandwidth / 1e9:.2f} GB/s"),
        ("intra-node step latency", f"{preset.intra_node.latency * 1e6:.1f} us"),
    ]
    for kind in preset.intra_node.bandwidth_by_kind:
        curve = preset.intra_node.bandwidth_curve(kind)
        low, high = min(bw for _, bw in curve), max(bw for _, bw in curve)
        span = f"{high / 1e9:.2f}" if low == high else f"{low / 1e9:.2f} to {high / 1e9:.2f}"
        rows.append((f"intra-node {kind}", f"{span} GB/s"))
    host = preset.op_overhead
    rows += [
        ("inter-node bus bandwidth", f"{preset.inter_node.bandwidth / 1e9:.2f} GB/s"),
        (
            "op overhead",
            f"{host.forward * 1e6:.1f} us forward, {host.backward * 1e6:.1f} us backward",
        ),
        ("ops inside a step, over alone", f"{preset.in_step:g}x"),
        ("communication compute hides", f"{preset.comm_overlap:.0%}"),
    ]
    if preset.host is not None:
        rows += _host_rows(preset.host, host_link_source)
    return rows


def _host_rows(host: HostLink, link_source: str) -> list[tuple[str, str]]:
    """The host's memory, optimizer step and link; a link figure with its efficiency, what
    a copy reaches being their product."""
    step = (
        f"{host.optimizer_bandwidth / 1e9:.1f} GB/s of {HOST_OPTIMIZER}'s traffic"
        if host.optimizer_bandwidth is not None
        else "not measured (host memory bandwidth x efficiency)"
    )
    how = f"; {link_source}" if link_source else ""
    return [
        ("host memory", f"{host.memory_bytes / 2**30:.1f} GiB"),
        ("host optimizer step", step),
        ("host to device", f"{host.to_device / 1e9:.2f} GB/s x {host.efficiency:g}{how}"),
        ("device to host", f"{host.from_device / 1e9:.2f} GB/s x {host.efficiency:g}{how}"),
    ]
