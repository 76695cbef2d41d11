"""The ``autopar`` command: one small module per subcommand, wired here.

Each subcommand module has ``add_parser(subparsers)`` and ``run(args) -> int``. Errors a user
can fix (``autopar_plans.AutoparError``) print one message and exit with the documented code:

====  =====================================================
code  meaning
====  =====================================================
0     success
1     internal error (a bug in autopar: please report it)
2     usage error: a bad argument, MODEL string, mesh, plan or hint
      file (a hint error names the file, the line and the hint), a plan
      at odds with itself or with the model or mesh, a path that
      cannot be written
3     infeasible: no plan fits the memory limit or the hints
      (conflicting hints are named with their file and line)
4     untraceable model: torch.export could not trace it
130   interrupted (Ctrl-C): one line; the console script
      (``autopar_entry``) also covers the imports before ``main``
====  =====================================================
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from autopar._version import __version__
from autopar.cli import calibrate, codegen, demo, devices, diff, explain, plan, show
from autopar_plans.errors import (
    AutoparError,
    HintError,
    InfeasiblePlanError,
    PlanFileError,
    PlanWarning,
    PresetError,
    UntraceableModelError,
    UsageError,
)

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
EXIT_UNTRACEABLE = 4
EXIT_INTERRUPTED = 130

SUBCOMMANDS = (demo, plan, show, explain, diff, codegen, devices, calibrate)


def exit_code(error: AutoparError) -> int:
    """The exit code documented above for each kind of user error."""
    if isinstance(error, InfeasiblePlanError):
        return EXIT_INFEASIBLE
    if isinstance(error, UntraceableModelError):
        return EXIT_UNTRACEABLE
    if isinstance(error, UsageError | PlanFileError | PresetError | HintError):
        return EXIT_USAGE
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Plan and run a PyTorch model across a device mesh: data, tensor, "
        "sequence, pipeline and expert parallelism, ZeRO/FSDP and recomputation, chosen by "
        "an ILP over a cost model.",
        epilog="Exit codes: 0 success, 2 usage error (bad argument, model, mesh, plan or hint "
        "file), 3 infeasible plan (memory limit or conflicting hints), 4 untraceable model. "
        "See docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        with warnings.catch_warnings():
            # each command shows the plan's warnings its own way (``plan`` beside the plan,
            # ``codegen`` a line each), not in Python's file:line form
            warnings.simplefilter("ignore", PlanWarning)
            code = int(args.run(args))
        return code
    except AutoparError as error:
        print(f"autopar {args.command}: error: {error}", file=sys.stderr)
        return exit_code(error)
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
