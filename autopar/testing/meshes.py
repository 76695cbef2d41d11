"""Meshes for tests and benchmarks of what compute hides of communication."""

from __future__ import annotations

from pathlib import Path

from autopar.mesh import Mesh
from autopar_cost_model import load_preset, save_preset


def fast_link_mesh(folder: Path, overlap: float, devices: int = 4) -> Mesh:
    """``devices`` that compute at CPU speed on an H100's link (layers compute longer than
    their parameters' gathers), compute hiding ``overlap`` of the communication that runs
    beside it; the preset is written into ``folder``."""
    preset = load_preset("cpu").model_copy(
        update={
            "name": f"overlap-{overlap:g}",
            "comm_overlap": overlap,
            "intra_node": load_preset("h100-sxm").intra_node,
        }
    )
    path = save_preset(preset, folder / f"overlap-{overlap:g}.yaml")
    return Mesh((devices,), ("dp",), device=str(path))
