"""State under the user's names, sharded checkpoints and sharded outputs on a (2, 2) mesh.

One spawn of 4 gloo ranks (``features.state_on_2x2``) runs every check; the tests read its
results. GPT-tiny is planned with tensor parallelism forced, so most parameters are
sharded (and the tied ``wte.weight``/``lm_head.weight`` is one parameter with two names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.features import state_on_2x2

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmpdir: Path = tmp_path_factory.mktemp("checkpoints")
    return run_ranks(state_on_2x2, 4, (str(tmpdir),))[0]


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for name, ref in want.items():
        scale = float(ref.abs().max()) or 1.0
        torch.testing.assert_close(
            got[name], ref, rtol=1e-4, atol=1e-6 * scale, msg=f"{what}: {name}"
        )


def test_the_plan_shards_parameters(results: dict[str, Any]) -> None:
    """Otherwise the tests below would not test gathering and resharding."""
    assert "wte.weight" in results["sharded"]
    assert len(results["sharded"]) > 10


def test_named_parameters_are_the_users_names_with_tied_weights_once(
    results: dict[str, Any],
) -> None:
    assert results["names"] == results["ref_names"]
    assert "lm_head.weight" not in results["names"]  # tied to wte.weight: yielded once
    assert results["optimizer_params"] == len(results["ref_names"])


def test_state_dict_equals_the_single_device_state_dict(results: dict[str, Any]) -> None:
    state, ref = results["state"], results["ref_state"]
    assert list(state) == list(ref)  # the same keys in the same order, both tied names
    assert "lm_head.weight" in state
    for key, value in ref.items():
        assert state[key].shape == value.shape, key
        assert torch.equal(state[key], value), key


def test_loading_a_single_device_state_gives_its_outputs(results: dict[str, Any]) -> None:
    torch.testing.assert_close(
        results["loaded_output"], results["modified_output"], rtol=1e-4, atol=1e-5
    )
    assert not torch.allclose(results["modified_output"], results["ref_output"])


def test_inside_a_parent_module_names_and_state_are_prefixed(results: dict[str, Any]) -> None:
    assert results["parent_names"] == [f"net.{n}" for n in results["ref_names"]]
    assert results["parent_state_keys"] == [f"net.{k}" for k in results["ref_state"]]
    torch.testing.assert_close(
        results["parent_loaded_output"], results["ref_output"], rtol=1e-4, atol=1e-5
    )


def test_a_state_that_does_not_fit_is_a_usage_error(results: dict[str, Any]) -> None:
    message = results["bad_state_error"]
    assert "missing" in message and "layers.0.attn.qkv.weight" in message


@pytest.mark.parametrize("style", ["tp", "dp"])
def test_checkpoint_loads_into_a_fresh_model_of_any_plan(
    results: dict[str, Any], style: str
) -> None:
    """Saved under TP; loaded into a model with other weights planned TP (same layouts)
    and DP (DCP reshards): the parameters are the saved ones, and the next AdamW step (so
    the optimizer state too) matches the model that saved."""
    saved, loaded = results["ckpt_saved"], results[f"ckpt_{style}"]
    assert loaded["differed_before"]
    if style == "dp":
        assert set(loaded["layouts"].values()) == {"[R, R]"}
    for name, value in saved["params"].items():
        assert torch.equal(loaded["params"][name], value), name
    assert loaded["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-5)
    close(loaded["after"], saved["after"], f"after a step, loaded into {style}")


def test_loading_a_missing_checkpoint_is_a_usage_error(results: dict[str, Any]) -> None:
    assert "no checkpoint at" in results["missing_ckpt_error"]


def test_sharded_outputs_with_a_replicated_axis_give_single_device_gradients(
    results: dict[str, Any],
) -> None:
    """A 2-layer MLP with TP forced ends in a row-parallel linear: its output is split on
    the batch over dp and a partial sum over tp, returned as S(0) x R. Each rank's loss is
    its local squared-error sum over the global count (tp pairs compute the same term);
    the gradients are the single-device ones only if the boundary scales the replicated
    axis by 1/2 and leaves the sharded one alone."""
    sharded = results["sharded_output"]
    assert sharded["layout"] == "[S(0), R]"
    assert sharded["local_shape"] == (2, 16)
    close(sharded["grads"], sharded["ref_grads"], "gradients")
