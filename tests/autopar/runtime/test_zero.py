"""ZeRO-1 and ZeRO-2 on real ranks: the optimizer holds only its piece, training is exact."""

from __future__ import annotations

import pytest
import torch

from autopar.testing.ranks import run_ranks
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
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), rtol=1e-4, atol=0
    )
    for kind in ("grads", "params"):
        for name, ref in result[f"ref_{kind}"].items():
            scale = float(ref.abs().max()) or 1.0
            torch.testing.assert_close(
                result[kind][name],
                ref,
                rtol=1e-4,
                atol=1e-6 * scale,
                msg=f"{case}: {kind} of {name}",
            )


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
