"""``autopar diff A B``: what changed between two plans of one model.

The parallelism, the estimate (step time, MFU, memory, communication) side by side with the
change, the pipeline stages, and every parameter whose layout changed (identical layers
folded into one row). ``--format json`` gives the same for scripts; the exit code is 0
whether or not the plans differ (2 when a file cannot be read).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from autopar.cli.render import console
from autopar.report.views import ranges
from autopar_plans.placement import format_spec
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes, format_seconds
from autopar_plans.validate import load_checked_plan

ESTIMATES: tuple[tuple[str, str], ...] = (
    ("step time", "step_time_s"),
    ("MFU", "mfu"),
    ("memory / device", "memory"),
    ("compute", "compute_s"),
    ("communication not hidden", "exposed_comm_s"),
    ("pipeline bubble", "bubble_s"),
    ("bytes sent per device", "comm_bytes_per_step"),
)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diff",
        help="compare two plans: parallelism, estimate, changed layouts",
        description="Compare plan A with plan B (files from `autopar plan -o`).",
    )
    parser.add_argument("a", metavar="A", type=Path, help="the first plan file")
    parser.add_argument("b", metavar="B", type=Path, help="the second plan file")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    a, b = load_checked_plan(args.a), load_checked_plan(args.b)
    changes = plan_diff(a, b)
    if args.format == "json":
        print(json.dumps(changes, indent=2, sort_keys=True))
        return 0
    out = console()
    out.print(f"A: {escape(str(args.a))} ({escape(a.model)} on {a.mesh.describe()})")
    out.print(f"B: {escape(str(args.b))} ({escape(b.model)} on {b.mesh.describe()})")
    for table in diff_tables(changes):
        out.print(table)
    if not changes["params"] and not changes["parallelism"]:
        out.print("the parameter layouts and the parallelism are the same")
    return 0


def plan_diff(a: Plan, b: Plan) -> dict[str, Any]:
    """The differences as plain data (the JSON output)."""
    parallelism = {
        name: [value, getattr(b.parallelism, name)]
        for name, value in a.parallelism.model_dump().items()
        if getattr(b.parallelism, name) != value
    }
    estimate = {key: [_value(a, key), _value(b, key)] for _, key in ESTIMATES}
    params: dict[str, list[str | None]] = {}
    for name in sorted(set(a.params) | set(b.params)):
        left, right = _spec(a, name), _spec(b, name)
        if left != right:
            params[name] = [left, right]
    ops = sorted(
        name
        for name in set(a.ops) & set(b.ops)
        if a.ops[name].strategy != b.ops[name].strategy or a.ops[name].output != b.ops[name].output
    )
    stages = [[list(s.layers) for s in a.stages], [list(s.layers) for s in b.stages]]
    return {
        "a": {"model": a.model, "mesh": a.mesh.describe()},
        "b": {"model": b.model, "mesh": b.mesh.describe()},
        "parallelism": parallelism,
        "estimate": estimate,
        "stages": stages if stages[0] != stages[1] else None,
        "params": params,
        "ops_changed": len(ops),
        "ops": ops,
    }


def diff_tables(changes: dict[str, Any]) -> list[Table]:
    tables = []
    if changes["parallelism"]:
        table = Table(title="parallelism", title_justify="left")
        for column in ("", "A", "B"):
            table.add_column(column)
        for name, (left, right) in changes["parallelism"].items():
            table.add_row(name, str(left), str(right))
        tables.append(table)
    table = Table(title="estimate", title_justify="left")
    for column in ("", "A", "B", "change"):
        table.add_column(column, justify="left" if not column else "right")
    for label, key in ESTIMATES:
        left, right = changes["estimate"][key]
        if not left and not right:
            continue
        change = f"{100 * (right - left) / left:+.1f}%" if left else ""
        table.add_row(label, _show(key, left), _show(key, right), change)
    tables.append(table)
    if changes["stages"]:
        table = Table(title="pipeline stages (layers)", title_justify="left")
        table.add_column("A")
        table.add_column("B")
        left, right = changes["stages"]
        table.add_row(_stages(left), _stages(right))
        tables.append(table)
    if changes["params"]:
        table = Table(title="parameters whose layout changed", title_justify="left")
        for column in ("parameter", "layers", "A", "B"):
            table.add_column(column)
        for name, layers, left, right in _fold(changes["params"]):
            table.add_row(escape(name), layers, escape(left or "-"), escape(right or "-"))
        tables.append(table)
    if changes["ops_changed"]:
        note = Table(show_header=False, box=None)
        note.add_column("")
        shown = ", ".join(changes["ops"][:8]) + (" ..." if changes["ops_changed"] > 8 else "")
        note.add_row(f"{changes['ops_changed']} ops run another strategy: {shown}")
        tables.append(note)
    return tables


def _spec(plan: Plan, name: str) -> str | None:
    param = plan.params.get(name)
    if param is None:
        return None
    mesh = plan.stage_mesh or plan.mesh
    return format_spec(param.param, mesh.axis_names, len(param.shape))


def _value(plan: Plan, key: str) -> float:
    if key == "memory":
        return plan.estimate.memory_per_device_bytes.total
    return float(getattr(plan.estimate, key))


def _show(key: str, value: float) -> str:
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key in ("memory", "comm_bytes_per_step"):
        return format_bytes(value)
    return format_seconds(value)


def _stages(stages: list[list[int]]) -> str:
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in stages) or "none"


def _fold(params: dict[str, list[str | None]]) -> list[tuple[str, str, str | None, str | None]]:
    """Names that differ only in their layer index, with the same change: one row."""
    groups: dict[tuple[str, str | None, str | None], list[int]] = {}
    for name, (left, right) in params.items():
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        pattern = ".".join("*" if i == index else p for i, p in enumerate(parts))
        layer = int(parts[index]) if index is not None else -1
        groups.setdefault((pattern, left, right), []).append(layer)
    rows = []
    for (pattern, left, right), layers in groups.items():
        numbered = layers != [-1]
        name = pattern.replace("*", str(layers[0]), 1) if numbered and len(layers) == 1 else pattern
        rows.append((name, ranges(layers) if numbered else "", left, right))
    return rows
