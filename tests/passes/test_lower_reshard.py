"""Every reshard the lowering emits gives the right values: all layout pairs of rank-2 to
rank-4 tensors on (2, 2) and (2, 2, 2) meshes, each device's emitted program run on
simulated devices (``autopar.testing.simulate.simulate_reshard``) against the whole tensor.

A device's piece of ``have`` is its chunk of the whole tensor, split into random summands
over the ``Partial`` axes (not the value on one device and zeros elsewhere, which would hide
a sum taken on the wrong devices). Its result must be its chunk in ``want``, the summands
over ``want``'s partial axes adding up to it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from autopar.testing.simulate import simulate_reshard
from autopar_plans.placement import Layout, Partial, Replicate, Shard
from autopar_plans.reshard import plan_reshard


def _layouts(mesh_ndim: int, rank: int) -> list[Layout]:
    options = [Replicate(), Partial(), *(Shard(d) for d in range(rank))]
    return [Layout(*p) for p in itertools.product(options, repeat=mesh_ndim)]


def _chunk(
    whole: torch.Tensor, layout: Layout, coords: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> torch.Tensor:
    """The device's chunk of ``whole`` (outer mesh axis first), before any partial split."""
    piece = whole
    for axis, placement in enumerate(layout):
        if isinstance(placement, Shard):
            piece = piece.chunk(mesh_shape[axis], dim=placement.dim)[coords[axis]]
    return piece


def _pieces(
    whole: torch.Tensor, layout: Layout, mesh_shape: tuple[int, ...]
) -> dict[tuple[int, ...], torch.Tensor]:
    """Each device's piece: its chunk, as random summands over the partial axes."""
    partial = [a for a, p in enumerate(layout) if isinstance(p, Partial)]
    generator = torch.Generator().manual_seed(7)
    pieces = {}
    for coords in itertools.product(*(range(n) for n in mesh_shape)):
        if any(coords[a] for a in partial):
            continue
        chunk = _chunk(whole, layout, coords, mesh_shape)
        rest = chunk.clone()
        for others in itertools.product(*(range(mesh_shape[a]) for a in partial)):
            if not any(others):
                continue
            summand = torch.randn(chunk.shape, generator=generator, dtype=chunk.dtype)
            at = list(coords)
            for axis, index in zip(partial, others, strict=True):
                at[axis] = index
            pieces[tuple(at)] = summand
            rest -= summand
        pieces[coords] = rest
    for coords in itertools.product(*(range(n) for n in mesh_shape)):
        if coords not in pieces:  # along a replicated axis: the same piece
            first = tuple(
                0 if isinstance(layout[a], Replicate) else c for a, c in enumerate(coords)
            )
            pieces[coords] = pieces[first]
    return pieces


def _check(
    results: dict[tuple[int, ...], torch.Tensor],
    whole: torch.Tensor,
    want: Layout,
    mesh_shape: tuple[int, ...],
) -> None:
    partial = [a for a, p in enumerate(want) if isinstance(p, Partial)]
    for coords, got in results.items():
        if any(coords[a] for a in partial):
            continue
        total = torch.zeros_like(got)
        for others in itertools.product(*(range(mesh_shape[a]) for a in partial)):
            at = list(coords)
            for axis, index in zip(partial, others, strict=True):
                at[axis] = index
            total += results[tuple(at)]
        expected = _chunk(whole, want, coords, mesh_shape)
        if total.shape != expected.shape or not torch.allclose(total, expected):
            torch.testing.assert_close(total, expected, msg=f"device {coords}")


CASES = [(mesh, rank) for mesh in ((2, 2), (2, 2, 2)) for rank in (2, 3, 4)]


@pytest.mark.parametrize(("mesh_shape", "rank"), CASES, ids=[f"{m}-rank{r}" for m, r in CASES])
def test_every_layout_pair_reshards_to_the_right_values(
    mesh_shape: tuple[int, ...], rank: int
) -> None:
    size = math.prod(mesh_shape)  # every dim divides by all axes at once
    whole = torch.randn((size,) * rank, generator=torch.Generator().manual_seed(0)).double()
    layouts = _layouts(len(mesh_shape), rank)
    pieces = {have: _pieces(whole, have, mesh_shape) for have in layouts}
    failures = []
    for have, want in itertools.product(layouts, repeat=2):
        results = simulate_reshard(pieces[have], have, want, mesh_shape)
        try:
            _check(results, whole, want, mesh_shape)
        except AssertionError:
            steps = [f"{s.kind} {s.axis}" for s in plan_reshard(have, want)]
            failures.append(f"{have} -> {want}: {steps}")
    assert not failures, f"{len(failures)} of {len(layouts) ** 2} pairs wrong: {failures[:10]}"
