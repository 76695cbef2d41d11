"""Image models train on gloo ranks as on one device: a ResNet, whose batch norms take
their statistics over the whole batch however it is split (``autopar_passes.batch_norm``),
running statistics included, and a ViT. Losses, first gradients, final parameters and
buffers within fp32 roundoff of single-device training (``closeness``)."""

from __future__ import annotations

import pytest
import torch

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.closeness import assert_same_training, assert_trains_alike
from tests.autopar.runtime.equivalence import compare
from tests.autopar.runtime.per_device_bn import compare_with_ddp

pytestmark = pytest.mark.multirank

CASES = {
    (2, 2): [
        ("resnet-tiny", None, {}),
        ("resnet-tiny", "dp", {"zero": 0}),
        ("resnet-tiny", "fsdp", {}),
        ("vit-tiny", None, {}),
        ("vit-tiny", "tp", {}),
    ],
    (4,): [("resnet-tiny", "dp", {"zero": 0})],
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    found = {}
    for shape, cases in CASES.items():
        for result in run_ranks(compare, 4, (shape, cases))[0]:
            found[f"{'x'.join(map(str, shape))}/{result['case']}"] = result
    return found


KEYS = [
    f"{'x'.join(map(str, shape))}/{model}/{style or 'free'}"
    + "".join(f"/{k}={v}" for k, v in options.items())
    for shape, cases in CASES.items()
    for model, style, options in cases
]


@pytest.mark.parametrize("case", KEYS)
def test_compiled_training_equals_single_device(results: dict[str, dict], case: str) -> None:
    assert_same_training(results[case])


def test_batch_norm_statistics_are_the_whole_batchs_on_every_split(results) -> None:
    """Data parallelism splits each batch norm's input over the devices: the running mean
    and variance after three steps are the single device's (the comparison above), and
    they moved (a check that compared stale buffers would pass too)."""
    result = results["4/resnet-tiny/dp/zero=0"]
    means = [n for n in result["buffers"] if n.endswith("running_mean")]
    assert len(means) == 2 * 4 + 3 + 1  # two a basic block, three shortcuts, the stem
    assert all(float(result["buffers"][n].abs().max()) > 0 for n in means)
    tracked = [n for n in result["buffers"] if n.endswith("num_batches_tracked")]
    assert all(int(result["buffers"][n]) == 3 for n in tracked)


def test_per_device_batch_norm_is_ddps() -> None:
    """``batch_norm="per_device"``: each device's slice normalized by its own statistics,
    as DDP does; two steps on 4 ranks next to DDP's. The losses (DDP's mean over ranks),
    the gradients and parameters equal DDP's within fp32 roundoff; the running statistics
    are rank 0's slice's on every rank, which DDP's are from the next forward on (it copies
    rank 0's buffers over the others' before each), so rank 0's are compared."""
    results = run_ranks(compare_with_ddp, 4, ())
    exact = results[0]["exact"]
    assert results[0]["got"]["parallelism"]["dp"] == 4
    ddp_losses = [sum(r["ddp"]["losses"][s] for r in results) / 4 for s in range(2)]
    ddp_state = results[0]["ddp"]["state"]
    for rank, result in enumerate(results):
        got, ddp = result["got"], result["ddp"]
        assert_trains_alike(got["losses"], ddp_losses, exact["losses"], f"rank {rank} losses")
        for name, grad in ddp["grads"].items():
            assert_trains_alike(got["grads"][name], grad, exact["grads"][name], name)
        for name, value in ddp_state.items():
            if value.is_floating_point():
                assert_trains_alike(got["state"][name], value, exact["state"][name], name)
            else:
                assert torch.equal(got["state"][name], value), (rank, name)
    # the statistics are the slices', not the batch's: rank 1's DDP buffers are not rank 0's
    means = [n for n in ddp_state if n.endswith("running_mean")]
    assert means
    assert all(not torch.allclose(results[1]["ddp"]["state"][n], ddp_state[n]) for n in means)
