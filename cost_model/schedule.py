"""The pipeline schedule, simulated: when each stage runs the forward and backward of each
microbatch, and how long the step's schedule takes.

List scheduling: every device runs one task at a time, in the order its schedule
prescribes, as soon as what the task needs is done; the gaps left are the bubbles.

- a forward of microbatch ``i`` on chunk ``c`` needs its forward on chunk ``c - 1``; a
  backward on chunk ``c`` needs the forward on ``c`` and the backward on ``c + 1``;
- chunk ``c`` runs on device ``c % p`` (``p`` devices in the pipeline, ``v`` chunks each,
  interleaved 1F1B; otherwise ``v = 1`` and chunk = stage = device);
- **GPipe**: every forward first, then the backwards (Huang et al. 2019);
- **1F1B**: at most ``p - s`` microbatches in flight on device ``s``, a ready backward before
  a forward (PipeDream-Flush, Narayanan et al. 2021);
- **interleaved 1F1B**: at most ``2 (p - s - 1) + (v - 1) p + 1`` chunk-forwards in flight,
  microbatches taken in groups of ``p`` chunk by chunk (Megatron-LM's order);
- no pipeline: one device runs forward and backward of each microbatch in turn (gradient
  accumulation).

A task is compute, then a wait (``waits``: the blocking point-to-point of its hand-offs, in
which the device computes nothing). Where the devices share a host's cores
(``SharedCores``: CPU ranks, more of them than cores) compute runs at a speed set by how
many devices compute at that moment: a device that waits in the bubble leaves its share of
the cores to the others. Each device's figures were measured with every rank busy, so with
``k`` busy a task's compute runs ``SharedCores.speed(k)`` times as fast as measured.

>>> tasks = simulate("1f1b", stages=2, microbatches=3, chunks=1, forward=[1, 1], backward=[2, 2])
>>> [(t.kind, t.microbatch, t.start) for t in tasks if t.device == 1]
[('F', 0, 1.0), ('B', 0, 2.0), ('F', 1, 4.0), ('B', 1, 5.0), ('F', 2, 7.0), ('B', 2, 8.0)]
>>> makespan(tasks)
12.0

Two ranks on one core, each measured at half a core: what a device runs while the other
waits (the first forward, the last backwards, the backward the first 1F1B forwards wait
for) runs at the whole core's speed.

>>> shared = SharedCores(ranks=2, cores=1)
>>> makespan(simulate("1f1b", 2, 3, 1, [1, 1], [2, 2], cores=shared))
9.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from autopar_cost_model.hardware import SharedCores
from autopar_cost_model.step import pipeline_time

# below this many seconds of compute a task's compute is done (float residue of the rates)
_DONE_S = 1e-12


@dataclass(frozen=True)
class Task:
    """One forward (``F``) or backward (``B``) of one microbatch on one chunk."""

    device: int
    kind: Literal["F", "B"]
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class _Running:
    task: tuple[str, int, int]
    start: float
    compute: float  # seconds left at the measured speed
    wait: float  # seconds left of the wait after it


def simulate(
    schedule: str,
    stages: int,
    microbatches: int,
    chunks: int,
    forward: Sequence[float],
    backward: Sequence[float],
    waits: Sequence[float] | None = None,
    cores: SharedCores | None = None,
    replicas: int = 1,
) -> list[Task]:
    """Every task of one training step, in start order (module docstring).

    ``forward[s]``/``backward[s]``: compute seconds per microbatch on device ``s`` for its
    whole share of the layers (a chunk takes ``1 / chunks`` of it); ``waits[s]``: the
    seconds device ``s`` waits per microbatch, half after each forward and half after each
    backward. ``replicas``: pipelines that run the same schedule in step beside this one on
    the same host (data parallelism across pipelines), whose devices compute when these do.
    """
    p, m = max(stages, 1), max(microbatches, 1)
    v = chunks if schedule == "interleaved" else 1
    total = p * v
    wait = list(waits) if waits is not None else [0.0] * p
    pending: dict[int, list[tuple[str, int, int]]] = {s: [] for s in range(p)}
    for i in range(m):
        for c in range(total):
            pending[c % p] += [("F", i, c), ("B", i, c)]
    limits = [_in_flight_limit(schedule, p, s, m, v) for s in range(p)]
    done: set[tuple[str, int, int]] = set()
    in_flight = [0] * p
    running: dict[int, _Running] = {}
    tasks: list[Task] = []
    now = 0.0
    while len(done) < 2 * m * total:
        for s in range(p):
            if s in running:
                continue
            unit = _next(schedule, pending[s], done, in_flight[s] < limits[s], p, total)
            if unit is None:
                continue
            compute = (forward[s] if unit[0] == "F" else backward[s]) / v
            running[s] = _Running(unit, now, compute, wait[s] / (2 * v))
            pending[s].remove(unit)
            in_flight[s] += 1 if unit[0] == "F" else -1
        if not running:  # a limit no order can meet: lift it rather than stall
            limits = [m * v] * p
            continue
        busy = sum(1 for r in running.values() if r.compute > _DONE_S)
        speed = cores.speed(busy * replicas) if cores is not None else 1.0
        step = min(r.compute / speed if r.compute > _DONE_S else r.wait for r in running.values())
        now += step
        for s, r in list(running.items()):
            if r.compute > _DONE_S:
                r.compute -= speed * step
            else:
                r.wait -= step
            if r.compute <= _DONE_S and r.wait <= _DONE_S:
                kind, i, c = r.task
                tasks.append(Task(s, kind, i, c, r.start, now))  # type: ignore[arg-type]
                done.add(r.task)
                del running[s]
    return sorted(tasks, key=lambda t: (t.start, t.device))


def makespan(tasks: Sequence[Task]) -> float:
    return max((t.end for t in tasks), default=0.0)


def idle_fraction(tasks: Sequence[Task], devices: int) -> float:
    """Idle share of the devices' time between the first start and the last end."""
    span = makespan(tasks)
    if span <= 0:
        return 0.0
    busy = sum(t.end - t.start for t in tasks)
    return max(0.0, 1.0 - busy / (span * max(devices, 1)))


def _in_flight_limit(schedule: str, p: int, s: int, m: int, v: int) -> int:
    if schedule == "1f1b":
        return p - s
    if schedule == "interleaved":
        return 2 * (p - s - 1) + (v - 1) * p + 1
    if schedule == "none":
        return 1
    return m * v  # gpipe: every forward before any backward


def _next(
    schedule: str,
    pending: list[tuple[str, int, int]],
    done: set[tuple[str, int, int]],
    may_forward: bool,
    p: int,
    total: int,
) -> tuple[str, int, int] | None:
    """The task the device starts now, or None to wait."""

    def ready(unit: tuple[str, int, int]) -> bool:
        kind, i, c = unit
        if kind == "F":
            return c == 0 or ("F", i, c - 1) in done
        return ("F", i, c) in done and (c == total - 1 or ("B", i, c + 1) in done)

    def order(unit: tuple[str, int, int]) -> tuple[int, ...]:
        kind, i, c = unit
        chunk = c if kind == "F" else total - 1 - c
        if schedule == "interleaved":
            return (i // p, chunk, i % p)
        return (i, chunk)

    # each kind in its schedule's order, never skipping ahead of a task that waits
    forwards = [u for u in pending if u[0] == "F"]
    backwards = [u for u in pending if u[0] == "B"]
    backward = min(backwards, key=order) if backwards else None
    if backward is not None and ready(backward) and (schedule != "gpipe" or not forwards):
        return backward
    forward = min(forwards, key=order) if forwards else None
    if forward is not None and may_forward and ready(forward):
        return forward
    return None


def schedule_time(
    schedule: str,
    microbatches: int,
    chunks: int,
    forward: Sequence[float],
    backward: Sequence[float],
    waits: Sequence[float],
    cores: SharedCores | None = None,
    replicas: int = 1,
) -> float:
    """Seconds a pipeline's schedule takes, stage ``s`` computing ``forward[s]`` and
    ``backward[s]`` and waiting ``waits[s]`` per microbatch.

    Where each device has cores of its own, ``autopar_cost_model.step.pipeline_time`` of
    ``T_s = forward[s] + backward[s] + waits[s]``, the closed form; where devices share cores
    (``cores``), the span of the simulated schedule, whose devices run faster while others
    wait (module docstring). ``replicas``: devices of each stage, busy together.
    """
    if cores is None:
        times = [f + b + w for f, b, w in zip(forward, backward, waits, strict=True)]
        return pipeline_time(times, microbatches, chunks)
    stages = len(forward)
    tasks = simulate(
        schedule, stages, microbatches, chunks, forward, backward, waits, cores, replicas
    )
    return makespan(tasks)
