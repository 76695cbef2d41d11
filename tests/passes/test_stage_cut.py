"""The stage cut: contiguous layers onto pipeline stages, the slowest stage as fast as any
cut that fits allows (``sum_s T_s`` is the same for every cut, so the objective
``sum_s T_s + (m - 1) T_max`` is least where ``T_max`` is), checked against every cut."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar_passes.pipeline.layer_costs import LayerCosts, Part
from autopar_passes.pipeline.stage_cut import cut_stages, evaluate_cut


def uneven_layers(seed: int, count: int = 9) -> LayerCosts:
    """Layers of different times, states and activations (as recomputing some makes them),
    with an embedding before and a head after."""
    rng = random.Random(seed)

    def part() -> Part:
        return Part(
            compute_s=rng.uniform(1.0, 5.0),
            activations=rng.uniform(1.0, 4.0),
            states=rng.uniform(2.0, 6.0),
        )

    return LayerCosts(part(), [part() for _ in range(count)], part())


def every_cut(costs: LayerCosts, p: int, m: int, schedule: str, limit: float | None):
    count = len(costs.layers)
    p2p = [0.1 * s for s in range(p)]
    for inner in itertools.combinations(range(1, count), p - 1):
        cut = evaluate_cut(costs, (0, *inner), m, schedule, 1.0, p2p)
        if limit is None or max(cut.stage_memory) <= limit:
            yield cut


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("p", "schedule", "limit"),
    [(3, "1f1b", None), (3, "1f1b", 40.0), (4, "gpipe", 110.0), (2, "1f1b", 52.0)],
)
def test_the_cut_is_the_best_of_every_cut_that_fits(seed, p, schedule, limit):
    costs = uneven_layers(seed)
    m = 8
    p2p = [0.1 * s for s in range(p)]
    found = cut_stages(costs, p, m, schedule, 1.0, limit, p2p)
    fitting = list(every_cut(costs, p, m, schedule, limit))
    if not fitting:
        assert found is None
        return
    assert found is not None
    assert limit is None or max(found.stage_memory) <= limit
    best = min(sum(c.stage_times) + (m - 1) * max(c.stage_times) for c in fitting)
    assert sum(found.stage_times) + (m - 1) * max(found.stage_times) == pytest.approx(best)
    assert found.first_layers[0] == 0 and len(found.first_layers) == p


def test_no_cut_when_even_one_layer_per_stage_overflows():
    costs = uneven_layers(0)
    assert cut_stages(costs, 3, 8, "1f1b", 1.0, 1.0, [0.0, 0.0, 0.0]) is None
    assert cut_stages(costs, 10, 8, "1f1b", 1.0, None, [0.0] * 10) is None  # 9 layers
