"""A compiled model takes the calls a training script makes at shapes and in modes it was
not traced for: the last, partial batch of an epoch, another sequence length, eval mode.
Each gets a program planned for it with the parameters where they are (``runtime.calls``),
and computes what the model computes on one device (within fp32 roundoff, ``closeness``).

One spawn of 4 ranks (a 2 x 2 mesh) runs every case (``call_shapes``)."""

from __future__ import annotations

from typing import Any

import pytest

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.call_shapes import call_shapes
from tests.autopar.runtime.closeness import assert_trains_alike

pytestmark = pytest.mark.multirank

CASES: dict[str, dict[str, Any]] = {
    "forward/dp+zero1": {"kind": "forward", "force": "dp", "zero": 1},
    "forward/fsdp": {"kind": "forward", "force": "fsdp"},
    "forward/tp+sp": {"kind": "forward", "force": "tp+sp"},
    # every parameter a master on the host, its working copy fetched per layer: a call of
    # another shape holds them the same way (it read views that do not exist before)
    "forward/fsdp+offload": {"kind": "forward", "force": "fsdp", "offload": "parameters"},
    "train_step/free": {"kind": "train_step"},
    "train_step/fsdp": {"kind": "train_step", "force": "fsdp"},
    "eval/dropout": {"kind": "eval", "config": {"dropout": 0.5}},
}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    per_rank = run_ranks(call_shapes, 4, (list(CASES.values()),))
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(CASES)}


def _forward_cases() -> list[str]:
    return [name for name, case in CASES.items() if case["kind"] in ("forward", "eval")]


def _training_cases() -> list[str]:
    return [name for name, case in CASES.items() if case["kind"] in ("forward", "train_step")]


@pytest.mark.parametrize("case", _forward_cases())
def test_a_call_of_another_shape_or_mode_computes_what_one_device_does(results, case):
    for rank, result in enumerate(results[case]):
        reference = result["reference"]
        for i, got in enumerate(result["outputs"]):
            assert_trains_alike(
                got, reference["single"][i], reference["exact"][i], f"{case} rank {rank} call {i}"
            )


@pytest.mark.parametrize("case", _training_cases())
def test_training_through_a_partial_last_batch_equals_one_device(results, case):
    for result in results[case]:
        (single_losses, single_params), (exact_losses, exact_params) = (
            result["trained"]["single"],
            result["trained"]["exact"],
        )
        assert_trains_alike(result["losses"], single_losses, exact_losses, f"{case}: losses")
        for name, got in result["params"].items():
            assert_trains_alike(got, single_params[name], exact_params[name], f"{case}: {name}")


@pytest.mark.parametrize("case", list(CASES))
def test_every_call_keeps_the_parameters_where_they_are_stored(results, case):
    plans = results[case][0]["plans"]
    # forward: the traced call and three others; train_step: the traced microbatch and the
    # partial batch's last microbatch (of 2); eval: the traced call in eval mode
    assert len(plans) == {"forward": 4, "train_step": 2, "eval": 2}[CASES[case]["kind"]]
    if CASES[case].get("offload"):
        assert plans[0]["offload"] == ("optimizer", "parameters")
    for plan in plans[1:]:
        assert plan["params"] == plans[0]["params"], plan["parallelism"]
        assert plan["offload"] == plans[0]["offload"]  # held on the host alike
    assert [plan["batch"] for plan in plans[1:]] == {
        "forward": [3, 4, 2],
        "train_step": [2],
        "eval": [4],
    }[CASES[case]["kind"]]
