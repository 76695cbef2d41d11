"""``autopar plan MODEL --mesh 8x8 --device h100-sxm``: plan a model offline and print it.

The model is built on the ``meta`` device (no weights), traced, and planned; the plan is
printed as tables (default), JSON (stable: sorted keys, the plan schema) or YAML, written
with ``-o``, steered with ``--hints FILE`` (``docs/hints.md``) and drawn with ``--report
plan.html`` (a self-contained page and ``plan.png`` beside it). While it traces and solves,
a status line runs on stderr when stderr is a terminal.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import autopar
from autopar.cli.mesh_args import add_mesh_arguments, mesh_from_args
from autopar.cli.render import (
    comm_sources_table,
    comm_table,
    console,
    plan_tables,
    summary_of,
    working,
)
from autopar.force import STYLES
from autopar.model_source import build_model, parse_config
from autopar.report import require_matplotlib
from autopar_cost_model.memory import OPTIMIZERS
from autopar_passes.collector import collector_paused
from autopar_plans.compression import SCHEMES
from autopar_plans.io import dump_plan, save_plan
from autopar_plans.plan import Plan
from autopar_plans.writes import check_writable


def add_model_arguments(parser: Any) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a preset (llama3-8b), path/to/file.py:factory or package.module:factory",
    )
    parser.add_argument(
        "--config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="arguments for the model factory, such as n_layer=4",
    )


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan a model on a mesh (offline, no GPUs) and print the plan",
        description="Trace MODEL on the meta device, choose how to shard it over the mesh "
        "and print the plan with its estimated step time and memory.",
    )
    add_model_arguments(parser)
    add_mesh_arguments(parser)
    parser.add_argument(
        "--global-batch",
        type=int,
        help="batch per optimizer step (default: the model's example batch)",
    )
    parser.add_argument(
        "--memory", help="memory limit per device, such as 80GiB (default: the preset's memory)"
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=list(OPTIMIZERS),
    )
    parser.add_argument(
        "--precision", default="fp32", choices=["fp32", "bf16_mixed", "fp16_mixed", "bf16"]
    )
    parser.add_argument("--force", choices=STYLES, help="impose a parallel style")
    parser.add_argument(
        "--zero", type=int, choices=[0, 1, 2], help="force a ZeRO stage (default: searched)"
    )
    parser.add_argument(
        "--stages", type=int, help="pipeline stages (default: searched; 1: no pipeline)"
    )
    parser.add_argument(
        "--grad-compression",
        choices=list(SCHEMES),
        help="compress the data-parallel gradient sum (opt-in; docs/communication.md)",
    )
    parser.add_argument(
        "--sync",
        choices=["every_step", "local_sgd"],
        default="every_step",
        help="local_sgd: average the models every --period steps instead of summing gradients",
    )
    parser.add_argument("--period", type=int, default=1, help="local SGD's steps per averaging")
    parser.add_argument(
        "--offload",
        metavar="WHAT",
        help="what may live in host memory: auto (default: where the memory limit calls for "
        "it), none, or kinds forced on: optimizer, activations, parameters (with the "
        "optimizer: it needs it), optimizer,activations (docs/offload.md)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=60.0,
        help="solver budget per solve, in seconds of work (the same plan on any machine)",
    )
    parser.add_argument(
        "--hints", type=Path, metavar="FILE", help="a hint file (YAML; see docs/hints.md)"
    )
    add_output_arguments(parser)
    parser.set_defaults(run=run)


def add_output_arguments(parser: Any) -> None:
    """--format, -o and --report, shared by ``plan`` and ``show``."""
    parser.add_argument(
        "--format",
        choices=["table", "json", "yaml"],
        default="table",
        help="tables for people (default), or the plan as JSON/YAML for scripts",
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="write the plan to this file (.json or .yaml)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="FILE",
        help="write a self-contained HTML report (pipeline timeline, memory, layouts) and a "
        "PNG beside it",
    )
    parser.add_argument(
        "--comm",
        action="store_true",
        help="print the communication ledger: every collective a step issues (kind, mesh "
        "axes, dtype, bytes, calls, time, what hides it) instead of the layouts",
    )


@collector_paused()  # the model's build and the plan's printing too
def run(args: argparse.Namespace) -> int:
    if args.report:
        require_matplotlib()
    mesh = mesh_from_args(args)
    for written in (args.output, args.report):
        if written is not None:
            check_writable(written)  # before minutes of planning, not after
    options: dict[str, Any] = {
        "global_batch": args.global_batch,
        "memory_limit": args.memory,
        "optimizer": args.optimizer,
        "precision": args.precision,
        "force": args.force,
        "time_limit": args.time_limit,
        "zero": args.zero,
        "stages": args.stages,
        "grad_compression": args.grad_compression,
        "sync": args.sync,
        "period": args.period,
        "offload": args.offload,
    }
    with working(f"planning {args.model} on {mesh.describe()}") as say:
        model, inputs, name = build_model(args.model, parse_config(args.config), meta=True)
        plan = autopar.plan(
            model, mesh, inputs, name=name, hints=args.hints, progress=say, **options
        )
    return print_plan(plan, args)


def print_plan(plan: Plan, args: argparse.Namespace) -> int:
    """Print ``plan`` in ``--format``; write ``-o`` and ``--report``; say what was written
    on stderr (stdout stays the plan alone, for scripts)."""
    if args.output:
        save_plan(plan, args.output)
    if args.report:
        with working(f"drawing the report {args.report}"):
            from autopar.report.html import write_report

            page, picture = write_report(plan, args.report)
    if args.format == "table":
        out = console()
        tables = (
            [summary_of(plan), comm_sources_table(plan), comm_table(plan)]
            if args.comm
            else plan_tables(plan)
        )
        for table in tables:
            out.print(table)
    else:
        print(dump_plan(plan, args.format), end="")
    notes = console(stderr=True)
    if args.output:
        notes.print(f"plan written to {args.output}")
    if args.report:
        notes.print(f"report written to {page} and {picture}")
    return 0
