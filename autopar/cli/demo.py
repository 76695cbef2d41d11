"""``autopar demo``: the README's main job, end to end on this machine.

Starts 4 local ranks joined by gloo, plans a small GPT on a 2x2 mesh, trains it a few steps
compiled and, on each rank, single-device next to it; prints the plan and both losses.
``--trace`` instead traces the model and prints what autopar sees in its graph.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from autopar.cli.demo_work import train_side_by_side
from autopar.cli.render import console, ops_table, plan_tables, summary_table
from autopar.model_source import build_model, parse_config
from autopar.testing.ranks import run_ranks
from autopar_passes.trace import trace
from autopar_plans.io import plan_from_dict
from autopar_plans.mesh import parse_mesh_shape


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="plan and train a small GPT on 4 local CPU ranks",
        description="Plan a small GPT on a 2x2 mesh of local CPU processes (gloo), train it "
        "a few steps, and print the plan and the loss next to single-device training.",
    )
    parser.add_argument(
        "--model",
        default="gpt-demo",
        help="MODEL: a preset, path/to/file.py:factory or package.module:factory "
        "(default: gpt-demo)",
    )
    parser.add_argument(
        "--config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="factory arguments, such as n_layer=4",
    )
    parser.add_argument("--mesh", default="2x2", help="local mesh (default 2x2: dp x tp)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--device",
        default="cpu",
        help="hardware preset the plan is costed for (the ranks run on this "
        "machine's CPU either way); try h100-sxm",
    )
    parser.add_argument("--code", action="store_true", help="also print rank 0's code")
    parser.add_argument(
        "--trace", action="store_true", help="only trace the model and summarise its graph"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = console()
    config = parse_config(args.config)
    if args.trace:
        model, inputs, name = build_model(args.model, config)
        traced = trace(model, inputs)
        out.print(summary_table(traced.summary(), title=f"{name}: traced with torch.export"))
        out.print(ops_table(traced.summary()))
        for warning in traced.warnings:
            out.print(f"warning: {warning}")
        return 0
    model, inputs, _ = build_model(args.model, config)
    out.print(f"tracing {args.model} ...")
    trace(model, inputs)  # fail here, with one clear message, before starting ranks
    shape = parse_mesh_shape(args.mesh)
    axes = (
        ("dp", "tp")[: len(shape)] if len(shape) <= 2 else tuple(f"a{i}" for i in range(len(shape)))
    )
    world = 1
    for size in shape:
        world *= size
    out.print(f"starting {world} local ranks (gloo) for a {args.mesh} mesh ...")
    results = run_ranks(
        train_side_by_side, world, (args.model, config, shape, axes, args.steps, args.device)
    )
    first = results[0]
    for table in plan_tables(plan_from_dict(first["plan"])):
        out.print(table)
    losses = Table(title="training loss, single device vs autopar (rank 0)", title_justify="left")
    for column in ("step", "single device", "autopar", "difference"):
        losses.add_column(column, justify="right")
    single, compiled = first["losses"]["single device"], first["losses"]["autopar"]
    for step, (a, b) in enumerate(zip(single, compiled, strict=True), start=1):
        losses.add_row(str(step), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}")
    out.print(losses)
    if args.code:
        out.print(first["code"], markup=False, highlight=False)
    return 0
