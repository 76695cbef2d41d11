"""Step time and MFU: compute, the communication left exposed, the pipeline bubble.

One training step (one optimizer update) on the busiest device:

    busy   = compute (fwd + bwd of all its microbatches) + recompute + inline comm
    bubble = busy * (p - 1) / (v m)
    step   = busy + bubble + tail comm

*Inline comm* is communication on the critical path of every microbatch (tensor-parallel
all-reduces, the exposed part of parameter all-gathers: ``exposed_prefetch``); it stretches
with the pipeline like compute. *Tail comm* is what is left of the gradient sync after
backward ends (``exposed_gradient_sync``). The pipeline bubble is Narayanan et al. 2021,
Sec. 2.2: ``(p - 1) / m`` of the ideal time for GPipe and 1F1B, ``(p - 1) / (v m)`` for the
interleaved schedule with ``v`` model chunks per device.

MFU (Chowdhery et al. 2022, "PaLM", App. B) counts the model's FLOPs (fwd + bwd, no
recompute) against the devices' peak: ``model_flops / (step_time x peak x devices)``.

What it leaves out: the optimizer step itself, data loading, kernel launch gaps, imbalance
between data-parallel ranks, and the bubble's partial hiding of the gradient sync.

>>> bubble_fraction(4, 16), bubble_fraction(4, 16, v=2)
(0.1875, 0.09375)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from autopar_plans.errors import UsageError
from autopar_plans.plan import Estimate, MemoryBreakdown, StageEstimate


class StepTime(BaseModel):
    """Where the time of one step goes, in seconds."""

    model_config = ConfigDict(frozen=True)

    step_time_s: float
    compute_s: float
    recompute_s: float = 0.0
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle time of a ``p``-stage pipeline over ``m`` microbatches, ``v`` chunks per device,
    as a fraction of the ideal (bubble-free) time: ``(p - 1) / (v m)``."""
    if min(p, m, v) < 1:
        raise UsageError(f"pipeline p={p}, m={m}, v={v}: all must be at least 1")
    return (p - 1) / (v * m)


def pipeline_time(stage_times: Sequence[float], microbatches: int, chunks: int = 1) -> float:
    """Time of a pipeline whose stage ``s`` takes ``T_s`` per microbatch (fwd + bwd).

    ``(sum_s T_s + (m v - 1) max_s T_s) / v``: the first microbatch passes every stage, the
    others follow at the pace of the slowest. ``v = 1`` is the stage-cut objective of
    DESIGN.md; equal stages give ``m T (1 + (p - 1) / (v m))``, the bubble above.
    """
    if not stage_times or microbatches < 1 or chunks < 1:
        raise UsageError("a pipeline needs stages, at least one microbatch and one chunk")
    return (sum(stage_times) + (microbatches * chunks - 1) * max(stage_times)) / chunks


def exposed_overlap(
    comm_s: Sequence[float], ready_s: Sequence[float], compute_end_s: float
) -> float:
    """Communication left after compute ends, when transfers run one at a time in order.

    Transfer ``j`` takes ``comm_s[j]`` and may start at ``ready_s[j]`` (and after transfer
    ``j - 1``); compute runs alongside and ends at ``compute_end_s``.
    """
    end = 0.0
    for comm, ready in zip(comm_s, ready_s, strict=True):
        end = max(end, ready) + comm
    return max(0.0, end - compute_end_s)


def exposed_gradient_sync(
    sync_s: float, backward_s: float, buckets: int, overlap: float = 1.0
) -> float:
    """The part of a bucketed gradient sync that backward does not hide.

    Gradients fill ``k`` equal buckets at even times during a backward of ``B`` seconds; each
    bucket's all-reduce (or reduce-scatter) of ``C / k`` starts when it is full, one at a
    time (PyTorch DDP, Li et al. 2020). All but the last bucket can hide behind the backward
    still to run:

        exposed = max(C / k, C - B (k - 1) / k)

    (the last bucket, or, when communication is the bottleneck, everything backward cannot
    cover). Equals ``exposed_overlap`` on that schedule. Where compute hides only a share
    ``f`` of what runs beside it (``DevicePreset.comm_overlap``: collectives that need the
    cores compute runs on), the rest stays exposed, ``(1 - f) C + f exposed``:

        exposed = max(C (1 - f (k - 1) / k), C - f B (k - 1) / k)

    >>> exposed_gradient_sync(4.0, 10.0, 4), exposed_gradient_sync(4.0, 10.0, 4, overlap=0.0)
    (1.0, 4.0)
    """
    if buckets < 1:
        raise UsageError(f"buckets={buckets}: at least one bucket")
    if sync_s <= 0:
        return 0.0
    hides = overlap * (buckets - 1) / buckets
    return max(sync_s * (1 - hides), sync_s - backward_s * hides)


def exposed_prefetch(
    gather_s: Sequence[float], compute_s: Sequence[float], overlap: float = 1.0
) -> float:
    """Exposed time of per-layer parameter all-gathers prefetched one layer ahead (FSDP):
    the sum of ``prefetch_waits``.

    >>> exposed_prefetch([2.0, 2.0, 2.0], [3.0, 1.0, 3.0])
    3.0
    >>> exposed_prefetch([2.0, 2.0, 2.0], [3.0, 3.0, 3.0], overlap=0.5)
    4.0
    """
    return sum(prefetch_waits(gather_s, compute_s, overlap))


def prefetch_waits(
    gather_s: Sequence[float], compute_s: Sequence[float], overlap: float = 1.0
) -> list[float]:
    """How long each layer waits for its parameters' all-gather, prefetched one layer
    ahead (FSDP2's forward prefetch, and the backward's in reverse).

    Layer ``i``'s gather is issued when layer ``i - 1`` starts computing, so it hides behind
    that layer; the first gather hides behind nothing; gathers run one at a time. For ``L``
    equal layers the waits sum to ``g + (L - 1) max(0, g - c)``. Where compute hides only a
    share ``f`` of what runs beside it (``DevicePreset.comm_overlap``), each wait is
    ``(1 - f) g + f`` times the wait of that rule, as ``exposed_gradient_sync`` does.

    >>> prefetch_waits([2.0, 2.0, 2.0], [3.0, 1.0, 3.0])
    [2.0, 0.0, 1.0]
    """
    if len(gather_s) != len(compute_s):
        raise UsageError("one all-gather time per layer compute time")
    waits = []
    gather_end = gather_s[0] if gather_s else 0.0
    compute_end = 0.0
    for i, compute in enumerate(compute_s):
        start = max(compute_end, gather_end)
        waits.append((1 - overlap) * gather_s[i] + overlap * (start - compute_end))
        if i + 1 < len(gather_s):  # the next layer's gather is issued now
            gather_end = max(gather_end, start) + gather_s[i + 1]
        compute_end = start + compute
    return waits


def backward_segments(ops: Sequence[tuple[int, float]], reached: Sequence[int]) -> list[float]:
    """The backward compute between the points where backward reaches each group of a
    prefetch chain: ``ops`` are (graph position, backward seconds) of the ops, ``reached``
    the positions of the ops where backward reaches each group, descending (backward runs
    the graph in reverse). Segment ``k`` is the backward of the ops in
    (``reached[k + 1]``, ``reached[k]``]: what runs while the group after ``k`` is fetched.

    >>> backward_segments([(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0)], [2, 0])
    [6.0, 1.0]
    """
    segments = [0.0] * len(reached)
    ascending = [-r for r in reached]
    for position, seconds in ops:
        k = bisect.bisect_right(ascending, -position) - 1  # the last group reached at or after
        if k >= 0:
            segments[k] += seconds
    return segments


def step_time(
    compute_s: float,
    *,
    recompute_s: float = 0.0,
    inline_comm_s: float = 0.0,
    tail_comm_s: float = 0.0,
    stages: int = 1,
    microbatches: int = 1,
    chunks: int = 1,
) -> StepTime:
    """Compose a step as in the module docstring: ``busy (1 + bubble) + tail``."""
    busy = compute_s + recompute_s + inline_comm_s
    bubble = busy * bubble_fraction(stages, microbatches, chunks) if stages > 1 else 0.0
    return StepTime(
        step_time_s=busy + bubble + tail_comm_s,
        compute_s=compute_s,
        recompute_s=recompute_s,
        exposed_comm_s=inline_comm_s + tail_comm_s,
        bubble_s=bubble,
    )


def mfu(model_flops: float, step_time_s: float, peak_flops: float, devices: int) -> float:
    """Model FLOPs utilisation: ``model_flops / (step_time_s x peak_flops x devices)``.

    >>> round(mfu(6 * 1.3e9 * 2**20, 20.0, 312e12, 8), 3)      # 1.3B model, 1M tokens
    0.164
    """
    if step_time_s <= 0 or peak_flops <= 0 or devices < 1:
        raise UsageError("mfu needs a positive step time and peak, and at least one device")
    return model_flops / (step_time_s * peak_flops * devices)


def to_estimate(
    step: StepTime,
    *,
    flops_per_step: float,
    peak_flops: float,
    devices: int,
    comm_bytes_per_step: float,
    memory: MemoryBreakdown,
    stages: tuple[StageEstimate, ...] = (),
) -> Estimate:
    """The ``autopar_plans.Estimate`` of a step, with its MFU."""
    return Estimate(
        step_time_s=step.step_time_s,
        flops_per_step=flops_per_step,
        mfu=mfu(flops_per_step, step.step_time_s, peak_flops, devices),
        comm_bytes_per_step=comm_bytes_per_step,
        memory_per_device_bytes=memory,
        compute_s=step.compute_s,
        exposed_comm_s=step.exposed_comm_s,
        bubble_s=step.bubble_s,
        recompute_s=step.recompute_s,
        stages=stages,
    )
