"""The stage cut: contiguous layers onto pipeline stages, the slowest stage as fast as any
cut that fits allows (``sum_s T_s`` is the same for every cut, so the objective
``sum_s T_s + (m - 1) T_max`` is least where ``T_max`` is), checked against every cut."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar_cost_model.step import prefetch_waits
from autopar_passes.pipeline.layer_costs import LayerCosts, Part, chain_time
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


def gathering_layers(seed: int, overlap: float, count: int = 9) -> LayerCosts:
    """Layers under FSDP: each gathers its parameters (forward), gathers them again
    (backward) and reduce-scatters their gradients, beside uneven compute."""
    rng = random.Random(seed)

    def part() -> Part:
        forward, backward = rng.uniform(0.5, 2.0), rng.uniform(1.0, 4.0)
        gather, regather, reduce = rng.uniform(0.2, 3.0), rng.uniform(0.2, 3.0), 0.7
        return Part(
            compute_s=forward + backward,
            forward_s=forward,
            gather_s=gather + regather + reduce,
            prefetched=[gather, regather],
            overlap=overlap,
            activations=rng.uniform(1.0, 4.0),
            states=rng.uniform(2.0, 6.0),
        )

    return LayerCosts(part(), [part() for _ in range(count)], part())


@pytest.mark.parametrize("overlap", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("seed", range(3))
def test_a_stage_waits_for_its_gathers_as_the_ledger_prefetches_them(seed, overlap):
    """A stage's parts run as FSDP's prefetch chain: the forward's gathers each behind
    the part before, the backward's regathers each behind the part after, the first of
    each whole (``prefetch_waits``, the ledger's rule); the reduce-scatters are not
    prefetched."""
    costs = gathering_layers(seed, overlap)
    parts = [costs.pre, *costs.layers[:4]]
    forward = prefetch_waits(
        [p.prefetched[0] for p in parts], [p.forward_s for p in parts], overlap
    )
    backward = prefetch_waits(
        [p.prefetched[1] for p in parts[::-1]],
        [p.compute_s - p.forward_s for p in parts[::-1]],
        overlap,
    )
    rest = sum(p.compute_s + p.gather_s - sum(p.prefetched) for p in parts)
    assert chain_time(parts, 1.0) == pytest.approx(rest + sum(forward) + sum(backward))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("p", "limit"), [(3, None), (3, 40.0), (4, 110.0), (2, 52.0)])
def test_the_cut_of_gathering_layers_paces_the_slowest_stage_as_fast_as_any_cut(seed, p, limit):
    """With what the prefetch hides inside each stage (lost at each cut), the cut's
    slowest stage is as fast as that of every cut that fits."""
    costs = gathering_layers(seed, overlap=1.0)
    found = cut_stages(costs, p, 8, "1f1b", 1.0, limit, [0.1 * s for s in range(p)])
    fitting = list(every_cut(costs, p, 8, "1f1b", limit))
    assert (found is None) == (not fitting)
    if found is not None:
        assert max(found.stage_times) == pytest.approx(min(max(c.stage_times) for c in fitting))
