"""`autopar calibrate`: placeholder until the cost model lands."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("calibrate", help="(not yet available)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
