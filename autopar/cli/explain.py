"""``autopar explain PLAN TARGET``: how the plan places a parameter or an op, and why.

TARGET is a parameter name (``layers.0.attn.q_proj.weight``), a module path (its last op)
or an op's node name from the plan. What the plan records (layouts in the mesh's axis
names, the pipeline stage, the collectives the ledger charges to it) is read from the plan
file alone (``autopar.report.facts``). ``--alternatives`` costs every other layout it could
take, with the rest of the plan as it is (``autopar.report.explain``): the plan does not
keep what it beat, so the model is built and traced again (on ``meta``): ``--model``
defaults to the plan's model name, which works for presets; pass the MODEL and
``--config`` given to ``autopar plan`` otherwise, and its ``--hints`` to see which hint
decided.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from autopar.cli.render import console, working
from autopar.model_source import build_model, parse_config
from autopar.report.explain import Explanation, explain
from autopar.report.facts import mesh_in_words, plan_facts
from autopar.report.gradients import explain_gradients
from autopar.report.offload import explain_offload
from autopar_passes.hints import resolve_hints
from autopar_passes.trace import trace
from autopar_plans.errors import UsageError
from autopar_plans.hints import load_hints
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes, format_seconds
from autopar_plans.validate import check_plan_against, load_checked_plan


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="why a parameter or op has its layout: its cost next to the alternatives'",
        description="Cost every layout TARGET could take, with the rest of PLAN as it is, and "
        "say what decided: a hint, the memory limit or the cost.",
    )
    parser.add_argument("plan", metavar="PLAN", type=Path, help="a plan file")
    parser.add_argument(
        "target",
        metavar="TARGET",
        help="a parameter name, an op (linear_3) or a module path; or 'gradients': whether "
        "gradient compression or local SGD would pay; or 'offload': why the plan keeps "
        "state in host memory or not, and what it costs (both from the plan alone)",
    )
    parser.add_argument(
        "--alternatives",
        action="store_true",
        help="cost every layout TARGET could take (traces the model again)",
    )
    parser.add_argument(
        "--model",
        help="the MODEL the plan was made for (default: the plan's model name, for presets)",
    )
    parser.add_argument(
        "--config", nargs="*", default=[], metavar="KEY=VALUE", help="the model's --config"
    )
    parser.add_argument("--hints", type=Path, metavar="FILE", help="the plan's hint file")
    parser.add_argument(
        "--all", action="store_true", help="every alternative (default: the best 10)"
    )
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = load_checked_plan(args.plan)
    if args.target == "gradients":
        return _gradients(plan, args.format)
    if args.target == "offload":
        return _offload(plan, args.format)
    if not args.alternatives:
        return _facts(plan, args.target, args.format)
    source = args.model or plan.model
    with working(f"tracing {source} to cost the layouts {args.target} could take"):
        try:
            model, inputs, _ = build_model(source, parse_config(args.config), meta=True)
        except UsageError as error:
            if args.model:
                raise
            raise UsageError(
                f"the plan's model {plan.model!r} is not a MODEL autopar can build ({error}); "
                "pass --model (and --config) as given to autopar plan"
            ) from None
        traced = trace(model, inputs)
        shapes = {name: info.shape for name, info in traced.params.items()}
        check_plan_against(plan, str(args.plan), params=shapes)
        hints = resolve_hints(load_hints(args.hints), traced, plan.mesh) if args.hints else None
        result = explain(plan, traced, args.target, hints)
    if args.format == "json":
        data = asdict(result)
        data["mesh"] = result.mesh.describe()
        for entry, option in zip(data["options"], result.options, strict=True):
            entry["time_s"] = option.time_s  # a property: asdict leaves it out
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    out = console()
    out.print(f"[bold]{escape(result.what)}[/bold] on {escape(mesh_in_words(plan))}")
    out.print(f"decided by {escape(result.decided_by)}")
    for note in result.notes:
        out.print(f"note: {escape(note)}")
    forbidding = sorted({h for option in result.options for h in option.forbidden_by})
    if forbidding:
        out.print("hints that forbid alternatives:")
        for hint in forbidding:
            out.print(f"  {escape(hint)}")
    out.print(options_table(result, None if args.all else 10))
    return 0


def _facts(plan: Plan, target: str, form: str) -> int:
    """What the plan records about ``target``, from the plan file alone."""
    facts = plan_facts(plan, target)
    if form == "json":
        print(json.dumps(asdict(facts), indent=2, sort_keys=True))
        return 0
    out = console()
    table = Table(title=facts.what, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for name, value in facts.rows:
        table.add_row(name, escape(value))
    out.print(table)
    if facts.collectives:
        sent = Table(title="collectives the plan charges to it (per step, per device)")
        for column in ("collective", "what", "sent", "time"):
            sent.add_column(column, justify="right" if column in ("sent", "time") else "left")
        for row in facts.collectives:
            sent.add_row(*(escape(cell) for cell in row))
        out.print(sent)
    else:
        out.print("the plan's ledger charges no collective to it by name")
    out.print(
        "why this layout and not another: add --alternatives (costs each one; traces the "
        "model again)"
    )
    return 0


def _gradients(plan: Plan, form: str) -> int:
    """The plan's gradient sum next to each compression scheme and local SGD."""
    report = explain_gradients(plan)
    if form == "json":
        print(json.dumps(asdict(report), indent=2, sort_keys=True))
        return 0
    out = console()
    table = Table(
        title="the gradient sum under each policy (the rest as planned; per step, per device)",
        title_justify="left",
    )
    for column in ("", "policy", "sent", "comm", "exposed", "step", "vs plan", "state"):
        table.add_column(column, justify="left" if column in ("", "policy") else "right")
    own = report.rows[0]
    for row in report.rows:
        delta = row.step_time_s - own.step_time_s
        table.add_row(
            "*" if row.planned else "",
            escape(row.name),
            format_bytes(row.sent_bytes),
            format_seconds(row.comm_s),
            format_seconds(row.exposed_s),
            format_seconds(row.step_time_s),
            "" if row.planned else ("+" if delta >= 0 else "-") + format_seconds(abs(delta)),
            format_bytes(row.state_bytes),
        )
    out.print(table)
    out.print(escape(report.verdict))
    return 0


def _offload(plan: Plan, form: str) -> int:
    """Each kind of offload on the plan: what it moves off the device and what it costs."""
    report = explain_offload(plan)
    if form == "json":
        print(json.dumps(asdict(report), indent=2, sort_keys=True))
        return 0
    out = console()
    table = Table(
        title="offload to host memory (per device, per step; the busiest stage)",
        title_justify="left",
    )
    for column in ("kind", "in plan", "frees on device", "host holds", "host link", "costs"):
        table.add_column(column, justify="left" if column in ("kind", "in plan") else "right")
    for row in report.rows:
        table.add_row(
            row.kind,
            "yes" if row.used else "no",
            format_bytes(row.frees_bytes),
            format_bytes(row.host_bytes),
            format_bytes(row.moved_bytes),
            format_seconds(row.cost_s),
        )
    out.print(table)
    out.print(escape(report.verdict))
    return 0


def options_table(result: Explanation, top: int | None) -> Table:
    """The chosen layout first, then the alternatives by time, with why each lost."""
    chosen = result.options[0]
    table = Table(
        title="layouts it could take (everything else as planned; per step, per device)",
        title_justify="left",
    )
    for column in (
        "",
        "layout",
        "vs plan",
        "compute",
        "resharding",
        "overlappable comm",
        "memory / device",
        "why not",
    ):
        table.add_column(
            column,
            justify="right"
            if column
            in ("vs plan", "compute", "resharding", "overlappable comm", "memory / device")
            else "left",
        )
    shown = result.options if top is None else result.options[:top]
    for option in shown:
        delta = option.time_s - chosen.time_s
        if option.chosen:
            why, mark = "chosen", "*"
        elif option.forbidden_by:
            # the place of each hint (file:line); the hints are listed above the table
            why, mark = "hint " + ", ".join(_place(h) for h in option.forbidden_by), ""
        elif option.over_memory:
            why, mark = "over the memory limit", ""
        else:
            why, mark = ("slower" if delta > 0 else "no faster"), ""
        table.add_row(
            mark,
            escape(option.layout),
            "" if option.chosen else ("+" if delta >= 0 else "-") + format_seconds(abs(delta)),
            format_seconds(option.compute_s),
            format_seconds(option.reshard_s),
            format_seconds(option.overlap_s),
            format_bytes(option.memory_bytes),
            escape(why),
        )
    if top is not None and len(result.options) > top:
        table.caption = f"{len(result.options) - top} more: --all"
    return table


def _place(hint: str) -> str:
    """``line 11`` for ``hints.yaml:11: shard ...`` (the hints are listed above the table)."""
    where = hint.split(": ", 1)[0]
    line = where.rsplit(":", 1)[-1]
    return f"line {line}" if line.isdigit() else where
