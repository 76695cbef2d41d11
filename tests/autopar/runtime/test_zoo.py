"""The Hugging Face zoo on gloo ranks: families built tiny from their configs (decoders,
encoders, an encoder-decoder, image models, mixtures of experts) compiled with the
solver's free choice, with tensor parallelism forced, and the mixtures of experts with
expert parallelism (``ep``: the experts split over the mesh's last axis), one training
step equal to one device's: the model's own loss and every gradient within the fp32
roundoff of single-device training (``closeness``)."""

from __future__ import annotations

import pytest

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.closeness import assert_same_training
from tests.autopar.runtime.zoo import compare_zoo

pytestmark = pytest.mark.multirank

FAMILIES = (
    "llama", "qwen2", "gemma2", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "opt",
    "bloom", "bert", "t5", "vit", "resnet", "mixtral", "qwen2_moe",
)  # fmt: skip
# tensor parallelism forced on one family of each way of building a block: Llama's (gated
# MLP, grouped queries, rotary; Qwen2's is the same), Gemma 2's soft-capped and windowed
# attention, Phi-3's fused projections, GPT-2's Conv1D, GPT-NeoX's parallel residual (GPT-J's
# too), Falcon's fused multi-query projection, BLOOM's ALiBi, BERT's encoder, T5's
# encoder-decoder, Mixtral's experts (the other families repeat one of these, and the sweep
# over every architecture is ``docs/coverage.md``'s)
TP_FAMILIES = (
    "llama", "gemma2", "phi3", "gpt2", "gpt_neox", "falcon", "bloom", "bert", "t5", "mixtral",
)  # fmt: skip
CASES = {
    (2, 2): [(f, None) for f in FAMILIES]
    + [(f, "tp") for f in TP_FAMILIES]
    + [("resnet18", None), ("resnet18", "dp"), ("mixtral", "ep"), ("qwen2_moe", "ep")],
    (2,): [("mixtral", "ep"), ("qwen2_moe", "ep")],
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    found = {}
    for shape, cases in CASES.items():
        world = shape[0] * (shape[1] if len(shape) > 1 else 1)
        for result in run_ranks(compare_zoo, world, (shape, cases))[0]:
            found[f"{'x'.join(map(str, shape))}/{result['case']}"] = result
    return found


KEYS = [
    f"{'x'.join(map(str, shape))}/{family}/{style or 'free'}"
    for shape, cases in CASES.items()
    for family, style in cases
]


@pytest.mark.parametrize("case", KEYS)
def test_one_step_equals_one_device(results: dict[str, dict], case: str) -> None:
    assert_same_training(results[case])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_the_experts_are_split_under_ep(results: dict[str, dict], family: str) -> None:
    for mesh in ("2", "2x2"):
        assert results[f"{mesh}/{family}/ep"]["parallelism"]["ep"] == 2
