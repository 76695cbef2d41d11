"""The ILP without edge variables (``autopar_passes.ilp_relax``) is a relaxation: every
choice costs it no more time and no more memory than the ILP, and recomputation frees no
less and replays no more, so a cutoff it proves hopeless is hopeless for the ILP too, and
``solve_ilp`` gives the same answers with it as without."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

import autopar
from autopar_examples.models import build
from autopar_passes import ilp
from autopar_passes.ilp import IlpProblem, objective_at, solve_ilp
from autopar_passes.ilp_relax import relax_edges


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def problems() -> list[IlpProblem]:
    """gpt-tiny's ILPs on 2x2: memory set aside (FSDP group calls, prefetch links), then
    the first under a memory limit that binds (recompute regions with edge terms)."""
    model, inputs = build("gpt-tiny", batch_size=8)
    mesh = autopar.Mesh((2, 2), ("x", "y"), device="h100-sxm")
    found: list[IlpProblem] = []
    real = ilp._solve

    def spy(problem: IlpProblem, *args: object, **kwargs: object) -> ilp.IlpSolution:
        if any(edge.cost for edge in problem.edges):
            found.append(problem)
            if problem.recompute:
                raise _Captured
        return real(problem, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ilp, "_solve", spy)
        roomy = autopar.plan(model, mesh, inputs, stages=1).estimate.memory_per_device_bytes
        states = roomy.total - roomy.activations
        with pytest.raises(_Captured):
            autopar.plan(model, mesh, inputs, stages=1, memory_limit=states)
    return [found[0], found[-1]]


def _random_choices(problem: IlpProblem, rng: random.Random) -> dict[str, int]:
    return {
        d: rng.choice(sorted(problem.allowed.get(d, range(count))))
        for d, count in problem.choices.items()
    }


def _pair(problem: IlpProblem, e: int, choice: dict[str, int]) -> tuple[int, int]:
    edge = problem.edges[e]
    return edge.left_class[choice[edge.left]], edge.right_class[choice[edge.right]]


def _memory_at(problem: IlpProblem, choice: dict[str, int]) -> float:
    total = sum(row[choice[d]] for d, row in problem.memory.items())
    return total + sum(
        edge.memory.get(_pair(problem, e, choice), 0.0) for e, edge in enumerate(problem.edges)
    )


def _region_at(problem: IlpProblem, term: ilp.RecomputeTerm, choice: dict[str, int]):
    """(bytes freed, forward seconds) of one recomputed copy of ``term`` under ``choice``."""
    saving = sum(row[choice[d]] for d, row in term.saving.items())
    forward = sum(row[choice[d]] for d, row in term.forward.items())
    saving += sum(m.get(_pair(problem, e, choice), 0.0) for e, m in term.edge_saving.items())
    forward += sum(m.get(_pair(problem, e, choice), 0.0) for e, m in term.edge_forward.items())
    return saving, forward


def test_the_fixture_covers_every_term_the_relaxation_folds(problems):
    roomy, bounded = problems
    assert roomy.group_calls and any(call.edges for call in roomy.group_calls)
    assert roomy.prefetch and any(link.edges for link in roomy.prefetch)
    assert any(link.after is not None for link in roomy.prefetch)
    assert bounded.memory_limit is not None
    assert any(term.edge_saving and term.edge_forward for term in bounded.recompute)
    relaxed = relax_edges(bounded)
    assert not relaxed.edges
    assert not any(call.edges for call in relaxed.group_calls)
    assert not any(term.edge_saving or term.edge_forward for term in relaxed.recompute)


def test_no_choice_costs_the_relaxation_more_time_or_memory_than_the_ilp(problems):
    rng = random.Random(0)
    for problem in problems:
        relaxed = relax_edges(problem)
        for _ in range(300):
            choice = _random_choices(problem, rng)
            exact = objective_at(problem, choice)
            assert objective_at(relaxed, choice) <= exact * (1 + 1e-12) + 1e-15
            assert _memory_at(relaxed, choice) <= _memory_at(problem, choice) * (1 + 1e-12) + 1e-6
            for term, folded in zip(problem.recompute, relaxed.recompute, strict=True):
                freed, replayed = _region_at(problem, term, choice)
                freed_relaxed, replayed_relaxed = _region_at(relaxed, folded, choice)
                assert freed_relaxed >= freed * (1 - 1e-12) - 1e-6
                assert replayed_relaxed <= replayed * (1 + 1e-12) + 1e-15


def test_it_is_a_bound_close_under_the_ilp_optimum(problems):
    """Not the ILP (a choice's pairs are bounded, not joint), but within a few percent."""
    problem = problems[0]
    exact = solve_ilp(problem).report.objective
    relaxed = solve_ilp(relax_edges(problem)).report.objective
    assert exact is not None and relaxed is not None
    assert 0.8 * exact < relaxed <= exact * (1 + 1e-9)


def test_a_cutoff_the_relaxation_proves_hopeless_is_hopeless_for_the_ilp(problems):
    problem = problems[0]
    best = solve_ilp(problem).report.objective
    relaxed_best = solve_ilp(relax_edges(problem)).report.objective
    assert best is not None and relaxed_best is not None
    hopeless = solve_ilp(problem, cutoff=0.9 * relaxed_best)
    assert not hopeless.feasible and not hopeless.timed_out
    assert "relaxation" in hopeless.report.status
    exact = ilp._solve(problem, 60.0, "highs", 0.9 * relaxed_best, None)
    assert not exact.feasible and exact.report.status == "infeasible"
    # wherever the cutoff lies, the same answer as the ILP alone
    for cutoff in (0.9 * relaxed_best, (relaxed_best + best) / 2, 1.01 * best):
        with_relaxation = solve_ilp(problem, cutoff=cutoff)
        alone = ilp._solve(problem, 60.0, "highs", cutoff, None)
        assert with_relaxation.feasible == alone.feasible
        assert with_relaxation.report.objective == alone.report.objective
    found = solve_ilp(problem, cutoff=best * 1.01)
    assert found.feasible and found.report.objective == pytest.approx(best, rel=1e-9)


def test_a_link_that_gathers_on_an_edge_waits_no_longer_in_the_relaxation():
    """A link of identical layers (``after`` None) hides behind the layer before (``C`` =
    2 s) whenever it gathers: here on the edge ``a -> b`` (0.1 s where ``a`` takes choice 1
    and ``b`` 0) and in its group's call (1 s): the ILP's wait is 0. The edge's lower
    potentials are 0, so its folded rows say nothing of whether it gathers; taken as
    never hidden there, the relaxation waited for the call, 1.0 s where the ILP costs
    0.1 s."""
    identity = (0, 1)
    problem = IlpProblem(
        choices={"a": 2, "b": 2},
        cost={"a": [0.0, 0.0], "b": [0.0, 0.0]},
        memory={"a": [0.0, 0.0], "b": [0.0, 0.0]},
        edges=[ilp.EdgeTerm("a", "b", identity, identity, {(1, 0): 0.1})],
        group_calls=[ilp.GroupCall(0.0, edges={0: frozenset({(1, 0), (1, 1)})})],
        prefetch=[ilp.PrefetchLink(1.0, 2.0, edges={0: {(1, 0): 0.1}}, calls={0: 1.0})],
    )
    relaxed = relax_edges(problem)
    for a, b in itertools.product((0, 1), repeat=2):
        choice = {"a": a, "b": b}
        assert objective_at(relaxed, choice) <= objective_at(problem, choice) + 1e-12
    assert objective_at(problem, {"a": 1, "b": 0}) == pytest.approx(0.1)
    ilp_best = solve_ilp(replace(problem, cost={"a": [5.0, 0.0], "b": [0.0, 5.0]}))
    relaxed_best = solve_ilp(
        replace(relaxed, cost=relaxed.cost | {"a": [5.0, 0.0], "b": [0.0, 5.0]})
    )
    assert ilp_best.report.objective == pytest.approx(0.1, abs=1e-6)
    assert relaxed_best.report.objective <= ilp_best.report.objective + 1e-6


def test_a_link_launched_by_gathers_on_an_edge_waits_no_longer_in_the_relaxation():
    """Layer ``b``'s gather (an edge, 1 s) hides behind the part before (``C`` = 2 s)
    when that part gathers, on an edge too, as it does where ``a`` takes choice 1: the
    ILP's wait is 0. The relaxation cannot tell from potentials whether the part
    before gathers; it had taken the link as never hidden, a wait of 1 s, dearer than the
    ILP, so a cutoff it called hopeless might not have been."""
    identity = (0, 1)
    problem = IlpProblem(
        choices={"a": 2, "b": 2, "c": 2},
        cost={d: [0.0, 0.0] for d in "abc"},
        memory={d: [0.0, 0.0] for d in "abc"},
        edges=[
            ilp.EdgeTerm("a", "b", identity, identity, {(1, 0): 0.5, (1, 1): 0.5}),
            ilp.EdgeTerm("b", "c", identity, identity, {(1, 0): 1.0, (1, 1): 1.0}),
        ],
        prefetch=[
            ilp.PrefetchLink(1.0, 0.0, edges={0: {(1, 0): 0.5, (1, 1): 0.5}}),
            ilp.PrefetchLink(1.0, 2.0, edges={1: {(1, 0): 1.0, (1, 1): 1.0}}, after=0),
        ],
    )
    relaxed = relax_edges(problem)
    for a, b, c in itertools.product((0, 1), repeat=3):
        choice = {"a": a, "b": b, "c": c}
        assert objective_at(relaxed, choice) <= objective_at(problem, choice)
    gathering = {"a": 1, "b": 1, "c": 0}
    assert objective_at(problem, gathering) == pytest.approx(0.5 + 1.0 + 0.5)  # edges + first
