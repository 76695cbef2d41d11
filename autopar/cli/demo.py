"""``autopar demo``: the main job of the README, run end to end on this machine.

Today it traces a small GPT and prints what autopar sees in it: ops, parameters, FLOPs and
the repeated layers it found. It grows with the project into planning and training the GPT
on a local CPU mesh.
"""

from __future__ import annotations

import argparse
from typing import Any

from autopar.cli.render import console, ops_table, summary_table
from autopar.model_source import build_model, parse_config
from passes.trace import trace


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="trace a small GPT and show what autopar sees in it",
        description="Trace a small GPT (or MODEL) and print a summary of its graph.",
    )
    parser.add_argument(
        "--model",
        default="gpt-demo",
        help="MODEL to trace: a preset, path/to/file.py:factory or "
        "package.module:factory (default: gpt-demo)",
    )
    parser.add_argument(
        "--config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="factory arguments, such as n_layer=4",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = console()
    model, inputs, name = build_model(args.model, parse_config(args.config))
    traced = trace(model, inputs)
    summary = traced.summary()
    out.print(summary_table(summary, title=f"{name}: traced with torch.export"))
    out.print(ops_table(summary))
    for warning in traced.warnings:
        out.print(f"warning: {warning}")
    return 0
