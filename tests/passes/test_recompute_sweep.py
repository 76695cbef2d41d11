"""A falling memory limit: selective recomputation first, then full; slower, never over.

GPT-2 small's shape (4 layers, Megatron-style explicit attention, whose T x T scores are
candidates next to the MLP's activation) on one H100, bf16 mixed precision, one
microbatch: as the limit leaves less of the plain plan's activations, the planner
recomputes selected regions first (what the costs favour), then whole layers; the
estimated step time never falls; every plan fits its limit; below the floor the error
says how much memory a device would need.
"""

from __future__ import annotations

import itertools
import re

import pytest

import autopar
from autopar_examples.models import build
from autopar_plans import InfeasiblePlanError
from autopar_plans.units import parse_bytes

# recomputation frees at most 89% of the plain plan's activations here: autocast's bf16
# copies of the weights stay (its cache holds them to the forward's end, checkpoint or
# not: ``CostModel.weight_cast_bytes``), as do the layers' inputs; 0.1 takes offload
FRACTIONS = (1.0, 0.8, 0.5, 0.3, 0.15)


@pytest.fixture(scope="module")
def sweep():
    model, inputs = build("gpt2-124m", device="meta", batch_size=4, n_layer=4, attention="explicit")
    mesh = autopar.Mesh((1,), device="h100-sxm")
    options = {"precision": "bf16_mixed", "microbatches": 1}
    roomy = autopar.plan(model, mesh, inputs, **options).estimate.memory_per_device_bytes
    states = roomy.total - roomy.activations
    plans = []
    for fraction in FRACTIONS:
        limit = states + fraction * roomy.activations
        plans.append((limit, autopar.plan(model, mesh, inputs, memory_limit=limit, **options)))
    return model, inputs, mesh, options, states, plans


def test_every_plan_fits_its_limit(sweep):
    for limit, plan in sweep[-1]:
        assert plan.estimate.memory_per_device_bytes.total <= limit * (1 + 1e-6)


def test_step_time_rises_as_the_limit_falls(sweep):
    times = [plan.estimate.step_time_s for _, plan in sweep[-1]]
    assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(times))
    assert times[-1] > times[0]


def test_selective_recompute_comes_first_then_full(sweep):
    kinds = [{region.kind for region in plan.recompute} for _, plan in sweep[-1]]
    assert kinds[0] == set()  # roomy: nothing recomputed
    first = next(k for k in kinds if k)
    assert first == {"selective"}, kinds
    assert "full" in kinds[-1], kinds


def test_below_the_floor_the_error_names_the_memory_needed(sweep):
    """(Without offload: with it the optimizer's states leave the device and the model
    fits, ``tests/passes/test_offload_planning.py``.)"""
    model, inputs, mesh, options, states, _ = sweep
    with pytest.raises(InfeasiblePlanError, match=r"needs [\d.]+ \w?i?B per device") as error:
        autopar.plan(model, mesh, inputs, memory_limit=states, offload="none", **options)
    short = re.search(r"short by ([\d.]+ \w?i?B)", str(error.value))
    assert short is not None and parse_bytes(short[1]) > 0
