"""The simulated pipeline schedule: the closed form where each device has its cores, and
where ranks share fewer cores, faster while some wait (``autopar_cost_model.schedule``)."""

from __future__ import annotations

import pytest

from autopar_cost_model.hardware import SharedCores
from autopar_cost_model.schedule import makespan, schedule_time, simulate
from autopar_cost_model.step import pipeline_time

STAGES = 4
FORWARD = [1.0, 1.0, 1.0, 1.0]
BACKWARD = [2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("microbatches", [1, 4, 8])
def test_each_device_on_its_own_cores_runs_the_closed_form(schedule, microbatches):
    """Equal stages: the list schedule's span is ``(m + p - 1) T``, which is
    ``pipeline_time``; ``schedule_time`` without shared cores is that closed form."""
    waits = [0.5] * STAGES
    tasks = simulate(schedule, STAGES, microbatches, 1, FORWARD, BACKWARD, waits)
    closed = pipeline_time([3.5] * STAGES, microbatches)
    assert makespan(tasks) == pytest.approx(closed)
    assert schedule_time(schedule, microbatches, 1, FORWARD, BACKWARD, waits) == closed


def test_ranks_with_a_core_each_run_as_measured():
    """Four ranks on four cores: nobody gains when others wait."""
    cores = SharedCores(ranks=4, cores=4)
    alone = simulate("1f1b", STAGES, 4, 1, FORWARD, BACKWARD)
    shared = simulate("1f1b", STAGES, 4, 1, FORWARD, BACKWARD, cores=cores)
    assert shared == alone


def test_a_rank_that_waits_leaves_its_share_of_the_cores_to_the_busy_ones():
    """Four ranks on two cores, every figure measured with all four busy (half a core each):
    the span is below the closed form, which counts the bubble at the measured speed, and
    no shorter than all the work at four ranks' measured throughput, the most two cores
    give (``SharedCores.speed``: k busy ranks get ``min(k, 2) / 2`` of four ranks' speed)."""
    cores = SharedCores(ranks=4, cores=2)
    m = 4
    span = schedule_time("1f1b", m, 1, FORWARD, BACKWARD, [0.0] * STAGES, cores)
    work = m * (sum(FORWARD) + sum(BACKWARD))
    assert work / cores.ranks <= span < pipeline_time([3.0] * STAGES, m)
    # one stage, alone: twice as fast; two busy: as fast as two of four
    assert cores.speed(1) == cores.speed(2) == 2.0
    assert schedule_time("1f1b", 1, 1, [1.0], [2.0], [0.0], cores) == pytest.approx(1.5)


def test_waiting_is_not_sped_up_and_leaves_the_cores_to_others():
    """Two stages of one rank each on one core: stage 0's forward of microbatch 1 runs
    while stage 1 waits out its hand-off, at the whole core's speed."""
    cores = SharedCores(ranks=2, cores=1)
    waits_only = schedule_time("1f1b", 2, 1, [0.0, 0.0], [0.0, 0.0], [2.0, 2.0], cores)
    assert waits_only == pytest.approx(schedule_time("1f1b", 2, 1, [0.0] * 2, [0.0] * 2, [2.0] * 2))
    tasks = simulate("1f1b", 2, 2, 1, [1.0, 1.0], [0.0, 0.0], [2.0, 2.0], cores)
    first = next(t for t in tasks if (t.device, t.kind, t.microbatch) == (0, "F", 0))
    # half a second of compute at twice the measured speed, then a second's wait
    assert first.end - first.start == pytest.approx(0.5 + 1.0)


def test_the_devices_of_a_stage_compute_together():
    """Two stages of two ranks each (``replicas=2``) on two cores: one busy stage is two
    busy ranks, which the two cores run at their whole speed; both busy, at the measured."""
    cores = SharedCores(ranks=4, cores=2)
    one_each = schedule_time("1f1b", 4, 1, [1.0] * 2, [2.0] * 2, [0.0] * 2, cores, replicas=1)
    two_each = schedule_time("1f1b", 4, 1, [1.0] * 2, [2.0] * 2, [0.0] * 2, cores, replicas=2)
    closed = pipeline_time([3.0, 3.0], 4)
    assert one_each < two_each < closed
