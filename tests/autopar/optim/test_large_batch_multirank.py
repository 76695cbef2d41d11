"""LARS and LAMB on a compiled model step as on one device.

On 4 gloo ranks (a 2x2 mesh) under data, tensor and fully sharded parallelism and ZeRO-1,
the whole-parameter norms behind each trust ratio are summed over the shards and not over
the replicas, so three steps of each optimizer give the single-device losses, trust
ratios and parameters, and replicated parameters stay bit-equal across ranks. GPT under
tensor parallelism with ZeRO-1 steps master pieces cut inside a tensor-parallel split
(``_StridedShard``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.testing.ranks import run_ranks
from tests.autopar.optim.large_batch_work import OPTIMIZERS, run_cases

pytestmark = pytest.mark.multirank

# (model, layout, ZeRO stage, whether biases and norm gains are chosen by the user's shapes
# with layerwise_groups: the default rule sees the shapes as stepped, and the planner
# steps GPT's fused q/k/v bias as [3, C])
CASES = [
    ("llama-tiny", "dp", 0, False),
    ("llama-tiny", "tp", 0, False),
    ("llama-tiny", "fsdp", 0, False),
    ("llama-tiny", "dp", 1, False),
    ("gpt-tiny", "tp", 1, True),
]
NAMES = [
    f"{model}/{force}/zero={zero}/{label}"
    for model, force, zero, _ in CASES
    for label in OPTIMIZERS
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(run_cases, 4, (CASES,))


@pytest.fixture(scope="module")
def results(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return ranks[0]["results"]


@pytest.mark.parametrize("case", NAMES)
def test_losses_match_one_device(results, case) -> None:
    result = results[case]
    reference, _ = result["reference"]
    losses, _ = result["steps"]
    assert losses[-1] < losses[0]  # it trains
    assert losses == pytest.approx(reference, abs=TOLERANCE)
    assert result["parameter_gap"] < TOLERANCE


@pytest.mark.parametrize("case", NAMES)
def test_trust_ratios_match_one_device(results, case) -> None:
    _, reference = results[case]["reference"]
    _, ratios = results[case]["steps"]
    for step, (got, want) in enumerate(zip(ratios, reference, strict=True)):
        assert got.keys() == want.keys(), step
        assert any(r != 1.0 for r in want.values())  # matrices are adapted
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), (step, name)


@pytest.mark.parametrize("case", NAMES)
def test_states_are_sharded_as_their_parameters_and_checkpoint(results, case) -> None:
    assert results[case]["state"] == {"dtensors": True, "saved": True}


def test_the_layouts_shard_what_they_should(results) -> None:
    assert not results["llama-tiny/dp/zero=0/lars"]["sharded"]
    for layout in ("tp/zero=0", "fsdp/zero=0", "dp/zero=1"):
        assert results[f"llama-tiny/{layout}/lars"]["sharded"], layout
    assert results["gpt-tiny/tp/zero=1/lamb"]["strided"]


def test_layerwise_groups_exclude_by_the_users_shapes(results) -> None:
    """The planner steps GPT's q/k/v bias as [3, C]: the default rule (``ndim <= 1``) would
    adapt it on the compiled model, ``layerwise_groups`` leaves it out as on one device
    (the matching trust ratios above are of that choice)."""
    reshaped = results["gpt-tiny/tp/zero=1/lars"]["reshaped_vectors"]
    assert reshaped and all(name.endswith("qkv.bias") for name in reshaped)
    _, ratios = results["gpt-tiny/tp/zero=1/lars"]["steps"]
    assert all(ratios[-1][name] == 1.0 for name in reshaped)
    assert not results["llama-tiny/tp/zero=0/lars"]["reshaped_vectors"]


def test_the_lr_scales_with_the_plans_global_batch(results) -> None:
    # make() builds batch 4: the plan's global batch, twice the base batch of 2
    assert results["llama-tiny/dp/zero=0/lars"]["global_batch_lr"] == pytest.approx(0.2)


def test_replicated_parameters_stay_equal_across_ranks(ranks) -> None:
    first = ranks[0]["replicated"]
    assert any(first.values())
    for other in ranks[1:]:
        for case, values in first.items():
            for name, value in values.items():
                assert torch.equal(other["replicated"][case][name], value), (case, name)
