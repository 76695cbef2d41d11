"""``autopar codegen MODEL --mesh 2x2 --rank 1``: print the code one rank runs.

Plans the model (or reads ``--plan``), lowers it for the rank's mesh coordinates and prints
the resulting Python: local shapes, local ops, and the collectives, by mesh axis.
"""

from __future__ import annotations

import argparse
from typing import Any

import autopar
from autopar.cli.mesh_args import add_mesh_arguments, mesh_from_args
from autopar.cli.plan import add_model_arguments
from autopar.model_source import build_model, parse_config
from passes.from_plan import PlanLayouts
from passes.lower_spmd import lower_spmd
from passes.trace import trace
from plans.errors import UsageError
from plans.io import load_plan


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
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    mesh = mesh_from_args(args)
    if not 0 <= args.rank < mesh.size:
        raise UsageError(f"--rank {args.rank}: the mesh has ranks 0..{mesh.size - 1}")
    model, inputs, name = build_model(args.model, parse_config(args.config), meta=True)
    # pipeline plans lower per stage (next); codegen plans without stages for now
    plan = load_plan(args.plan) if args.plan else autopar.plan(model, mesh, inputs, name=name,
                                                               stages=1)
    traced = trace(model, inputs)
    layouts = PlanLayouts(traced, plan)
    coords = plan.mesh.coordinates(args.rank)
    lowered = lower_spmd(traced, layouts.strategy, layouts.layout, plan.mesh, coords)
    header = (
        f"# {name} on {plan.mesh.describe()}, rank {args.rank} at mesh coordinates "
        f"{dict(zip(plan.mesh.axis_names, coords, strict=True))}\n"
    )
    print(header + lowered.graph.python_code("self").src.strip())
    return 0
