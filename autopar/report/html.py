"""``autopar plan --report plan.html``: one self-contained HTML page and a PNG beside it.

The page carries its CSS and its pictures inline (SVG, its words as text a browser lays
out, finds and copies), so it can be mailed or attached to a review as one file. Three
views (``autopar.report.figures``): the pipeline timeline, memory per device against the
limit, the layouts per layer (also as a table, to search and copy). The PNG (``plan.png``
beside ``plan.html``) has the three on one page, for a README or a chat.
"""

from __future__ import annotations

import html
import io
import re
from pathlib import Path

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure

from autopar.report.figures import overview_figure, single_figure
from autopar.report.views import layout_rows, memory_bars, plan_mesh_axes, ranges, time_rows
from autopar.report.words import cautions, plan_in_words
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes, format_seconds
from autopar_plans.writes import write_atomic

STYLE = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222;
       max-width: 1200px; margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 2em; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 13px; }
th, td { border-bottom: 1px solid #e3e3e3; padding: 3px 10px; text-align: left; }
th { background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-family: "SFMono-Regular", Menlo, Consolas, monospace; font-size: 12px; }
figure.view { margin: 0.6em 0; } figure.view svg { width: 100%; height: auto; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8em; }
.card { background: #f7f9fc; border: 1px solid #e3e8f0; border-radius: 6px; padding: 0.5em 1em; }
.card b { display: block; font-size: 1.2em; }
.warn { color: #a04000; } .words { font-size: 1.05em; }
"""


def write_report(plan: Plan, path: str | Path) -> tuple[Path, Path]:
    """Write ``path`` (HTML) and the PNG beside it; returns both paths.

    Both are drawn in memory first and then each written whole or not at all
    (``autopar_plans.writes``), so a failure while drawing leaves both files as they were.
    """
    path = Path(path)
    png = path.with_suffix(".png")
    picture = _png(overview_figure(plan))
    page = report_html(plan)
    write_atomic(png, picture)
    write_atomic(path, page)
    return path, png


def report_html(plan: Plan) -> str:
    """The whole page as one string."""
    e = plan.estimate
    p = plan.parallelism
    title = f"{plan.model} on {plan.mesh.describe()}"
    cards = [
        ("step time", format_seconds(e.step_time_s)),
        ("MFU", f"{100 * e.mfu:.1f}%"),
        ("memory / device", format_bytes(e.memory_per_device_bytes.total)),
        ("parallelism", f"dp {p.dp} · tp {p.tp} · pp {p.pp} · sp {p.sp} · zero {p.zero}"),
        ("batch", f"{plan.global_batch} = {p.microbatches} × {plan.microbatch_size}"),
    ]
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>autopar plan: {html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="sub">{_solver_line(plan)}</p>',
        f'<p class="words">{html.escape(plan_in_words(plan))}</p>',
        *(f'<p class="warn">Caution: {html.escape(c)}</p>' for c in cautions(plan)),
        '<div class="cards">'
        + "".join(f'<div class="card">{k}<b>{html.escape(v)}</b></div>' for k, v in cards)
        + "</div>",
        '<h2 id="timeline">Pipeline timeline</h2>',
        "<p>Forward (blue) and backward (orange) of each microbatch on each stage, as the "
        f"{html.escape(p.schedule if p.pp > 1 else 'gradient accumulation')} schedule runs "
        "them from the plan's per-stage estimates; the hatched background is idle time, and "
        "the title gives the plan's bubble, the number in the table below. At hundreds of "
        "microbatches the steady state is one band per stage that counts what it holds.</p>",
        _image(single_figure(plan, "timeline"), "pipeline timeline"),
        _time_table(plan),
        '<h2 id="memory">Memory per device</h2>',
        _image(single_figure(plan, "memory"), "memory per device"),
        _memory_table(plan),
        '<h2 id="layouts">Layouts per layer</h2>',
        "<p>Each parameter's layout in the JAX spelling: the mesh axis that splits each "
        "tensor dim (<code>None</code>: whole). Identical layers share one row. On a mesh "
        "axis of one device (the outer axis inside a pipeline stage) every tensor is whole.</p>",
        _image(single_figure(plan, "layouts"), "parameter layouts"),
        _layouts_table(plan),
    ]
    if plan.warnings:
        parts.append("<h2>Warnings</h2><ul>")
        parts += [f'<li class="warn">{html.escape(w)}</li>' for w in plan.warnings]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _solver_line(plan: Plan) -> str:
    s = plan.solver
    return html.escape(
        f"{plan.optimizer}, {plan.precision}; solver {s.backend} {s.status} in {s.time_s:.2f} s "
        f"({s.variables} variables, {s.constraints} constraints)"
    )


def _image(figure: Figure, alt: str) -> str:
    """The figure as inline SVG that scales with the page, its text kept as text."""
    buffer = io.StringIO()
    FigureCanvasSVG(figure)
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "autopar"}):
        figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]  # no XML prolog or doctype inside HTML
    # as wide as drawn at most, narrower with the page (its height follows the viewBox)
    svg = re.sub(
        r'<svg([^>]*?) width="([^"]*)" height="[^"]*"',
        r'<svg\1 style="max-width: \2"',
        svg,
        count=1,
    )
    label = f'<svg role="img" aria-label="{html.escape(alt)}" '
    return f'<figure class="view">{svg.replace("<svg ", label, 1)}</figure>'


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    FigureCanvasAgg(figure)
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _table(header: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{html.escape(c)}</td>'
            if i in numeric
            else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _time_table(plan: Plan) -> str:
    step = plan.estimate.step_time_s or 1.0
    rows = [[n, format_seconds(v), f"{100 * v / step:.0f}%"] for n, v in time_rows(plan)]
    rows.append(["step", format_seconds(plan.estimate.step_time_s), "100%"])
    return _table(["part of the step", "time", "share"], rows, {1, 2})


def _memory_table(plan: Plan) -> str:
    limit = plan.memory_limit_bytes
    rows = [
        [
            bar.label,
            *(format_bytes(v) for v in (bar.params, bar.grads, bar.optimizer, bar.activations)),
            format_bytes(bar.total),
            f"{100 * bar.total / limit:.0f}%" if limit else "",
        ]
        for bar in memory_bars(plan)
    ]
    header = ["", "params", "grads", "optimizer", "activations", "total", "of limit"]
    bars = memory_bars(plan)
    if any(bar.host for bar in bars):  # offload: what each device keeps in host memory
        header.append("in host memory")
        for row, bar in zip(rows, bars, strict=True):
            row.append(format_bytes(bar.host))
    return _table(header, rows, set(range(1, len(header))))


def _layouts_table(plan: Plan) -> str:
    axes = plan_mesh_axes(plan)
    header = ["parameter", "layers", "shape", "layout", "gradient", "optimizer state"]
    if plan.stages:
        header.append("stage")
    rows = []
    for row in layout_rows(plan):
        cells = [
            row.name,
            row.layers,
            "×".join(map(str, row.shape)),
            row.spec("param", axes),
            row.spec("grad", axes),
            row.spec("optimizer", axes),
        ]
        if plan.stages:
            cells.append(row.stage)
        rows.append(cells)
    stages = ""
    if plan.stages:
        stage_rows = [
            [str(s.index), f"{s.layers[0]}-{s.layers[1]}", ranges(list(s.ranks))]
            for s in plan.stages
        ]
        stages = '<h3 id="stages">Pipeline stages</h3>' + _table(
            ["stage", "layers", "ranks"], stage_rows, set()
        )
    return _table(header, rows, set()) + stages
