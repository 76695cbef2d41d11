"""ZeRO-1 and ZeRO-2 on real ranks: the optimizer holds only its piece, training is exact."""

from __future__ import annotations

import pytest
import torch

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.closeness import assert_same_training
from tests.autopar.runtime.equivalence import compare

pytestmark = pytest.mark.multirank

CASES = [
    ("gpt-tiny", "dp", {"zero": 1}),
    ("gpt-tiny", "dp", {"zero": 2}),
    ("mlp-tiny", "tp", {"zero": 2}),
    ("gpt-tiny", "dp", {"zero": 0}),
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    (rank0, *_) = run_ranks(compare, 4, ((2, 2), CASES))
    return {r["case"]: r for r in rank0}


@pytest.mark.parametrize("case", ["gpt-tiny/dp/zero=1", "gpt-tiny/dp/zero=2", "mlp-tiny/tp/zero=2"])
def test_zero_trains_exactly_like_one_device(results: dict[str, dict], case: str) -> None:
    result = results[case]
    assert result["parallelism"]["zero"] == int(case[-1])
    assert_same_training(result)


def test_the_optimizer_holds_a_quarter_of_the_state_under_zero_on_four_data_ranks(
    results: dict[str, dict],
) -> None:
    # data parallel on 2x2: every parameter replicated on 4 devices, its state split 4 ways
    # (a few small tensors whose dims do not divide stay whole)
    plain = results["gpt-tiny/dp/zero=0"]["state_fraction"]
    for stage in (1, 2):
        sharded = results[f"gpt-tiny/dp/zero={stage}"]["state_fraction"]
        assert plain == pytest.approx(1.0)
        assert sharded <= 0.26


def _zero_step(rank: int, world: int, stage: int) -> dict:
    """One ZeRO step of gpt-tiny on ``world`` data ranks: the collectives of the gradient
    sum (in backward and at its end) and of the gather (before the next forward)."""
    from collections import Counter

    import autopar
    from autopar_examples.models import build
    from tests.autopar.runtime.collective_counts import counting

    torch.manual_seed(0)
    model, (tokens,) = build("gpt-tiny", batch_size=4)
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    compiled = autopar.compile(model, mesh, example_inputs=(tokens,), force="dp", zero=stage)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    reduce: Counter[str] = Counter()
    gather: Counter[str] = Counter()
    launched_in_backward = []

    def counted(method):  # a bucket's own collectives, started in backward or at its end
        def run() -> None:
            with counting(reduce):
                method()
            if method.__name__ == "start":
                launched_in_backward.append(method.__self__.started is not None)

        return run

    for bucket in compiled._zero.buckets:
        bucket.start = counted(bucket.start)  # type: ignore[method-assign]
        bucket.finish = counted(bucket.finish)  # type: ignore[method-assign]
    compiled(tokens).float().square().mean().backward()
    optimizer.step()
    with counting(gather):
        compiled._zero.gather()
    return {
        "reduce": dict(reduce),
        "gather": dict(gather),
        "zero_params": len(compiled._zero.params),
        "buckets": len(compiled._zero.buckets),
        "launched_in_backward": launched_in_backward,
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_sums_and_gathers_a_bucket_of_parameters_per_collective(stage: int) -> None:
    """gpt-tiny's parameters fit one bucket (25 MiB): the gradients of all those whose
    dims split are summed in one collective, and the masters gathered back in one, where
    each parameter had its own. Those that do not split evenly keep their own."""
    rank, _ = run_ranks(_zero_step, 2, (stage,))
    assert rank["zero_params"] > 20
    assert rank["buckets"] < rank["zero_params"] / 4
    # (gloo builds the reduce-scatter from an all-reduce)
    assert sum(rank["reduce"].values()) == rank["buckets"]
    # each launched as soon as backward had its gradients, waited for at the end (DDP's way)
    assert rank["launched_in_backward"] == [True] * rank["buckets"]
    assert sum(rank["gather"].values()) == rank["buckets"]
