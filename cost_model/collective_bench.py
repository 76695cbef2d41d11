"""Measuring collectives on this machine, with real processes (for ``calibrate``).

Starts ``world_size`` local processes (``torch.multiprocessing``, spawn) that join a process
group over a free TCP port on 127.0.0.1: gloo on CPU, NCCL on GPUs (one per process). For
each collective and message size ``S`` (from ``SMALLEST`` up to the budget's, by fours)
rank 0 reports the median time, the slowest rank's as in nccl-tests, and its bus bandwidth

    busbw(S) = S * factor(n) / (t(S) - steps(n) * alpha)

where ``alpha`` is the step latency, a one-value all-reduce's time over its ring steps
(taken out so the bandwidth of a mid-sized message is not understated). The preset keeps
the curve, since mid-sized messages reach less than large ones (gloo on 4 processes here:
0.27 GB/s at 1 MiB, 0.9 at 64 MiB). Each collective runs as autopar's runtime runs it
(``autopar.runtime.collectives``), its bandwidth counted in the collective's own bytes: on
gloo a reduce-scatter is an all-reduce of the whole array, an all-to-all an all-gather of
every device's whole array.

**Overlap.** An all-reduce of the largest size (``t_c``) and a run of matmuls of about as
long (``t_m``) are timed apart and then together, the all-reduce launched first without
waiting (``async_op``, as gradient buckets are): the share of the shorter that the run
together hides, ``(t_c + t_m - t_both) / min(t_c, t_m)`` clamped to [0, 1], is the
preset's ``comm_overlap``. On GPUs NCCL runs on its own stream and links (near 1); gloo
needs the cores that compute runs on (near 0 when the ranks already fill them).

**A collective after compute.** ``PENALTY_COMPUTE_S`` of matmuls then a one-value
all-reduce, in a loop, against the two timed apart: what a blocking collective loses
waiting for the ranks still computing, beyond its own time. Near 0 with a core per rank;
milliseconds where ranks share cores (the scheduler pauses some while others run: on 4
processes and 2 cores here 1.7 to 3.8 ms after 6 to 25 ms of compute). It is the preset's
``launch_overhead``, the fixed cost of every call.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar_cost_model.collectives import bus_factor, ring_steps

BENCH_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SMALLEST = 64 << 10  # bytes: the curve's first size
PENALTY_COMPUTE_S = 5e-3  # compute before each collective when measuring the penalty
TRIALS = 3  # trials of the overlap and the penalty in one process group, the median kept


class CommMeasurement(NamedTuple):
    """What ``measure_collectives`` found."""

    backend: str
    world_size: int
    nbytes: int  # the largest size measured
    # per collective: (bytes, bus bandwidth) at each size, growing
    curves: dict[str, list[tuple[float, float]]]
    small_message_s: float
    overlap: float = 1.0  # the share of communication compute hid (module docstring)
    penalty_s: float = 0.0  # what a collective after compute loses (module docstring)

    @property
    def bus_bandwidth(self) -> dict[str, float]:
        """Bus bandwidth of each collective at the largest size."""
        return {kind: curve[-1][1] for kind, curve in self.curves.items()}

    @property
    def bandwidth(self) -> float:
        """Bus bandwidth: the all-reduce's at the largest size (gradient sync's)."""
        return self.bus_bandwidth["all_reduce"]

    @property
    def step_latency(self) -> float:
        """The small all-reduce's time spread over its ring steps."""
        return self.small_message_s / ring_steps("all_reduce", self.world_size)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _median_time(fn: Any, iters: int, device: torch.device, group_max: bool) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, the slowest rank's when ``group_max``."""
    fn()  # warm-up (connections, buffers)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    if group_max:
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def sizes(largest: int) -> list[int]:
    """The message sizes measured: ``SMALLEST`` up to ``largest`` by factors of four."""
    found, size = [], SMALLEST
    while size < largest:
        found.append(size)
        size *= 4
    return [*found, largest]


class BenchConfig(NamedTuple):
    """What every rank of the benchmark needs to know."""

    backend: str
    world_size: int
    port: int
    nbytes: int
    iters: int


def _collectives(nbytes: int, world_size: int, backend: str, device: torch.device) -> dict:
    """Each collective on an array of ``nbytes``, as the runtime runs it."""
    numel = max(nbytes // 4 // world_size, 1) * world_size
    full = torch.ones(numel, dtype=torch.float32, device=device)
    shard = torch.ones(numel // world_size, dtype=torch.float32, device=device)
    pieces = [torch.empty_like(shard) for _ in range(world_size)]
    swapped = torch.empty_like(full)
    if backend == "nccl":
        return {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather(pieces, shard),
            "reduce_scatter": lambda: dist.reduce_scatter(shard, list(full.chunk(world_size))),
            "all_to_all": lambda: dist.all_to_all_single(swapped, full),
        }
    # gloo, as ``autopar.runtime.collectives`` builds what it lacks: a reduce-scatter from
    # an all-reduce, an all-to-all from an all-gather of every device's whole array
    wholes = [torch.empty_like(full) for _ in range(world_size)]
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather(pieces, shard),
        "reduce_scatter": lambda: dist.all_reduce(full),
        "all_to_all": lambda: dist.all_gather(wholes, full),
    }


def _join(rank: int, config: BenchConfig) -> torch.device:
    """This process as rank ``rank`` of the benchmark's group; its device."""
    device = torch.device(f"cuda:{rank}" if config.backend == "nccl" else "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))  # share the cores
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        config.backend,
        init_method=f"tcp://127.0.0.1:{config.port}",
        rank=rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=60),
    )
    return device


def _beside_compute(
    config: BenchConfig, comm_s: float, small_s: float, device: torch.device
) -> tuple[float, float]:
    """(overlap, penalty) of the largest all-reduce, taking ``comm_s``, and of a one-value
    one, taking ``small_s`` (the module docstring)."""
    one = torch.ones(1, dtype=torch.float32, device=device)
    full = torch.ones(config.nbytes // 4, dtype=torch.float32, device=device)
    launch = lambda: dist.all_reduce(full, async_op=True)  # noqa: E731
    overlap = _overlap(launch, comm_s, device)
    return overlap, _penalty(lambda: dist.all_reduce(one), small_s, device)


def _worker(rank: int, config: BenchConfig, queue: Any) -> None:
    """One rank of the benchmark; rank 0 puts ``(kind -> [(bytes, seconds)], small seconds,
    overlap, penalty)`` on ``queue``."""
    device = _join(rank, config)
    try:
        times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in BENCH_KINDS}
        for size in sizes(config.nbytes):
            ops = _collectives(size, config.world_size, config.backend, device)
            sent = float(max(size // 4 // config.world_size, 1) * config.world_size * 4)
            for kind in BENCH_KINDS:
                times[kind].append((sent, _median_time(ops[kind], config.iters, device, True)))
        one = torch.ones(1, dtype=torch.float32, device=device)
        small = _median_time(lambda: dist.all_reduce(one), 3 * config.iters, device, True)
        overlap, penalty = _beside_compute(config, times["all_reduce"][-1][1], small, device)
        if rank == 0:
            queue.put((times, small, overlap, penalty))
    finally:
        dist.destroy_process_group()


def _beside_worker(
    rank: int, config: BenchConfig, comm_s: float, small_s: float, queue: Any
) -> None:
    """One rank of a group of its own measuring only the overlap and the penalty; rank 0
    puts them on ``queue``."""
    device = _join(rank, config)
    try:
        found = _beside_compute(config, comm_s, small_s, device)
        if rank == 0:
            queue.put(found)
    finally:
        dist.destroy_process_group()


def measure_collectives(
    backend: str, world_size: int, nbytes: int, iters: int = 5, groups: int = 3
) -> CommMeasurement:
    """Run the benchmark on ``world_size`` local processes; raises ``RuntimeError`` on failure.

    The overlap and the penalty are the medians over ``groups`` process groups, the first
    the benchmark's own: where ranks share cores they differ from one group of processes
    to the next (4 ranks on 2 cores: a penalty of 0 in one, 1.3 to 2.7 ms in others, and
    the same within one group), as the scheduler happens to place them."""
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()

    def spawn(worker: Any, *args: Any) -> Any:
        config = BenchConfig(backend, world_size, free_port(), nbytes, iters)
        mp.start_processes(
            worker, args=(config, *args, queue), nprocs=world_size, join=True, start_method="spawn"
        )
        if queue.empty():
            raise RuntimeError("the collective benchmark finished without a result")
        return queue.get()

    times, small, overlap, penalty = spawn(_worker)
    found = [(overlap, penalty)]
    found += [spawn(_beside_worker, times["all_reduce"][-1][1], small) for _ in range(groups - 1)]
    overlap = statistics.median(o for o, _ in found)
    penalty = statistics.median(p for _, p in found)
    latency = small / ring_steps("all_reduce", world_size)
    curves = {}
    for kind, measured in times.items():
        curve = []
        for sent, seconds in measured:
            fixed = ring_steps(kind, world_size) * latency
            moving = seconds - fixed if seconds > 2 * fixed else seconds
            curve.append((sent, sent * bus_factor(kind, world_size) / moving))
        curves[kind] = curve
    return CommMeasurement(
        backend, world_size, int(times["all_reduce"][-1][0]), curves, small, overlap, penalty
    )


def _matmuls(device: torch.device) -> Any:
    """A function running ``count`` matmuls of a fixed size (synchronised on a GPU)."""
    size = 256 if device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)

    def run(count: int) -> None:
        for _ in range(count):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def _runs_for(seconds: float, matmuls: Any, device: torch.device) -> int:
    """How many matmuls take about ``seconds``, the same on every rank."""
    start = time.perf_counter()
    matmuls(4)
    per = (time.perf_counter() - start) / 4
    count = torch.tensor([max(1, round(seconds / max(per, 1e-9)))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _overlap(launch: Any, comm_s: float, device: torch.device) -> float:
    """The share of the shorter of a collective and a matmul run that running them together
    hides (the module docstring), the slowest rank's, the median of ``TRIALS``."""
    matmuls = _matmuls(device)
    runs = _runs_for(comm_s, matmuls, device)

    def both() -> None:
        work = launch()
        matmuls(runs)
        work.wait()

    def trial() -> float:
        compute_s = _median_time(lambda: matmuls(runs), 3, device, True)
        both_s = _median_time(both, 3, device, True)
        shorter = min(comm_s, compute_s)
        hidden = (comm_s + compute_s - both_s) / shorter if shorter > 0 else 0.0
        return min(max(hidden, 0.0), 1.0)

    return statistics.median(trial() for _ in range(TRIALS))


def _penalty(collective: Any, collective_s: float, device: torch.device) -> float:
    """What a blocking collective after ``PENALTY_COMPUTE_S`` of compute loses beyond its
    own time (the module docstring), per call, the slowest rank's, the median of
    ``TRIALS``."""
    matmuls = _matmuls(device)
    runs = _runs_for(PENALTY_COMPUTE_S, matmuls, device)
    loops = 10

    def both() -> None:
        for _ in range(loops):
            matmuls(runs)
            collective()

    def trial() -> float:
        compute_s = _median_time(lambda: [matmuls(runs) for _ in range(loops)], 3, device, True)
        both_s = _median_time(both, 3, device, True)
        return max((both_s - compute_s) / loops - collective_s, 0.0)

    return statistics.median(trial() for _ in range(TRIALS))
