"""PyTorch's own tools on a compiled model: its parameters are DTensors, so clipping, the
standard checkpoint API and optimizers compute what they compute on one device.

On 4 gloo ranks (a 2x2 mesh) under data, tensor and fully sharded parallelism and ZeRO-1:
``clip_grad_norm_`` returns the single-device norm every step, training under clipping and
a cosine schedule matches single-device training step by step, replicated parameters stay
bit-equal across ranks, and a checkpoint written with ``get_state_dict`` and ``dcp.save``
resumes, under another layout, into the same losses.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.pytorch_tools import (
    run_foreach_zero,
    run_hf_script,
    run_pipeline_checkpoint,
    run_script,
)

pytestmark = pytest.mark.multirank

# (model, layout, ZeRO stage, the layout it resumes under, its ZeRO stage); GPT's biases
# under tp with ZeRO-1 are master pieces cut inside a tensor-parallel split (_StridedShard)
CASES = [
    ("llama-tiny", "dp", 0, "tp", 0),
    ("llama-tiny", "tp", 0, "fsdp", 0),
    ("llama-tiny", "fsdp", 0, "dp", 1),
    ("llama-tiny", "dp", 1, "dp", 0),
    ("gpt-tiny", "tp", 1, "dp", 0),
]
NAMES = [f"{model}/{force}/zero={zero}" for model, force, zero, _, _ in CASES]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("checkpoints"))
    return run_ranks(run_script, 4, (CASES, root))


@pytest.fixture(scope="module")
def results(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return ranks[0]["results"]


@pytest.mark.parametrize("case", NAMES)
def test_every_parameter_is_a_dtensor_in_the_plans_placements(results, case) -> None:
    placed = results[case]["placed"]
    assert placed
    if case == "gpt-tiny/tp/zero=1":
        assert any(entry["strided"] for entry in placed.values())
    for name, entry in placed.items():
        assert entry["dtensor"], name
        assert entry["placements"], name
        assert entry["whole"], name  # DTensor's full_tensor is the gathered parameter


@pytest.mark.parametrize("case", NAMES)
def test_clip_grad_norm_returns_the_single_device_norm(results, case) -> None:
    result = results[case]
    norms = [norm for _, norm in result["steps"]]
    reference = [norm for _, norm in result["reference"]]
    assert min(reference) > 0.5  # clipping acts on every step
    assert norms == pytest.approx(reference, rel=TOLERANCE)


@pytest.mark.parametrize("case", NAMES)
def test_training_with_clipping_and_a_schedule_matches_one_device(results, case) -> None:
    result = results[case]
    losses = [loss for loss, _ in result["steps"]]
    reference = [loss for loss, _ in result["reference"]]
    assert losses == pytest.approx(reference, abs=TOLERANCE)


# under FSDP and ZeRO-1 on 2x2 every parameter the optimizer steps (ZeRO: the master
# piece) is sharded four ways: nothing is replicated there
@pytest.mark.parametrize("case", ["llama-tiny/dp/zero=0", "llama-tiny/tp/zero=0"])
def test_replicated_parameters_stay_bit_equal_across_ranks(ranks, case) -> None:
    pieces: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = defaultdict(list)
    for rank in ranks:
        for name, entry in rank["results"][case]["trained"].items():
            held = tuple(rank["coords"][axis] for axis in entry["sharded_on"])
            pieces[(name, held)].append(entry["local"])
    assert any(len(copies) > 1 for copies in pieces.values())
    for (name, held), copies in pieces.items():
        for other in copies[1:]:
            assert torch.equal(copies[0], other), (name, held)


@pytest.mark.parametrize("case", NAMES)
@pytest.mark.parametrize("pattern", ["accumulated", "zeroed in place"])
def test_gradients_are_the_single_device_ones_under_the_usual_patterns(
    results, case, pattern
) -> None:
    """Two backwards without zeroing add up; a zero_grad(set_to_none=False) starts afresh."""
    gaps = results[case]["gradients"][pattern]
    assert all(gap is not None and gap < TOLERANCE for gap in gaps.values()), gaps


@pytest.mark.parametrize("case", NAMES)
def test_a_frozen_parameter_gets_no_gradient_and_the_others_theirs(results, case) -> None:
    frozen = results[case]["gradients"]["frozen"]
    gaps = dict(frozen["gaps"])
    assert gaps.pop(frozen["name"]) is None, frozen
    assert all(gap is not None and gap < TOLERANCE for gap in gaps.values()), gaps


@pytest.mark.parametrize("case", NAMES)
def test_a_dcp_checkpoint_resumes_under_another_layout_and_a_foreach_optimizer(
    results, case
) -> None:
    result = results[case]
    assert result["resumed_parallelism"] != result["parallelism"]
    continued = [loss for loss, _ in result["steps"][-len(result["resumed"]) :]]
    resumed = [loss for loss, _ in result["resumed"]]
    assert resumed == pytest.approx(continued, abs=TOLERANCE)
    assert result["optimizer_state_is_dtensor"]


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_trains_as_on_one_device_under_a_foreach_optimizer(zero) -> None:
    # foreach kernels step a DTensor master without bumping its version counter: the
    # working copies must be gathered again all the same
    losses = run_ranks(run_foreach_zero, 2, (zero,))[0]
    assert losses["compiled"] == pytest.approx(losses["single"], abs=TOLERANCE)
    assert losses["single"][0] != pytest.approx(losses["single"][-1], abs=1e-2)


HF_FORCES = ["dp", "tp", "fsdp"]


@pytest.fixture(scope="module")
def hugging_face() -> dict[str, Any]:
    return run_ranks(run_hf_script, 4, (HF_FORCES,))[0]


@pytest.mark.parametrize("force", HF_FORCES)
def test_a_hugging_face_model_called_with_labels_trains_as_on_one_device(
    hugging_face, force
) -> None:
    result = hugging_face[force]
    assert [loss for loss, _ in result["steps"]] == pytest.approx(
        [loss for loss, _ in result["reference"]], abs=TOLERANCE
    )
    assert [norm for _, norm in result["steps"]] == pytest.approx(
        [norm for _, norm in result["reference"]], rel=TOLERANCE
    )


@pytest.mark.parametrize("force", HF_FORCES)
def test_a_call_without_labels_and_generation_give_what_one_device_gives(hugging_face, force):
    """The traced call had labels; a call without them (the logits), and greedy generation
    in eval mode, run programs of their own (``runtime.calls``) with the same weights."""
    calls = hugging_face[force]["other calls"]
    got, want = calls["logits"]
    assert torch.allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    generated, reference = calls["generated"]
    assert generated.shape == (2, 9)
    assert torch.equal(generated, reference)


def test_a_call_asking_for_the_kv_cache_is_refused_with_what_to_do(hugging_face) -> None:
    refused = hugging_face["dp"]["other calls"]["refused"]
    assert "use_cache=True" in refused and "use_cache=False" in refused
    assert "generate" in refused


def test_a_pipeline_plan_saves_and_resumes_through_dcp(tmp_path) -> None:
    """A pipeline rank holds its stage's parameters, yet the standard checkpoint API works
    on it: ``get_state_dict`` and ``dcp.save`` under two pipeline stages resume under data
    parallelism into the single-device losses, and the other way round."""
    losses = run_ranks(run_pipeline_checkpoint, 2, (str(tmp_path),))[0]
    reference = losses.pop("single")
    assert set(losses) == {"pipeline then dp", "dp then pipeline"}
    for run in losses.values():
        assert run == pytest.approx(reference, rel=TOLERANCE, abs=TOLERANCE)
