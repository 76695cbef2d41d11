"""Terminal output shared by the subcommands: rich tables, colour only on a TTY."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autopar.report.views import (
    comm_sources,
    layout_rows,
    memory_bars,
    plan_mesh_axes,
    ranges,
    time_rows,
    what_in_words,
)
from autopar.report.words import cautions, plan_in_words
from autopar_passes.trace import GraphSummary
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes, format_count, format_flops, format_seconds


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


@contextlib.contextmanager
def working(message: str) -> Iterator[Callable[[str], None]]:
    """A status line with a spinner on stderr while something slow runs (tracing and solving
    a big model take minutes), only when stderr is a terminal: logs and pipes stay clean.
    Yields what says how far it got (``autopar.plan``'s ``progress=``): the line reads
    ``message: what``."""
    if not sys.stderr.isatty():
        yield lambda _: None
        return
    with console(stderr=True).status(f"{message} ...") as status:
        yield lambda what: status.update(f"{message}: {escape(what)}")


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
    """Everything ``autopar plan`` and ``autopar show`` print: the summary, where the step
    time goes, memory per device (per stage), the pipeline stages, the layouts per layer
    (identical layers folded into one row) and the warnings."""
    tables = [summary_of(plan), time_table(plan), memory_table(plan)]
    if plan.stages:
        tables.append(stages_table(plan))
    tables.append(layouts_table(plan))
    if plan.warnings:
        notes = Table(title="warnings", show_header=False, title_justify="left")
        notes.add_column("warning")
        for warning in plan.warnings:
            notes.add_row(escape(warning))
        tables.append(notes)
    return tables


def summary_of(plan: Plan) -> Table:
    """Parallelism, batch, step time, MFU, memory and the solver's report, one row each."""
    summary = Table(
        title=f"{plan.model} on {plan.mesh.describe()}", show_header=False, title_justify="left"
    )
    summary.add_column("what", style="bold")
    summary.add_column("value")
    p = plan.parallelism
    mixed = f" mixed={p.mixed}" if p.mixed > 1 else ""
    summary.add_row("plan", plan_in_words(plan))
    for caution in cautions(plan):
        summary.add_row("[yellow]caution[/yellow]", f"[yellow]{escape(caution)}[/yellow]")
    summary.add_row(
        "parallelism", f"dp={p.dp} tp={p.tp} sp={p.sp} pp={p.pp} ep={p.ep}{mixed} zero={p.zero}"
    )
    if p.pp > 1:
        chunks = f", {p.chunks} chunks per device" if p.chunks > 1 else ""
        summary.add_row(
            "pipeline", f"{p.pp} stages, {p.schedule}, {p.microbatches} microbatches{chunks}"
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
    if e.comm_bytes_per_step:
        kinds = sorted(e.comm_bytes_by_kind.items(), key=lambda item: -item[1])
        parts = ", ".join(f"{kind} {format_bytes(nbytes)}" for kind, nbytes in kinds)
        summary.add_row(
            "sent / device",
            f"{format_bytes(e.comm_bytes_per_step)} per step" + (f": {parts}" if parts else ""),
        )
    m = e.memory_per_device_bytes
    limit = f" of {format_bytes(plan.memory_limit_bytes)}" if plan.memory_limit_bytes else ""
    summary.add_row(
        "memory / device",
        f"{format_bytes(m.total)}{limit}: params "
        f"{format_bytes(m.params)}, grads {format_bytes(m.grads)}, optimizer "
        f"{format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}",
    )
    if plan.offload.active:
        summary.add_row("offload", offload_summary(plan))
    s = plan.solver
    summary.add_row(
        "solver",
        f"{s.backend} {s.status} in {s.time_s:.2f} s, {s.variables} "
        f"variables, {s.constraints} constraints",
    )
    return summary


def offload_summary(plan: Plan) -> str:
    """What the plan keeps in host memory, how much, and what moving it costs a step: the
    bytes each way, and where several kinds copy, each kind's share of them (read off
    ``Estimate.host`` by purpose)."""
    e = plan.estimate
    moved: dict[str, float] = {}
    by_purpose: dict[str, float] = {}
    for copy in e.host:
        moved[copy.direction] = moved.get(copy.direction, 0.0) + copy.bytes
        by_purpose[copy.purpose] = by_purpose.get(copy.purpose, 0.0) + copy.bytes
    copies = sum(c.exposed_s for c in e.host if c.purpose == "optimizer")
    shares = (
        " (" + ", ".join(f"{k} {format_bytes(b)}" for k, b in by_purpose.items()) + ")"
        if len(by_purpose) > 1
        else ""
    )
    return (
        f"{plan.offload.describe()} in host memory: {format_bytes(e.memory_per_device_bytes.host)}"
        f" per device; {format_bytes(moved.get('to_host', 0.0))} down and "
        f"{format_bytes(moved.get('to_device', 0.0))} up per step{shares}, "
        f"{format_seconds(e.offload_s)} of the step waits for the host link"
        + (
            f"; the optimizer steps on the CPU in {format_seconds(e.optimizer_s - copies)}"
            if plan.offload.optimizer
            else ""
        )
        + (
            "; every working copy comes up from the host twice a microbatch"
            if plan.offload.parameters
            else ""
        )
    )


def time_table(plan: Plan) -> Table:
    """Where one step's time goes, each part with its share."""
    table = Table(title="step time", title_justify="left")
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    step = plan.estimate.step_time_s or 1.0
    for name, value in time_rows(plan):
        table.add_row(name, format_seconds(value), f"{100 * value / step:.0f}%")
    table.add_row("step", format_seconds(plan.estimate.step_time_s), "100%", style="bold")
    hidden = plan.estimate.comm_s - plan.estimate.exposed_comm_s
    if hidden > 0:
        table.add_row("(communication hidden under compute)", format_seconds(hidden), "")
    return table


def memory_table(plan: Plan) -> Table:
    """Memory per device at the peak of a step, per pipeline stage, against the limit."""
    table = Table(title="memory per device", title_justify="left")
    for column in ("", "params", "grads", "optimizer", "activations", "total", "of limit"):
        table.add_column(column, justify="right" if column else "left")
    limit = plan.memory_limit_bytes
    bars = memory_bars(plan)
    hosted = any(bar.host for bar in bars)
    if hosted:  # offload: what each device keeps in host memory, beside its own
        table.add_column("in host memory", justify="right")
    for bar in bars:
        share = f"{100 * bar.total / limit:.0f}%" if limit else ""
        table.add_row(
            bar.label,
            format_bytes(bar.params),
            format_bytes(bar.grads),
            format_bytes(bar.optimizer),
            format_bytes(bar.activations),
            format_bytes(bar.total),
            share,
            *([format_bytes(bar.host)] if hosted else []),
        )
    return table


def stages_table(plan: Plan) -> Table:
    """The pipeline stages: layers, devices and time per microbatch (forward compute, the
    rest of its work, and its point-to-point with the neighbouring stages)."""
    table = Table(title="pipeline stages", title_justify="left")
    for column in ("stage", "layers", "ranks", "forward", "backward", "hand-off"):
        table.add_column(column, justify="left" if column in ("layers", "ranks") else "right")
    times = {s.stage: s for s in plan.estimate.stages}
    physical = plan.parallelism.pp
    for stage in plan.stages:
        first, last = stage.layers
        estimate = times.get(stage.index % physical)
        chunks = max(plan.parallelism.chunks, 1)
        table.add_row(
            str(stage.index),
            f"{first}-{last}" if last > first else str(first),
            ranges(list(stage.ranks)),
            format_seconds(estimate.forward_s / chunks) if estimate else "",
            format_seconds(estimate.backward_s / chunks) if estimate else "",
            format_seconds(estimate.handoff_s / chunks) if estimate else "",
        )
    return table


def layouts_table(plan: Plan) -> Table:
    """Parameter layouts in the JAX spelling, identical layers folded into one row."""
    axes = plan_mesh_axes(plan)
    on = f" on {', '.join(axes)}"
    table = Table(title=f"parameter layouts{on}", title_justify="left")
    table.add_column("parameter")
    table.add_column("layers")
    table.add_column("shape")
    table.add_column("layout")
    table.add_column("optimizer state")
    if plan.stages:
        table.add_column("stage")
    for row in layout_rows(plan):
        cells = [
            escape(row.name),
            row.layers,
            "x".join(map(str, row.shape)),
            escape(row.spec("param", axes)),
            escape(row.spec("optimizer", axes)),
        ]
        if plan.stages:
            cells.append(row.stage)
        table.add_row(*cells)
    return table


SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def comm_table(plan: Plan) -> Table:
    """The plan's ledger (``autopar_plans.ledger``): every collective a step issues, the sites of
    one shape folded into a row (phase, kind, axes, dtype, bytes per call, what hides it), the
    costliest first, with the totals the summary quotes."""
    rows: dict[tuple, list] = {}
    staged = plan.parallelism.pp > 1
    for e in plan.estimate.comm:
        key = (e.stage, e.phase, e.kind, e.axes, e.dtype, e.bytes_per_call, e.overlap)
        row = rows.setdefault(key, [0, 0, 0.0, 0.0, 0.0, e.what])
        row[0] += 1
        row[1] += e.calls_per_step
        row[2] += e.sent_per_step
        row[3] += e.time_s
        row[4] += e.exposed_s
    title = "communication per step (the ledger)"
    if staged:
        title += "; a pipeline's totals: its busiest stage's"
    table = Table(title=title, title_justify="left")
    if staged:
        table.add_column("stage", justify="right")
    table.add_column("phase")
    table.add_column("collective")
    for name in ("bytes/call", "calls", "time", "exposed"):
        table.add_column(name, justify="right")
    table.add_column("what (sites)")
    if not plan.estimate.comm:
        table.caption = "this plan communicates nothing (or was made before plans had a ledger)"
    ordered = sorted(rows.items(), key=lambda item: (item[0][0], -item[1][3]))
    for (stage, phase, kind, axes, dtype, nbytes, overlap), (
        sites,
        calls,
        _,
        time,
        exposed,
        what,
    ) in ordered:
        hidden = "" if overlap == "none" else f" (under {overlap})"
        table.add_row(
            *([str(stage)] if staged else []),
            phase,
            f"{kind} {','.join(axes)} {SHORT_DTYPES.get(dtype, dtype)}",
            format_bytes(nbytes),
            str(calls),
            format_seconds(time),
            format_seconds(exposed) + hidden,
            escape(what_in_words(plan, what)) + (f" (+{sites - 1})" if sites > 1 else ""),
        )
    e = plan.estimate
    table.add_row(
        *([""] if staged else []),
        "step",
        f"{format_bytes(e.comm_bytes_per_step)} sent",
        "",
        str(sum(c.calls_per_step for c in e.comm)),
        format_seconds(e.comm_s),
        format_seconds(e.exposed_comm_s),
        "",
        style="bold",
    )
    return table


def comm_sources_table(plan: Plan) -> Table:
    """What each kind of collective's bytes are spent on, its largest reasons first
    (``autopar.report.views.comm_sources``): the ops behind a large all-to-all volume."""
    staged = plan.parallelism.pp > 1
    title = "where each collective's bytes come from (per device a step"
    title += ", on the stage where each sends most)" if staged else ")"
    table = Table(title=title, title_justify="left")
    table.add_column("collective")
    table.add_column("what causes it")
    table.add_column("sent", justify="right")
    table.add_column("calls", justify="right")
    table.add_column("sites", justify="right")
    for row in comm_sources(plan):
        table.add_row(
            row.kind,
            escape(row.source),
            format_bytes(row.sent_per_step),
            str(row.calls_per_step),
            str(row.sites),
        )
    return table
