"""Step time: pipeline bubble, overlap of communication with compute, MFU."""

from __future__ import annotations

import pytest

from autopar_cost_model import (
    bubble_fraction,
    exposed_gradient_sync,
    exposed_overlap,
    exposed_prefetch,
    mfu,
    model_state_memory,
    pipeline_time,
    step_time,
    to_estimate,
)
from autopar_plans.errors import UsageError


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 16), (8, 64), (8, 1)])
def test_bubble_fraction_gpipe_and_1f1b(p, m):
    # Narayanan et al. 2021, Sec. 2.2.1: (p - 1) / m
    assert bubble_fraction(p, m) == (p - 1) / m


@pytest.mark.parametrize(("p", "m", "v"), [(4, 16, 2), (8, 64, 4), (4, 8, 1)])
def test_bubble_fraction_interleaved(p, m, v):
    # Narayanan et al. 2021, Sec. 2.2.2: (p - 1) / (v m)
    assert bubble_fraction(p, m, v) == (p - 1) / (v * m)


def test_pipeline_time_of_equal_stages_has_the_bubble():
    t, p, m = 0.1, 4, 16
    ideal = m * t
    assert pipeline_time([t] * p, m) == pytest.approx(ideal * (1 + bubble_fraction(p, m)))
    assert pipeline_time([t] * p, m, chunks=2) == pytest.approx(
        ideal * (1 + bubble_fraction(p, m, 2))
    )
    # the slowest stage sets the pace
    assert pipeline_time([0.1, 0.3, 0.1], 10) == pytest.approx(0.5 + 9 * 0.3)


def test_step_time_adds_bubble_and_tail():
    step = step_time(
        1.0, recompute_s=0.25, inline_comm_s=0.25, tail_comm_s=0.1, stages=4, microbatches=6
    )
    assert step.bubble_s == pytest.approx(1.5 * 3 / 6)
    assert step.step_time_s == pytest.approx(1.5 + 0.75 + 0.1)
    assert step.exposed_comm_s == pytest.approx(0.35)
    assert step_time(2.0).step_time_s == 2.0


@pytest.mark.parametrize(
    ("sync", "backward", "buckets"), [(1.0, 4.0, 4), (1.0, 4.0, 1), (3.0, 1.0, 4), (2.0, 2.0, 8)]
)
def test_bucketed_gradient_sync_closed_form_matches_the_schedule(sync, backward, buckets):
    # bucket j is full at backward * (j + 1) / k and takes sync / k on one stream
    ready = [backward * (j + 1) / buckets for j in range(buckets)]
    simulated = exposed_overlap([sync / buckets] * buckets, ready, backward)
    assert exposed_gradient_sync(sync, backward, buckets) == pytest.approx(simulated)


def test_only_the_last_bucket_shows_when_backward_is_long():
    assert exposed_gradient_sync(1.0, 10.0, 4) == pytest.approx(0.25)
    assert exposed_gradient_sync(1.0, 10.0, 1) == pytest.approx(1.0)  # no overlap at all
    assert exposed_gradient_sync(0.0, 10.0, 4) == 0.0


def test_fsdp_prefetch_hides_all_but_the_first_gather():
    layers = 8
    assert exposed_prefetch([0.1] * layers, [0.2] * layers) == pytest.approx(0.1)
    # gathers slower than compute: g + (L - 1)(g - c)
    assert exposed_prefetch([0.3] * layers, [0.2] * layers) == pytest.approx(0.3 + 7 * 0.1)
    assert exposed_prefetch([], []) == 0.0


def test_mfu_and_estimate():
    # Narayanan et al. 2021, Table 1: the 1T model reaches 163 TFLOP/s per A100, 52% of 312
    assert mfu(163e12 * 3072, 1.0, 312e12, 3072) == pytest.approx(0.522, abs=1e-3)
    step = step_time(3.0, tail_comm_s=1.0)
    estimate = to_estimate(
        step,
        flops_per_step=8 * 312e12,
        peak_flops=312e12,
        devices=4,
        comm_bytes_per_step=1e9,
        memory=model_state_memory([], (1,)),
    )
    assert estimate.mfu == pytest.approx(0.5)
    assert estimate.step_time_s == 4.0 and estimate.exposed_comm_s == 1.0


def test_bad_arguments_are_refused():
    with pytest.raises(UsageError):
        bubble_fraction(4, 0)
    with pytest.raises(UsageError):
        mfu(1.0, 0.0, 1.0, 1)
    with pytest.raises(UsageError):
        exposed_gradient_sync(1.0, 1.0, 0)


@pytest.mark.parametrize(("overlap", "exposed"), [(1.0, 1.0), (0.5, 2.5), (0.0, 4.0)])
def test_compute_hides_only_its_share_of_the_gradient_sync(overlap, exposed):
    """4 s of sync in 4 buckets behind 10 s of backward: all but the last bucket hides
    (1 s exposed); where compute hides only ``overlap`` of what runs beside it, the rest
    shows: ``(1 - f) C + f exposed``."""
    assert exposed_gradient_sync(4.0, 10.0, 4, overlap) == pytest.approx(exposed)
    # when communication is the bottleneck the backward hides only its share of itself
    assert exposed_gradient_sync(4.0, 2.0, 4, overlap) == pytest.approx(4.0 - overlap * 1.5)
