"""Meshes the planning tests share."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

import autopar
from autopar.testing.meshes import fast_link_mesh as make_fast_link_mesh


@pytest.fixture
def fast_link_mesh(tmp_path: Path) -> Callable[..., autopar.Mesh]:
    """``fast_link_mesh(overlap, devices=4)``: ``autopar.testing.meshes.fast_link_mesh``
    with its preset in the test's own folder."""
    return partial(make_fast_link_mesh, tmp_path)
