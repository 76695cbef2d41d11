"""A failed rank is named (``runtime.faults``): on 4 gloo ranks, when rank 2's call raises,
when it is SIGKILLed, and when it hangs past the collectives' timeout, every other rank
raises one ``RankFailedError`` that names rank 2 and what happened to it, instead of gloo's
socket error after 20-74 s or a 30-minute wait; ranks given different batches where
``inputs="global"`` expects one are told which."""

from __future__ import annotations

from typing import Any

import pytest

from autopar.testing.ranks import run_ranks, run_ranks_outcomes
from tests.autopar.runtime.fault_cases import (
    FAILING,
    different_batches,
    one_rank_fails,
    pipeline_rank_killed,
)

pytestmark = pytest.mark.multirank

TIMEOUT = 3.0


def _others(outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    others = [o for rank, o in enumerate(outcomes) if rank != FAILING]
    assert all(o["ok"] for o in others), others
    return [o["result"] for o in others]


def test_a_rank_whose_call_raises_is_named_with_its_error_by_the_others() -> None:
    outcomes = run_ranks_outcomes(one_rank_fails, 4, ("raise", 60.0))
    failed = outcomes[FAILING]
    assert not failed["ok"] and "ValueError: boom: a bug on this rank" in failed["error"]
    for seen in _others(outcomes):
        assert seen["rank_failed"], seen
        assert f"rank {FAILING} failed: ValueError: boom: a bug on this rank" in seen["message"]
        assert seen["seconds"] < 120  # not the process group's 30 minutes (a hang's bound)


def test_a_killed_rank_is_named_by_the_others() -> None:
    outcomes = run_ranks_outcomes(one_rank_fails, 4, ("kill", 60.0))
    assert outcomes[FAILING] == {"ok": False, "died": -9}
    for seen in _others(outcomes):
        assert seen["rank_failed"], seen
        assert f"rank {FAILING} was killed" in seen["message"]


def test_a_stuck_rank_is_named_after_the_timeout() -> None:
    outcomes = run_ranks_outcomes(one_rank_fails, 4, ("hang", TIMEOUT))
    for seen in _others(outcomes):
        assert seen["rank_failed"], seen
        assert f"rank {FAILING} did not reach the collective" in seen["message"]
        assert "autopar.compile(..., timeout=)" in seen["message"]
        assert seen["seconds"] < 4 * TIMEOUT + 10


def test_ranks_given_different_batches_are_told_which() -> None:
    for seen in run_ranks(different_batches, 4):
        assert seen["type"] == "UsageError"
        assert "rank(s) 3 were given other inputs than rank 0" in seen["message"]


def test_a_killed_pipeline_stage_is_named_by_the_others() -> None:
    # torch's pipeline schedule sends and receives by itself; its failure is explained too
    outcomes = run_ranks_outcomes(pipeline_rank_killed, 4)
    for seen in _others(outcomes):
        assert seen["type"] == "RankFailedError", seen
        assert f"rank {FAILING} was killed" in seen["message"]
