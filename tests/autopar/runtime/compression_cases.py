"""Work for compressed gradient sums on a 2 x 2 mesh of gloo ranks (``test_compression``).

Every rank draws its gradients from a generator seeded by its rank and step, so every rank
can also draw every other rank's and compute the exact sum (in float64) to compare with.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autopar.runtime.comm import AxisGroup, CommLog
from autopar.runtime.compression import Compressor
from autopar.runtime.groups import axis_groups
from autopar_plans.compression import GradCompression, state_values
from autopar_plans.mesh import MeshSpec

MESH = MeshSpec((2, 2), ("a", "b"))
BUCKET = [(16, 12), (32, 3, 3), (100,), (7,)]
MATRICES = [(16, 12), (32, 3, 3)]  # PowerSGD compresses these at rank 2
FULL_RANK = [(6, 4), (8, 2, 2)]  # rank 4 spans them whole
STEPS = 2
DRAWS = 500  # TernGrad sums of one bucket on the mesh, for the unbiasedness test

CASES: dict[str, tuple[GradCompression, list[tuple[int, ...]]]] = {
    "terngrad": (GradCompression(scheme="terngrad"), BUCKET),
    "topk": (GradCompression(scheme="topk", ratio=0.1), BUCKET),
    "topk-momentum": (GradCompression(scheme="topk", ratio=0.05, momentum=0.9), BUCKET),
    "block_topk": (GradCompression(scheme="block_topk", ratio=0.25, block=16), BUCKET),
    "powersgd": (GradCompression(scheme="powersgd", rank=2), MATRICES),
    "topk-full": (GradCompression(scheme="topk", ratio=1.0), BUCKET),
    "block_topk-full": (GradCompression(scheme="block_topk", ratio=1.0, block=16), BUCKET),
    "powersgd-full": (GradCompression(scheme="powersgd", rank=4), FULL_RANK),
}


def local_grads(rank: int, step: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def exact_sum(world: int, step: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """The sum over every rank of its gradients, in float64."""
    per_rank = [local_grads(r, step, shapes) for r in range(world)]
    return [sum(g[i].double() for g in per_rank) for i in range(len(shapes))]  # type: ignore[misc]


def _groups(log: CommLog) -> list[AxisGroup]:
    groups = axis_groups(MESH, log)
    assert all(g is not None for g in groups)
    return [g for g in groups if g is not None]


def _run_case(
    rank: int, groups: list[AxisGroup], log: CommLog, scheme: GradCompression, shapes: list
) -> dict[str, Any]:
    """Two steps of one scheme: each step's calls, results and state."""
    compressor = Compressor(scheme, seed_offset=rank)
    keys = [f"g{i}" for i in range(len(shapes))]
    steps = []
    for step in range(STEPS):
        log.clear()
        out = compressor.reduce(local_grads(rank, step, shapes), groups, keys)
        steps.append(
            {
                "calls": [(c.kind, c.axes, c.dtype, c.nbytes) for c in log.calls],
                "out": [o.clone() for o in out],
                "exact": exact_sum(math.prod(MESH.shape), step, shapes),
            }
        )
    return {
        "steps": steps,
        "axes": [g.axes for g in groups],
        "state_bytes": compressor.state_bytes(),
        "state_values": sum(state_values(scheme, s) for s in shapes),
    }


def _terngrad_draws(rank: int, groups: list[AxisGroup]) -> torch.Tensor:
    """The mean of ``DRAWS`` TernGrad sums (no clipping) of step 0's bucket."""
    compressor = Compressor(GradCompression(scheme="terngrad", clip=None), seed_offset=rank)
    grads = local_grads(rank, 0, BUCKET)
    keys = list(range(len(BUCKET)))
    total = torch.zeros(sum(math.prod(s) for s in BUCKET), dtype=torch.float64)
    for _ in range(DRAWS):
        out = compressor.reduce(grads, groups, keys)
        total += torch.cat([o.reshape(-1) for o in out]).double()
    return total / DRAWS


def compress_on_mesh(rank: int, world: int) -> dict[str, Any]:
    """Every case of ``CASES`` on the 2 x 2 mesh, then TernGrad's repeated draws."""
    log = CommLog()
    groups = _groups(log)
    results = {
        name: _run_case(rank, groups, log, scheme, shapes)
        for name, (scheme, shapes) in CASES.items()
    }
    return {"cases": results, "terngrad_mean": _terngrad_draws(rank, groups)}
