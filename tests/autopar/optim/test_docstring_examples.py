"""The examples in ``autopar.optim``'s docstrings run and print what they say (STYLE.md)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["norms", "layerwise", "lars", "lamb", "schedule"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"autopar.optim.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
