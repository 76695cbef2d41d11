"""``autopar codegen MODEL --mesh 2x2 --rank 1``: print the code one rank runs.

Plans the model (or reads ``--plan``), lowers it for the rank's mesh coordinates and prints
the resulting Python: local shapes, local ops, and the collectives, by mesh axis. For a
pipeline plan, the rank's stage programs (one, or ``chunks`` when interleaved), each under
a header naming what it receives from the previous stage and sends to the next.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import autopar
from autopar.api import example_batch, microbatch_inputs
from autopar.cli.mesh_args import add_mesh_arguments, mesh_from_args
from autopar.cli.plan import add_model_arguments
from autopar.model_source import build_model, parse_config
from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_spmd import lower_spmd
from autopar_passes.lower_stages import iter_stage_codes, locate, split_stages, stage_mesh
from autopar_passes.trace import trace
from autopar_plans.errors import UsageError
from autopar_plans.mesh import MeshSpec
from autopar_plans.plan import Plan
from autopar_plans.validate import check_plan_against, load_checked_plan


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "codegen",
        help="print the per-rank code of a planned model",
        description="Plan MODEL (or use --plan) and print the Python that one rank runs.",
    )
    add_model_arguments(parser)
    add_mesh_arguments(parser)
    parser.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    parser.add_argument("--plan", help="a plan file to lower instead of planning anew")
    parser.add_argument("--global-batch", type=int, help="batch per optimizer step")
    parser.add_argument("--stages", type=int, help="pipeline stages (default: searched)")
    parser.add_argument(
        "--schedule", choices=["gpipe", "1f1b", "interleaved"], help="pipeline schedule"
    )
    parser.add_argument("--microbatches", type=int, help="microbatches per step")
    parser.add_argument("--chunks", type=int, help="interleaved stages per device")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    mesh = mesh_from_args(args)
    if not 0 <= args.rank < mesh.size:
        raise UsageError(f"--rank {args.rank}: the mesh has ranks 0..{mesh.size - 1}")
    given = _given_plan(args.plan, mesh, bool(args.axes)) if args.plan else None
    model, inputs, name = build_model(args.model, parse_config(args.config), meta=True)
    plan = given if given is not None else _plan(model, mesh, inputs, name, args)
    # the program runs one microbatch: trace at its size
    traced = trace(model, microbatch_inputs(inputs, example_batch(inputs), plan.microbatch_size))
    if given is not None:
        shapes = {param: info.shape for param, info in traced.params.items()}
        check_plan_against(plan, args.plan, params=shapes)
    layouts = PlanLayouts(traced, plan)
    place = locate(plan, args.rank)
    lowered = lower_spmd(traced, layouts.strategy, layouts.layout, stage_mesh(plan), place.coords)
    header = (
        f"# {name} on {plan.mesh.describe()}, rank {args.rank} at mesh coordinates "
        f"{dict(zip(plan.mesh.axis_names, plan.mesh.coordinates(args.rank), strict=True))}\n"
    )
    par = plan.parallelism
    if par.pp == 1:
        print(header + lowered.graph.python_code("self").src.strip())
        return 0
    inner = stage_mesh(plan)
    header += (
        f"# pipeline stage {place.stage} of {par.pp} ({par.schedule}, {par.microbatches} x "
        f"microbatch of {plan.microbatch_size}), at stage-mesh coordinates "
        f"{dict(zip(inner.axis_names, place.coords, strict=True))}\n"
    )
    programs = split_stages(traced, lowered, plan)
    mine = [programs[index] for index in place.stages]
    print(header + "\n\n".join(iter_stage_codes(mine)))
    return 0


def _given_plan(path: str, mesh: MeshSpec, named: bool) -> Plan:
    """The ``--plan`` file, checked on its own and against the ``--mesh`` given."""
    plan = load_checked_plan(path)
    check_plan_against(plan, path, mesh=_named_as(mesh, plan, named))
    return plan


def _plan(model: Any, mesh: MeshSpec, inputs: Any, name: str, args: argparse.Namespace) -> Plan:
    """Plan the model anew, with the planning options given; its warnings on stderr."""
    options = {
        "global_batch": args.global_batch,
        "stages": args.stages,
        "schedule": args.schedule,
        "microbatches": args.microbatches,
        "chunks": args.chunks,
    }
    given = {k: v for k, v in options.items() if v is not None}
    plan = autopar.plan(model, mesh, inputs, name=name, **given)
    for warning in plan.warnings:
        print(f"autopar codegen: warning: {warning}", file=sys.stderr)
    return plan


def _named_as(mesh: MeshSpec, plan: Plan, named: bool) -> MeshSpec:
    """The mesh to hold the plan to: as given, or, where ``--axes`` was left out, with the
    plan's axis names (``--mesh 2x2`` then means the plan's 2 x 2, whatever its names)."""
    if named or len(mesh.shape) != len(plan.mesh.shape):
        return mesh
    return mesh.model_copy(update={"axis_names": plan.mesh.axis_names})
