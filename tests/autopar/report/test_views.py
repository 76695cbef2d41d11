"""The ledger said by what causes it: modules and ops, never the graph's node names."""

from __future__ import annotations

import re

import pytest

import autopar
from autopar.report.views import comm_sources, op_in_words, what_in_words
from autopar_examples.models import build
from autopar_plans.plan import Plan


def test_every_op_is_said_by_its_module_with_layers_folded(planned: Plan) -> None:
    for node, op in planned.ops.items():
        words = op_in_words(planned, node)
        assert node not in words.split(" ") or node == op.op.removeprefix("aten.").split(".")[0]
        assert not re.search(r"\.\d+\.", words)  # layers.3.attn: folded to layers.*.attn


def test_the_sources_of_each_collective_add_up_to_the_ledger(planned: Plan) -> None:
    """Without a pipeline and with every reason kept, each kind's sources sum to what the
    ledger says that kind sends; no source is a node name of the graph."""
    sources = comm_sources(planned, top=10**6)
    assert sources
    for kind in {entry.kind for entry in planned.estimate.comm}:
        ledger = sum(e.sent_per_step for e in planned.estimate.comm if e.kind == kind)
        said = sum(s.sent_per_step for s in sources if s.kind == kind)
        assert said == pytest.approx(ledger)
    for source in sources:
        assert not set(source.source.split(" ")) & set(planned.ops)
    assert all(what_in_words(planned, e.what) for e in planned.estimate.comm)


def test_the_largest_kind_comes_first() -> None:
    """Forced FSDP: gathers and reduce-scatters besides the rest, the most bytes first."""
    model, inputs = build("gpt-tiny", device="meta", batch_size=8)
    mesh = autopar.Mesh.cluster(nodes=2, gpus_per_node=2, device="h100-sxm")
    planned = autopar.plan(model, mesh, inputs, stages=1, force="fsdp")
    totals: dict[str, float] = {}
    for e in planned.estimate.comm:
        totals[e.kind] = totals.get(e.kind, 0.0) + e.sent_per_step
    kinds = list(dict.fromkeys(s.kind for s in comm_sources(planned)))
    shown = [totals[k] for k in kinds]
    assert shown == sorted(shown, reverse=True) and len(kinds) >= 2
