"""The plan is what runs: every collective a compiled step issues on real gloo ranks is the
plan's ledger, call for call and byte for byte, per (kind, mesh axes, dtype).

One spawn of 4 ranks (a 2 x 2 mesh, dp x tp) trains each case two steps; the second step's
collectives, as the runtime recorded them (``CompiledModel.observed_collectives``), are
compared with ``autopar_plans.ledger.tally_entries(plan.estimate.comm)``. Four microbatches tell a
collective paid once per step (gradient sync, ZeRO-1's sum, ZeRO's gathers) from one paid
per microbatch (reshards, ZeRO-2's sum, FSDP's gathers).

Pipelines (two stages of a 2 x 2 mesh, each stage data or tensor parallel over its two
devices): each rank's step is its own stage's entries of the ledger
(``autopar_passes.pipeline.ledger``), sends and receives included.
"""

from __future__ import annotations

from typing import Any

import pytest

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.ledger_cases import observed_and_planned

pytestmark = pytest.mark.multirank

CASES: dict[str, dict[str, Any]] = {
    "gpt/dp": {"force": "dp", "microbatches": 4},
    "gpt/tp": {"force": "tp", "microbatches": 4},
    "gpt/tp+sp": {"force": "tp+sp", "microbatches": 4},
    "gpt/fsdp/1 microbatch": {"force": "fsdp"},
    "gpt/fsdp": {"force": "fsdp", "microbatches": 4},
    "gpt/zero1": {"force": "dp", "zero": 1, "microbatches": 4},
    "gpt/zero2": {"force": "dp", "zero": 2, "microbatches": 4},
    "llama/tp+sp": {"model": "llama-tiny", "force": "tp+sp", "microbatches": 4},
    "moe/ep": {"model": "moe-tiny", "force": "ep", "microbatches": 4},
    # bf16_mixed: weights gathered and gradients summed in bf16, activations as autocast
    # makes them (a norm's output stays fp32)
    "gpt/dp/bf16": {"force": "dp", "microbatches": 4, "precision": "bf16_mixed"},
    "gpt/fsdp/bf16": {"force": "fsdp", "microbatches": 4, "precision": "bf16_mixed"},
    "gpt/tp+sp/bf16": {"force": "tp+sp", "microbatches": 4, "precision": "bf16_mixed"},
    "gpt/zero2/bf16": {"force": "dp", "zero": 2, "microbatches": 4, "precision": "bf16_mixed"},
    # the gradient-reduction policy (autopar_plans.reduction): the hierarchical form over
    # both axes (reduce-scatter over tp, all-reduce over dp, all-gather over tp, on the
    # padded bucket); fp32 gradients summed in bf16 (DDP's bf16_compress_hook)
    "gpt/dp/hierarchical": {
        "force": "dp",
        "microbatches": 4,
        "options": {"reduction_form": "hierarchical"},
    },
    "gpt/dp/bf16 sums": {"force": "dp", "microbatches": 4, "options": {"grad_compression": "bf16"}},
    # recomputed layer 1 (a hint): the collectives inside its checkpoint run again in
    # backward as far as the replay goes (up to the last op that keeps a tensor), its
    # gathers are single, not the layer's group, and its inputs are saved for the replay
    "gpt/tp/recompute": {
        "force": "tp",
        "microbatches": 2,
        "options": {"hints": {"recompute": ["layers.1"]}},
    },
    "gpt/tp+sp/recompute": {
        "force": "tp+sp",
        "microbatches": 2,
        "options": {"hints": {"recompute": ["layers.1"]}},
    },
    "gpt/fsdp/recompute": {
        "force": "fsdp",
        "microbatches": 2,
        "options": {"hints": {"recompute": ["layers.1"]}},
    },
    "gpt/dp/hierarchical/bf16_mixed": {
        "force": "dp",
        "microbatches": 4,
        "precision": "bf16_mixed",
        "options": {"reduction_form": "hierarchical"},
    },
}


PIPELINE_CASES: dict[str, dict[str, Any]] = {
    "gpt/pp/1f1b/dp": {"force": "dp", "stages": 2, "microbatches": 4},
    "gpt/pp/gpipe/fsdp": {"force": "fsdp", "stages": 2, "microbatches": 4, "schedule": "gpipe"},
    "gpt/pp/zero1": {"force": "dp", "zero": 1, "stages": 2, "microbatches": 4},
    "gpt/pp/zero2/bf16": {
        "force": "dp",
        "zero": 2,
        "stages": 2,
        "microbatches": 4,
        "precision": "bf16_mixed",
    },
    "gpt/pp/tp+sp/bf16": {
        "force": "tp+sp",
        "stages": 2,
        "microbatches": 4,
        "precision": "bf16_mixed",
    },
    # PowerSGD inside a pipeline: each stage's buckets compressed in its last backward
    "gpt/pp/1f1b/dp/powersgd": {
        "force": "dp",
        "stages": 2,
        "microbatches": 4,
        "options": {"grad_compression": "powersgd"},
    },
    # a recomputed layer on a pipeline stage: its replay's collectives are its stage's
    "gpt/pp/tp/recompute": {
        "force": "tp",
        "stages": 2,
        "microbatches": 4,
        "config": {"n_layer": 4},
        "options": {"hints": {"recompute": ["layers.*"]}},
    },
    # four layers: two chunks of one layer per device, the last handing back to the first
    "gpt/pp/interleaved": {
        "force": "dp",
        "stages": 2,
        "microbatches": 4,
        "schedule": "interleaved",
        "chunks": 2,
        "config": {"n_layer": 4},
    },
}
ALL_CASES = {**CASES, **PIPELINE_CASES}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    """Every rank's result per case name."""
    per_rank = run_ranks(observed_and_planned, 4, ((2, 2), list(ALL_CASES.values())))
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(ALL_CASES)}


def _difference(result: dict[str, Any]) -> str:
    observed, planned = result["observed"], result["planned"]
    lines = [f"{result['case']} ({result['parallelism']}): observed != planned"]
    for key in sorted(set(observed) | set(planned)):
        got, want = observed.get(key), planned.get(key)
        mark = "" if got == want else "   <-- differs"
        lines.append(f"  {key}: observed {got}, planned {want}{mark}")
    lines.append("ledger:")
    lines += [f"  {entry}" for entry in result["ledger"]]
    return "\n".join(lines)


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_every_rank_issues_exactly_the_collectives_the_plan_charges(
    results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    for result in results[case]:
        assert result["observed"], "a 2 x 2 plan communicates"
        assert result["observed"] == result["planned"], _difference(result)


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_no_collective_of_a_step_goes_around_the_recording_layer(
    results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    # on gloo each recorded collective is one torch.distributed call (a reduce-scatter runs
    # as an all-reduce there): the calls torch saw are the calls recorded (a pipeline's
    # sends and receives go through torch's batch_isend_irecv, recorded where the stage
    # makes them, not counted here)
    for result in results[case]:
        collectives = [c for c in result["calls"] if c[0] not in ("send", "recv")]
        assert result["torch_calls"] == len(collectives)


def test_a_pipeline_stage_hands_off_each_microbatch_both_ways(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    # gpt-tiny's stages hand over the residual stream and nothing else: per microbatch the
    # first stage sends it forward and receives its gradient back, the second the reverse
    for rank, result in enumerate(results["gpt/pp/1f1b/dp"]):
        handoffs = [
            (kind, phase) for kind, _, _, _, phase in result["calls"] if kind in ("send", "recv")
        ]
        first = rank < 2
        assert sorted(handoffs) == sorted(
            [("send", "forward"), ("recv", "backward")] * 4
            if first
            else [("recv", "forward"), ("send", "backward")] * 4
        )


def test_a_pipeline_syncs_gradients_in_the_last_backward_not_after_the_schedule(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    # DDP's convention: the data-parallel sum runs in the stage's last microbatch's
    # backward, where it can overlap the other stage's; only the tied embedding's sum
    # across the stages and the loss run after the schedule
    for result in results["gpt/pp/1f1b/dp"]:
        after = [(kind, axes) for kind, axes, _, _, phase in result["calls"] if phase == "step"]
        assert sorted(after) == [("all_reduce", ("pp",)), ("broadcast", ("pp",))]
        # (the stage's one mesh axis, whatever its name, replicates every parameter)
        synced = [c for c in result["calls"] if c[0] == "all_reduce" and c[1] != ("pp",)]
        assert synced and all(phase == "backward" for *_, phase in synced)


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_local_parameter_gradient_and_optimizer_bytes_are_the_plans(
    results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    # what each rank holds, as the plan's memory counts it (autopar_cost_model.memory): the
    # weights the forward reads (ZeRO's working copies, in bf16 under mixed precision for
    # the weights only matmuls read), the gradients at the end of a backward (ZeRO-1's
    # accumulate whole, ZeRO-2's land in the master's fp32 piece) and the optimizer's
    # state (AdamW's two moments, plus ZeRO's fp32 master pieces)
    for result in results[case]:
        held, planned = result["held"], result["memory"]
        assert held["params"] == planned["params"], (held, planned)
        assert held["grads"] == planned["grads"], (held, planned)
        assert held["optimizer"] == planned["optimizer"], (held, planned)


def test_zero1_sums_once_per_step_and_zero2_once_per_microbatch(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    def sums(case: str) -> int:
        return sum(
            1
            for kind, _, _, _, phase in results[case][0]["calls"]
            if phase == "backward" and kind in ("all_reduce", "reduce_scatter")
        )

    # gpt-tiny's parameters fit one ZeRO bucket; data parallel over both axes: one sum per
    # axis, plus the backward of the logits' gather (a reduce-scatter per axis) per microbatch
    assert sums("gpt/zero1") == 2 + 4 * 2
    assert sums("gpt/zero2") == 4 * 2 + 4 * 2
