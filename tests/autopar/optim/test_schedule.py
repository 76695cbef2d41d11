"""The large-batch learning rate: scaling rules and gradual warm-up (Goyal et al. 2017),
values exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopar.optim import LinearWarmup, scaled_lr, warmup_from, warmup_schedule
from autopar_plans.errors import UsageError


def test_linear_scaling_multiplies_by_the_batch_ratio() -> None:
    assert scaled_lr(0.5, 256, 1024) == 2.0
    assert scaled_lr(0.5, 256, 1024, rule="linear") == 2.0
    assert scaled_lr(0.1, 256, 256) == 0.1
    assert scaled_lr(0.5, 1024, 256) == 0.125  # a smaller batch scales down


def test_square_root_scaling_multiplies_by_its_root() -> None:
    assert scaled_lr(0.5, 256, 1024, rule="sqrt") == 1.0
    assert scaled_lr(0.5, 256, 16384, rule="sqrt") == 4.0


def test_the_global_batch_comes_from_a_compiled_models_plan() -> None:
    compiled = SimpleNamespace(plan=SimpleNamespace(global_batch=2048))
    assert scaled_lr(0.25, 512, compiled) == 1.0
    assert scaled_lr(0.25, 512, compiled, rule="sqrt") == 0.5


def test_a_model_without_a_plan_and_bad_values_are_refused() -> None:
    with pytest.raises(UsageError, match="plan"):
        scaled_lr(0.1, 256, torch.nn.Linear(2, 2))
    with pytest.raises(UsageError, match="rule"):
        scaled_lr(0.1, 256, 512, rule="cube")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="positive"):
        scaled_lr(0.1, 0, 512)
    with pytest.raises(UsageError, match="start"):
        LinearWarmup(10, start=2.0)


def test_the_warmup_ramps_linearly_then_holds() -> None:
    ramp = LinearWarmup(4)
    assert [ramp(t) for t in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    ramp = LinearWarmup(4, start=0.5)
    assert [ramp(t) for t in range(5)] == [0.5, 0.625, 0.75, 0.875, 1.0]
    assert LinearWarmup(0)(0) == 1.0  # no warm-up


def test_the_warmup_hands_over_to_a_decay() -> None:
    ramp = LinearWarmup(2, then=lambda t: 0.5**t)
    assert [ramp(t) for t in range(5)] == [0.0, 0.5, 1.0, 0.5, 0.25]


def test_goyals_warmup_starts_at_the_small_batchs_rate() -> None:
    """Base 0.1 at batch 256, global batch 8192: from 0.1 to 3.2 over 4 steps."""
    weight = torch.nn.Parameter(torch.zeros(1))
    lr = scaled_lr(0.1, 256, 8192)
    optimizer = torch.optim.SGD([weight], lr=lr)
    schedule = warmup_schedule(optimizer, 4, start=warmup_from(0.1, lr))
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    ramp = [0.1 + (3.2 - 0.1) * t / 4 for t in range(4)]
    assert rates == pytest.approx([*ramp, 3.2, 3.2], rel=1e-15)
    assert schedule.state_dict()["lr_lambdas"][0]["steps"] == 4  # saved with a checkpoint
