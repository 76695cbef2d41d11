"""Hints for ``autopar.plan`` and ``autopar.compile``: the one function the API calls.

``apply_hints(hints, traced, mesh, options)`` reads the hint file, checks every hint against
the traced model and the mesh (``autopar_passes.hints``) and against the options given next to it,
and returns a ``HintedPlanner`` whose ``plan(traced, request)`` runs the pipeline search
with the hints as constraints, naming the conflicting hints when no plan satisfies them.
With ``hints=None`` it is ``plan_pipeline`` itself, so the API calls it unconditionally::

    hinted = apply_hints(options.hints, traced, mesh, options)    # after trace()
    ...                                                            # request built as before
    result = hinted.plan(traced, pipeline)                         # not plan_pipeline(...)

An option and a hint that set the same thing (``memory_limit=``, ``stages=``, ...) must
agree; a hint file never silently loses to an argument, nor the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.options import PlanOptions
from autopar_passes.hints import ResolvedHints, resolve_hints
from autopar_passes.pipeline.search import PipelineRequest, plan_pipeline
from autopar_passes.trace import TracedModel
from autopar_plans.errors import HintError
from autopar_plans.hints import Hints, as_hints
from autopar_plans.mesh import MeshSpec
from autopar_plans.offload import offload_request
from autopar_plans.plan import Plan
from autopar_plans.units import parse_bytes

HintsLike = str | Path | Mapping[str, Any] | Hints


@dataclass(frozen=True)
class HintedPlanner:
    """The pipeline search with the hints applied (``resolved`` is None without hints)."""

    resolved: ResolvedHints | None

    def plan(self, traced: TracedModel, request: PipelineRequest) -> Plan:
        if self.resolved is None:
            return plan_pipeline(traced, request)
        return self.resolved.plan(traced, request)


def apply_hints(
    hints: HintsLike | None, traced: TracedModel, mesh: MeshSpec, options: PlanOptions
) -> HintedPlanner:
    """Check ``hints`` against the model, the mesh and ``options``; ``HintError`` names the
    file, line and hint of anything that does not fit."""
    if hints is None:
        return HintedPlanner(None)
    loaded = as_hints(hints)
    resolved = resolve_hints(loaded, traced, mesh)
    _check_options(loaded, options)
    return HintedPlanner(resolved)


def options_with_hints(options: PlanOptions) -> PlanOptions:
    """``options`` with what the hint file sets that is an option, not a constraint (the
    gradient compression), and the file loaded once; a hint and an option for the same
    thing must agree."""
    if options.hints is None:
        return options
    loaded = as_hints(options.hints)
    update: dict[str, object] = {"hints": loaded}
    hinted = loaded.grad_compression
    if hinted is not None:
        given = options.grad_reduction().compression
        if options.grad_compression is not None and given != hinted:
            raise HintError(
                f"{loaded.where('grad_compression')}: grad_compression {hinted.scheme!r}, but "
                f"grad_compression={options.grad_compression!r} was passed too; keep one"
            )
        update["grad_compression"] = hinted.model_dump()
    if loaded.offload is not None:
        wanted = offload_request(loaded.offload)
        if options.offload is not None and options.offload_request() != wanted:
            raise HintError(
                f"{loaded.where('offload')}: offload {loaded.offload!r}, but "
                f"offload={options.offload!r} was passed too; keep one"
            )
        update["offload"] = loaded.offload
    return options.model_copy(update=update)


def _check_options(hints: Hints, options: PlanOptions) -> None:
    """An option and a hint for the same thing must agree."""
    if hints.memory_limit is not None and options.memory_limit is not None:
        given = parse_bytes(options.memory_limit)
        if given != hints.memory_limit_bytes:
            raise HintError(
                f"{hints.where('memory_limit')}: memory_limit {hints.memory_limit}, but "
                f"memory_limit={options.memory_limit!r} was passed too; keep one of them"
            )
    pipeline = hints.pipeline
    if pipeline is None:
        return
    pairs = (
        ("stages", pipeline.stage_count, options.stages),
        ("schedule", pipeline.schedule, options.schedule),
        ("microbatches", pipeline.microbatches, options.microbatches),
        ("chunks", pipeline.chunks, options.chunks),
    )
    for name, hinted, given in pairs:
        if hinted is not None and given is not None and hinted != given:
            key = "cuts" if name == "stages" and pipeline.stages is None else name
            raise HintError(
                f"{hints.where('pipeline', key)}: pipeline {name} {hinted}, but {name}="
                f"{given!r} was passed too; keep one of them"
            )
