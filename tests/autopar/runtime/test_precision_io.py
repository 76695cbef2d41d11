"""Mixed precision, local inputs, sharded outputs and mesh errors on a (2,) mesh.

One spawn of 2 gloo ranks (``features.precision_io_on_2``) runs every check.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.features import precision_io_on_2

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(precision_io_on_2, 2)


@pytest.fixture(scope="module")
def results(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return ranks[0]


def test_a_mesh_that_is_not_the_world_size_is_a_usage_error(results: dict[str, Any]) -> None:
    message = results["mesh_error"]
    assert "4 devices" in message and "2 processes" in message
    assert "launch 4 processes or change the mesh shape" in message


def test_bf16_mixed_trains_like_single_device_autocast(results: dict[str, Any]) -> None:
    run = results["bf16_mixed"]
    torch.testing.assert_close(
        torch.tensor(run["losses"]), torch.tensor(run["ref_losses"]), rtol=2e-2, atol=0
    )
    assert run["losses"][2] < run["losses"][0]  # it trains
    assert run["output_dtype"] == "torch.bfloat16"  # the forward ran in bf16
    for kind in ("param_dtypes", "grad_dtypes", "state_dtypes"):
        assert run[kind] == ["torch.float32"], kind  # master weights stay fp32


def test_a_plan_runs_in_the_precision_it_was_made_for(results: dict[str, Any]) -> None:
    message = results["plan_precision_error"]
    assert "'bf16_mixed', not 'fp32'" in message


def test_pure_bf16_holds_bf16_parameters(results: dict[str, Any]) -> None:
    run = results["bf16"]
    assert run["param_dtypes"] == ["torch.bfloat16"]
    assert run["loss"] == pytest.approx(run["ref_loss"], rel=2e-2)


def test_fp16_mixed_runs_where_autocast_has_fp16(results: dict[str, Any]) -> None:
    run = results["fp16_mixed"]
    assert run["param_dtypes"] == ["torch.float32"]
    assert run["loss"] == pytest.approx(run["ref_loss"], rel=2e-2)


def test_input_slices_split_the_batch_between_ranks(ranks: list[dict[str, Any]]) -> None:
    """DP forced: the MLP's input goes straight into a batch-sharded matmul."""
    runs = [r["local_io/mlp-tiny"] for r in ranks]
    assert runs[0]["input_layouts"] == ["[S(0)]"]
    assert runs[0]["input_slices"] == ((slice(0, 2), slice(0, 16)),)
    assert runs[1]["input_slices"] == ((slice(2, 4), slice(0, 16)),)


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny"])
def test_local_inputs_and_sharded_outputs_give_single_device_gradients(
    ranks: list[dict[str, Any]], name: str
) -> None:
    """Each rank passes its slice of the inputs (GPT's token ids may be whole: the plan
    looks them up replicated), gets its half of the outputs (no whole output is made) and
    computes the local loss sum over the global count; the summands add up to the single-
    device mean loss and the gradients are the single-device ones."""
    run = ranks[0][f"local_io/{name}"]
    assert run["output_layout"] == "[S(0)]"
    assert run["local_shape"][0] == 2
    assert [r[f"local_io/{name}"]["piece"][0] for r in ranks] == [slice(0, 2), slice(2, 4)]
    assert run["loss"] == pytest.approx(run["ref_loss"], rel=1e-5)
    assert set(run["grads"]) == set(run["ref_grads"])
    for param, ref in run["ref_grads"].items():
        scale = float(ref.abs().max()) or 1.0
        torch.testing.assert_close(
            run["grads"][param], ref, rtol=1e-4, atol=1e-6 * scale, msg=param
        )


def test_a_whole_batch_given_to_local_inputs_is_a_usage_error(results: dict[str, Any]) -> None:
    message = results["local_io/mlp-tiny"]["shape_error"]
    assert "(4, 16)" in message and "(2, 16)" in message and "input_slices" in message


def test_state_dict_keeps_persistent_buffers_only(results: dict[str, Any]) -> None:
    run = results["buffers"]
    assert run["keys"] == run["ref_keys"]
    assert "offset" not in run["keys"]
    assert torch.equal(run["scale"], torch.full((8,), 2.0))
    torch.testing.assert_close(run["output"], run["ref_output"])
