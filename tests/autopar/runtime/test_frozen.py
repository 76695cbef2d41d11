"""A frozen parameter stays frozen: compiled, it keeps ``requires_grad=False``, gets no
gradient and does not move, in every style; the others train as on one device. (Before,
every parameter of a compiled model required a gradient: an optimizer over
``compiled.parameters()`` trained what the user had frozen.)"""

from __future__ import annotations

import pytest
import torch

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.frozen import train_partly_frozen

pytestmark = pytest.mark.multirank
STYLES = [
    {},
    {"force": "dp", "zero": 0},
    {"force": "dp", "zero": 2},
    {"force": "fsdp"},
    {"force": "tp"},
]
FROZEN = {"frozen.weight", "frozen.bias", "positions"}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(train_partly_frozen, 4, (STYLES,))[0]


@pytest.mark.parametrize("style", range(len(STYLES)), ids=[str(s) for s in STYLES])
def test_frozen_stays_frozen_and_the_rest_trains_as_on_one_device(results, style) -> None:
    result = results[style]
    assert {n for n, trained in result["flags"].items() if not trained} == FROZEN
    torch.testing.assert_close(result["losses"], result["ref_losses"], rtol=1e-5, atol=1e-7)
    for name, ref in result["ref_params"].items():
        torch.testing.assert_close(result["params"][name], ref, rtol=1e-5, atol=1e-6)
