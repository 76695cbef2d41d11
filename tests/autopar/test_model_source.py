"""MODEL strings: presets, files and modules resolve; mistakes get one clear message."""

import pytest
import torch

from autopar.model_source import build_model, parse_config
from autopar_plans import UsageError


def test_preset_name():
    _, inputs, name = build_model("gpt-tiny")
    assert name == "gpt-tiny"
    assert isinstance(inputs[0], torch.Tensor)


def test_module_and_factory_with_config():
    model, _, name = build_model("autopar_examples.models:gpt_tiny", {"n_layer": 3})
    assert len(model.layers) == 3
    assert name == "autopar_examples.models:gpt_tiny"


def test_file_and_factory_on_meta():
    model, _, _ = build_model(
        "examples/models/llama.py:llama",
        {
            "vocab_size": 64,
            "seq_len": 8,
            "n_layer": 1,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 32,
            "d_ff": 64,
        },
        meta=True,
    )
    assert next(model.parameters()).device.type == "meta"


def test_config_values_are_typed():
    assert parse_config(["n_layer=2", "dropout=0.1", "bias=false", "name=x"]) == {
        "n_layer": 2,
        "dropout": 0.1,
        "bias": False,
        "name": "x",
    }
    with pytest.raises(UsageError, match="key=value"):
        parse_config(["n_layer"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no/such/file.py:f", "no such file"),
        ("autopar_examples.models:gpt_tiy", "did you mean gpt_tiny"),
        ("no_such_package.mod:f", "cannot import module"),
        ("gpt-tiyn", "did you mean gpt-tiny"),
        ("autopar_examples.models:", "write path/to/file.py:factory"),
    ],
)
def test_bad_model_strings(spec, message):
    with pytest.raises(UsageError, match=message):
        build_model(spec)


def test_factory_that_returns_the_wrong_thing(tmp_path):
    source = tmp_path / "odd.py"
    source.write_text("def factory():\n    return 42\n")
    with pytest.raises(UsageError, match=r"must return \(model, example_inputs\)"):
        build_model(f"{source}:factory")
