"""The examples in the cost model's docstrings run and print what they say (STYLE.md)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "hardware",
    "compute",
    "collectives",
    "reshard",
    "memory",
    "optimizer",
    "step",
    "schedule",
    "reference",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"autopar_cost_model.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
