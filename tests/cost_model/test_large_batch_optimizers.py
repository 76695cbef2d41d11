"""LARS and LAMB in the cost model: the state they keep and the traffic of their step
(``autopar.optim``'s implementations, ``tests/autopar/optim`` checks the state they hold)."""

from __future__ import annotations

import pytest

from autopar_cost_model.memory import OPTIMIZERS, optimizer_state_values, param_state_bytes
from autopar_cost_model.optimizer import STEP_TRAFFIC, optimizer_step_time


@pytest.mark.parametrize(
    ("optimizer", "states"), [("lars", 1), ("lamb", 2), ("sgd_momentum", 1), ("adamw", 2)]
)
def test_lars_keeps_a_momentum_buffer_and_lamb_two_moments(optimizer, states) -> None:
    for shape in ((4096, 1024), (8, 64, 32), (4096,)):
        n = 1
        for size in shape:
            n *= size
        assert optimizer_state_values(shape, optimizer) == states * n


def test_their_bytes_under_mixed_precision_and_zero() -> None:
    n = 4096 * 4096
    assert param_state_bytes((4096, 4096), "lamb", "bf16_mixed") == (4 * n, 4 * n, 8 * n)
    assert param_state_bytes((4096, 4096), "lars", "fp32") == (4 * n, 4 * n, 4 * n)
    # a ZeRO master piece (4) beside the states, the working copy cast to 2 bytes
    assert param_state_bytes((4096, 4096), "lamb", "bf16_mixed", zero=1, working_cast=True) == (
        2 * n,
        2 * n,
        12 * n,
    )


def test_every_optimizer_the_planner_lists_has_a_step_cost(make_preset) -> None:
    assert {"lars", "lamb"} <= set(OPTIMIZERS)
    assert set(OPTIMIZERS) == set(STEP_TRAFFIC)
    preset = make_preset()
    # 13 and 25 passes of 4 bytes a value at 2 TB/s (efficiency 1)
    assert optimizer_step_time(1e9, "lars", 4, preset) == pytest.approx(52e9 / 2e12)
    assert optimizer_step_time(1e9, "lamb", 4, preset) == pytest.approx(100e9 / 2e12)
