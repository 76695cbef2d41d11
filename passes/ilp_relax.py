"""A small relaxation of the intra-op ILP: its edges folded into the decisions' own rows.

The ILP's size is its edges' class-pair variables (llama3-8b on 8x8: 59,000 of 61,000
columns, ``autopar_passes.ilp``), and a proof that no plan beats a cutoff costs the root LP
over all of them (1.3-3 s each, dozens per search). The relaxation drops the pairs: each
edge matrix ``M[p, q]`` (a resharding's seconds, a resharded copy's bytes, a gather's
seconds, a recomputed reshard's seconds) is bounded from below by *potentials*
``a[p] + b[q] <= M[p, q]`` over the class pairs the allowed choices reach, with::

    a[p] = min_q M[p, q],    b[q] = min_p (M[p, q] - a[p])

and ``a`` joins the producer's per-choice row, ``b`` the consumer's. What recomputation
frees is bounded from above the same way (``a[p] = max_q``, ``b[q] = max_p``). A group call
runs when a whole row or column of its members is chosen (``g`` only bounded by those); a
prefetch link counts its gathers by their lower potentials, and is hidden always where it
or the part before gathers on an edge (whether it gathers, or launches it, is not known).

For whole choices every term of the relaxation is at most the ILP's (time, memory) or at
least it (memory freed), so each plan of the ILP is a plan of the relaxation, no slower:
when the relaxation has no plan under a memory limit and a cutoff, neither has the ILP.
It has no edge variables (2,500 columns where the ILP has 61,000), so that proof costs a
fraction of the ILP's, when the relaxation is tight enough to give it
(``autopar_passes.ilp.solve_ilp``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # autopar_passes.ilp imports this module to solve the relaxation
    from autopar_passes.ilp import (
        EdgeTerm,
        GroupCall,
        IlpProblem,
        Matrix,
        PrefetchLink,
        RecomputeTerm,
    )

Potentials = tuple[dict[int, float], dict[int, float]]


def relax_edges(problem: IlpProblem) -> IlpProblem:
    """``problem`` with its edges folded into their decisions' rows (module docstring)."""
    cost = {d: list(row) for d, row in problem.cost.items()}
    memory = {d: list(row) for d, row in problem.memory.items()}
    reach = [_reached(problem, edge) for edge in problem.edges]
    for edge, (left, right) in zip(problem.edges, reach, strict=True):
        _fold(cost, problem, edge, _lower(edge.cost, left, right))
        _fold(memory, problem, edge, _lower(edge.memory, left, right))
    calls = [_relaxed_call(problem, call, reach) for call in problem.group_calls]
    links = [_relaxed_link(problem, link, reach) for link in problem.prefetch]
    recompute = [_relaxed_term(problem, term, reach) for term in problem.recompute]
    return replace(
        problem,
        cost=cost,
        memory=memory,
        edges=[],
        group_calls=calls,
        prefetch=links,
        recompute=recompute,
    )


def _reached(problem: IlpProblem, edge: EdgeTerm) -> tuple[set[int], set[int]]:
    """The classes the allowed choices of each side give."""

    def classes(decision: str, of_choice: tuple[int, ...]) -> set[int]:
        allowed = problem.allowed.get(decision, range(problem.choices[decision]))
        return {of_choice[k] for k in allowed}

    return classes(edge.left, edge.left_class), classes(edge.right, edge.right_class)


def _lower(matrix: Matrix, left: set[int], right: set[int]) -> Potentials:
    """``a[p] + b[q] <= matrix[p, q]`` on the reached pairs (missing pairs are 0)."""
    if not left or not right or not any(matrix.values()):
        return {}, {}
    a = {p: min(matrix.get((p, q), 0.0) for q in right) for p in left}
    b = {q: min(matrix.get((p, q), 0.0) - a[p] for p in left) for q in right}
    return a, b


def _upper(matrix: Matrix, left: set[int], right: set[int]) -> Potentials:
    """``a[p] + b[q] >= matrix[p, q]`` on the reached pairs."""
    a, b = _lower({pq: -v for pq, v in matrix.items()}, left, right)
    return {p: -v for p, v in a.items()}, {q: -v for q, v in b.items()}


def _fold(
    rows: dict[str, list[float]], problem: IlpProblem, edge: EdgeTerm, potentials: Potentials
) -> None:
    """Add an edge's potentials to its two decisions' per-choice ``rows``."""
    a, b = potentials
    for decision, of_choice, values in (
        (edge.left, edge.left_class, a),
        (edge.right, edge.right_class, b),
    ):
        if not any(values.values()):
            continue
        row = rows.setdefault(decision, [0.0] * problem.choices[decision])
        for k, cls in enumerate(of_choice):
            row[k] += values.get(cls, 0.0)


def _relaxed_call(
    problem: IlpProblem, call: GroupCall, reach: list[tuple[set[int], set[int]]]
) -> GroupCall:
    """A call that runs when one of its member decisions' choices does, or when a chosen
    class's whole row (column) of an edge's reached pairs is among its members."""
    choices = {d: set(members) for d, members in call.choices.items()}
    for e, members in call.edges.items():
        edge = problem.edges[e]
        left, right = reach[e]
        full_rows = {p for p in left if all((p, q) in members for q in right)}
        full_cols = {q for q in right if all((p, q) in members for p in left)}
        for decision, of_choice, full in (
            (edge.left, edge.left_class, full_rows),
            (edge.right, edge.right_class, full_cols),
        ):
            ks = {k for k, cls in enumerate(of_choice) if cls in full}
            if ks:
                choices.setdefault(decision, set()).update(ks)
    return replace(call, edges={}, choices={d: frozenset(ks) for d, ks in choices.items()})


def _relaxed_link(
    problem: IlpProblem, link: PrefetchLink, reach: list[tuple[set[int], set[int]]]
) -> PrefetchLink:
    """A link whose gathers on edges count their lower potentials. Where it or the part
    before gathers on an edge, whether it gathers (and is hidden) is no longer known: a
    folded row may be 0 where the edge's pair gathers. The link is then taken as always
    hidden, ``w >= G - C`` with ``C`` taken off one member's row (the ILP's
    ``w >= G - C y``, ``y <= 1``, waits no less); without rows, it waits nothing."""
    choices = {d: list(row) for d, row in link.choices.items()}
    for e, members in link.edges.items():
        _fold(choices, problem, problem.edges[e], _lower(members, *reach[e]))
    unknown = link.hiding > 0 and (
        bool(link.edges) or (link.after is not None and bool(problem.prefetch[link.after].edges))
    )
    if not unknown:
        return replace(link, edges={}, choices=choices)
    if not choices:
        return replace(link, edges={}, choices=choices, weight=0.0)
    first = next(iter(choices))
    choices[first] = [value - link.hiding for value in choices[first]]
    return replace(link, edges={}, choices=choices, after=None, hiding=0.0)


def _relaxed_term(
    problem: IlpProblem, term: RecomputeTerm, reach: list[tuple[set[int], set[int]]]
) -> RecomputeTerm:
    """A region whose edges' freed bytes count their upper potentials and whose replayed
    reshards count their lower ones."""
    saving = {d: list(row) for d, row in term.saving.items()}
    forward = {d: list(row) for d, row in term.forward.items()}
    for e, matrix in term.edge_saving.items():
        _fold(saving, problem, problem.edges[e], _upper(matrix, *reach[e]))
    for e, matrix in term.edge_forward.items():
        _fold(forward, problem, problem.edges[e], _lower(matrix, *reach[e]))
    return replace(term, saving=saving, forward=forward, edge_saving={}, edge_forward={})
