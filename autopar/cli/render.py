"""Terminal output shared by the subcommands: rich tables, colour only on a TTY."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from passes.trace import GraphSummary
from plans.placement import format_spec
from plans.plan import Plan
from plans.units import format_bytes, format_count, format_flops, format_seconds


def console(stderr: bool = False) -> Console:
    """A console that colours only when writing to a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(
        file=stream,
        highlight=False,
        soft_wrap=False,
        no_color=not stream.isatty(),
        width=None if stream.isatty() else 100,
    )


def summary_table(summary: GraphSummary, title: str) -> Table:
    """Ops, parameters, FLOPs and layers of a traced model."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("graph nodes", str(summary.nodes))
    table.add_row(
        "parameters",
        f"{format_count(summary.parameters)} ({format_bytes(summary.parameter_bytes)})",
    )
    table.add_row(
        "layers found",
        f"{summary.layers} under '{summary.layer_container}'" if summary.layers else "none",
    )
    table.add_row("forward FLOPs", format_flops(summary.fwd_flops))
    table.add_row("backward FLOPs", format_flops(summary.bwd_flops))
    table.add_row("saved for backward", format_bytes(summary.saved_activation_bytes))
    table.add_row("trace time", f"{summary.trace_seconds:.2f} s")
    return table


def ops_table(summary: GraphSummary, top: int = 12) -> Table:
    table = Table(title="ops", title_justify="left")
    table.add_column("op")
    table.add_column("count", justify="right")
    for op, count in list(summary.ops.items())[:top]:
        table.add_row(op, str(count))
    rest = list(summary.ops.items())[top:]
    if rest:
        table.add_row(f"({len(rest)} more kinds)", str(sum(c for _, c in rest)))
    return table


def plan_tables(plan: Plan) -> list[Table]:
    """The parallelism summary, the estimate, and the layouts of the first layer."""
    summary = Table(
        title=f"{plan.model} on {plan.mesh.describe()}", show_header=False, title_justify="left"
    )
    summary.add_column("what", style="bold")
    summary.add_column("value")
    p = plan.parallelism
    summary.add_row(
        "parallelism", f"dp={p.dp} tp={p.tp} sp={p.sp} pp={p.pp} ep={p.ep} zero={p.zero}"
    )
    summary.add_row(
        "batch", f"{plan.global_batch} per step = {p.microbatches} x {plan.microbatch_size}"
    )
    e = plan.estimate
    summary.add_row(
        "step time",
        f"{format_seconds(e.step_time_s)} (compute "
        f"{format_seconds(e.compute_s)}, communication not hidden "
        f"{format_seconds(e.exposed_comm_s)} of {format_seconds(e.comm_s)})",
    )
    summary.add_row("MFU", f"{100 * e.mfu:.1f}%")
    m = e.memory_per_device_bytes
    limit = f" of {format_bytes(plan.memory_limit_bytes)}" if plan.memory_limit_bytes else ""
    summary.add_row(
        "memory / device",
        f"{format_bytes(m.total)}{limit}: params "
        f"{format_bytes(m.params)}, grads {format_bytes(m.grads)}, optimizer "
        f"{format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}",
    )
    s = plan.solver
    summary.add_row(
        "solver",
        f"{s.backend} {s.status} in {s.time_s:.2f} s, {s.variables} "
        f"variables, {s.constraints} constraints",
    )
    layouts = Table(
        title="parameter layouts (layer 0 stands for every identical layer)", title_justify="left"
    )
    layouts.add_column("parameter")
    layouts.add_column("shape")
    layouts.add_column("layout")
    layouts.add_column("optimizer state")
    axes = plan.mesh.axis_names
    for name, param in plan.params.items():
        parts = name.split(".")
        if any(part.isdigit() and part != "0" for part in parts):
            continue
        layouts.add_row(
            name,
            "x".join(map(str, param.shape)),
            escape(format_spec(param.param, axes, len(param.shape))),
            escape(format_spec(param.optimizer, axes, len(param.shape))),
        )
    tables = [summary, layouts]
    if plan.warnings:
        notes = Table(title="warnings", show_header=False, title_justify="left")
        notes.add_column("warning")
        for warning in plan.warnings:
            notes.add_row(escape(warning))
        tables.append(notes)
    return tables
