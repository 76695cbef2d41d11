"""Checking a plan before anything reads its layouts: the plan against itself, then against
the model and the mesh it is about to be used with.

A plan file can be edited by hand, copied between projects or made by another version of a
model. pydantic checks each field's type; these checks are about how the fields fit
together, so that a bad file is refused with its name, the parameter and what is wrong,
instead of failing later in a ``zip`` or, worse, being shown as if it were fine.

The rules (``check_plan``):

- every layout has one placement per mesh axis (``stage_mesh``'s axes for a pipeline plan);
- a parameter's layouts shard only dims its shape has, and never hold partial sums;
- every sharded dim splits evenly over the axes that shard it: the runtime cuts equal
  pieces (``autopar.runtime.shards.local_slices`` refuses any other), and the planner
  shards only dims that divide, ZeRO's optimizer-state layouts included
  (``autopar_passes.costs.zero_layout_of``);
- the gradient and the optimizer state are pieces of the parameter's own shard: on each
  axis that shards the parameter they are sharded the same way, and the gradient lies as
  the parameter (ZeRO 0 and 1) or as the optimizer state (ZeRO 2 and 3);
- the global batch is the microbatches times the microbatch size; pipeline stages and
  their ranks fit the mesh.

And against what the plan is used with (``check_plan_against``): the mesh's shape and axis
names, the model's parameter names and shapes.

>>> check_plan(plan, "plan.json")  # doctest: +SKIP
>>> check_plan_against(plan, "plan.json", mesh=MeshSpec((2, 2), ("dp", "tp")))  # doctest: +SKIP
Traceback (most recent call last):
PlanFileError: plan.json: the plan was made for the mesh dp=4 (4 devices), not dp=2 x tp=2
(4 devices); plan the model again on this mesh, or use the plan's
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from autopar_plans.errors import PlanFileError
from autopar_plans.io import load_plan
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout, Partial, Shard
from autopar_plans.plan import ParamPlan, Plan


def load_checked_plan(path: str | Path) -> Plan:
    """``load_plan`` then ``check_plan``: what every command that reads a plan file uses."""
    plan = load_plan(path)
    check_plan(plan, str(path))
    return plan


def check_plan(plan: Plan, source: str) -> None:
    """Raise ``PlanFileError`` (naming ``source``) if the plan contradicts itself."""
    problems = plan_problems(plan)
    if problems:
        raise PlanFileError(_message(source, problems))


def check_plan_against(
    plan: Plan,
    source: str,
    *,
    mesh: MeshSpec | None = None,
    params: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Raise ``PlanFileError`` if the plan was not made for ``mesh`` or for a model whose
    parameters (name -> shape, as traced) are ``params``; either may be left out."""
    problems = []
    if mesh is not None:
        problems += mesh_problems(plan, mesh)
    if params is not None:
        problems += model_problems(plan, params)
    if problems:
        raise PlanFileError(_message(source, problems))


def _message(source: str, problems: list[str]) -> str:
    """One line: the file, the first problem, and how many more there are."""
    more = len(problems) - 1
    tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{source}: {problems[0]}{tail}"


def plan_problems(plan: Plan) -> list[str]:
    """Every way the plan contradicts itself, one line each (empty: none)."""
    layout_mesh = plan.stage_mesh or plan.mesh
    problems = _stage_mesh_problems(plan)
    if problems:  # the layouts cannot be read against a mesh that does not fit
        return problems
    for name, param in plan.params.items():
        problems += _param_problems(name, param, layout_mesh)
    for name, op in plan.ops.items():
        for which, layout in (("output", op.output), *_numbered_inputs(op.inputs)):
            if layout is not None and len(layout) != layout_mesh.ndim:
                problems.append(f"op {name!r}: {which} {_axis_count(layout, layout_mesh)}")
    problems += _batch_problems(plan)
    problems += _stage_problems(plan)
    return problems


def _numbered_inputs(inputs: Sequence[Layout | None]) -> list[tuple[str, Layout | None]]:
    return [(f"input {i}", layout) for i, layout in enumerate(inputs)]


def _stage_mesh_problems(plan: Plan) -> list[str]:
    """A pipeline plan's stage mesh names the same axes as the mesh, each no larger."""
    inner = plan.stage_mesh
    if inner is None:
        return []
    if inner.axis_names != plan.mesh.axis_names:
        return [
            f"stage_mesh has axes {list(inner.axis_names)} but the mesh "
            f"{list(plan.mesh.axis_names)}; a stage's mesh keeps every axis of the mesh"
        ]
    if any(a > b for a, b in zip(inner.shape, plan.mesh.shape, strict=True)):
        return [f"stage_mesh {inner.shape} is larger than the mesh {plan.mesh.shape} on some axis"]
    return []


def _axis_count(layout: Layout, mesh: MeshSpec) -> str:
    return (
        f"{layout} has {len(layout)} placements but the mesh {mesh.describe()} has "
        f"{mesh.ndim} axes ({', '.join(mesh.axis_names)}); give one placement per mesh axis"
    )


# how a message names each of a parameter's three layouts
_WHAT = {"param": "layout", "grad": "gradient layout", "optimizer": "optimizer-state layout"}


def _param_problems(name: str, param: ParamPlan, mesh: MeshSpec) -> list[str]:
    """The parameter's three layouts, each on its own, then how they fit together (the
    first problem only: the three layouts are often wrong alike)."""
    for which in ("param", "grad", "optimizer"):
        found = _layout_problem(getattr(param, which), param.shape, mesh)
        if found:
            return [f"parameter {name!r}: {_WHAT[which]} {found}"]
    return _pieces_problems(name, param, mesh)[:1]


def _layout_problem(layout: Layout, shape: tuple[int, ...], mesh: MeshSpec) -> str | None:
    """What is wrong with a parameter's layout of ``shape`` on ``mesh``, or None."""
    if len(layout) != mesh.ndim:
        return _axis_count(layout, mesh)
    split = list(shape)
    for axis, placement in enumerate(layout):
        axis_name = mesh.axis_names[axis]
        if isinstance(placement, Partial):
            return (
                f"{layout} is partial over mesh axis {axis_name!r}; a parameter is stored "
                "whole (R) or in pieces (S(dim)), never as partial sums"
            )
        if not isinstance(placement, Shard):
            continue
        dim, size = placement.dim, mesh.shape[axis]
        if dim >= len(shape):
            return (
                f"{layout} shards dim {dim} (over mesh axis {axis_name!r}), but the "
                f"parameter has shape {shape}: dims 0..{len(shape) - 1}"
            )
        if split[dim] % size:
            return (
                f"{layout} splits dim {dim} ({_pieces(shape[dim], split[dim])}) {size} ways "
                f"over mesh axis {axis_name!r}, which does not divide it; the runtime cuts "
                "equal pieces: shard another dim or replicate it (R)"
            )
        split[dim] //= size
    return None


def _pieces(whole: int, left: int) -> str:
    return f"size {whole}" if whole == left else f"size {whole}, {left} per piece already"


def _pieces_problems(name: str, param: ParamPlan, mesh: MeshSpec) -> list[str]:
    """The gradient and the optimizer state are pieces of the parameter's own shard."""
    problems = []
    for which in ("grad", "optimizer"):
        layout: Layout = getattr(param, which)
        for axis, (mine, theirs) in enumerate(zip(param.param, layout, strict=True)):
            if isinstance(mine, Shard) and theirs != mine:
                problems.append(
                    f"parameter {name!r}: the parameter is {mine} on mesh axis "
                    f"{mesh.axis_names[axis]!r} but its {_WHAT[which]} is {theirs} there; "
                    "on an axis that shards the parameter its gradient and optimizer state "
                    "are sharded the same way"
                )
    if not problems and param.grad not in (param.param, param.optimizer):
        problems.append(
            f"parameter {name!r}: the gradient layout {param.grad} is neither the "
            f"parameter's {param.param} (ZeRO 0-1) nor the optimizer state's "
            f"{param.optimizer} (ZeRO 2-3)"
        )
    return problems


def _batch_problems(plan: Plan) -> list[str]:
    par = plan.parallelism
    if plan.global_batch == par.microbatches * plan.microbatch_size:
        return []
    return [
        f"global_batch {plan.global_batch} is not microbatches x microbatch_size "
        f"({par.microbatches} x {plan.microbatch_size} = "
        f"{par.microbatches * plan.microbatch_size})"
    ]


def _stage_problems(plan: Plan) -> list[str]:
    """Pipeline stages: indices in range and ranks on the mesh; parameters on a stage."""
    problems = []
    count = len(plan.stages)
    for stage in plan.stages:
        outside = [r for r in stage.ranks if not 0 <= r < plan.mesh.size]
        if outside:
            problems.append(
                f"stage {stage.index} runs on ranks {outside}, outside the mesh's "
                f"{plan.mesh.size} devices (0..{plan.mesh.size - 1})"
            )
    for name, param in plan.params.items():
        if param.stage and not 0 <= param.stage < count:
            problems.append(
                f"parameter {name!r} is on pipeline stage {param.stage}, but the plan has "
                f"{count} stages"
            )
    return problems


def mesh_problems(plan: Plan, mesh: MeshSpec) -> list[str]:
    """The plan's mesh against the one it is used on: shape and axis names (the device
    preset may differ: it only priced the plan)."""
    if plan.mesh.shape == mesh.shape and plan.mesh.axis_names == mesh.axis_names:
        return []
    return [
        f"the plan was made for the mesh {_mesh_text(plan.mesh)}, not "
        f"{_mesh_text(mesh)}; plan the model again on this mesh, or use the plan's"
    ]


def _mesh_text(mesh: MeshSpec) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.shape, strict=True)) + (
        f" ({math.prod(mesh.shape)} devices)"
    )


def model_problems(plan: Plan, params: Mapping[str, Sequence[int]]) -> list[str]:
    """The plan's parameters against the model's (as traced): names and shapes."""
    known = {alias: name for name, p in plan.params.items() for alias in (name, *p.aliases)}
    problems = []
    for name in plan.params:
        if name not in params:
            problems.append(
                f"parameter {name!r} is not in the model{_close(name, params)}; the plan "
                f"was made for another model ({plan.model!r})"
            )
    for name, shape in params.items():
        planned = known.get(name)
        if planned is None:
            problems.append(
                f"the plan has no layout for parameter {name!r}; it was made for another "
                f"model ({plan.model!r})"
            )
        elif tuple(shape) != plan.params[planned].shape:
            problems.append(
                f"parameter {name!r} has shape {tuple(shape)} in the model but "
                f"{plan.params[planned].shape} in the plan; it was made for another "
                f"configuration of the model ({plan.model!r})"
            )
    return problems


def _close(name: str, names: Mapping[str, object]) -> str:
    match = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
