"""Compiled models train exactly like the single-device model, on real gloo ranks.

For the GPT, Llama and MLP examples (tiny) on meshes (2,), (4,) and (2, 2): once with the
solver's free choice and once with each of DP, TP, TP+SP and FSDP forced, the loss of every
step, every gradient (gathered) after the first step and every parameter after 3 AdamW
steps equal the single-device run in fp32, up to the roundoff of reordered fp32 sums
(``closeness``: no further from a float64 run than the single-device fp32 run is, within a
small factor).

The MLP has no sequence dim, so TP+SP forces the same plan as TP there.
"""

from __future__ import annotations

import pytest

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.closeness import assert_same_training
from tests.autopar.runtime.equivalence import compare

MODELS = ("gpt-tiny", "llama-tiny", "mlp-tiny")
STYLES = (None, "dp", "tp", "tp+sp", "fsdp")
MESHES = {"2": (2,), "4": (4,), "2x2": (2, 2)}
# DP as DDP: with the optimizer's step priced, ZeRO-1 can tie it on the cpu preset (its
# sharded step against its exposed gathers); ZeRO's training is test_zero's
OPTIONS = {"dp": {"zero": 0}}
CASES = [(m, s, OPTIONS.get(s or "", {})) for m in MODELS for s in STYLES]


def _key(model: str, style: str | None) -> str:
    options = OPTIONS.get(style or "", {})
    return f"{model}/{style or 'free'}" + "".join(f"/{k}={v}" for k, v in options.items())


pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_results(request: pytest.FixtureRequest) -> dict[str, dict]:
    shape = MESHES[request.param]
    world = 1
    for size in shape:
        world *= size
    (results, *_) = run_ranks(compare, world, (shape, CASES))
    return {r["case"]: r for r in results}


@pytest.mark.parametrize("case", [_key(m, s) for m, s, _ in CASES])
def test_compiled_training_equals_single_device(mesh_results: dict[str, dict], case: str) -> None:
    assert_same_training(mesh_results[case])


@pytest.mark.parametrize("style", ["dp", "tp", "tp+sp", "fsdp"])
def test_forced_styles_show_in_the_plan(mesh_results: dict[str, dict], style: str) -> None:
    """The parallelism summary read off the chosen layouts names the forced style."""
    for model in ("gpt-tiny", "llama-tiny"):
        summary = mesh_results[_key(model, style)]["parallelism"]
        if style == "dp":
            assert summary["dp"] > 1 and summary["tp"] == 1 and summary["zero"] == 0
        if style == "fsdp":
            assert summary["dp"] > 1 and summary["zero"] == 3
        if style in ("tp", "tp+sp"):
            assert summary["tp"] > 1
            assert (summary["sp"] > 1) == (style == "tp+sp")
