"""Recomputation as a count of layer copies per region, placed so that no two clash.

The ILP decides how many copies of a layer class each recompute region takes (an integer in
binary digits, ``ilp.RecomputeTerm``); regions that cannot share a layer (the full layer, and
selective regions sharing ops) share the class's copies (``ilp.RecomputeBudget``, made by
``recompute_budgets``); ``chosen_layers`` says which copies: all at the front of the class
(a 1F1B pipeline's first stage holds the most microbatches), the full layer the first ones,
each group of clashing selective regions the ones after, one region after another. The
closed forms are hand-made regions and hand-built ILPs; end to end, the solver decides
recomputation jointly with the ZeRO stage, so it recomputes where that beats a ZeRO stage
that fits without it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from functools import partial

import pytest

import autopar
import autopar_passes.solve as solve_module
from autopar.force import style_constraints
from autopar_examples.models import build
from autopar_passes.ilp import (
    GIB,
    EdgeTerm,
    IlpProblem,
    RecomputeBudget,
    RecomputeTerm,
    _recompute_parts,
    _times_digit,
    solve_ilp,
)
from autopar_passes.mip import Lin, Mip
from autopar_passes.recompute import Region, chosen_layers, recompute_budgets
from autopar_passes.solve import SolveRequest, solve_sharding
from autopar_passes.trace import trace
from autopar_plans import InfeasiblePlanError


def region(name: str, kind: str, nodes: tuple[str, ...], layers=range(8)) -> Region:
    """A candidate whose ops ``nodes`` repeat in every layer of ``layers``."""
    copies = {layer: tuple(f"{n}.{layer}" for n in nodes) for layer in layers}
    return Region(name, kind, nodes, copies)


# One layer class of 8 copies: the whole layer; ``a`` and ``b`` share the op ``y`` (an
# element-wise run, and the same run with the matmul before it), ``c`` shares none.
FULL = region("full", "full", ("x", "y", "z", "w"))
A = region("a", "selective", ("x", "y"))
B = region("b", "selective", ("y", "z"))
C = region("c", "selective", ("w",))


# ---- chosen_layers: which copies ----


def test_full_recompute_takes_the_first_layers_of_its_class():
    assert chosen_layers([FULL], {"full": 3}) == {"full": (0, 1, 2)}
    assert chosen_layers([FULL], {"full": 8}) == {"full": tuple(range(8))}
    later = region("full", "full", ("x",), layers=(1, 2, 3))  # the class's own layers
    assert chosen_layers([later], {"full": 2}) == {"full": (1, 2)}


def test_clashing_selective_regions_take_adjacent_runs_from_the_front():
    """The first region of the group the first layers, the next the ones just after."""
    chosen = chosen_layers([A, B], {"a": 2, "b": 3})
    assert chosen == {"a": (0, 1), "b": (2, 3, 4)}
    assert not set(chosen["a"]) & set(chosen["b"])
    assert sorted(chosen["a"] + chosen["b"]) == [0, 1, 2, 3, 4]


def test_full_and_a_clashing_group_fill_the_class_without_meeting():
    chosen = chosen_layers([FULL, A, B], {"full": 3, "a": 2, "b": 3})
    assert chosen == {"full": (0, 1, 2), "a": (3, 4), "b": (5, 6, 7)}


def test_a_selective_region_sharing_no_op_may_share_layers_with_another():
    chosen = chosen_layers([A, B, C], {"a": 2, "b": 3, "c": 4})
    assert chosen["c"] == (0, 1, 2, 3)  # from the front, as its own group
    assert set(chosen["c"]) & set(chosen["a"]) and set(chosen["c"]) & set(chosen["b"])


def test_regions_linked_through_a_third_are_one_group():
    """``a`` and ``d`` share no op, but both share one with ``b``: one run of layers."""
    d = region("d", "selective", ("z", "v"))
    chosen = chosen_layers([A, d, B], {"a": 1, "d": 2, "b": 3})
    layers = [layer for name in ("a", "d", "b") for layer in chosen[name]]
    assert sorted(layers) == [0, 1, 2, 3, 4, 5]  # disjoint, adjacent, from the front
    (budget,) = recompute_budgets([A, d, B])
    assert sorted(budget.regions) == ["a", "b", "d"] and budget.copies == 8


def test_a_count_of_zero_or_none_gives_no_layers():
    assert chosen_layers([FULL, A, B, C], {"full": 0, "a": 0}) == {}
    assert chosen_layers([FULL, A, B], {"a": 0, "b": 2}) == {"b": (0, 1)}


def test_each_layer_class_is_placed_on_its_own():
    """Two classes (the first layer apart from the rest, say) with the same op names: each
    fills its own layers, neither pushes the other back."""
    first = [region("full0", "full", ("x", "y"), (0,)), region("a0", "selective", ("y",), (0,))]
    rest = [
        region("full1", "full", ("x", "y"), range(1, 8)),
        region("a1", "selective", ("y",), range(1, 8)),
    ]
    chosen = chosen_layers(first + rest, {"full0": 1, "a1": 3, "full1": 2})
    assert chosen == {"full0": (0,), "full1": (1, 2), "a1": (3, 4, 5)}
    assert chosen_layers(rest + first, {"a0": 1, "a1": 7}) == {"a0": (0,), "a1": tuple(range(1, 8))}


def test_any_counts_within_the_budgets_give_each_region_its_count_and_no_clash():
    """Every combination on a class of 4 layers: a region gets exactly its count of the
    class's layers, and two regions that cannot share a layer never do."""
    layers = (2, 3, 4, 5)
    regions = [
        region("full", "full", ("x", "y", "z", "w"), layers),
        region("a", "selective", ("x", "y"), layers),
        region("b", "selective", ("y", "z"), layers),
        region("c", "selective", ("w",), layers),
    ]
    budgets = recompute_budgets(regions)
    clashing = {("full", "a"), ("full", "b"), ("full", "c"), ("a", "b")}
    tried = 0
    for counts in itertools.product(range(5), repeat=4):
        count = dict(zip(("full", "a", "b", "c"), counts, strict=True))
        if any(sum(count[n] for n in budget.regions) > budget.copies for budget in budgets):
            continue
        tried += 1
        chosen = chosen_layers(regions, count)
        for name, n in count.items():
            taken = chosen.get(name, ())
            assert len(set(taken)) == n and set(taken) <= set(layers), (count, chosen)
        for one, other in clashing:
            assert not set(chosen.get(one, ())) & set(chosen.get(other, ())), (count, chosen)
    assert tried > 50


# ---- recompute_budgets: who shares the copies ----


def test_the_full_layer_shares_its_copies_with_each_group_of_clashing_regions():
    assert recompute_budgets([FULL, A, B, C]) == [
        RecomputeBudget(("full", "a", "b"), 8),
        RecomputeBudget(("full", "c"), 8),
    ]


def test_a_region_that_clashes_with_nothing_has_no_budget():
    assert recompute_budgets([FULL]) == []
    assert recompute_budgets([C]) == []
    assert recompute_budgets([A, C]) == []  # no op shared, no full layer
    assert recompute_budgets([A, B, C]) == [RecomputeBudget(("a", "b"), 8)]


def test_budgets_are_per_layer_class_with_its_number_of_copies():
    first = [region("full0", "full", ("x",), (0,)), region("a0", "selective", ("x",), (0,))]
    rest = [
        region("full1", "full", ("x",), range(1, 4)),
        region("a1", "selective", ("x",), range(1, 4)),
    ]
    assert recompute_budgets(first + rest) == [
        RecomputeBudget(("full0", "a0"), 1),
        RecomputeBudget(("full1", "a1"), 3),
    ]


# ---- solve_ilp: how many copies ----

BASE_S = 1.0  # the one decision's time
STATES_GIB = 100.0  # its memory
FORWARD_S = 0.01  # one copy's forward, run again


def term(name: str, copies: int, saving_gib=1.0, forward_s=FORWARD_S, **kwargs) -> RecomputeTerm:
    """A region whose every copy frees ``saving_gib`` and runs ``forward_s`` again."""
    return RecomputeTerm(
        name=name,
        kind=kwargs.pop("kind", "selective"),
        copies=copies,
        saving={"a": [saving_gib * GIB]},
        forward={"a": [forward_s]},
        **kwargs,
    )


def short_of(deficit_gib: float | None, *terms: RecomputeTerm, budgets=()) -> IlpProblem:
    """One decision of one choice, ``deficit_gib`` over the memory limit (None: no limit)."""
    return IlpProblem(
        choices={"a": 1},
        cost={"a": [BASE_S]},
        memory={"a": [STATES_GIB * GIB]},
        memory_limit=None if deficit_gib is None else (STATES_GIB - deficit_gib) * GIB,
        recompute=list(terms),
        recompute_budgets=list(budgets),
    )


@pytest.mark.parametrize(
    ("copies", "deficit_gib"),
    [(5, 0.5), (5, 2.5), (5, 4.5), (96, 36.5), (96, 95.5), (96, -1.0)],
    ids=["5-one", "5-three", "5-all", "96-thirty-seven", "96-all", "96-none"],
)
def test_the_optimum_recomputes_just_enough_copies_to_fit(copies, deficit_gib):
    """Each copy frees S = 1 GiB for F seconds: a deficit D takes ceil(D / S) copies, at
    F each (37 of 96 is 100101 in binary: several digits together)."""
    solution = solve_ilp(short_of(deficit_gib, term("r", copies)))
    count = max(0, math.ceil(deficit_gib))
    assert solution.feasible
    assert solution.recompute == {"r": count}
    assert solution.report.objective == pytest.approx(BASE_S + count * FORWARD_S, abs=1e-6)


def test_each_copy_runs_again_for_every_microbatch():
    solution = solve_ilp(short_of(2.5, term("r", 5, weight=4.0)))
    assert solution.recompute == {"r": 3}
    assert solution.report.objective == pytest.approx(BASE_S + 4 * 3 * FORWARD_S, abs=1e-6)


def test_more_than_every_copy_frees_is_infeasible():
    assert not solve_ilp(short_of(5.5, term("r", 5))).feasible


def test_regions_sharing_a_budget_recompute_at_most_its_copies_together():
    """``p`` frees 1 GiB for 0.01 s, ``q`` 2 GiB for 0.03 s; 8 copies, 9.5 GiB short.
    On their own, 8 of ``p`` and 1 of ``q`` (0.11 s, 9 copies); sharing the 8 copies, 6 and
    2 (0.12 s): q >= 2 to free 9.5 GiB in 8 copies."""
    p, q = term("p", 8), term("q", 8, saving_gib=2.0, forward_s=0.03)
    alone = solve_ilp(short_of(9.5, p, q))
    assert alone.recompute == {"p": 8, "q": 1}
    assert alone.report.objective == pytest.approx(BASE_S + 0.11, abs=1e-6)
    shared = solve_ilp(short_of(9.5, p, q, budgets=[RecomputeBudget(("p", "q"), 8)]))
    assert shared.recompute == {"p": 6, "q": 2}
    assert shared.report.objective == pytest.approx(BASE_S + 0.12, abs=1e-6)
    assert not solve_ilp(short_of(12.5, p, q, budgets=[RecomputeBudget(("p", "q"), 5)])).feasible


@pytest.mark.parametrize("deficit_gib", [None, -1.0, 2.5])
def test_a_forcing_hint_recomputes_every_copy_whatever_the_memory(deficit_gib):
    solution = solve_ilp(short_of(deficit_gib, term("r", 37, forced=True)))
    assert solution.recompute == {"r": 37}
    assert solution.report.objective == pytest.approx(BASE_S + 37 * FORWARD_S, abs=1e-6)


def test_a_forbidding_hint_recomputes_none_even_when_nothing_else_fits():
    assert solve_ilp(short_of(-1.0, term("r", 37, forced=False))).recompute == {"r": 0}
    assert not solve_ilp(short_of(2.5, term("r", 37, forced=False))).feasible


def test_without_a_memory_limit_nothing_is_recomputed_unless_forced():
    solution = solve_ilp(short_of(None, term("r", 37)))
    assert solution.recompute == {}
    assert solution.report.objective == pytest.approx(BASE_S, abs=1e-6)


@pytest.mark.parametrize(("slower_s", "recompute"), [(0.3, 2), (0.1, 0)])
def test_recomputation_against_a_leaner_strategy_the_cheaper_wins(slower_s, recompute):
    """Choice 0 takes 10 GiB, choice 1 6 GiB for ``slower_s`` more; the limit is 8 GiB, and
    under choice 0 a copy frees 1 GiB for 0.1 s: two copies (0.2 s) or the leaner choice."""
    problem = IlpProblem(
        choices={"a": 2},
        cost={"a": [1.0, 1.0 + slower_s]},
        memory={"a": [10 * GIB, 6 * GIB]},
        memory_limit=8 * GIB,
        recompute=[RecomputeTerm("r", "selective", 8, {"a": [GIB, GIB / 4]}, {"a": [0.1, 0.1]})],
    )
    solution = solve_ilp(problem)
    assert solution.choice == {"a": 0 if recompute else 1}
    assert solution.recompute == {"r": recompute}
    assert solution.report.objective == pytest.approx(1.0 + min(0.2, slower_s), abs=1e-6)


def net_cost_problem() -> IlpProblem:
    """A region whose checkpoint would keep, under choice 0, an input larger than what it
    frees (``recompute._kept_boundary``): its net saving is -1 GiB there. Memory does not
    bind (2 GiB of 10): the fastest choice, 0, with nothing recomputed, is the optimum."""
    return IlpProblem(
        choices={"a": 2},
        cost={"a": [1.0, 2.0]},
        memory={"a": [2 * GIB, 2 * GIB]},
        memory_limit=10 * GIB,
        recompute=[RecomputeTerm("r", "selective", 4, {"a": [-GIB, GIB]}, {"a": [0.1, 0.1]})],
    )


def test_a_region_that_would_cost_memory_only_goes_unrecomputed():
    """A region whose net saving is negative under some choice (the inputs only its
    checkpoint keeps outweigh what it frees) is simply not recomputed there: it neither
    forbids that choice nor makes the plan slower."""
    problem = net_cost_problem()
    solution = solve_ilp(problem)
    assert (solution.choice, solution.recompute) == ({"a": 0}, {"r": 0})
    assert solution.report.objective == pytest.approx(1.0, abs=1e-6)
    assert solve_ilp(replace(problem, allowed={"a": {0}})).feasible


def kept_copy_problem(limit_gib: float) -> IlpProblem:
    """A producer ``a`` whose output (4 GiB, replicated) a consumer ``b`` keeps for
    backward. Under ``b``'s fast choice 0 the consumer keeps a split copy instead (1 GiB:
    the edge's memory is -3 GiB); under choice 1 it keeps the tensor itself. The states
    take 10 GiB. Recomputing the layer frees what it keeps in either case: the 4 GiB
    tensor less the copy's difference, i.e. the 1 GiB copy, under choice 0."""
    return IlpProblem(
        choices={"a": 1, "b": 2},
        cost={"a": [1.0], "b": [1.0, 2.0]},
        memory={"a": [14 * GIB], "b": [0.0, 0.0]},
        memory_limit=limit_gib * GIB,
        edges=[EdgeTerm("a", "b", (0,), (0, 1), {}, memory={(0, 0): -3 * GIB})],
        recompute=[
            RecomputeTerm(
                "layer",
                "full",
                1,
                {"a": [4 * GIB]},
                {"a": [0.1]},
                edge_saving={0: {(0, 0): -3 * GIB}},
            )
        ],
    )


def test_recomputing_a_kept_resharded_copy_frees_the_copy_not_the_tensor_again():
    """11 GiB under choice 0 (10 after recomputing), 14 under choice 1 (10 after): a limit
    of 9 GiB fits nothing. Counting the tensor's 4 GiB freed on top of the copy's -3 GiB
    would make choice 0 fit at 7 GiB: memory that does not exist."""
    assert not solve_ilp(kept_copy_problem(9.0)).feasible
    fits = solve_ilp(kept_copy_problem(10.0))
    assert (fits.choice, fits.recompute) == ({"a": 0, "b": 0}, {"layer": 1})
    assert solve_ilp(kept_copy_problem(11.0)).recompute == {"layer": 0}


# ---- end to end: recomputation decided jointly with the ZeRO stage ----


def no_recompute(monkeypatch) -> None:
    """The solver with no recompute candidates: only strategies and ZeRO save memory."""
    monkeypatch.setattr(solve_module, "find_regions", lambda *args: [])


def _tie(a: float, b: float) -> bool:
    return a <= b * (1 + 1e-4)  # HiGHS's relative MIP gap


@pytest.fixture(scope="module")
def data_parallel_gpt2():
    """GPT-2 small's shape (4 layers, flash attention) on 8 H100s, bf16 mixed precision,
    plain data parallelism (forced): the fastest plan of each ZeRO stage, and its memory."""
    model, inputs = build("gpt2-124m", device="meta", batch_size=8, n_layer=4)
    traced = trace(model, inputs)
    request = SolveRequest(
        autopar.Mesh((8,), device="h100-sxm"),
        precision="bf16_mixed",
        constraints=partial(style_constraints, "dp"),
    )
    memory = {
        zero: solve_sharding(traced, replace(request, zero_levels=(zero,))).memory()
        for zero in (0, 1, 2)
    }
    return traced, request, memory


def test_the_joint_solve_weighs_a_zero_stage_against_recomputing_layers(
    data_parallel_gpt2, monkeypatch
):
    """10% of the way from ZeRO-0's memory down to ZeRO-2's, ZeRO-1 fits without
    recomputation, at the price of gathering the stepped masters before the next forward
    (exposed, as the runtime runs it); recomputing a layer instead costs forward time. The
    joint solve weighs the two: it is never slower than ZeRO alone, and what it picks fits
    (ZeRO-0 only by recomputing)."""
    traced, request, memory = data_parallel_gpt2
    limit = memory[0] - 0.1 * (memory[0] - memory[2])
    assert memory[1] < limit < memory[0]
    joint = solve_sharding(traced, replace(request, memory_limit=limit))
    no_recompute(monkeypatch)
    plain = solve_sharding(traced, replace(request, memory_limit=limit))
    assert plain.zero >= 1 and not any(plain.recompute.values())
    assert _tie(joint.report.objective, plain.report.objective)
    assert joint.zero >= 1 or any(joint.recompute.values())
    assert joint.memory() <= limit + 1e-6 * GIB  # HiGHS's tolerance on the GiB row


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.2, 0.5])
def test_the_joint_solve_is_never_slower_than_one_without_recomputation(
    data_parallel_gpt2, monkeypatch, fraction
):
    """Forbidding recomputation only takes choices away."""
    traced, request, memory = data_parallel_gpt2
    limited = replace(request, memory_limit=memory[0] - fraction * (memory[0] - memory[2]))
    joint = solve_sharding(traced, limited)
    no_recompute(monkeypatch)
    plain = solve_sharding(traced, limited)
    assert _tie(joint.report.objective, plain.report.objective)


@pytest.mark.parametrize("force", [None, "dp"])
def test_explicit_attention_is_never_slower_with_recomputation_allowed(monkeypatch, force):
    """Megatron-style explicit attention: the selective region from the QKV bias add keeps
    the QKV projection's output, more than it frees under some strategies."""
    model, inputs = build("gpt2-124m", device="meta", batch_size=8, n_layer=4, attention="explicit")
    traced = trace(model, inputs)
    request = SolveRequest(autopar.Mesh((8,), device="h100-sxm"), precision="bf16_mixed")
    if force is not None:
        request = replace(request, constraints=partial(style_constraints, force))
    limit = 0.9 * solve_sharding(traced, request).memory()
    try:
        joint = solve_sharding(traced, replace(request, memory_limit=limit)).report.objective
    except InfeasiblePlanError:
        joint = math.inf
    no_recompute(monkeypatch)
    plain = solve_sharding(traced, replace(request, memory_limit=limit)).report.objective
    assert _tie(joint, plain)


@pytest.mark.parametrize("chosen", [0, 1])
def test_a_fraction_of_a_recomputed_copy_frees_that_fraction_of_its_own_saving(chosen):
    """The products of a digit and a region's saving and forward time are written on the
    convex hull of the choice (``ilp._times_digit``): with the choice whole and the digit
    at a half, as the LP relaxation may set it, the copy frees half of what the chosen
    strategy frees, and its forward costs half of that strategy's, however large the other
    strategy's saving. (The big-M form before it freed up to half the largest saving at
    no time at all, so a relaxed plan fitted the memory limit almost for free.)"""
    term = RecomputeTerm("r", "full", 1, {"a": [64 * GIB, GIB]}, {"a": [6.4, 0.1]})
    model = Mip()
    select: list[Lin | float] = [
        model.variable(float(k == chosen), float(k == chosen)) for k in range(2)
    ]
    r = model.variable(0.5, 0.5)
    (groups,) = _recompute_parts(term, {"a": select}, [])
    saving, forward = Lin(), Lin()
    _times_digit(model, groups, r, saving, forward)
    for sense, expected in ((1, 0.5 * [64, 1][chosen]), (-1, 0.5 * [64, 1][chosen])):
        model.minimize(saving.scaled(-sense))  # the most, then the least, it could free
        result = model.solve(time_limit=10.0)
        assert result.value(saving) == pytest.approx(expected)  # GiB
        assert result.value(forward) == pytest.approx(0.5 * [6.4, 0.1][chosen])


@pytest.mark.parametrize("style", ["tp", "tp+sp"])
def test_a_recomputed_layer_is_priced_with_the_collectives_its_replay_runs_again(style):
    """A tensor-parallel layer's replay runs its all-reduces (reduce-scatters and gathers
    under sequence parallelism) again: the ledger counts them in backward, and the region's
    price (``RecomputeRegion.recompute_s``, what the ILP weighed) includes their time."""
    model, inputs = build("llama-tiny", device="meta", batch_size=4)
    plan = autopar.plan(
        model,
        autopar.Mesh((2,), device="h100-sxm"),
        inputs,
        force=style,
        stages=1,
        microbatches=1,
        hints={"recompute": ["layers.*"]},
    )
    replayed = [e for e in plan.estimate.comm if e.what.endswith("(recompute)")]
    assert replayed and all(e.phase == "backward" for e in replayed)
    priced = sum(region.recompute_s for region in plan.recompute)
    communication = sum(e.time_s for e in replayed)
    assert priced >= communication
    # the rest is the regions' own ops: a fraction of a microsecond at this size on an H100
    assert priced - communication < 0.1 * communication
