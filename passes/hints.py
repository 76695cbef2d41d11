"""Hints on a traced model: checked against it, then turned into the solver's constraints.

Reads a ``autopar_plans.Hints`` (the file, validated), the ``TracedModel`` and the mesh; writes a
``ResolvedHints``: every hint matched to the nodes it constrains, and

- ``constraints(base)``: a constraints factory for ``SolveRequest`` (``autopar_passes.solve``).
  Every layout and ban is a predicate ``(node, choices, strategy) -> bool``, so the ILP sets
  ``s[d, k] = 0`` for what a hint forbids and completes the rest of the plan around it;
  nothing is edited after solving;
- ``apply(request)``: a ``PipelineRequest`` with the constraints, the memory limit and the
  fixed parts of the pipeline search (stages, schedule, microbatches, chunks, cuts);
- ``plan(traced, request)``: ``plan_pipeline`` on that request; when nothing is feasible,
  the error names a minimal set of conflicting hints (``find_conflict``).

**Matching** (``docs/hints.md``). A ``shard``/``replicate`` glob is matched against parameter
names first (every name of a tied parameter). A glob that matches no parameter is matched
against module paths; it then constrains the module's *output*: each tensor a node inside
the module hands to a node outside it, where ``null`` also admits a pending sum
(``Partial``: a row-parallel projection's output, reduced where it is read whole). A spec may
be shorter than the tensor's dims (the
rest are ``null``), never longer. Identical layers share one decision in the ILP
(``autopar_passes.layer_sharing``), so a hint on ``layers.0`` binds every layer identical to it.

**Meshes of more than two axes** are solved as 2-d groupings (``autopar_passes.solve.group_axes``):
an axis group behaves as one axis, so a layout holds on a grouping only when it places every
(non-trivial) member of a group alike; on a grouping where it cannot hold, the hint's nodes
have no allowed choice and that grouping is infeasible. A ban on an axis applies to its
group. On an axis of size 1 (an axis a pipeline takes whole, inside a stage) sharding and
replicating are the same, and bans there are moot.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from autopar_passes.annotation import META_KEY, NodeAnnotation
from autopar_passes.decisions import Decisions, group_decisions
from autopar_passes.layer_sharing import traced_representatives
from autopar_passes.pipeline.search import PipelineRequest, plan_pipeline
from autopar_passes.plan_build import MATMULS, is_residual_add
from autopar_passes.recompute import RecomputeHint
from autopar_passes.solve import Constraint, Constraints, group_axes, grouped_mesh, no_constraints
from autopar_passes.strategies.graph import NodeChoices, tensor_inputs, traced_choices
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel
from autopar_plans.errors import HintError, InfeasiblePlanError, UsageError
from autopar_plans.hints import (
    Hint,
    HintConflictError,
    Hints,
    closest_names,
    name_matches,
)
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout, Partial, Replicate, Shard, layout_from_spec
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes

EMBEDDINGS = {"aten.embedding.default"}
# the hints that constrain the plan; a conflict is a set of these
CONSTRAINING = (
    "shard",
    "replicate",
    "ban",
    "memory_limit",
    "pipeline",
    "recompute",
    "no_recompute",
)


@dataclass(frozen=True)
class Target:
    """One tensor a ``shard``/``replicate`` hint fixes: output ``index`` of ``node``, in
    ``layout`` on the user's mesh. ``label`` names it for messages. A module's output may
    also be a pending sum (``Partial``) where the spec says ``null`` (``partial_ok``)."""

    node: str
    index: int
    layout: Layout
    label: str
    partial_ok: bool = False


@dataclass(frozen=True)
class WeightedOp:
    """A matmul or embedding with a parameter operand: which tensor inputs are weights, and
    for each activation input the dims that hold tokens (batch, sequence)."""

    weights: tuple[int, ...]
    activations: tuple[tuple[int, frozenset[int]], ...]


@dataclass
class ResolvedHints:
    """Hints checked against one traced model and mesh (``resolve_hints``)."""

    hints: Hints
    mesh: MeshSpec
    targets: dict[Hint, list[Target]]
    weighted: dict[str, WeightedOp]
    layers: int
    recompute: dict[Hint, list[str]] = field(default_factory=dict)  # hint -> module paths

    @property
    def items(self) -> list[Hint]:
        """The hints that constrain the plan, in file order."""
        return [h for h in self.hints.items() if h.kind in CONSTRAINING]

    def constraints(
        self, base: Constraints = no_constraints, keep: Collection[Hint] | None = None
    ) -> Constraints:
        """The factory ``SolveRequest.constraints`` takes: ``base``'s constraints plus one per
        kept hint (all by default), made for the mesh the ILP is solved on."""
        kept = self.items if keep is None else [h for h in self.items if h in keep]
        return partial(_constraints_on, self, tuple(kept), base)

    def apply(
        self, request: PipelineRequest, keep: Collection[Hint] | None = None
    ) -> PipelineRequest:
        """``request`` with the kept hints (all by default): constraints, memory limit,
        pipeline. Values the hints do not fix stay as the request has them."""
        kept = self.items if keep is None else [h for h in self.items if h in keep]
        solve = replace(
            request.solve, constraints=self.constraints(request.solve.constraints, kept)
        )
        kinds = {h.kind for h in kept}
        recompute = tuple(
            RecomputeHint(tuple(self.recompute[h]), h.kind == "recompute", str(h))
            for h in kept
            if h.kind in ("recompute", "no_recompute")
        )
        if recompute:
            solve = replace(solve, recompute_hints=recompute)
        if "memory_limit" in kinds:
            solve = replace(solve, memory_limit=self.hints.memory_limit_bytes)
        request = replace(request, solve=solve)
        pipeline = self.hints.pipeline
        if "pipeline" in kinds and pipeline is not None:
            request = replace(
                request,
                stages=pipeline.stage_count or request.stages,
                schedule=pipeline.schedule or request.schedule,
                microbatches=pipeline.microbatches or request.microbatches,
                chunks=pipeline.chunks or request.chunks,
                cuts=pipeline.cuts,
            )
        return request

    def plan(self, traced: TracedModel, request: PipelineRequest) -> Plan:
        """Plan with every hint applied; infeasible hints are named (``find_conflict``).

        Hints that leave some node no strategy are found before any solving (cheap: the
        strategies alone); a conflict with the memory limit only when the search fails.
        """
        self._check_batch(request)
        structure = _Structure(self, traced, request)
        if any(h.kind in ("shard", "replicate", "ban") for h in self.items) and not (
            structure.feasible(self.items)
        ):
            raise find_conflict(self, traced, request, None, structure)
        try:
            return plan_pipeline(traced, self.apply(request))
        except InfeasiblePlanError as error:
            raise find_conflict(self, traced, request, error, structure) from None

    def _check_batch(self, request: PipelineRequest) -> None:
        pipeline = self.hints.pipeline
        if pipeline is None or pipeline.microbatches is None:
            return
        m, total, traced = pipeline.microbatches, request.global_batch, request.traced_batch
        where = self.hints.where("pipeline", "microbatches")
        if total % m:
            raise HintError(
                f"{where}: {m} microbatches do not divide the global batch of {total}; pick "
                f"a divisor of {total} (or pass another global_batch)"
            )
        if total // m > traced or traced % (total // m):
            raise HintError(
                f"{where}: {m} microbatches of {total // m} from a global batch of {total}: "
                f"the example inputs' batch ({traced}) must be a multiple of the microbatch"
            )


def resolve_hints(hints: Hints, traced: TracedModel, mesh: MeshSpec) -> ResolvedHints:
    """Check every hint against the traced model and the mesh; ``HintError`` names the file,
    line and hint, with the closest real names for a name that matches nothing."""
    _check_mesh(hints, mesh)
    layers = traced.layers.count if traced.layers else 0
    _check_pipeline(hints, mesh, layers)
    names = _param_names(traced)
    modules = _module_paths(traced)
    resolved = ResolvedHints(hints, mesh, {}, _weighted_ops(traced), layers)
    # a layout divides a stage's mesh, where the hints fix the stages: with 35 stages on 315
    # nodes, "node" spans the 9 nodes of a stage
    stages = hints.pipeline.stage_count if hints.pipeline is not None else None
    stage_mesh = (mesh.stage_mesh(stages) if stages else None) or mesh
    for hint in hints.items():
        if hint.kind in ("shard", "replicate"):
            resolved.targets[hint] = _targets(hint, traced, stage_mesh, names, modules)
        elif hint.kind == "ban":
            _check_axis(hint, hint.pattern, mesh)
        elif hint.kind in ("recompute", "no_recompute"):
            matched = sorted(m for m in modules if name_matches(hint.pattern, m))
            if not matched:
                raise HintError(_no_match(hint, "module", modules))
            resolved.recompute[hint] = matched
    return resolved


# ---- checking -----------------------------------------------------------------------------


def _check_mesh(hints: Hints, mesh: MeshSpec) -> None:
    if hints.mesh is None:
        return
    if hints.mesh.shape is not None and tuple(hints.mesh.shape) != mesh.shape:
        raise HintError(
            f"{hints.where('mesh', 'shape')}: the hints are for a mesh of shape "
            f"{list(hints.mesh.shape)}, but the mesh is {list(mesh.shape)} "
            f"({mesh.describe()})"
        )
    if hints.mesh.axes is not None and tuple(hints.mesh.axes) != mesh.axis_names:
        raise HintError(
            f"{hints.where('mesh', 'axes')}: the hints name the mesh axes "
            f"{list(hints.mesh.axes)}, but the mesh's are {list(mesh.axis_names)}"
        )


def _check_axis(hint: Hint, axis: str, mesh: MeshSpec) -> None:
    if axis not in mesh.axis_names:
        close = closest_names(axis, mesh.axis_names, 1)
        guess = f"; did you mean {close[0]}?" if close else ""
        raise HintError(
            f"{hint}: unknown mesh axis {axis!r}{guess} (the mesh's axes are "
            f"{', '.join(mesh.axis_names)})"
        )


def _check_pipeline(hints: Hints, mesh: MeshSpec, layers: int) -> None:
    pipeline = hints.pipeline
    if pipeline is None:
        return
    stages = pipeline.stage_count
    if stages is not None and stages > 1:
        key = "stages" if pipeline.stages is not None else "cuts"
        where = hints.where("pipeline", key)
        if layers == 0:
            raise HintError(f"{where}: the model has no repeated layers to cut into stages")
        if stages > layers:
            raise HintError(
                f"{where}: {stages} pipeline stages but the model has {layers} layers; use at "
                "most one stage per layer"
            )
        if mesh.stage_mesh(stages) is None:
            raise HintError(f"{where}: {mesh.no_stage_cut(stages, layers)}")
    if pipeline.cuts is not None and pipeline.cuts[-1] >= layers:
        raise HintError(
            f"{hints.where('pipeline', 'cuts')}: cut at layer {pipeline.cuts[-1]}, but the "
            f"model's layers are 0..{layers - 1}"
        )
    if pipeline.schedule == "interleaved" and stages:
        chunks = pipeline.chunks or 2
        if layers % (stages * chunks):
            raise HintError(
                f"{hints.where('pipeline', 'chunks' if pipeline.chunks else 'schedule')}: "
                f"interleaved 1F1B with {chunks} chunks per device needs the {layers} layers "
                f"to divide into {stages} x {chunks} equal chunks"
            )


def _param_names(traced: TracedModel) -> dict[str, str]:
    """Every name of every parameter (tied weights have several) -> its first name."""
    names: dict[str, str] = {}
    for name, info in traced.params.items():
        names[name] = name
        for alias in info.aliases:
            names[alias] = name
    return names


def _module_paths(traced: TracedModel) -> set[str]:
    """The module paths of the graph's nodes and every module that contains them."""
    paths: set[str] = set()
    for node in traced.graph.nodes:
        module = node.meta[META_KEY].module
        parts = module.split(".") if module else []
        for end in range(1, len(parts) + 1):
            paths.add(".".join(parts[:end]))
    return paths


def _no_match(hint: Hint, what: str, names: Iterable[str]) -> str:
    close = closest_names(hint.pattern, names)
    guess = f"; closest: {', '.join(close)}" if close else ""
    return f"{hint}: matches no {what}{guess}"


def _targets(
    hint: Hint,
    traced: TracedModel,
    mesh: MeshSpec,
    names: dict[str, str],
    modules: set[str],
) -> list[Target]:
    """The tensors a shard/replicate hint fixes, each checked: dims, axes, divisibility."""
    params = sorted({first for name, first in names.items() if name_matches(hint.pattern, name)})
    spec = list(hint.spec)
    targets: list[Target] = []
    if params:
        for name in params:
            info = traced.params[name]
            layout = _layout(hint, spec, info.shape, name, mesh)
            targets.extend(Target(node, 0, layout, name) for node in info.nodes)
        return targets
    matched = sorted(m for m in modules if name_matches(hint.pattern, m))
    if not matched:
        raise HintError(_no_match(hint, "parameter or module", [*names, *modules]))
    for module in matched:
        for node, index, note in _module_outputs(traced, module):
            label = f"the output of {module} ({node})"
            layout = _layout(hint, spec, note.outputs[index].shape, label, mesh)
            targets.append(Target(node, index, layout, label, partial_ok=True))
        if not targets:
            raise HintError(f"{hint}: module {module} hands no tensor to the rest of the model")
    return targets


def _layout(hint: Hint, spec: list, shape: Sequence[int], what: str, mesh: MeshSpec) -> Layout:
    """The hint's spec as a layout for a tensor of ``shape``, or a HintError saying why not."""
    if len(spec) > len(shape):
        raise HintError(
            f"{hint}: the spec has {len(spec)} entries but {what} has {len(shape)} dim"
            f"{'s' if len(shape) != 1 else ''} (shape {list(shape)}): dim {len(shape)} is "
            "out of range"
        )
    for entry in spec:
        for axis in [entry] if isinstance(entry, str) else entry or []:
            _check_axis(hint, axis, mesh)
    padded = spec + [None] * (len(shape) - len(spec))
    try:
        layout = layout_from_spec(padded, mesh.axis_names)
    except UsageError as error:
        raise HintError(f"{hint}: {error}") from None
    for dim, axes in layout.sharded_dims().items():
        pieces = 1
        for axis in axes:
            pieces *= mesh.shape[axis]
        if shape[dim] % pieces:
            over = " x ".join(f"{mesh.axis_names[a]} ({mesh.shape[a]})" for a in axes)
            raise HintError(
                f"{hint}: dim {dim} of {what} (shape {list(shape)}) has size {shape[dim]}, "
                f"which {over} does not divide into {pieces} equal pieces"
            )
    return layout


def _module_outputs(traced: TracedModel, module: str) -> list[tuple[str, int, NodeAnnotation]]:
    """(node, output index, annotation) of each tensor the module hands outside itself; a
    ``getitem`` is given as the output of the node it reads."""
    prefix = module + "."
    inside: set[str] = set()
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        if note.kind in ("op", "view") and (
            note.module == module or note.module.startswith(prefix)
        ):
            inside.add(node.name)
    found = []
    for node in traced.graph.nodes:
        if node.name not in inside or not any(u.name not in inside for u in node.users):
            continue
        note = node.meta[META_KEY]
        if not note.outputs:
            continue
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            parent = node.args[0]
            found.append((parent.name, int(node.args[1]), parent.meta[META_KEY]))
        elif len(note.outputs) == 1:
            found.append((node.name, 0, note))
    return found


def _weighted_ops(traced: TracedModel) -> dict[str, WeightedOp]:
    """Matmuls and embeddings with a parameter operand: the ops the bans speak about.

    An input is a weight when it is read from a parameter through free single-input ops
    (views, transposes, casts); an activation's token dims are all but its last for a
    matmul, all of them for an embedding's indices.
    """
    from_param: set[str] = set()
    found: dict[str, WeightedOp] = {}
    notes = traced.annotations()
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        inputs = tensor_inputs(node)
        if note.kind == "param":
            from_param.add(node.name)
            continue
        free = note.kind == "view" or (note.kind == "op" and note.fwd_flops == 0)
        if free and len(inputs) == 1 and inputs[0].producer in from_param:
            from_param.add(node.name)
            continue
        if note.op not in MATMULS and note.op not in EMBEDDINGS:
            continue
        weights = tuple(i for i, s in enumerate(inputs) if s.producer in from_param)
        if not weights or len(weights) == len(inputs):
            continue
        activations = []
        for i, source in enumerate(inputs):
            if i in weights:
                continue
            ndim = len(notes[source.producer].outputs[source.index].shape)
            tokens = range(ndim) if note.op in EMBEDDINGS else range(max(ndim - 1, 0))
            activations.append((i, frozenset(tokens)))
        found[node.name] = WeightedOp(weights, tuple(activations))
    return found


# ---- constraints ----------------------------------------------------------------------------


def _constraints_on(
    resolved: ResolvedHints,
    kept: tuple[Hint, ...],
    base: Constraints,
    mesh: MeshSpec,
) -> list[Constraint]:
    """The constraints of the kept hints on ``mesh`` (the user's mesh, one stage of it, or a
    grouping of either), after ``base``'s own."""
    groups = _groups_of(mesh, resolved.mesh)
    return [*base(mesh), *(hint_constraint(resolved, hint, mesh, groups) for hint in kept)]


def hint_constraint(
    resolved: ResolvedHints,
    hint: Hint,
    mesh: MeshSpec,
    groups: tuple[tuple[int, ...], ...],
) -> Constraint:
    """One hint as a predicate on (node, choices, strategy) for the ILP on ``mesh``, whose
    axis ``i`` stands for the user's axes ``groups[i]``."""
    if hint.kind in ("shard", "replicate"):
        wanted: dict[str, list[tuple[int, Layout | None, bool]]] = {}
        for target in resolved.targets[hint]:
            layout = _collapse(target.layout, groups, resolved.mesh.shape)
            wanted.setdefault(target.node, []).append((target.index, layout, target.partial_ok))

        def layout_rule(node: str, choices: NodeChoices, strategy: Strategy) -> bool:
            for index, layout, partial_ok in wanted.get(node, ()):
                if layout is None:  # the layout treats the axes of a group differently
                    return False
                if not _same(strategy.outputs[index], layout, mesh.shape, partial_ok):
                    return False
            return True

        return layout_rule
    if hint.kind == "ban":
        user_axis = resolved.mesh.axis_names.index(hint.pattern)
        axis = next(i for i, g in enumerate(groups) if user_axis in g)
        if mesh.shape[axis] == 1:
            return _allow_all
        return partial(_ban_rule, hint.ban, axis, resolved.weighted)
    return _allow_all  # memory_limit and pipeline act on the request, not on nodes


def _allow_all(node: str, choices: NodeChoices, strategy: Strategy) -> bool:
    return True


def _ban_rule(
    kind: str,
    axis: int,
    weighted: dict[str, WeightedOp],
    node: str,
    choices: NodeChoices,
    strategy: Strategy,
) -> bool:
    """Whether ``strategy`` is free of the banned kind of parallelism on ``axis`` (the
    predicates of ``autopar_plans.hints.BAN_KINDS``)."""
    if kind == "fsdp":
        return choices.kind != "param" or not isinstance(strategy.outputs[0][axis], Shard)
    if kind == "sequence_parallel":
        out = strategy.outputs[0][axis] if strategy.outputs else None
        return not (is_residual_add(choices) and isinstance(out, Shard) and out.dim == 1)
    op = weighted.get(node)
    if op is None or not strategy.inputs:
        return True
    tokens_split = any(
        isinstance(p := strategy.inputs[i][axis], Shard) and p.dim in dims
        for i, dims in op.activations
    )
    if kind == "data_parallel":
        return not tokens_split
    # a partial weight (a shard padded with zeros) is a split weight too: each device
    # multiplies by its slice, and the outputs are summed
    weight_split = any(isinstance(strategy.inputs[i][axis], Shard | Partial) for i in op.weights)
    return not (weight_split and not tokens_split)  # tensor_parallel


def _groups_of(mesh: MeshSpec, user: MeshSpec) -> tuple[tuple[int, ...], ...]:
    """Which of the user's axes each axis of ``mesh`` stands for: ``mesh`` is the user's
    mesh, one pipeline stage of it (same names), or a grouping of either (names joined
    with ``_``, ``autopar_passes.solve.grouped_mesh``)."""
    names = user.axis_names
    if mesh.axis_names == names:
        return tuple((a,) for a in range(len(names)))
    for cuts in range(1 << (len(names) - 1)):
        groups: list[list[int]] = [[0]]
        for axis in range(1, len(names)):
            if cuts >> (axis - 1) & 1:
                groups.append([axis])
            else:
                groups[-1].append(axis)
        joined = tuple("_".join(names[a] for a in g) for g in groups)
        if joined == mesh.axis_names:
            return tuple(tuple(g) for g in groups)
    raise UsageError(
        f"hints for a mesh with axes {list(names)} cannot be applied on one with "
        f"axes {list(mesh.axis_names)}"
    )


def _collapse(
    layout: Layout, groups: tuple[tuple[int, ...], ...], user_shape: tuple[int, ...]
) -> Layout | None:
    """A layout on the user's axes as one on grouped axes, or None when the (non-trivial)
    axes of a group are placed differently."""
    if all(len(g) == 1 for g in groups):
        return layout
    placements = []
    for group in groups:
        members = [layout[a] for a in group if user_shape[a] > 1] or [layout[group[0]]]
        if any(m != members[0] for m in members):
            return None
        placements.append(members[0])
    return Layout(*placements)


def _same(have: Layout, want: Layout, shape: tuple[int, ...], partial_ok: bool) -> bool:
    """Equal layouts, where an axis of size 1 places nothing (any placement will do) and,
    with ``partial_ok``, a pending sum counts as not split (the consumer reduces it)."""
    return all(
        h == w or size == 1 or (partial_ok and isinstance(h, Partial) and isinstance(w, Replicate))
        for h, w, size in zip(have, want, shape, strict=True)
    )


# ---- conflicts ----------------------------------------------------------------------------


def find_conflict(
    resolved: ResolvedHints,
    traced: TracedModel,
    request: PipelineRequest,
    error: InfeasiblePlanError | None,
    structure: _Structure | None = None,
) -> InfeasiblePlanError:
    """The error to raise when the hinted problem has no plan: a ``HintConflictError``
    naming a minimal set of hints that cannot hold together, or ``error`` itself when the
    problem has no plan even without the hints.

    Deletion filter: start from every constraining hint; drop each in turn and keep it
    dropped when the rest is still infeasible. What is left is minimal: without any one of
    its hints, a plan exists. Feasibility is first asked of the ILP's choices alone (a node
    that the hints leave no strategy: no solving needed); when every node keeps a choice,
    the conflict is with the memory limit and each test is a re-plan (the memory limit
    alone is tried first: it is the usual culprit, and one re-plan then settles it).
    """
    hints = resolved.items
    structure = structure or _Structure(resolved, traced, request)
    if hints and not structure.feasible(hints):
        core = _deletion_filter(hints, lambda kept: not structure.feasible(kept))
        return HintConflictError(_conflict_message(core, structure.why(core), request))
    assert error is not None
    if not hints:
        return error

    def infeasible(kept: Sequence[Hint]) -> bool:
        try:
            plan_pipeline(traced, resolved.apply(request, kept))
        except InfeasiblePlanError:
            return True
        return False

    if infeasible([]):
        return error
    limits = [h for h in hints if h.kind == "memory_limit"]
    core = limits if limits and infeasible(limits) else _deletion_filter(hints, infeasible)
    limit = resolved.apply(request, core).solve.memory_limit
    why = (
        f"with {'it' if len(core) == 1 else 'them'} no plan fits the memory limit of "
        f"{format_bytes(limit)} per device"
        if limit
        else "no plan satisfies them"
    )
    return HintConflictError(_conflict_message(core, f"{why}: {error}", request))


def _deletion_filter(
    hints: Sequence[Hint], infeasible: Callable[[Sequence[Hint]], bool]
) -> list[Hint]:
    core = list(hints)
    for hint in list(hints):
        trial = [h for h in core if h != hint]
        if infeasible(trial):
            core = trial
    return core


def _conflict_message(core: Sequence[Hint], why: str, request: PipelineRequest) -> str:
    forced = request.solve.constraints is not no_constraints
    lines = "\n".join(f"  {hint}" for hint in core)
    if len(core) == 1:
        head = "this hint cannot hold"
        head += " with the forced parallel style" if forced else ""
    else:
        head = "these hints conflict (without any one of them a plan exists)"
        head += ", with the forced parallel style" if forced else ""
    return f"{head}:\n{lines}\n{why}"


class _Structure:
    """Which choices each hint forbids, per solve mesh that ``plan_pipeline`` would try;
    a set of hints is structurally feasible when, on some mesh, every decision keeps one."""

    def __init__(self, resolved: ResolvedHints, traced: TracedModel, request: PipelineRequest):
        self.resolved = resolved
        self.traced = traced
        self.request = request
        self.contexts: dict[int, list[_Context]] = {}

    def feasible(self, kept: Sequence[Hint]) -> bool:
        return any(c.blocked(kept) is None for c in self._contexts(kept))

    def why(self, core: Sequence[Hint]) -> str:
        """Which tensors the hints leave without a layout, on the first mesh tried."""
        context = self._contexts(core)[0]
        blocked = context.blocked(core) or []
        shown = [context.describe(d) for d in blocked[:3]]
        more = f" and {len(blocked) - 3} more" if len(blocked) > 3 else ""
        return "no layout satisfies them for " + "; ".join(shown) + more

    def _contexts(self, kept: Sequence[Hint]) -> list[_Context]:
        request = self.resolved.apply(self.request, kept)
        layers = self.resolved.layers
        mesh = request.solve.mesh
        counts = [request.stages] if request.stages is not None else mesh.stage_counts(layers)
        found = []
        for p in counts:
            if p not in self.contexts:
                stage = mesh.stage_mesh(p)
                assert stage is not None, "hinted stage counts are checked (_check_pipeline)"
                self.contexts[p] = [
                    _Context(self, grouped_mesh(stage, groups)) for groups in group_axes(stage)
                ]
            found.extend(self.contexts[p])
        return found


class _Context:
    """One solve mesh: its decisions, and the choices each hint forbids there."""

    def __init__(self, structure: _Structure, mesh: MeshSpec) -> None:
        self.structure = structure
        self.mesh = mesh
        traced = structure.traced
        choices, _ = traced_choices(traced, mesh.shape)
        representatives = traced_representatives(traced)
        tied = {n: info.nodes[0] for info in traced.params.values() for n in info.nodes[1:]}
        self.decisions: Decisions = group_decisions(choices, representatives, tied)
        self.groups = _groups_of(mesh, structure.resolved.mesh)
        self.forbidden: dict[Hint, dict[str, set[int]]] = {}
        self.base = self._forbid(structure.request.solve.constraints(mesh), None)

    def blocked(self, kept: Sequence[Hint]) -> list[str] | None:
        """The decisions left without a choice by ``kept`` (and the base constraints)."""
        union: dict[str, set[int]] = {d: set(ks) for d, ks in self.base.items()}
        for hint in kept:
            for decision, ks in self._of(hint).items():
                union.setdefault(decision, set()).update(ks)
        empty = sorted(  # sorted: the message reads the same on every run
            d for d, ks in union.items() if len(ks) >= len(self.decisions.decisions[d].strategies)
        )
        return empty or None

    def describe(self, decision: str) -> str:
        """A decision in the user's words: a parameter name, or an op and its module."""
        members = self.decisions.decisions[decision].members
        note = self.decisions.choices[decision].note
        what = decision
        if note is not None and note.param:
            what = note.param
        elif note is not None and note.module:
            what = f"{decision} ({note.op} in {note.module})"
        if len(members) > 1:
            what += f", shared by {len(members)} identical layers"
        return what

    def _of(self, hint: Hint) -> dict[str, set[int]]:
        if hint not in self.forbidden:
            rule = hint_constraint(self.structure.resolved, hint, self.mesh, self.groups)
            nodes = (
                {t.node for t in self.structure.resolved.targets[hint]}
                if hint.kind in ("shard", "replicate")
                else None
            )
            self.forbidden[hint] = self._forbid([rule], nodes)
        return self.forbidden[hint]

    def _forbid(self, rules: Sequence[Constraint], nodes: set[str] | None) -> dict[str, set[int]]:
        return forbidden_choices(self.decisions, rules, nodes)


def forbidden_choices(
    decisions: Decisions, rules: Sequence[Constraint], nodes: Iterable[str] | None = None
) -> dict[str, set[int]]:
    """Decision -> the choices that some bound node's rule rejects (the complement of
    ``autopar_passes.solve.allowed_choices`` for one set of rules); ``nodes`` limits the nodes
    asked (the ones a layout hint names)."""
    found: dict[str, set[int]] = {}
    if not rules:
        return found
    names = decisions.bindings if nodes is None else nodes
    for node in names:
        binding = decisions.bindings.get(node)
        if binding is None or binding.source is not None:
            continue
        choices = decisions.choices[node]
        count = len(decisions.decisions[binding.decision].strategies)
        for k in range(count):
            strategy = decisions.strategy(node, k)
            if not all(rule(node, choices, strategy) for rule in rules):
                found.setdefault(binding.decision, set()).add(k)
    return found


def hint_rules(
    resolved: ResolvedHints, mesh: MeshSpec
) -> dict[Hint, tuple[Constraint, set[str] | None]]:
    """Each constraining hint's rule on ``mesh`` (the user's, a stage's, or a grouping), with
    the nodes it can reject (None: any node), for ``autopar explain``."""
    groups = _groups_of(mesh, resolved.mesh)
    rules = {}
    for hint in resolved.items:
        if hint.kind not in ("shard", "replicate", "ban"):
            continue
        nodes = (
            {t.node for t in resolved.targets[hint]}
            if hint.kind in ("shard", "replicate")
            else None
        )
        rules[hint] = (hint_constraint(resolved, hint, mesh, groups), nodes)
    return rules
