"""A mixed-integer linear program held as arrays, the form HiGHS reads, and its solve.

``autopar_passes.ilp`` writes the planner's ILP term by term. Written through PuLP's expression
algebra, building it took longer than HiGHS took to solve it (llama-tiny over 8 devices:
260,000 pair variables, each a named Python object, each product of a coefficient and a
variable a new expression): here a variable is a column index and an expression a dict
from column to coefficient, and the model goes to HiGHS as one sparse matrix. CBC, the
fallback, gets the same model through PuLP.

>>> m = Mip()
>>> x, y = m.binary(), m.binary()
>>> m.add(Lin.total([x, y]), lower=1.0)               # x + y >= 1
>>> m.minimize(Lin.total([x.scaled(2.0), y.scaled(3.0)]))
>>> result = m.solve(time_limit=10.0)
>>> result.status, result.objective, result.value(x), result.value(y)
('optimal', 2.0, 1.0, 0.0)
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import highspy
import numpy as np

INF = math.inf


class Lin:
    """``sum_i terms[i] x_i + constant``: a linear expression over a ``Mip``'s columns."""

    __slots__ = ("constant", "terms")

    def __init__(self, terms: dict[int, float] | None = None, constant: float = 0.0) -> None:
        self.terms = terms if terms is not None else {}
        self.constant = constant

    @staticmethod
    def total(items: Iterable[Lin | float], scale: float = 1.0) -> Lin:
        """``scale`` times the sum of ``items`` (expressions, or numbers)."""
        out = Lin()
        for item in items:
            out.add(item, scale)
        return out

    def add(self, other: Lin | float, scale: float = 1.0) -> Lin:
        """``self += scale * other`` (in place); returns ``self``."""
        if isinstance(other, Lin):
            terms = self.terms
            for column, coefficient in other.terms.items():
                terms[column] = terms.get(column, 0.0) + scale * coefficient
            self.constant += scale * other.constant
        else:
            self.constant += scale * other
        return self

    def scaled(self, scale: float) -> Lin:
        """``scale * self`` as a new expression."""
        return Lin({c: scale * v for c, v in self.terms.items()}, scale * self.constant)

    def minus(self, other: Lin | float) -> Lin:
        """``self - other`` as a new expression."""
        return Lin(dict(self.terms), self.constant).add(other, -1.0)

    def is_constant(self) -> bool:
        return not any(self.terms.values())


def constant_of(item: Lin | float) -> float | None:
    """The value of ``item`` when it has no variable in it, else None."""
    if isinstance(item, Lin):
        return item.constant if item.is_constant() else None
    return float(item)


@dataclass
class MipResult:
    """What a solve found: ``status`` in words, whether it has a solution, the values."""

    status: str
    has_solution: bool
    infeasible: bool
    objective: float | None
    gap: float | None
    backend: str
    values: list[float]

    def value(self, item: Lin | float) -> float:
        """``item`` at the solution."""
        if not isinstance(item, Lin):
            return float(item)
        return item.constant + sum(v * self.values[c] for c, v in item.terms.items())


class Mip:
    """Columns (bounds, integrality) and rows (bounds, sparse coefficients) in lists; an
    objective to minimise."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[float, float, dict[int, float]]] = []
        # rows ``terms <= upper`` over the objective's own sums (cutoffs; ``cap``)
        self.caps: list[tuple[float, dict[int, float]]] = []
        self.objective = Lin()

    @property
    def num_columns(self) -> int:
        return len(self.lower)

    def variable(self, lower: float = 0.0, upper: float = INF, integer: bool = False) -> Lin:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return Lin({len(self.lower) - 1: 1.0})

    def binary(self) -> Lin:
        return self.variable(0.0, 1.0, integer=True)

    def add(self, expression: Lin, lower: float = -INF, upper: float = INF) -> None:
        """The row ``lower <= expression <= upper`` (its constant moved to the bounds)."""
        terms = {c: v for c, v in expression.terms.items() if v}
        self.rows.append((lower - expression.constant, upper - expression.constant, terms))

    def cap(self, expression: Lin, upper: float) -> None:
        """The row ``expression <= upper`` where ``expression`` is the objective or most of
        it: a cutoff. The MIP has it as a row; ``solve_rounded``'s relaxation leaves it out
        and checks it after (one row over every column the objective has, with
        coefficients from 1e-11 to 2e3, kept HiGHS's simplex 55 s from an answer on a
        relaxation it solved in 2.4 s without it: llama3-70b on 8x8)."""
        terms = {c: v for c, v in expression.terms.items() if v}
        self.caps.append((upper - expression.constant, terms))

    def all_rows(self) -> list[tuple[float, float, dict[int, float]]]:
        """The rows with the caps among them, as the MIP has them."""
        return self.rows + [(-INF, upper, terms) for upper, terms in self.caps]

    def equal(self, left: Lin, right: Lin | float) -> None:
        """The row ``left == right``."""
        self.add(left.minus(right), 0.0, 0.0)

    def at_most(self, left: Lin, right: Lin | float) -> None:
        """The row ``left <= right``."""
        self.add(left.minus(right), upper=0.0)

    def minimize(self, objective: Lin) -> None:
        self.objective = objective

    def solve(
        self,
        time_limit: float,
        backend: str = "highs",
        options: dict[str, Any] | None = None,
        callback: Any = None,
    ) -> MipResult:
        """HiGHS first (``options``: HiGHS options; ``callback``: its MIP interrupt
        callback), then CBC; ``backend="cbc"`` tries CBC first."""
        order = [_solve_highs, _solve_cbc] if backend == "highs" else [_solve_cbc, _solve_highs]
        errors: list[str] = []
        for solver in order:
            try:
                return solver(self, time_limit, options or {}, callback)
            except SolverUnavailable as error:
                errors.append(str(error))
        raise RuntimeError(f"no ILP solver could run (HiGHS, CBC): {'; '.join(errors)}")


class SolverUnavailable(Exception):
    """A backend that is not installed, or failed before it solved."""


def _csr(
    rows: list[tuple[float, float, dict[int, float]]],
) -> tuple[list[int], list[int], list[float]]:
    """``rows`` as a row-wise sparse matrix: starts, column indices, values."""
    starts, index, values = [0], [], []
    for _, _, terms in rows:
        index.extend(terms.keys())
        values.extend(terms.values())
        starts.append(len(index))
    return starts, index, values


def _highs_lp(mip: Mip, caps: bool = True) -> Any:
    """``mip`` as HiGHS reads it; ``caps=False``: without its caps (``Mip.cap``)."""
    rows = mip.all_rows() if caps else mip.rows
    lp = highspy.HighsLp()
    lp.num_col_ = mip.num_columns
    lp.num_row_ = len(rows)
    cost = [0.0] * mip.num_columns
    for column, value in mip.objective.terms.items():
        cost[column] += value
    lp.col_cost_ = cost
    lp.offset_ = mip.objective.constant
    lp.col_lower_ = mip.lower
    lp.col_upper_ = [highspy.kHighsInf if u == INF else u for u in mip.upper]
    lp.row_lower_ = [-highspy.kHighsInf if lo == -INF else lo for lo, _, _ in rows]
    lp.row_upper_ = [highspy.kHighsInf if hi == INF else hi for _, hi, _ in rows]
    starts, index, values = _csr(rows)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = index
    lp.a_matrix_.value_ = values
    lp.a_matrix_.num_col_ = mip.num_columns
    lp.a_matrix_.num_row_ = len(rows)
    if any(mip.integer):
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
            for i in mip.integer
        ]
    return lp


def _highs(lp: Any, time_limit: float, options: dict[str, Any]) -> Any:
    with quiet_stdout():  # HiGHS prints a banner from C++ when first created
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit))
    for key, value in options.items():
        highs.setOptionValue(key, value)
    if highs.passModel(lp) == highspy.HighsStatus.kError:
        raise SolverUnavailable("HiGHS refused the model")
    return highs


def _solve_highs(mip: Mip, time_limit: float, options: dict[str, Any], callback: Any) -> MipResult:
    highs = _highs(_highs_lp(mip), time_limit, options)
    stop = _interrupt_by(highs, callback)
    with quiet_stdout(), stop.ctrl_c_marked():
        highs.run()
    stop.raise_ctrl_c()
    return _result(highs, mip)


@dataclass
class _Interrupt:
    """HiGHS's MIP interrupt callback: ``check`` (None: none), and Ctrl-C.

    Python runs its SIGINT handler at the next Python code the main thread runs, during a
    solve the callback at HiGHS's next checkpoint; the KeyboardInterrupt it raised there
    escaped into HiGHS before any code could catch it, and HiGHS swallowed it: the solve
    stopped "not solved" and planning went on as if it had found nothing. So while HiGHS
    runs, the handler only marks Ctrl-C (``ctrl_c_marked``), the callback stops the solve,
    and ``raise_ctrl_c`` raises KeyboardInterrupt once HiGHS has returned."""

    check: Any
    ctrl_c: bool = False

    def __call__(self, kind: int, message: str, out: Any, into: Any, data: Any) -> None:
        if self.ctrl_c:
            into.user_interrupt = True
        elif self.check is not None:
            self.check(kind, message, out, into, data)

    @contextlib.contextmanager
    def ctrl_c_marked(self) -> Iterator[None]:
        """SIGINT marks ``ctrl_c`` meanwhile, where Python's own handler is set (only the
        main thread sets handlers; a handler of the user's own is left as it is)."""
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return

        def mark(signum: int, frame: Any) -> None:
            self.ctrl_c = True

        signal.signal(signal.SIGINT, mark)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def raise_ctrl_c(self) -> None:
        if self.ctrl_c:
            raise KeyboardInterrupt


def _interrupt_by(highs: Any, check: Any) -> _Interrupt:
    """``check`` (None: none) as ``highs``'s MIP interrupt callback, with Ctrl-C."""
    stop = _Interrupt(check)
    highs.setCallback(stop, None)
    highs.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
    return stop


def _result(highs: Any, mip: Mip) -> MipResult:
    """What the solve ``highs`` ran on ``mip`` found."""
    status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kModelEmpty:  # no columns: nothing to choose
        return MipResult("optimal", True, False, mip.objective.constant, 0.0, "highs", [])
    info = highs.getInfo()
    found = status == highspy.HighsModelStatus.kOptimal or (
        info.primal_solution_status == 2  # kSolutionStatusFeasible: stopped with a plan
        and math.isfinite(highs.getObjectiveValue())
    )
    infeasible = status in (
        highspy.HighsModelStatus.kInfeasible,
        highspy.HighsModelStatus.kUnboundedOrInfeasible,
    )
    gap: float | None = None
    if status == highspy.HighsModelStatus.kOptimal:
        gap = 0.0
    elif found:
        gap = float(info.mip_gap)
    return MipResult(
        status=_words(status, found),
        has_solution=found,
        infeasible=infeasible,
        objective=float(highs.getObjectiveValue()) if found else None,
        gap=gap,
        backend="highs",
        values=list(highs.getSolution().col_value) if found else [],
    )


# The proof beside a search (``solve_or_refute``) looks for no plan: without heuristics
# (40,617 of the 50,550 simplex iterations of one proof under a cutoff went to them:
# llama3-70b on 64x8, no pipeline, 62 s; without them 29 s) and without presolve (which
# took that proof to 100 s: it ends at the root, where presolve's reductions cost more
# than they save)
REFUTE: dict[str, Any] = {
    "presolve": "off",
    "mip_heuristic_effort": 0.0,
    "mip_heuristic_run_feasibility_jump": False,
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
    "mip_heuristic_run_root_reduced_cost": False,
    "mip_heuristic_run_zi_round": False,
    "mip_heuristic_run_shifting": False,
}
REFUTER = "autopar-refute"  # the proof's thread


def solve_or_refute(
    mip: Mip, time_limit: float, options: dict[str, Any], callback: Any
) -> MipResult:
    """``mip`` solved by HiGHS with ``options`` and the interrupt ``callback`` (as
    ``Mip.solve``), with a proof beside it: a second solve on its own thread, with
    ``REFUTE``'s options, that only looks for a proof that ``mip`` has no plan. It stops at
    the first plan either finds (its own is never used) or when the search ends; where it
    proves there is none first, the search is stopped at its next checkpoint and the answer is
    "infeasible". The answer is the search's or, where the proof came first, what the
    search would have found (no plan, or none in its budget), so the clock decides how
    fast, never what. HiGHS releases the GIL while it solves: the two share the cores.

    Under a cutoff, whether a MIP is a proof or a search shows only at its end: proofs end
    at their root, without presolve, in a fraction of the time a search takes (llama3-70b
    on 64x8, no pipeline: 29 s against 100 s), and searches find their plan faster with
    presolve (the same problem's configuration on 4 stages: 40 s against 105 s)."""
    lp = _highs_lp(mip)
    search = _highs(lp, time_limit, options)
    proof = _highs(lp, time_limit, REFUTE)
    # moot: the search has a plan, or has ended; the proof then stops and frees its core
    refuted, moot, stopped = threading.Event(), threading.Event(), threading.Event()

    def search_check(kind: int, message: str, out: Any, into: Any, data: Any) -> None:
        if refuted.is_set():
            into.user_interrupt = True
            stopped.set()
            return
        if math.isfinite(out.mip_primal_bound):
            moot.set()
        callback(kind, message, out, into, data)

    def proof_check(kind: int, message: str, out: Any, into: Any, data: Any) -> None:
        if moot.is_set() or math.isfinite(out.mip_primal_bound):
            into.user_interrupt = True

    def prove() -> None:
        proof.run()
        if proof.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
            refuted.set()

    stop = _interrupt_by(search, search_check)
    _interrupt_by(proof, proof_check)  # signals reach only the main thread: never Ctrl-C
    beside = threading.Thread(target=prove, name=REFUTER)
    with quiet_stdout(), stop.ctrl_c_marked():
        beside.start()
        try:
            search.run()
        finally:
            moot.set()
            beside.join()
    stop.raise_ctrl_c()
    return _no_plan(REFUTED) if stopped.is_set() else _result(search, mip)


REFUTED = "infeasible (proved beside the search)"


def _no_plan(status: str = "infeasible") -> MipResult:
    """A proof that the MIP has no plan."""
    return MipResult(status, False, True, None, None, "highs", [])


# The planner's relaxations are nearly integral: llama3-8b on 64 H100s under a memory
# limit leaves 6 of 2,542 binaries fractional at the root, whose bound is within 0.005% of
# the optimum; HiGHS took 11 s and 23 s to close those MIPs (presolve, restarts and rounds
# of cuts on 72,000 columns), the relaxation and the rounding below 2 s each.
ROUNDED_GAP = 1e-4  # HiGHS's own mip_rel_gap: "optimal" means the same either way
ROUNDED_MOST = 0.05  # the share of integer columns left fractional that is still tried


def solve_rounded(mip: Mip, time_limit: float) -> MipResult | None:
    """The MIP solved from its linear relaxation: no plan, a plan proved optimal, a plan
    further than that from the bound ("feasible", with its gap), or None (the caller solves
    the MIP itself).

    The caps (``Mip.cap``) are checked first, each on its own: a cap ``a x <= u`` that no
    point of the relaxation meets (``min a x > u``) proves the MIP has no plan. The
    objective's own cap is that of the relaxation's optimum ``z_LP`` (``z_LP > u``);
    another's is the relaxation minimising ``a x`` (``_cap_refuted``). Then the relaxation
    is solved without the caps: its optimum ``x*``, ``z_LP`` is no more than any plan's
    objective, caps or not. Where ``x*`` meets every cap it is the optimum with them too.
    Where it does not, no cap alone is refuted (above), but two together may be: the
    relaxation with them as rows is tried, within ``CAPPED_SECONDS``; otherwise the MIP is
    left to the caller.

    With every integer column the relaxation leaves integral fixed there, the few left are
    solved as a MIP, caps included; its optimum ``z`` is a plan, optimal within
    ``ROUNDED_GAP`` where ``z - z_LP <= ROUNDED_GAP |z|`` (status "optimal": HiGHS's own
    test, against the relaxation's bound instead of its branch-and-bound's); a plan
    further from the bound says at least that the MIP has one. A relaxation with no
    solution proves the MIP has none."""
    integer = [c for c, is_int in enumerate(mip.integer) if is_int]
    if not integer:
        return None
    lp = _highs_lp(mip, caps=False)
    objective = {c: v for c, v in mip.objective.terms.items() if v}
    own = [upper for upper, terms in mip.caps if terms == objective]
    others = [(upper, terms) for upper, terms in mip.caps if terms != objective]
    if any(_cap_refuted(lp, mip, upper, terms, time_limit) for upper, terms in others):
        return _no_plan()
    # without presolve: it spent 34 s proving one relaxation under a cutoff infeasible
    # (llama3-8b of 8 layers on 64 H100s), which the simplex alone did in 0.2 s
    options: dict[str, Any] = {"solve_relaxation": True, "presolve": "off"}
    if own:  # the dual simplex stops once its bound passes the cap: no plan
        options["objective_bound"] = _beyond(min(own)) + mip.objective.constant
    try:
        highs = _highs(lp, time_limit, options)
    except SolverUnavailable:
        return None
    with quiet_stdout():
        highs.run()
    status = highs.getModelStatus()
    if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kObjectiveBound):
        return _no_plan()
    if status != highspy.HighsModelStatus.kOptimal:
        return None
    bound = float(highs.getInfo().objective_function_value)
    if own and bound - mip.objective.constant > _beyond(min(own)):
        return _no_plan()
    values = list(highs.getSolution().col_value)
    if any(_at(terms, values) > _beyond(upper) for upper, terms in mip.caps):
        joint = len(mip.caps) > 1 and _caps_refuted(lp, mip, min(CAPPED_SECONDS, time_limit))
        return _no_plan() if joint else None
    settled = [c for c in integer if abs(values[c] - round(values[c])) <= 1e-9]
    if len(integer) - len(settled) > ROUNDED_MOST * len(integer):
        return None
    fixed = [float(round(values[c])) for c in settled]
    highs.setOptionValue("solve_relaxation", False)
    highs.setOptionValue("presolve", "choose")  # it takes the fixed columns out
    highs.setOptionValue("objective_bound", highspy.kHighsInf)
    highs.changeColsBounds(len(settled), settled, fixed, fixed)
    _add_caps(highs, mip)
    with quiet_stdout():
        highs.run()
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    objective_value = float(highs.getObjectiveValue())
    gap = max(objective_value - bound, 0.0) / max(abs(objective_value), 1e-300)
    return MipResult(
        "optimal" if gap <= ROUNDED_GAP else "feasible (a plan; not proved optimal)",
        True,
        False,
        objective_value,
        gap,
        "highs",
        list(highs.getSolution().col_value),
    )


# A cap other than the objective's is refuted by the relaxation minimising its sum, with
# the dual simplex stopped once its bound passes the cap (HiGHS's ``objective_bound``): the
# bound of a dual feasible basis, never above the least. It used to be tried as a row of
# the relaxation first: one dense row (every column the objective has, coefficients from
# 1e-11 to 2e3) made some of those relaxations crawl at 2-4 ms a simplex iteration. Every
# cap relaxation of llama3-70b's search on 64 H100s (188), solved both ways: the caps as
# rows proved 121 hopeless in 16.9 s, and ran 5 to their 2 s limit without an answer; each
# cap minimised proved those 126 in 17.8 s, agreed on every other (62, 1.8 s and 1.7 s).
# The caps as rows are left for two caps no point of the relaxation meets together though
# each alone is met: given this many seconds of the clock, past them the MIP decides, so
# the clock decides how fast, never what.
CAPPED_SECONDS = 2.0


def _add_caps(highs: Any, mip: Mip) -> None:
    """``mip``'s caps as rows of the model ``highs`` holds."""
    for upper, terms in mip.caps:
        highs.addRow(
            -highspy.kHighsInf,
            upper,
            len(terms),
            np.fromiter(terms.keys(), np.int32, len(terms)),
            np.fromiter(terms.values(), np.float64, len(terms)),
        )


def _cap_refuted(lp: Any, mip: Mip, upper: float, terms: dict[int, float], seconds: float) -> bool:
    """Whether no point of the relaxation ``lp`` (``mip`` without its caps) meets the cap
    ``terms <= upper``: their least passes it (False: it does not, or the time ran out)."""
    try:
        highs = _highs(
            lp,
            seconds,
            {"solve_relaxation": True, "presolve": "off", "objective_bound": _beyond(upper)},
        )
    except SolverUnavailable:
        return False
    costs = np.zeros(mip.num_columns)
    costs[np.fromiter(terms.keys(), np.int64, len(terms))] = list(terms.values())
    highs.changeColsCost(mip.num_columns, np.arange(mip.num_columns, dtype=np.int32), costs)
    highs.changeObjectiveOffset(0.0)
    with quiet_stdout():
        highs.run()
    status = highs.getModelStatus()
    if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kObjectiveBound):
        return True
    least = float(highs.getInfo().objective_function_value)
    return status == highspy.HighsModelStatus.kOptimal and least > _beyond(upper)


def _caps_refuted(lp: Any, mip: Mip, seconds: float) -> bool:
    """Whether the relaxation ``lp`` (``mip`` without its caps) with the caps as rows has
    no solution, proved within ``seconds`` (False: it has one, or the time ran out)."""
    try:
        highs = _highs(lp, seconds, {"solve_relaxation": True, "presolve": "off"})
    except SolverUnavailable:
        return False
    _add_caps(highs, mip)
    with quiet_stdout():
        highs.run()
    return bool(highs.getModelStatus() == highspy.HighsModelStatus.kInfeasible)


# a cap is met, or refuted, beyond this share of it: the simplex's own accuracy, well
# inside the margin the planner's cutoffs leave for ties (1e-7, ``solve.tie``); the
# planner's objectives run from 1e-5 s (tiny models) to 1e3 s, so not an absolute one
CAP_SLACK = 1e-9


def _beyond(upper: float) -> float:
    """The value past which a cap ``<= upper`` is not met (``CAP_SLACK``)."""
    return upper + CAP_SLACK * abs(upper)


def _at(terms: dict[int, float], values: list[float]) -> float:
    return sum(v * values[c] for c, v in terms.items())


def _words(status: Any, found: bool) -> str:
    if status == highspy.HighsModelStatus.kOptimal:
        return "optimal"
    if found:
        return "feasible (time limit; best found)"
    if status in (
        highspy.HighsModelStatus.kInfeasible,
        highspy.HighsModelStatus.kUnboundedOrInfeasible,
    ):
        return "infeasible"
    return "not solved"


def _solve_cbc(mip: Mip, time_limit: float, options: dict[str, Any], callback: Any) -> MipResult:
    """CBC through PuLP (which ships it): the same columns and rows, named in order."""
    import pulp

    solver = pulp.COIN_CMD(msg=False, timeLimit=time_limit)  # a CBC of the system's
    if not solver.available():
        with warnings.catch_warnings():  # the CBC PuLP ships, deprecated from PuLP 3.3
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    if not solver.available():
        raise SolverUnavailable("CBC is not available")
    model = pulp.LpProblem("autopar", pulp.LpMinimize)
    width = len(str(max(mip.num_columns, 1)))  # names in column order: PuLP sorts by name
    columns = [
        model.add_variable(
            f"x{c:0{width}d}",
            lo,
            None if hi == INF else hi,
            pulp.LpInteger if integer else pulp.LpContinuous,
        )
        for c, (lo, hi, integer) in enumerate(zip(mip.lower, mip.upper, mip.integer, strict=True))
    ]

    def expression(terms: dict[int, float], constant: float = 0.0) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression([(columns[c], v) for c, v in terms.items()], constant)

    for lower, upper, terms in mip.all_rows():
        if lower == upper:
            model += expression(terms) == lower
            continue
        if lower != -INF:
            model += expression(terms) >= lower
        if upper != INF:
            model += expression(terms) <= upper
    model += expression(mip.objective.terms, mip.objective.constant)
    try:
        with quiet_stdout():
            model.solve(solver)
    except pulp.PulpSolverError as error:
        raise SolverUnavailable(f"CBC failed: {error}") from error
    found = model.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    optimal = model.sol_status == pulp.LpSolutionOptimal
    return MipResult(
        status="optimal"
        if optimal
        else (
            "feasible (time limit; best found)"
            if found
            else ("infeasible" if model.status == pulp.LpStatusInfeasible else "not solved")
        ),
        has_solution=found,
        infeasible=model.status == pulp.LpStatusInfeasible,
        objective=float(pulp.value(model.objective) or 0.0) if found else None,
        gap=0.0 if optimal else None,
        backend="cbc",
        values=[v.value() or 0.0 for v in columns] if found else [],
    )


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Keep the C++ solvers' prints off the user's terminal."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
