"""The Hugging Face families users train most, built tiny from their configs
(``autopar_examples.models.hf_zoo``): every op of each has a sharding rule, so none is
replicated for want of one (the issue's target for the coverage sweep, ``docs/coverage.md``)."""

from __future__ import annotations

import pytest

import autopar
from autopar_examples.models.hf_zoo import FAMILIES, hf_tiny

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_op_has_a_rule(family: str) -> None:
    model, kwargs = hf_tiny(family)
    plan = autopar.plan(
        model, autopar.Mesh((2, 2), device="cpu"), (), example_kwargs=kwargs, stages=1
    )
    assert not [w for w in plan.warnings if "no sharding rule" in w]
    assert plan.ops


def test_the_families_are_the_issues_twenty_one_and_more() -> None:
    wanted = {
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2",
        "gpt_neox", "gptj", "falcon", "opt", "bloom", "starcoder2", "olmo", "bert",
        "roberta", "t5", "vit", "resnet", "mixtral", "qwen2_moe", "deepseek_v3",
    }  # fmt: skip
    assert wanted <= set(FAMILIES)
