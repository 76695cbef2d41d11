"""Image models train on gloo ranks as on one device: a ResNet, whose batch norms take
their statistics over the whole batch however it is split (``autopar_passes.batch_norm``),
running statistics included, and a ViT. Losses, first gradients, final parameters and
buffers within fp32 roundoff of single-device training (``closeness``)."""

from __future__ import annotations

import pytest

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.closeness import assert_same_training
from tests.autopar.runtime.equivalence import compare

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
