"""Terminal output shared by the subcommands: rich tables, colour only on a TTY."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from passes.trace import GraphSummary
from plans.units import format_bytes, format_count, format_flops


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
