"""Meshes the planning tests share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import autopar


@pytest.fixture
def fast_link_mesh(tmp_path: Path) -> Callable[..., autopar.Mesh]:
    """``fast_link_mesh(overlap, devices=4)``: devices that compute at CPU speed on an
    H100's link (layers compute longer than their parameters' gathers), compute hiding
    ``overlap`` of the communication that runs beside it."""
    from autopar_cost_model import load_preset, save_preset

    def make(overlap: float, devices: int = 4) -> autopar.Mesh:
        preset = load_preset("cpu").model_copy(
            update={
                "name": f"overlap-{overlap:g}",
                "comm_overlap": overlap,
                "intra_node": load_preset("h100-sxm").intra_node,
            }
        )
        path = save_preset(preset, tmp_path / f"overlap-{overlap:g}.yaml")
        return autopar.Mesh((devices,), ("dp",), device=str(path))

    return make
