"""The inter-op search: how many pipeline stages, which schedule, how many microbatches.

For each stage count ``p`` that cuts the mesh into blocks of consecutive devices (the
outer, slowest, axis first: across nodes, then inside them; ``MeshSpec.stage_mesh``), the
intra-op plan is solved once on one stage's mesh, its costs are read per
layer (``layer_costs``), and for each schedule and microbatch size the layers are cut into
stages (``stage_cut``) under the memory limit. The fastest configuration that fits wins;
the plan keeps the runners-up with their estimates.

Microbatches: the example inputs give the largest microbatch (the traced batch ``B``).
Smaller microbatches ``b = B / k`` that a stage's devices still divide are costed by
scaling what grows with the batch (compute, activations, resharding of activations) by
``b / B``; the runtime traces again at ``b``. Below a stage's devices the plan at ``B``
would not divide (its batch split no longer fits), so those sizes, from one sequence per
node of a stage upward, are planned on the model traced again at the smallest of them
(``PipelineRequest.retrace``; ``_small_sizes``) and scaled up from there. An example
smaller than a stage's nodes (a preset's one sequence) cannot split the batch across them
at all: one sequence per node, and without a pipeline one per device, are planned on the
model traced again at that size too (``_large_sizes``).
``global_batch / b`` microbatches make a step. ``p = 1`` is plain gradient accumulation
(schedule ``none``), so a pipeline is chosen only when it beats not having one.

Step time of a pipeline (``autopar_cost_model.step.pipeline_time``; where devices share cores, the
simulated schedule, ``autopar_cost_model.schedule``)::

    (sum_s T_s + (m v - 1) max_s T_s) / v + exposed gradient sync

with ``T_s`` stage ``s``'s time per microbatch (compute, resharding, and the point-to-point
of its boundary activations) and ``v`` the chunks per device of interleaved 1F1B. The
bubble is ``(p - 1) / (v m)`` of the ideal time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.compute import achieved_flops, dtype_key, peak_flops
from autopar_cost_model.hardware import DevicePreset, load_preset
from autopar_cost_model.memory import microbatches_in_flight
from autopar_cost_model.schedule import schedule_time
from autopar_cost_model.step import exposed_gradient_sync, mfu
from autopar_passes.annotation import META_KEY
from autopar_passes.collector import collector_paused
from autopar_passes.costs import compute_dtype_of
from autopar_passes.ilp import WorkCutoff, solve_ilp
from autopar_passes.ledger import step_ledger, with_ledger
from autopar_passes.mixed_precision import AutocastSaved, autocast_dtypes, autocast_saved
from autopar_passes.offload_ledger import stage_host
from autopar_passes.pipeline.layer_costs import (
    LayerCosts,
    Part,
    chain_time,
    first_calls,
    held_activations,
    layer_costs,
    without_calls,
)
from autopar_passes.pipeline.ledger import pipeline_ledger, with_pipeline_ledger
from autopar_passes.pipeline.stage_cut import StageCut, cut_stages, evaluate_cut
from autopar_passes.plan_build import build_plan
from autopar_passes.solve import (
    NothingFaster,
    Solved,
    SolveRequest,
    group_axes,
    solve_sharding,
    tie,
)
from autopar_passes.trace import TracedModel
from autopar_plans.errors import AutoparError, InfeasiblePlanError, UsageError
from autopar_plans.ledger import sent
from autopar_plans.mesh import MeshSpec
from autopar_plans.plan import (
    Alternative,
    Estimate,
    MemoryBreakdown,
    Parallelism,
    Plan,
    Stage,
    StageEstimate,
)
from autopar_plans.units import format_bytes, format_seconds

SCHEDULES = ("gpipe", "1f1b", "interleaved")

# what planning is doing, in a few words (``autopar.plan``'s ``progress=``)
Progress = Callable[[str], None]


def silent(_: str) -> None:
    """No progress shown."""


@dataclass
class PipelineRequest:
    """What to search; ``None`` fields are searched, the others fixed (hints, options)."""

    solve: SolveRequest  # on the whole mesh; its memory limit is per device
    global_batch: int
    traced_batch: int
    model: str = ""
    stages: int | None = None
    schedule: str | None = None
    microbatches: int | None = None
    chunks: int | None = None
    # the layer where each stage begins (hints' ``pipeline.cuts``): fixes the stage count and
    # the cut, so the stage cut is not searched; not with the interleaved schedule
    cuts: tuple[int, ...] | None = None
    # the model traced again at a smaller batch (the example inputs cut along their batch
    # dim): microbatches smaller than a stage's devices (``_small_sizes``); None: only the
    # sizes the example's trace scales to
    retrace: Callable[[int], TracedModel] | None = None
    progress: Progress = silent


@dataclass(frozen=True)
class Source:
    """A trace of the model, the batch it was traced at, and the microbatch sizes the
    search costs from it (largest first) by scaling what grows with the batch."""

    traced: TracedModel
    batch: int
    sizes: tuple[int, ...]


@dataclass
class Candidate:
    stages: int
    schedule: str
    chunks: int
    microbatch_size: int
    microbatches: int
    step_time_s: float
    memory: float
    stage_times: tuple[float, ...]
    stage_states: tuple[float, ...]
    stage_activations: tuple[float, ...]
    stage_forward: tuple[float, ...]
    stage_handoffs: tuple[float, ...]  # point-to-point per microbatch, in stage_times
    first_layers: tuple[int, ...]
    solved: Solved
    stage_mesh: MeshSpec
    bubble_s: float
    sync_s: float
    source: Source
    # each stage's states apart, (params, grads, optimizer); empty without a pipeline
    stage_state_terms: tuple[tuple[float, float, float], ...] = ()
    optimizer_s: float = 0.0  # the optimizer's step on the stage that sets the step's end
    stage_compute: tuple[float, ...] = ()  # forward + backward compute per microbatch
    stage_recompute: tuple[float, ...] = ()  # forward run again in backward, per microbatch

    def describe(self) -> Parallelism:
        return Parallelism(
            pp=self.stages,
            microbatches=self.microbatches,
            schedule=self.schedule,
            chunks=self.chunks,
        )


@collector_paused()
def plan_pipeline(traced: TracedModel, request: PipelineRequest) -> Plan:
    """The fastest plan over stage counts, schedules and microbatches (module docstring).

    Two passes over the stage counts. First the fastest intra-op plan of each, memory set
    aside, costed for every microbatch size and schedule (memory per stage is checked when
    cutting): where one fits, that stage count is done. Then, the most promising first,
    the stage counts where none fit and the microbatches below a stage's devices (traced
    again: ``_small_sizes``), each skipped when a lower bound on its step time
    (``_least_work`` and ``_bubble_factor``) is above the best found. The stage counts that
    do not fit need the memory-bounded solves, the slow part of planning (ZeRO and
    recomputation in the ILP); every solve of this pass looks only for plans that could
    beat the best (a work cutoff, which the solver proves hopeless in seconds where it took
    its minute to solve)."""
    _check(traced, request)
    mesh = request.solve.mesh
    layers = traced.layers.count if traced.layers else 0
    limit = request.solve.memory_limit
    search = _Search(request, layers)
    pending: list[tuple[float, int, Source | tuple[int, ...]]] = []
    counts = _stage_counts(mesh, layers, request)
    floor = _compute_floor(traced, request)
    for i, p in enumerate(counts):
        stage_mesh = _stage_mesh(mesh, p)
        least = floor * _bubble_factor(p, [1], layers, request)
        best = search.best()
        if least > tie(best):
            request.progress(
                f"{_stages(p)} ({i + 1} of {len(counts)}): skipped, at least "
                f"{format_seconds(least)}{search.best_words()}"
            )
            continue
        sources = []
        sizes = _microbatch_sizes(request, stage_mesh)
        if sizes:
            sources.append(Source(traced, request.traced_batch, tuple(sizes)))
        for large in _large_sizes(request, stage_mesh, p):
            request.progress(f"{_stages(p)}: tracing microbatches of {large}")
            found = search.retrace([large])
            if found is not None:
                sources.append(found)
        for source in sources:
            request.progress(
                f"{_stages(p)} ({i + 1} of {len(counts)}): fastest layouts{search.best_words()}"
            )
            solved = search.solve(p, None, source)
            if solved is None:
                continue
            fits = search.cost(p, solved, source) > 0
            # without a pipeline a smaller microbatch only holds fewer activations: worth
            # tracing again only when the example's does not fit
            small = (
                _small_sizes(request, stage_mesh, list(source.sizes))
                if source.traced is traced and (p > 1 or not fits)
                else ()
            )
            if (fits and not small) or (not fits and limit is None):
                continue
            work = _least_work(solved, mesh, p, request.solve.time_limit)
            bound = work.step(_bubble_factor(p, list(source.sizes), layers, request), p)
            if not fits:
                pending.append((bound, p, source))
            if small:
                # the least work per sequence is no less at a smaller microbatch (the
                # roofline scales with the batch at best, and fewer layouts divide it)
                bound = work.step(_bubble_factor(p, list(small), layers, request), p)
                pending.append((bound, p, small))
    for bound, p, entry in sorted(pending, key=lambda e: (e[0], e[1])):
        best = search.best()
        if bound > best:
            continue
        # a plan on a stage's mesh beats the best in hand only if its work, spread over
        # the stages with the least bubble stretching its per-microbatch part, does
        # (``WorkCutoff``)
        sizes = list(entry.sizes if isinstance(entry, Source) else entry)
        stretch = _bubble_factor(p, sizes, layers, request)
        cutoff = WorkCutoff(tie(best * p / stretch), stretch) if search.candidates else None
        what = (
            "layouts under the memory limit"
            if isinstance(entry, Source)
            else f"microbatches of {min(sizes)}, traced again"
        )
        request.progress(
            f"{_stages(p)}: {what} (at best {format_seconds(bound)}){search.best_words()}"
        )
        if isinstance(entry, Source):
            source = entry
        else:
            retraced = search.retrace(sizes)
            if retraced is None:
                continue
            source = retraced
            solved = search.solve(p, None, source, work_cutoff=cutoff)
            if solved is None or search.cost(p, solved, source) or limit is None:
                continue
        assert limit is not None
        m = request.global_batch // min(sizes)
        for memory, in_flight in _stage_budgets(p, limit, m, search.layers, request):
            solved = search.solve(p, memory, source, in_flight, cutoff)
            if solved is None or search.cost(p, solved, source):
                break
    if not search.candidates:
        raise _nothing_fits(mesh, limit, search.smallest, search.errors)
    # ties (the roofline scales compute and traffic with the microbatch, so splitting the
    # batch is often free on paper): fewer microbatches, whose larger kernels and fewer
    # collective launches the model does not see; then the leaner one
    candidates = sorted(
        search.candidates,
        key=lambda c: (float(f"{c.step_time_s:.9g}"), c.microbatches, c.memory),
    )
    return _to_plan(request, candidates[0], candidates[1:6])


def _stages(p: int) -> str:
    return "no pipeline" if p == 1 else f"{p} stages"


def _stage_budgets(
    p: int, limit: float, microbatches: int, layers: int, request: PipelineRequest
) -> list[tuple[float, float]]:
    """The memory rows the intra-op plan of ``p`` stages is solved under, in turn, until
    one gives a stage cut that fits: (limit of the row, weight of one microbatch's
    activations in it).

    The heaviest stage holds ``c = ceil(L / p)`` of the ``L`` layers, and the first stage
    ``k`` microbatches in flight (``autopar_cost_model.memory.microbatches_in_flight``): under 1F1B
    ``min(p, m)`` (Narayanan et al. 2021), the least of the schedules searched (GPipe
    takes as long and holds ``m``); the schedule the user fixed otherwise. With the whole
    model's states ``S`` and one microbatch's activations ``A``, spread evenly over the
    layers::

        (S + k A) c / L <= limit    <=>    S + k A <= limit L / c

    which is the first row. The end stages also hold the embedding and the head, so if
    no cut fits, the second row leaves them a quarter of the budget."""
    if p == 1:
        return [(limit, 1.0)]
    per_stage = -(-max(layers, 1) // p)
    budget = limit * max(layers, 1) / per_stage
    schedule, chunks = (request.schedule or "1f1b"), (request.chunks or 2)
    if schedule != "interleaved":
        chunks = 1
    in_flight = microbatches_in_flight(schedule, p, 0, microbatches, chunks)
    return [(budget, in_flight), (0.75 * budget, in_flight)]


@dataclass(frozen=True)
class _Work:
    """The least work (compute and resharding) a step of any plan on a stage's mesh runs,
    and the most of a plan's work the step pays once (``IlpProblem.once``)."""

    least: float
    once: float

    def step(self, stretch: float, p: int) -> float:
        """A lower bound on the step of ``p`` stages whose bubble stretches the work run
        per microbatch at least ``stretch`` times (``WorkCutoff``): each plan's ``stretch
        W_mb + W_once`` is at least ``stretch (W_mb + W_once) - (stretch - 1) W_once``, and
        at least its whole work, spread over the stages."""
        return max(stretch * self.least - (stretch - 1) * self.once, self.least) / p


def _least_work(solved: Solved, mesh: MeshSpec, p: int, time_limit: float) -> _Work:
    """The least compute and resharding per step of any plan on a stage's mesh: with no
    memory limit (so no ZeRO or recomputation) and all overlappable communication hidden
    (``IlpProblem.hide_all``), FSDP's prefetched gathers as far as compute hides any
    (no ``PrefetchLink``: the layer costs hide them behind the compute a configuration
    runs, which may exceed the least the links assume). A smaller microbatch costs
    proportionally (the search's scaling), so this is the same at every microbatch size.
    The per-step part: each decision's largest over its allowed choices. Both are the
    problem's the fastest plan was solved in (its ZeRO stage).
    """
    if len(group_axes(_stage_mesh(mesh, p))) > 1:
        # solved on the best of several groupings of the axes: a bound from one grouping's
        # problem says nothing of the others' (a mesh of three axes or more)
        return _Work(0.0, 0.0)
    problem = replace(
        solved.parts.problem,
        memory_limit=None,
        recompute=[],
        recompute_budgets=[],
        hide_all=True,
        prefetch=[],
    )
    relaxed = solve_ilp(problem, time_limit)
    least = (relaxed.report.objective or 0.0) if relaxed.feasible else 0.0
    once = sum(
        max((row[k] for k in problem.allowed.get(d, range(len(row)))), default=0.0)
        for d, row in problem.once.items()
    )
    return _Work(least, once)


def _compute_floor(traced: TracedModel, request: PipelineRequest) -> float:
    """The least compute a step can take on the whole mesh: every op's forward and backward
    FLOPs for the global batch at the fastest rate the cost model gives any op in the
    plan's compute dtype (``op_time``: the peak times the compute efficiency, or the best
    of the preset's measured curve), spread over every device, each op's time at least
    ``in_step`` times that. No plan does less on any stage count (a stage's devices share
    its layers' work at best), so ``floor x _bubble_factor`` bounds a stage count from
    below before any solve: with few microbatches a deep pipeline cannot win (llama3-8b on
    8x8 with one sequence a step: of the stage counts 1 to 32, those from 4 up)."""
    preset = load_preset(request.solve.mesh.device)
    dtype = compute_dtype_of(request.solve.precision)
    rates = [rate for _, rate in _curve_points(preset, dtype)]
    fallback = achieved_flops(preset, dtype, "", 0.0)
    rates += [fallback] if fallback is not None else []
    if not rates:
        return 0.0
    flops = 0.0
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        if node.op == "call_function":
            flops += note.fwd_flops + (note.bwd_flops if note.requires_grad else 0)
    per_step = flops * request.global_batch / request.traced_batch
    return preset.in_step * per_step / (request.solve.mesh.size * max(rates))


def _curve_points(preset: DevicePreset, dtype: str) -> list[tuple[float, float]]:
    """Every (FLOPs of a call, FLOP/s) point of the preset's measured curves in ``dtype``."""
    key = dtype_key(dtype)
    return [
        (float(f), float(r)) for curves in preset.op_rates.values() for f, r in curves.get(key, ())
    ]


def _bubble_factor(p: int, sizes: list[int], layers: int, request: PipelineRequest) -> float:
    """The least ratio of a ``p``-stage pipeline's time to its work spread evenly.

    With ``W`` the work of a step, ``m`` microbatches, ``v`` chunks per device and stage
    times ``T_s`` (each at least the work of its layers: ``sum_s T_s >= W / m`` and
    ``max_s T_s >= W / (m p)``), ``pipeline_time`` is::

        (sum_s T_s + (m v - 1) max_s T_s) / v  >=  W / p * (1 + (p - 1) / (m v))

    least at the most microbatches (the smallest size) and the most chunks any schedule
    allowed here takes.

    Where ``R`` ranks share ``C < R`` cores (``SharedCores``), a busy rank runs faster while
    others wait in the bubble, but ``k`` busy ranks together never get more than
    ``min(k, C) R / C`` ranks' measured speed (``SharedCores.speed``), so ``N`` devices
    take at least ``N C / (min(N, C) R)`` of ``W / p``, which is 1 for ``N = R``."""
    if p == 1:
        return 1.0
    m = request.global_batch // min(sizes)
    v = max(chunks for _, chunks in _schedules(p, layers, request))
    factor = 1.0 + (p - 1) / (m * v)
    mesh = request.solve.mesh
    shared = load_preset(mesh.device).shared_cores
    if shared is None or shared.ranks <= shared.cores:
        return factor
    n = mesh.size
    return min(factor, n * shared.cores / (min(n, shared.cores) * shared.ranks))


class _Search:
    """The configurations costed so far, and why the others did not fit."""

    def __init__(self, request: PipelineRequest, layers: int) -> None:
        self.request = request
        self.layers = layers
        self.candidates: list[Candidate] = []
        self.smallest: tuple[float, str] | None = None
        self.errors: list[InfeasiblePlanError] = []
        self.traces: dict[int, TracedModel | None] = {}
        self.autocast: dict[int, dict[str, str]] = {}  # traced batch -> node -> dtype
        # traced batch -> what autograd keeps under autocast (``autocast_saved``)
        self.saved: dict[int, AutocastSaved | None] = {}

    def best(self) -> float:
        """The fastest step of the configurations that fit so far (inf: none yet)."""
        return min((c.step_time_s for c in self.candidates), default=float("inf"))

    def best_words(self) -> str:
        """``; best 7.12 s a step`` once a configuration fits, else nothing."""
        if not self.candidates:
            return ""
        return f"; best {format_seconds(self.best())} a step"

    def solve(
        self,
        p: int,
        memory: float | None,
        source: Source,
        in_flight: float = 1.0,
        work_cutoff: WorkCutoff | None = None,
    ) -> Solved | None:
        """The intra-op plan of ``source`` on one stage's mesh: the fastest (``memory``
        None), else the fastest within ``memory`` for ``in_flight`` of the smallest
        microbatch's activations (``_stage_budgets``); None when none fits or none does
        less work than ``work_cutoff``."""
        request = self.request
        if source.batch not in self.saved:
            self.saved[source.batch] = autocast_saved(source.traced, request.solve.precision)
        solve = replace(
            request.solve,
            autocast_saved=self.saved[source.batch],
            mesh=_stage_mesh(request.solve.mesh, p),
            memory_limit=memory,
            microbatches=max(request.global_batch // source.batch, 1),
            batch_scale=in_flight * min(source.sizes) / source.batch,
            in_flight=in_flight,
            known_unfit=memory is not None,
            work_cutoff=work_cutoff,
        )
        try:
            return solve_sharding(source.traced, solve)
        except NothingFaster:
            return None
        except InfeasiblePlanError as error:
            # the whole mesh at the user's own limit (no pipeline) says it in their terms
            self.errors.insert(0 if p == 1 else len(self.errors), error)
            return None

    def retrace(self, sizes: list[int]) -> Source | None:
        """The model traced at the smallest of ``sizes`` (once per size), to cost them all;
        None when it cannot be traced there (the example's trace still stands)."""
        batch = min(sizes)
        if batch not in self.traces:
            assert self.request.retrace is not None
            try:
                self.traces[batch] = self.request.retrace(batch)
            except AutoparError:
                self.traces[batch] = None
        traced = self.traces[batch]
        return Source(traced, batch, tuple(sizes)) if traced is not None else None

    def cost(self, p: int, solved: Solved, source: Source) -> int:
        """Cost every microbatch size of ``source`` and schedule of ``solved`` with ``p``
        stages; returns how many fit."""
        request = self.request
        if source.batch not in self.autocast:  # the same for every stage count
            self.autocast[source.batch] = autocast_dtypes(source.traced, solved.cost.precision)
        costs = layer_costs(source.traced, solved, self.autocast[source.batch])
        stage_mesh = _stage_mesh(request.solve.mesh, p)
        # stages hand off on the whole mesh's links (a stage's own mesh may have none
        # between them: an axis of one device sends nothing)
        links = MeshCost(request.solve.mesh, solved.cost.mesh_cost.preset)
        fitted = 0
        for b in source.sizes:
            m = request.global_batch // b
            for schedule, chunks in _schedules(p, self.layers, request):
                found = _evaluate(
                    costs, solved, stage_mesh, links, p, schedule, chunks, b, m, source, request
                )
                if isinstance(found, Candidate):
                    self.candidates.append(found)
                    fitted += 1
                elif found is not None and (self.smallest is None or found[0] < self.smallest[0]):
                    self.smallest = found
        return fitted


def _check(traced: TracedModel, request: PipelineRequest) -> None:
    mesh = request.solve.mesh
    layers = traced.layers.count if traced.layers else 0
    if request.stages is not None:
        if request.stages > max(layers, 1):
            raise UsageError(
                f"{request.stages} pipeline stages but the model has {layers} "
                "layers; use at most one stage per layer"
            )
        if mesh.stage_mesh(request.stages) is None:
            raise UsageError(mesh.no_stage_cut(request.stages, layers))
    if request.cuts is not None:
        cuts = request.cuts
        if (
            not cuts
            or cuts[0] != 0
            or any(b <= a for a, b in itertools.pairwise(cuts))
            or cuts[-1] >= max(layers, 1)
        ):
            raise UsageError(
                f"pipeline cuts {list(cuts)}: give the first layer of each stage, increasing "
                f"from 0, below the model's {layers} layers"
            )
        if request.stages is not None and request.stages != len(cuts):
            raise UsageError(f"{request.stages} stages but the cuts make {len(cuts)}")
        if request.schedule == "interleaved":
            raise UsageError("interleaved 1F1B cuts the layers into equal chunks; drop the cuts")
        if mesh.stage_mesh(len(cuts)) is None:
            raise UsageError(mesh.no_stage_cut(len(cuts), layers))
    if request.schedule is not None and request.schedule not in SCHEDULES:
        raise UsageError(
            f"unknown pipeline schedule {request.schedule!r}; one of {', '.join(SCHEDULES)}"
        )
    if request.microbatches is not None:
        if request.global_batch % request.microbatches:
            raise UsageError(
                f"{request.microbatches} microbatches do not divide the global "
                f"batch of {request.global_batch}"
            )
        size = request.global_batch // request.microbatches
        if size > request.traced_batch or request.traced_batch % size:
            raise UsageError(
                f"{request.microbatches} microbatches of {size} from a global batch of "
                f"{request.global_batch}: the example inputs' batch ({request.traced_batch}) "
                "must be a multiple of the microbatch; pass example inputs of one microbatch"
            )


def _stage_counts(mesh: MeshSpec, layers: int, request: PipelineRequest) -> list[int]:
    if request.cuts is not None:
        return [len(request.cuts)]
    if request.stages is not None:
        return [request.stages]
    return mesh.stage_counts(layers)


def _stage_mesh(mesh: MeshSpec, stages: int) -> MeshSpec:
    found = mesh.stage_mesh(stages)
    assert found is not None, "stage counts are checked (_check) or listed by the mesh"
    return found


def _microbatch_sizes(request: PipelineRequest, stage_mesh: MeshSpec) -> list[int]:
    traced, total = request.traced_batch, request.global_batch
    if request.microbatches is not None:
        return [total // request.microbatches]
    sizes = [traced] if total % traced == 0 else []
    size = traced // 2
    while size >= 1 and traced % size == 0:
        # smaller than traced: keep it divisible by the stage's devices so any batch
        # sharding of the traced plan still divides
        if total % size == 0 and size % stage_mesh.size == 0:
            sizes.append(size)
        size //= 2
    return sizes


def _small_sizes(
    request: PipelineRequest, stage_mesh: MeshSpec, sizes: list[int]
) -> tuple[int, ...]:
    """Microbatches below those the example's trace scales to (``_microbatch_sizes`` keeps
    them divisible by a stage's devices), largest first: from one sequence per node of a
    stage (its mesh's outer axis; Megatron's one sequence per data-parallel rank, tensor
    parallel inside the node) doubling while below them. Their plan is solved on the model
    traced again at the smallest, which every one of them is a multiple of.

    Only where the example's batch covers a stage's devices, so that halving it stopped at
    them: an example smaller than that already spans a stage with other splits than the
    batch's, and the user chose microbatches near it (tracing a large model again takes
    seconds each: gpt3-175b, 6 s). None either when the search may not trace again, or
    the options fix the microbatches or the cut."""
    if (
        not _may_trace_again(request)
        or stage_mesh.ndim < 2
        or request.traced_batch < stage_mesh.size
    ):
        return ()
    found: list[int] = []
    size = stage_mesh.shape[0]
    while size < min(sizes):
        if request.traced_batch % size == 0 and request.global_batch % size == 0:
            found.append(size)
        size *= 2
    return tuple(sorted(found, reverse=True))


def _may_trace_again(request: PipelineRequest) -> bool:
    """Whether the search may plan microbatches on the model traced at another size: it can
    trace (``retrace``), and the options fix neither the microbatches nor the cut."""
    return request.retrace is not None and request.microbatches is None and request.cuts is None


def _large_sizes(request: PipelineRequest, stage_mesh: MeshSpec, p: int) -> list[int]:
    """Microbatches above the example's batch where it cannot split a stage's nodes (its
    mesh's outer axis), each planned on the model traced again at that size (a preset's
    example is one sequence):

    - one sequence per node: Megatron's data parallelism across nodes, one sequence per
      rank, tensor-parallel inside the node (Narayanan et al. 2021's 530B run: dp 9 x
      tp 8 x pp 35 on 315 nodes of 8);
    - without a pipeline, one sequence per device too: plain data parallelism (their 1.7B
      run, dp 32). A pipeline's stages would get few microbatches of that size.

    None where the example covers the nodes already or the search may not trace again
    (``_may_trace_again``); only sizes that divide the global batch."""
    traced = request.traced_batch
    if not _may_trace_again(request) or traced >= stage_mesh.shape[0]:
        return []
    sizes = [stage_mesh.shape[0], stage_mesh.size] if p == 1 else [stage_mesh.shape[0]]
    return sorted(
        {size for size in sizes if size % traced == 0 and request.global_batch % size == 0}
    )


def _schedules(stages: int, layers: int, request: PipelineRequest) -> list[tuple[str, int]]:
    if stages == 1:
        return [("none", 1)]
    names = [request.schedule] if request.schedule else list(SCHEDULES)
    found = []
    for name in names:
        if name == "interleaved" and request.cuts is not None:
            continue  # fixed cuts: one chunk per device
        if name == "interleaved":
            chunks = request.chunks or 2
            if layers % (stages * chunks) == 0 and chunks > 1:
                found.append((name, chunks))
            elif request.schedule == "interleaved":
                raise UsageError(
                    f"interleaved 1F1B with {chunks} chunks per device needs the "
                    f"{layers} layers to divide into {stages} x {chunks} equal "
                    "chunks; choose other stages or chunks"
                )
        else:
            found.append((name, 1))
    return found


def _evaluate(
    costs: LayerCosts,
    solved: Solved,
    stage_mesh: MeshSpec,
    mesh_cost: MeshCost,
    p: int,
    schedule: str,
    chunks: int,
    b: int,
    m: int,
    source: Source,
    request: PipelineRequest,
) -> Candidate | tuple[float, str] | None:
    """A costed configuration, or (memory it needs, what) when it does not fit."""
    buckets = solved.parts.problem.buckets  # the runtime's gradient-sync buckets
    overlap = solved.parts.problem.overlap
    passes = solved.cost.sync_passes
    scale = b / source.batch
    limit = request.solve.memory_limit
    if p == 1:
        # a tied weight's group gathers once a microbatch, for the embedding and the head
        post = without_calls(costs.post, costs.pre.calls.keys() & costs.post.calls.keys())
        parts = [costs.pre, *costs.layers, post]
        # as the intra-op ILP counts it: compute, resharding and parameter gathers per
        # microbatch, less what their prefetch hides; gradient sync once (ZeRO-2: every
        # microbatch), hidden bucket by bucket behind one backward each time
        # (autopar_cost_model.step.exposed_gradient_sync); ZeRO's gathers after the step
        time = chain_time(parts, scale)
        states = sum(part.states for part in parts) - _shared_states(costs)
        # offloaded parameters' working copies in flight are transient like activations
        # and held beside them (0 without): counted with them
        activations = held_activations(parts, 1.0, scale)
        first_sync, first_after = first_calls(parts)
        shared_sync, shared_after = _shared_sync(costs)
        sync = sum(part.sync_s for part in parts) - shared_sync + first_sync
        backward = sum(part.backward_at(scale) for part in parts)
        after = sum(part.step_s for part in parts) - shared_after + first_after
        optimizer = sum(part.optimizer_s for part in parts) - _shared_optimizer(costs)
        step = m * time + _exposed_sync(sync, backward, 0.0, buckets, passes(m), overlap) + after
        step += optimizer
        memory = states + activations
        forward = sum(part.forward_at(scale) for part in parts)
        candidate = Candidate(
            1,
            "none",
            1,
            b,
            m,
            step,
            memory,
            (time,),
            (states,),
            (activations,),
            (forward,),
            (0.0,),
            (0,),
            solved,
            stage_mesh,
            0.0,
            sync,
            source,
            optimizer_s=optimizer,
            stage_compute=(forward + backward,),
            stage_recompute=(sum(part.recompute_s for part in parts) * scale,),
        )
        return candidate if limit is None or memory <= limit else (memory, "no pipeline")
    p2p = _p2p_times(costs, mesh_cost, p, scale, chunks)
    if schedule == "interleaved":
        cut = _interleaved_cut(costs, p, chunks, m, scale, p2p)
    elif request.cuts is not None:
        cut = evaluate_cut(costs, request.cuts, m, schedule, scale, p2p)
    else:
        cut = cut_stages(costs, p, m, schedule, scale, limit, p2p)
        if cut is None:
            # what it would need is asked only when nothing fits (_nothing_fits)
            return (float("inf"), f"{p} stages, {schedule}") if limit is not None else None
    if limit is not None and max(cut.stage_memory) > limit:
        return (max(cut.stage_memory), f"{p} stages, {schedule}")
    # each stage pays the first call of each bucket key its parameters join
    firsts = [first_calls(parts) for parts in _stage_parts(costs, cut, p, chunks)]
    syncs = _stage_values(costs, cut, p, chunks, lambda part: part.sync_s)
    syncs = [sync + first for sync, (first, _) in zip(syncs, firsts, strict=True)]
    afters = _stage_values(costs, cut, p, chunks, lambda part: part.step_s)
    afters = [after + first for after, (_, first) in zip(afters, firsts, strict=True)]
    optimizers = _stage_values(costs, cut, p, chunks, lambda part: part.optimizer_s)
    forwards = _stage_values(costs, cut, p, chunks, lambda part: part.forward_at(scale))
    backwards = _stage_values(costs, cut, p, chunks, lambda part: part.backward_at(scale))
    # what is not compute in T_s (reshards, gathers, hand-offs) the stage waits for
    waits = [t - f - b for t, f, b in zip(cut.stage_times, forwards, backwards, strict=True)]
    shared = mesh_cost.preset.shared_cores
    pipeline = schedule_time(
        schedule, m, chunks, forwards, backwards, waits, shared, mesh_cost.mesh.size // p
    )
    # each stage syncs in its last microbatch's backward; the stages before it are still
    # running theirs (the first stage finishes last), which hides what its own does not
    # after the schedule a tied weight's gradient is summed across the end stages, and the
    # loss broadcast from the last (``autopar_passes.pipeline.ledger``)
    link = mesh_cost.mesh.handoff_axis(p, p - 1)
    tied = mesh_cost.p2p(sent("all_reduce", costs.tied_grad_bytes, 2), link)
    loss = mesh_cost.p2p(4.0, link)
    tails = [
        _exposed_sync(
            sync, backwards[s], sum(backwards[:s]), max(buckets // p, 1), passes(m), overlap
        )
        + afters[s]
        + optimizers[s]
        + (tied if s in (0, p - 1) else 0.0)
        + loss
        for s, sync in enumerate(syncs)
    ]
    last = max(range(p), key=lambda s: tails[s])
    step = pipeline + tails[last]
    terms = [
        _stage_values(costs, cut, p, chunks, lambda part, i=i: part.state_terms[i])  # type: ignore[misc]
        for i in range(3)
    ]
    return Candidate(
        p,
        schedule,
        chunks,
        b,
        m,
        step,
        max(cut.stage_memory),
        cut.stage_times,
        cut.stage_states,
        cut.stage_activations,
        tuple(forwards),
        tuple(p2p),
        cut.first_layers,
        solved,
        stage_mesh,
        max(pipeline - m * max(cut.stage_times), 0.0),
        max(syncs),
        source,
        tuple(zip(*terms, strict=True)),
        optimizers[last],
        tuple(f + b for f, b in zip(forwards, backwards, strict=True)),
        tuple(_stage_values(costs, cut, p, chunks, lambda part: part.recompute_s * scale)),
    )


def _exposed_sync(
    sync: float, backward: float, slack: float, buckets: int, passes: int, overlap: float
) -> float:
    """The gradient sync backward leaves exposed: ``passes`` of ``sync`` each, each hidden
    behind one microbatch's ``backward`` bucket by bucket, the last also by ``slack``
    (compute hiding the share ``overlap`` of what it runs beside)."""
    one = exposed_gradient_sync(sync, backward, buckets, overlap)
    return (passes - 1) * one + max(one - overlap * slack, 0.0)


def _shared_states(costs: LayerCosts) -> float:
    """States counted in both ``pre`` and ``post`` (a tied weight): once without a pipeline."""
    return sum(costs.pre.params[name] for name in costs.pre.params.keys() & costs.post.params)


def _shared_sync(costs: LayerCosts) -> tuple[float, float]:
    """The gradient sync and after-step gathers of the parameters ``pre`` and ``post``
    share: once without a pipeline."""
    shared = costs.pre.sync_of.keys() & costs.post.sync_of.keys()
    return (
        sum(costs.pre.sync_of[name][0] for name in shared),
        sum(costs.pre.sync_of[name][1] for name in shared),
    )


def _shared_optimizer(costs: LayerCosts) -> float:
    """The optimizer's step of the parameters ``pre`` and ``post`` share: once without a
    pipeline."""
    shared = costs.pre.params.keys() & costs.post.params
    return sum(costs.pre.optimizer_of[name] for name in shared)


def _p2p_times(
    costs: LayerCosts, mesh_cost: MeshCost, p: int, scale: float, chunks: int = 1
) -> list[float]:
    """Point-to-point seconds per microbatch of each stage (send forward, receive the
    gradient back) for the widest boundary of the model, each hand-off on the link between
    the two stages (``MeshSpec.handoff_axis`` of the whole mesh, ``mesh_cost``): across
    nodes at a node's edge, inside a node between stages that share one.

    With ``chunks`` (interleaved 1F1B, ``v``) every boundary is crossed ``v`` times, and the
    last stage hands back to the first ``v - 1`` times (chunk ``c p - 1`` to chunk ``c p``),
    a hand-off both end stages pay."""
    widest = max([part.boundary_bytes for part in (costs.pre, *costs.layers)] or [0.0])
    mesh = mesh_cost.mesh

    def one_way(boundary: int) -> float:
        return mesh_cost.p2p(widest * scale, mesh.handoff_axis(p, boundary)) if widest else 0.0

    between = [one_way(s) for s in range(p - 1)]
    wrap = 2 * (chunks - 1) * one_way(p - 1) if chunks > 1 else 0.0
    return [
        chunks * ((2 * between[s - 1] if s > 0 else 0.0) + (2 * between[s] if s < p - 1 else 0.0))
        + (wrap if s in (0, p - 1) else 0.0)
        for s in range(p)
    ]


def _interleaved_cut(
    costs: LayerCosts, p: int, v: int, m: int, scale: float, p2p: list[float]
) -> StageCut:
    """Interleaved 1F1B: ``p v`` equal chunks of layers, chunk ``c`` on device stage ``c % p``
    (Narayanan et al. 2021); the parts before and after the layers on the first and last.
    ``p2p``: each stage's hand-offs per microbatch, all ``v`` rounds and the wrap-around
    (``_p2p_times`` with ``chunks=v``)."""
    per_chunk = len(costs.layers) // (p * v)
    times, memory, states, acts = [], [], [], []
    for s, parts in enumerate(_stage_parts(costs, None, p, v)):
        held = microbatches_in_flight("interleaved", p, s, m, v)
        state = sum(part.states for part in parts)
        act = held_activations(parts, held, scale)
        times.append(chain_time(parts, scale) + p2p[s])
        states.append(state)
        acts.append(act)
        memory.append(state + act)
    firsts = tuple(c * per_chunk for c in range(p * v))
    return StageCut(firsts, tuple(times), tuple(memory), tuple(states), tuple(acts))


def _stage_parts(costs: LayerCosts, cut: StageCut | None, p: int, chunks: int) -> list[list[Part]]:
    """The parts each device stage runs, in the order it runs them (a prefetch chain,
    ``chain_time``): its layers (interleaved, ``chunks`` equal chunks round the stages;
    else ``cut``'s), on the first stage after ``pre``, on the last before ``post``."""
    layers = len(costs.layers)
    stages = []
    for s in range(p):
        if chunks > 1:
            per_chunk = layers // (p * chunks)
            mine = [c * per_chunk + i for c in range(s, p * chunks, p) for i in range(per_chunk)]
        else:
            assert cut is not None, "a cut without chunks"
            first, last = cut.layers_of(s, layers)
            mine = list(range(first, last + 1))
        layers_here: list[Part] = [costs.layers[i] for i in mine]
        stages.append([costs.pre] * (s == 0) + layers_here + [costs.post] * (s == p - 1))
    return stages


def _stage_values(
    costs: LayerCosts, cut: StageCut, p: int, chunks: int, value: object
) -> list[float]:
    return [
        sum(value(part) for part in parts)  # type: ignore[operator]
        for parts in _stage_parts(costs, cut, p, chunks)
    ]


def _nothing_fits(
    mesh: MeshSpec,
    limit: float | None,
    smallest: tuple[float, str] | None,
    errors: list[InfeasiblePlanError],
) -> InfeasiblePlanError:
    if errors:
        # the intra-op solver's account (floor per device, the dominant term) says most
        return errors[0]
    if smallest is None or smallest[0] == float("inf"):
        where = f" (the leanest tried: {smallest[1]})" if smallest else ""
        return InfeasiblePlanError(
            f"no plan fits in {format_bytes(limit or 0)} per device on {mesh.describe()}: no "
            f"cut of the layers into stages keeps every stage within it{where}. What would "
            "help: activation recomputation, more devices, smaller microbatches (smaller "
            "example inputs), a lighter optimizer or precision"
        )
    need, where = smallest
    return InfeasiblePlanError(
        f"no plan fits in {format_bytes(limit or 0)} per device on {mesh.describe()}: the "
        f"leanest configuration tried ({where}) needs {format_bytes(need)} per device. What "
        "would help: activation recomputation, more pipeline stages or devices, smaller "
        "microbatches (smaller example inputs), a lighter optimizer or precision"
    )


def _stage_plan(request: PipelineRequest, candidate: Candidate) -> Plan:
    """The plan of ``candidate``'s intra-op solution on one stage's mesh, at its
    microbatch (no pipeline yet: ``_to_plan`` adds it)."""
    return build_plan(
        candidate.source.traced,
        candidate.solved,
        model=request.model,
        global_batch=request.global_batch,
        microbatch_size=candidate.microbatch_size,
        memory_limit=request.solve.memory_limit,
        mesh=candidate.stage_mesh,
    )


def _to_plan(request: PipelineRequest, best: Candidate, others: list[Candidate]) -> Plan:
    mesh = request.solve.mesh
    traced = best.source.traced
    base = _stage_plan(request, best)
    p, v = best.stages, best.chunks
    layers = traced.layers.count if traced.layers else 0
    container = traced.layers.path if traced.layers else ""
    stages = []
    if p > 1:
        per_stage = mesh.size // p
        for chunk, first in enumerate(best.first_layers):
            last = (
                best.first_layers[chunk + 1] - 1
                if chunk + 1 < len(best.first_layers)
                else layers - 1
            )
            physical = chunk % p
            modules = tuple(
                f"{container}.{i}" if container else str(i) for i in range(first, last + 1)
            )
            if chunk == 0:
                modules = ("(before the layers)", *modules)
            if chunk == len(best.first_layers) - 1:
                modules = (*modules, "(after the layers)")
            ranks = tuple(range(physical * per_stage, (physical + 1) * per_stage))
            stages.append(Stage(index=chunk, layers=(first, last), modules=modules, ranks=ranks))
    estimate = _estimate(base, best, mesh, best.source.batch)
    scale = best.microbatch_size / best.source.batch
    recompute = tuple(
        r.model_copy(
            update={"saved_bytes": r.saved_bytes * scale, "recompute_s": r.recompute_s * scale}
        )
        for r in base.recompute
    )
    parallelism = base.parallelism.model_copy(
        update={"pp": p, "schedule": best.schedule, "microbatches": best.microbatches, "chunks": v}
    )
    # each runner-up labelled by its own stage plan (one per solve, shared by its candidates)
    labels: dict[int, Parallelism] = {id(best.solved): base.parallelism}

    def label(c: Candidate) -> Parallelism:
        if id(c.solved) not in labels:
            labels[id(c.solved)] = _stage_plan(request, c).parallelism
        return labels[id(c.solved)]

    alternatives = tuple(
        Alternative(
            parallelism=label(c).model_copy(
                update=c.describe().model_dump(include={"pp", "microbatches", "schedule", "chunks"})
            ),
            step_time_s=c.step_time_s,
            memory_per_device_bytes=c.memory,
            note=f"microbatch {c.microbatch_size}",
        )
        for c in others
    )
    if p == 1:  # the figures summed over the ledger
        planned = base.model_copy(update={"parallelism": parallelism})
        ledger = step_ledger(traced, planned, batch_scale=scale)
        solved = best.solved
        backward = best.stage_compute[0] - best.stage_forward[0]
        overlap = solved.parts.problem.overlap
        estimate = with_ledger(estimate, ledger, best.microbatches, backward, overlap)
        peak = peak_flops(solved.cost.mesh_cost.preset, solved.cost.compute_dtype) or 1.0
        estimate = estimate.model_copy(
            update={"mfu": mfu(estimate.flops_per_step, estimate.step_time_s, peak, mesh.size)}
        )
    plan = base.model_copy(
        update={
            "mesh": mesh,
            "stage_mesh": best.stage_mesh if p > 1 else None,
            "parallelism": parallelism,
            "stages": tuple(stages),
            "estimate": estimate,
            "alternatives": alternatives,
            "recompute": recompute,
        }
    )
    if p > 1:  # the figures read off the pipeline's ledger
        costs = layer_costs(traced, best.solved)
        cut = StageCut(best.first_layers, best.stage_times, (), (), ())
        compute = list(best.stage_compute)
        backward = [c - f for c, f in zip(best.stage_compute, best.stage_forward, strict=True)]
        optimizers = _stage_values(costs, cut, p, v, lambda part: part.optimizer_s)
        entries = pipeline_ledger(traced, plan, batch_scale=scale)
        estimate = with_pipeline_ledger(
            estimate,
            entries,
            compute,
            backward,
            best.microbatches,
            v,
            optimizers,
            best.solved.parts.problem.overlap,
            best.schedule,
            best.solved.cost.mesh_cost.preset.shared_cores,
            mesh.size // p,
        )
        peak = peak_flops(best.solved.cost.mesh_cost.preset, best.solved.cost.compute_dtype)
        estimate = estimate.model_copy(
            update={
                "mfu": mfu(estimate.flops_per_step, estimate.step_time_s, peak or 1.0, mesh.size)
            }
        )
        plan = plan.model_copy(update={"estimate": estimate})
    if plan.offload.active:
        plan = _with_host(plan, traced, best, scale)
    return plan


def _with_host(plan: Plan, traced: TracedModel, best: Candidate, scale: float) -> Plan:
    """``plan`` with its host side under offload (``autopar_passes.offload_ledger``): the
    host bytes per device, the copies a step makes and their exposed seconds."""
    costs = layer_costs(traced, best.solved)
    p, v = best.stages, best.chunks
    if p > 1:
        cut = StageCut(best.first_layers, best.stage_times, (), (), ())
        stages = _stage_parts(costs, cut, p, v)
    else:
        stages = [[costs.pre, *costs.layers, costs.post]]
    preset = best.solved.cost.mesh_cost.preset
    held, seconds, copies = stage_host(plan, traced, stages, scale, preset)
    estimate = plan.estimate
    per_stage = tuple(
        stage.model_copy(
            update={
                "memory_per_device_bytes": stage.memory_per_device_bytes.model_copy(
                    update={"host": held[stage.stage]}
                )
            }
        )
        for stage in estimate.stages
    )
    # the plan's figures: the busiest stage's
    memory = estimate.memory_per_device_bytes.model_copy(update={"host": max(held)})
    update = {
        "memory_per_device_bytes": memory,
        "stages": per_stage,
        "host": copies,
        "offload_s": max(seconds),
    }
    return plan.model_copy(update={"estimate": estimate.model_copy(update=update)})


def _estimate(base: Plan, best: Candidate, mesh: MeshSpec, traced_batch: int) -> Estimate:
    """The step estimate of the chosen configuration (the base plan's figures assume the
    traced batch and no pipeline)."""
    old = base.estimate
    scale = best.microbatch_size / traced_batch  # base's figures are for the traced batch
    flops = old.flops_per_step * scale
    worst = max(
        range(len(best.stage_times)), key=lambda s: best.stage_states[s] + best.stage_activations[s]
    )
    per_stage = tuple(
        StageEstimate(
            stage=s,
            forward_s=best.stage_forward[s],
            backward_s=max(
                best.stage_times[s] - best.stage_forward[s] - best.stage_handoffs[s], 0.0
            ),
            handoff_s=best.stage_handoffs[s],
            memory_per_device_bytes=MemoryBreakdown(
                params=terms[0],
                grads=terms[1],
                optimizer=terms[2],
                activations=best.stage_activations[s],
                total=best.stage_states[s] + best.stage_activations[s],
            ),
        )
        for s, terms in enumerate(best.stage_state_terms)
    )
    if per_stage:
        memory = per_stage[worst].memory_per_device_bytes
    else:  # no pipeline: the base plan's split of the candidate's states
        states = best.stage_states[0]
        known = old.memory_per_device_bytes
        share = states / max(known.params + known.grads + known.optimizer, 1.0)
        memory = MemoryBreakdown(
            params=known.params * share,
            grads=known.grads * share,
            optimizer=known.optimizer * share,
            activations=best.stage_activations[0],
            total=states + best.stage_activations[0],
        )
    peak = peak_flops(best.solved.cost.mesh_cost.preset, best.solved.cost.compute_dtype) or 1.0
    # the stage that sets the pace (the slowest; the only one without a pipeline): its
    # recomputation apart from its compute, which the candidate's times include. The
    # exposed communication is what is left, and the ledger's replaces it (``with_ledger``:
    # counted in compute_s but not apart, recomputation had left the step with the
    # exposed figure it was mistaken for, llama3-8b on 1x8 4.4 s under its plan). The
    # regions' own figures sum every stage's (each runs its own layers'): 1,211 s for a
    # 35-stage 530B step of 185 s.
    pace = max(range(best.stages), key=lambda s: best.stage_times[s])
    recompute = best.microbatches * best.stage_recompute[pace]
    compute = (
        best.microbatches * max(best.stage_times)
        if best.stages > 1
        else best.microbatches * best.stage_compute[0]
    ) - recompute
    return old.model_copy(
        update={
            "step_time_s": best.step_time_s,
            "flops_per_step": flops,
            "recompute_s": recompute,
            "mfu": mfu(flops, best.step_time_s, peak, mesh.size),
            "memory_per_device_bytes": memory,
            "bubble_s": best.bubble_s,
            "compute_s": compute,
            "optimizer_s": best.optimizer_s,
            "exposed_comm_s": max(
                best.step_time_s - compute - recompute - best.bubble_s - best.optimizer_s, 0.0
            ),
            "stages": per_stage,
        }
    )
