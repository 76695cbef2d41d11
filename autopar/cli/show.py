"""``autopar show PLAN``: the tables of a saved plan (or its JSON/YAML, or a report).

The same tables ``autopar plan`` prints: the summary, where the step time goes, memory per
device (per stage), the pipeline stages and the layouts per layer. No model is needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopar.cli.plan import add_output_arguments, print_plan
from autopar_plans.validate import load_checked_plan


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "show",
        help="print a saved plan as tables (or JSON/YAML, or an HTML report)",
        description="Read a plan file (.json or .yaml, from `autopar plan -o`) and print it.",
    )
    parser.add_argument("plan", metavar="PLAN", type=Path, help="a plan file")
    add_output_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return print_plan(load_checked_plan(args.plan), args)
