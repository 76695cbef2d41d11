"""A traced graph's strategies are made once per mesh shape (``traced_choices``): the
search's solve, the plan's layouts and its lowering read the same ones."""

from __future__ import annotations

import pytest

from autopar_examples.models import build
from autopar_passes.strategies import graph
from autopar_passes.trace import trace


def test_each_mesh_shape_walks_the_graph_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = build("gpt-tiny", device="meta", batch_size=4)
    traced = trace(model, inputs)
    walks: list[tuple[int, ...]] = []
    walk = graph.graph_choices

    def counted(g, shape):
        walks.append(tuple(shape))
        return walk(g, shape)

    monkeypatch.setattr(graph, "graph_choices", counted)
    first = graph.traced_choices(traced, (2, 2))
    assert graph.traced_choices(traced, [2, 2]) is first
    other = graph.traced_choices(traced, (4,))
    assert walks == [(2, 2), (4,)]
    assert first == walk(traced.graph, (2, 2)) and other[0].keys() == first[0].keys()
