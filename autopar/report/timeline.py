"""The pipeline timeline: when each stage runs the forward and backward of each microbatch.

Computed from the plan alone (stages, schedule, microbatches, chunks and each stage's
forward and backward time per microbatch, ``Estimate.stages``) by list scheduling: every
device runs one task at a time, in the order its schedule prescribes, as soon as what the
task needs is done; the gaps left are the bubbles.

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

>>> tasks = simulate("1f1b", stages=2, microbatches=3, chunks=1, forward=[1, 1], backward=[2, 2])
>>> [(t.kind, t.microbatch, t.start) for t in tasks if t.device == 1]
[('F', 0, 1.0), ('B', 0, 2.0), ('F', 1, 4.0), ('B', 1, 5.0), ('F', 2, 7.0), ('B', 2, 8.0)]
>>> makespan(tasks)
12.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Task:
    """One forward (``F``) or backward (``B``) of one microbatch on one chunk."""

    device: int
    kind: Literal["F", "B"]
    microbatch: int
    chunk: int
    start: float
    end: float


def simulate(
    schedule: str,
    stages: int,
    microbatches: int,
    chunks: int,
    forward: Sequence[float],
    backward: Sequence[float],
) -> list[Task]:
    """Every task of one training step, in start order (module docstring).

    ``forward[s]``/``backward[s]``: seconds per microbatch on device ``s`` for its whole
    share of the layers (a chunk takes ``1 / chunks`` of it).
    """
    p, m = max(stages, 1), max(microbatches, 1)
    v = chunks if schedule == "interleaved" else 1
    total = p * v
    pending: dict[int, list[tuple[str, int, int]]] = {s: [] for s in range(p)}
    for i in range(m):
        for c in range(total):
            pending[c % p] += [("F", i, c), ("B", i, c)]
    limits = [_in_flight_limit(schedule, p, s, m, v) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    in_flight = [0] * p
    free_at = [0.0] * p
    running: dict[int, Task] = {}
    tasks: list[Task] = []
    now = 0.0
    while len(done) < 2 * m * total:
        for s in range(p):
            if s in running or free_at[s] > now:
                continue
            unit = _next(schedule, pending[s], done, in_flight[s] < limits[s], p, total)
            if unit is None:
                continue
            kind, i, c = unit
            length = (forward[s] if kind == "F" else backward[s]) / v
            task = Task(s, kind, i, c, now, now + length)  # type: ignore[arg-type]
            pending[s].remove(unit)
            in_flight[s] += 1 if kind == "F" else -1
            running[s] = task
            tasks.append(task)
        if not running:  # a limit no order can meet: lift it rather than stall
            limits = [m * v] * p
            continue
        now = min(t.end for t in running.values())
        for s, task in list(running.items()):
            if task.end <= now:
                done[(task.kind, task.microbatch, task.chunk)] = task.end
                free_at[s] = task.end
                del running[s]
    return tasks


def makespan(tasks: Sequence[Task]) -> float:
    return max((t.end for t in tasks), default=0.0)


def bubble_fraction(tasks: Sequence[Task], devices: int) -> float:
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
    done: dict[tuple[str, int, int], float],
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
