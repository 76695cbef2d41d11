"""Measuring collective bus bandwidth on this machine, with real processes (for ``calibrate``).

Starts ``world_size`` local processes (``torch.multiprocessing``, spawn) that join a process
group over a free TCP port on 127.0.0.1: gloo on CPU, NCCL on GPUs (one per process). Rank
0 reports, for each collective, the median time and nccl-tests' bus bandwidth

    busbw = S * factor(n) / (t - t_0)

where ``t_0`` is the time of a one-value all-reduce (the latency, taken out so the bandwidth
of a mid-sized message is not understated). The slowest rank's time counts, as in nccl-tests.
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

from cost_model.collectives import bus_factor, ring_steps

BENCH_KINDS = ("all_reduce", "all_gather")


class CommMeasurement(NamedTuple):
    """What ``measure_collectives`` found: bus bandwidth per collective and step latency."""

    backend: str
    world_size: int
    nbytes: int
    bus_bandwidth: dict[str, float]
    small_message_s: float

    @property
    def bandwidth(self) -> float:
        """Bus bandwidth: the mean over the measured collectives."""
        return statistics.fmean(self.bus_bandwidth.values())

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


class BenchConfig(NamedTuple):
    """What every rank of the benchmark needs to know."""

    backend: str
    world_size: int
    port: int
    nbytes: int
    iters: int


def _worker(rank: int, config: BenchConfig, queue: Any) -> None:
    """One rank of the benchmark; rank 0 puts ``(kind -> seconds, small seconds)`` on ``queue``."""
    backend, world_size, port, nbytes, iters = config
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # share the cores
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        numel = nbytes // 4 // world_size * world_size
        full = torch.ones(numel, dtype=torch.float32, device=device)
        shard = torch.ones(numel // world_size, dtype=torch.float32, device=device)
        pieces = [torch.empty_like(shard) for _ in range(world_size)]
        one = torch.ones(1, dtype=torch.float32, device=device)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather(pieces, shard),
        }
        times = {kind: _median_time(ops[kind], iters, device, True) for kind in BENCH_KINDS}
        small = _median_time(lambda: dist.all_reduce(one), 3 * iters, device, True)
        if rank == 0:
            queue.put((times, small, numel * 4))
    finally:
        dist.destroy_process_group()


def measure_collectives(
    backend: str, world_size: int, nbytes: int, iters: int = 5
) -> CommMeasurement:
    """Run the benchmark on ``world_size`` local processes; raises ``RuntimeError`` on failure."""
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    config = BenchConfig(backend, world_size, free_port(), nbytes, iters)
    mp.start_processes(
        _worker, args=(config, queue), nprocs=world_size, join=True, start_method="spawn"
    )
    if queue.empty():
        raise RuntimeError("the collective benchmark finished without a result")
    times, small, sent = queue.get()
    bus = {}
    for kind, seconds in times.items():
        moving = seconds - small if seconds > 2 * small else seconds
        bus[kind] = sent * bus_factor(kind, world_size) / moving
    return CommMeasurement(backend, world_size, sent, bus, small)
