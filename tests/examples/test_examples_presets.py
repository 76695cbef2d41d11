"""Presets: parameter counts against published sizes and formulas, registry, bad input."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autopar_examples import models
from autopar_examples.models import PRESETS, build
from autopar_plans.errors import UsageError

REPO = Path(__file__).resolve().parents[2]

TINY = [name for name in PRESETS if name.endswith("-tiny")]
FULL_SIZE = [name for name in PRESETS if name not in TINY and name != "gpt-demo"]

# Published sizes: GPT-2 (Radford et al. 2019, as released), GPT-3 (Brown et al. 2020,
# Table 2.1), Llama 3 (Llama Team 2024, Table 3), Mixtral (Jiang et al. 2024: 47B total).
PUBLISHED = {
    "gpt2-124m": 124e6,
    "gpt3-1.3b": 1.3e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13e9,
    "gpt3-175b": 175e9,
    "llama3-8b": 8.0e9,
    "llama3-70b": 70e9,
    "mixtral-8x7b": 46.7e9,
    # He et al. 2016 as the reference implementations count them; Dosovitskiy et al. 2021,
    # Table 1 ("86M")
    "resnet18": 11.7e6,
    "resnet50": 25.6e6,
    "vit-b16": 86e6,
}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters counted once


def megatron_gpt_parameters(config: Mapping[str, Any]) -> int:
    """REFERENCE.md (Narayanan et al. 2021): 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)).

    Expanded into integers: 12 l h^2 + 13 l h + (V + s) h.
    """
    n_layer, h = config["n_layer"], config["d_model"]
    V, s = config["vocab_size"], config["seq_len"]
    return 12 * n_layer * h * h + 13 * n_layer * h + (V + s) * h


def llama_parameters(config: Mapping[str, Any]) -> int:
    """2 V h + h + l (2 h^2 + 2 h h_kv + 3 h f + 2 h), h_kv = n_kv_head * h / n_head.

    Untied embedding and head (V h each), final RMSNorm (h); per layer q and o (h^2 each),
    k and v (h h_kv each), SwiGLU gate/up/down (3 h f), two RMSNorm gains (2 h).
    """
    n_layer, h, V, f = config["n_layer"], config["d_model"], config["vocab_size"], config["d_ff"]
    h_kv = h // config["n_head"] * config["n_kv_head"]
    return 2 * V * h + h + n_layer * (2 * h * h + 2 * h * h_kv + 3 * h * f + 2 * h)


def moe_parameters(config: Mapping[str, Any]) -> int:
    """2 V h + h + l (2 h^2 + 2 h h_kv + E (3 h f + h) + 2 h).

    As llama_parameters with the MLP replaced by E SwiGLU experts and a router (E h).
    """
    n_layer, h, V, f = config["n_layer"], config["d_model"], config["vocab_size"], config["d_ff"]
    h_kv = h // config["n_head"] * config["n_kv_head"]
    E = config["n_experts"]
    return 2 * V * h + h + n_layer * (2 * h * h + 2 * h * h_kv + E * (3 * h * f + h) + 2 * h)


@pytest.mark.parametrize("name", [n for n in FULL_SIZE if n.startswith("gpt")])
def test_gpt_count_is_megatron_formula_plus_final_layernorm(name: str) -> None:
    model, _ = build(name, device="meta")
    config = PRESETS[name].config
    # The formula leaves out the final LayerNorm (gain and bias: 2h); the model has it.
    assert count_parameters(model) == megatron_gpt_parameters(config) + 2 * config["d_model"]


def test_gpt2_124m_has_its_released_count() -> None:
    model, _ = build("gpt2-124m", device="meta")
    assert count_parameters(model) == 124_439_808


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_llama_counts(name: str, expected: int) -> None:
    model, _ = build(name, device="meta")
    assert llama_parameters(PRESETS[name].config) == expected
    assert count_parameters(model) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [("resnet18", 11_689_512), ("resnet50", 25_557_032), ("vit-b16", 86_567_656)],
)
def test_image_model_counts(name: str, expected: int) -> None:
    model, _ = build(name, device="meta")
    assert count_parameters(model) == expected


def test_mixtral_count() -> None:
    # V = 32000, h = 4096, h_kv = 1024, f = 14336, E = 8, l = 32.
    model, _ = build("mixtral-8x7b", device="meta")
    assert moe_parameters(PRESETS["mixtral-8x7b"].config) == 46_702_792_704
    assert count_parameters(model) == 46_702_792_704


@pytest.mark.parametrize("name", FULL_SIZE)
def test_count_within_3_percent_of_published(name: str) -> None:
    model, _ = build(name, device="meta")
    assert abs(count_parameters(model) / PUBLISHED[name] - 1) < 0.03


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-70b"])
def test_biggest_presets_build_on_meta_at_full_depth(name: str) -> None:
    # How fast is a benchmark's question (BENCHMARKS.md), not a test's.
    model, (idx,) = build(name, device="meta")
    assert len(model.layers) == PRESETS[name].config["n_layer"]  # type: ignore[arg-type]
    assert all(p.device.type == "meta" for p in model.parameters())
    assert idx.device.type == "meta"


def test_every_preset_has_an_identifier_factory() -> None:
    for name in PRESETS:
        factory = getattr(models, name.replace("-", "_").replace(".", "p"))
        assert callable(factory)


def test_factory_overrides_replace_config_fields() -> None:
    model, (idx,) = models.llama3_8b(device="meta", n_layer=2, seq_len=128, batch_size=3)
    assert len(model.layers) == 2  # type: ignore[arg-type]
    assert idx.shape == (3, 128)
    assert model.lm_head.weight.shape == (128256, 4096)


def resolve(target: str) -> Callable[..., Any]:
    """What a CLI does with MODULE:ATTR or PATH.py:ATTR (no sys.modules registration)."""
    location, attr = target.split(":")
    if not location.endswith(".py"):
        return getattr(importlib.import_module(location), attr)
    spec = importlib.util.spec_from_file_location("model_by_path", REPO / location)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attr)


def test_cli_module_string_resolves_to_a_preset_factory() -> None:
    model, _ = resolve("autopar_examples.models:llama3_8b")(device="meta", n_layer=1)
    assert len(model.layers) == 1


def test_cli_path_string_resolves_to_a_family_factory() -> None:
    model, (idx,) = resolve("examples/models/llama.py:llama")(**PRESETS["llama-tiny"].config)
    assert model(idx).shape == (2, 16, 64)


def test_unknown_config_key_lists_valid_keys_closest_first() -> None:
    with pytest.raises(UsageError) as err:
        build("gpt-tiny", n_heads=4)
    message = str(err.value)
    assert "'n_heads'" in message
    assert "valid keys: n_head," in message
    for key in ("vocab_size", "seq_len", "d_model", "tie_embeddings", "dtype"):
        assert key in message


@pytest.mark.parametrize("factory", [models.gpt, models.llama, models.moe, models.mlp])
def test_factories_raise_usage_error_never_type_error(factory: object) -> None:
    with pytest.raises(UsageError, match="no key 'bogus'"):
        factory(bogus=1)  # type: ignore[operator]
    with pytest.raises(UsageError, match="needs a value for"):
        factory()  # type: ignore[operator]


def test_unknown_preset_name_suggests_the_close_match_first() -> None:
    with pytest.raises(UsageError) as err:
        build("lama3-8b")
    message = str(err.value)
    assert "known presets: llama3-8b," in message
    assert all(name in message for name in PRESETS)


@pytest.mark.parametrize(
    ("name", "overrides", "words"),
    [
        ("gpt-tiny", {"n_head": 3}, "n_head=3 must divide d_model=32"),
        ("llama-tiny", {"n_kv_head": 3}, "n_kv_head=3 must divide n_head=8"),
        ("gpt-tiny", {"n_layer": 0}, "n_layer must be a positive int"),
        ("moe-tiny", {"top_k": 5}, "top_k=5 > n_experts=4"),
        ("mlp-tiny", {"dtype": "float99"}, "unknown dtype"),
    ],
)
def test_bad_values_are_usage_errors(name: str, overrides: dict[str, object], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        build(name, **overrides)


def test_preset_configs_are_read_only() -> None:
    with pytest.raises(TypeError):
        PRESETS["gpt2-124m"].config["n_layer"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        PRESETS["nope"] = PRESETS["gpt2-124m"]  # type: ignore[index]


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_are_tiny_and_split_four_ways(name: str) -> None:
    model, inputs = build(name)
    assert 1_000 <= count_parameters(model) <= 100_000
    config = PRESETS[name].config
    for key in ("n_head", "n_kv_head", "d_model", "d_ff", "vocab_size", "n_experts"):
        if key in config:
            assert config[key] % 4 == 0, key
    # image models take 8: two images a device over four, for batch norm's statistics
    assert inputs[0].shape[0] in (2, 3, 4, 8)


def test_dtype_can_be_named() -> None:
    model, (idx,) = build("gpt-tiny", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(idx).dtype == torch.bfloat16
