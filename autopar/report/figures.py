"""The report's three pictures of a plan, drawn with matplotlib (Agg, no pyplot state).

- ``draw_timeline``: the pipeline timeline (``autopar_cost_model.schedule.simulate``): each
  device's forward
  and backward of each microbatch; the hatched background left showing is the bubble;
- ``draw_memory``: memory per device (per stage), stacked params, grads, optimizer states
  and activations, against the memory limit;
- ``draw_layouts``: the parameter layouts per layer, one cell per mesh axis.

``overview_figure`` puts the three on one page (the PNG beside the HTML report).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from autopar.report.views import (
    MemoryBar,
    layout_rows,
    memory_bars,
    plan_mesh_axes,
    shown_axes,
    stage_times,
)
from autopar_cost_model.schedule import Task, makespan, simulate
from autopar_plans.placement import Partial, Replicate, Shard
from autopar_plans.plan import Plan
from autopar_plans.units import format_bytes, format_seconds

FORWARD = "#4C78A8"
BACKWARD = "#F58518"
STATES = ("#54A24B", "#88D27A", "#B279A2", "#E45756")  # params, grads, optimizer, activations
DIM_COLOURS = ("#4C78A8", "#54A24B", "#B279A2", "#F58518", "#72B7B2")
REPLICATED = "#E8E8E8"
PARTIAL = "#FF9DA6"
STEADY = "#8E7CB8"  # the timeline's band of steady-state blocks
MAX_LAYOUT_ROWS = 28
MAX_LABELLED_BARS = 6  # memory bars each labelled with their total; above, the peak only
MAX_STAGE_TICKS = 16
ZOOM_BLOCKS = 48  # blocks per timeline row above which the steady state becomes a band
ZOOM_KEEP = 6  # steady blocks drawn on each side of the band
ZOOM_BAND = 0.12  # the band's width, a share of the time drawn around it


def draw_timeline(ax: Axes, plan: Plan) -> None:
    """Forward and backward of every microbatch on every pipeline device, bubbles visible.

    At many microbatches a block would be thinner than a pixel: the first and last few
    (the warm-up and the cool-down, where the bubble is) are drawn whole and the steady
    state between them is one band per device that says how many it holds (``Zoom``)."""
    p = plan.parallelism
    stages = max(p.pp, 1)
    forward, backward = stage_times(plan)
    schedule = p.schedule if stages > 1 else "none"
    tasks = simulate(schedule, stages, p.microbatches, p.chunks, forward, backward)
    span = makespan(tasks)
    zoom = Zoom.of(tasks, stages)
    scale, unit = _time_unit(span)
    shown = zoom.at(span)
    for device in range(stages):
        ax.barh(
            device,
            shown * scale,
            left=0,
            height=0.8,
            color="white",
            edgecolor="#BBBBBB",
            hatch="///",
            linewidth=0,
        )
    char_width = shown * scale / 180  # a 7-point digit, as a share of the axis
    for task in tasks:
        if zoom.hides(task):
            continue
        start, end = zoom.at(task.start), zoom.at(task.end)
        width = (end - start) * scale
        shade = 1.0 - 0.35 * (task.chunk // stages) / max(p.chunks - 1, 1) if p.chunks > 1 else 1
        colour = FORWARD if task.kind == "F" else BACKWARD
        ax.barh(
            task.device,
            width,
            left=start * scale,
            height=0.8,
            color=colour,
            alpha=shade,
            edgecolor="white",
            linewidth=0.5,
        )
        if width > char_width * (len(str(task.microbatch)) + 1):
            ax.text(
                start * scale + width / 2,
                task.device,
                str(task.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    if zoom.active:
        for device, (forwards, backwards) in enumerate(zoom.hidden_per_device(tasks, stages)):
            ax.barh(
                device,
                zoom.band * scale,
                left=zoom.start * scale,
                height=0.8,
                color=STEADY,
                edgecolor="white",
                linewidth=0.5,
            )
            ax.text(
                (zoom.start + zoom.band / 2) * scale,
                device,
                f"{forwards} fwd · {backwards} bwd",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
        ticks = _zoomed_ticks(zoom, span)
        ax.set_xticks([zoom.at(t) * scale for t in ticks])
        ax.set_xticklabels([f"{t * scale:.3g}" for t in ticks])
    ax.set_yticks(range(stages))
    ax.set_yticklabels([f"stage {s}" if stages > 1 else "every device" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, shown * scale * 1.01 if shown else 1)
    gap = "; the middle band stands for the steady state, not to scale" if zoom.active else ""
    ax.set_xlabel(f"time in one step ({unit}; gradient sync not shown{gap})")
    what = (
        f"{stages} stages, {schedule}, {p.microbatches} microbatches"
        + (f", {p.chunks} chunks per device" if p.chunks > 1 else "")
        if stages > 1
        else f"no pipeline: {p.microbatches} microbatch(es), gradient accumulation"
    )
    # the plan's own bubble figure, the one the step-time table shows (docs/cli.md)
    bubble = plan.estimate.bubble_s
    share = bubble / plan.estimate.step_time_s if plan.estimate.step_time_s else 0.0
    said = f"; bubble {format_seconds(bubble)} ({100 * share:.0f}% of the step)" if bubble else ""
    ax.set_title(f"Pipeline timeline: {what}{said}", loc="left", fontsize=11, pad=20)
    handles = [
        Patch(color=FORWARD, label="forward"),
        Patch(color=BACKWARD, label="backward"),
    ]
    if zoom.active:
        handles.append(Patch(color=STEADY, label="steady state (counted)"))
    if stages > 1:
        handles.append(Patch(facecolor="white", edgecolor="#BBBBBB", hatch="///", label="idle"))
    ax.legend(
        handles=handles,
        loc="lower right",
        fontsize=8,
        ncols=len(handles),
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
        borderaxespad=0.2,
    )


@dataclass(frozen=True)
class Zoom:
    """The part of a timeline drawn as one band: from ``start`` to ``end`` in schedule
    seconds, shown ``band`` wide. Inactive (nothing cut) when every block is wide enough."""

    start: float = 0.0
    end: float = 0.0
    band: float = 0.0

    @property
    def active(self) -> bool:
        return self.end > self.start

    @classmethod
    def of(cls, tasks: Sequence[Task], stages: int, keep: int = ZOOM_KEEP) -> Zoom:
        """Keep each device's warm-up and ``keep`` blocks after it, the same before its
        cool-down; cut where more than ``ZOOM_BLOCKS`` blocks would share one row."""
        rows: dict[int, list[Task]] = {}
        for task in tasks:
            rows.setdefault(task.device, []).append(task)
        if max((len(row) for row in rows.values()), default=0) <= ZOOM_BLOCKS:
            return cls()
        edge = 2 * stages + keep  # the warm-up's forwards and a few steady blocks
        start = end = None
        for row in rows.values():
            row.sort(key=lambda t: t.start)
            if len(row) <= 2 * edge:
                return cls()
            first, last = row[edge - 1].end, row[len(row) - edge].start
            start = first if start is None else max(start, first)
            end = last if end is None else min(end, last)
        if start is None or end is None or end <= start:
            return cls()
        kept = makespan(list(tasks)) - (end - start)
        return cls(start, end, ZOOM_BAND * kept)

    def at(self, t: float) -> float:
        """Where schedule time ``t`` is drawn."""
        if not self.active or t <= self.start:
            return t
        if t >= self.end:
            return t - (self.end - self.start) + self.band
        return self.start + self.band * (t - self.start) / (self.end - self.start)

    def hides(self, task: Task) -> bool:
        """A block that overlaps the band is in its count, not drawn."""
        return self.active and task.end > self.start and task.start < self.end

    def hidden_per_device(self, tasks: Sequence[Task], stages: int) -> list[tuple[int, int]]:
        """Per device, the forwards and backwards in the band."""
        counts = [[0, 0] for _ in range(stages)]
        for task in tasks:
            if self.hides(task):
                counts[task.device][task.kind == "B"] += 1
        return [(f, b) for f, b in counts]


def _zoomed_ticks(zoom: Zoom, span: float) -> list[float]:
    """Schedule times for the axis: nice ticks before the band and after it."""
    locator = MaxNLocator(nbins=4)
    scale, _ = _time_unit(span)
    before = [
        t / scale
        for t in locator.tick_values(0, zoom.start * scale)
        if 0 <= t / scale <= zoom.start
    ]
    after = [
        t / scale
        for t in locator.tick_values(zoom.end * scale, span * scale)
        if zoom.end <= t / scale <= span
    ]
    return before + after


def draw_memory(ax: Axes, plan: Plan) -> None:
    """Stacked memory per device, per stage, with the limit as a dashed line."""
    bars = memory_bars(plan)
    peak = max((bar.total for bar in bars), default=0.0)
    limit = plan.memory_limit_bytes
    top = max(peak, limit or 0.0) if limit and limit < 10 * peak else peak
    scale, unit = _byte_unit(top or 1.0)
    names = ("params", "grads", "optimizer", "activations")
    bottoms = [0.0] * len(bars)
    for name, colour in zip(names, STATES, strict=True):
        values = [getattr(bar, name) * scale for bar in bars]
        ax.bar(range(len(bars)), values, bottom=bottoms, color=colour, label=name, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    labelled = range(len(bars)) if len(bars) <= MAX_LABELLED_BARS else [_peak(bars)]
    for i in labelled:
        bar = bars[i]
        # under offload, what the device keeps in host memory too (not in the bar)
        label = format_bytes(bar.total) + (f"\n+ {format_bytes(bar.host)} host" if bar.host else "")
        if len(bars) > MAX_LABELLED_BARS:
            label = f"peak {label}"
        # a label over the first or last bar reads inwards, not past the frame
        ha = "center" if 0 < i < len(bars) - 1 or len(bars) == 1 else ("left", "right")[i > 0]
        x = i + {"center": 0.0, "left": -0.3, "right": 0.3}[ha]
        ax.text(x, bar.total * scale, label, ha=ha, va="bottom", fontsize=8)
    if len(bars) > 1 and all(bar.label.startswith("stage ") for bar in bars):
        # stages by number under an axis title: "stage 12" per bar runs together at 16
        step = max(1, -(-len(bars) // MAX_STAGE_TICKS))
        ticks = list(range(0, len(bars), step))
        ax.set_xticks(ticks)
        ax.set_xticklabels([bar.label.removeprefix("stage ") for bar in (bars[i] for i in ticks)])
        ax.set_xlabel("pipeline stage")
    else:
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([bar.label for bar in bars])
    ax.set_ylabel(f"per device ({unit})")
    if limit and limit < 10 * peak:
        ax.axhline(limit * scale, color="black", linestyle="--", linewidth=1)
        ax.text(  # x in axes fraction, y in data: inside the frame whatever the bar count
            0.01,
            limit * scale,
            f"limit {format_bytes(limit)}",
            transform=ax.get_yaxis_transform(),
            ha="left",
            va="bottom",
            fontsize=8,
        )
        ax.set_ylim(0, max(peak, limit) * scale * 1.35)
    else:
        ax.set_ylim(0, (peak or 1.0) * scale * 1.35)
        if limit:
            ax.text(
                0.01,
                0.97,
                f"limit {format_bytes(limit)} (off the scale)",
                transform=ax.transAxes,
                ha="left",
                va="top",
                fontsize=8,
            )
    ax.set_title("Memory per device at the peak of a step", loc="left", fontsize=11)
    ax.legend(fontsize=8, loc="upper right", ncols=2, frameon=False)


def _peak(bars: Sequence[MemoryBar]) -> int:
    return max(range(len(bars)), key=lambda i: bars[i].total)


def draw_layouts(ax: Axes, plan: Plan) -> None:
    """A grid: one row per parameter (identical layers folded), one cell per mesh axis."""
    axes = plan_mesh_axes(plan)
    sizes = (plan.stage_mesh or plan.mesh).shape
    rows = layout_rows(plan)
    shown = rows[:MAX_LAYOUT_ROWS]
    zero = any(row.optimizer != row.param for row in rows)
    kept = shown_axes(plan)  # an axis of one device keeps every tensor whole: no column
    columns = [(a, "param") for a in kept]
    if zero:
        columns += [(a, "optimizer") for a in kept]
    for r, row in enumerate(shown):
        for c, (axis, which) in enumerate(columns):
            placement = getattr(row, which)[axis]
            colour, text = _placement_cell(placement)
            ax.add_patch(_cell(c, r, colour))
            ax.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(shown), 0)
    ax.set_xticks([c + 0.5 for c in range(len(columns))])
    ax.set_xticklabels(
        [
            f"{axes[a]} ({sizes[a]})" + ("" if which == "param" else "\n(optim.)")
            for a, which in columns
        ],
        fontsize=8,
    )
    ax.xaxis.tick_top()
    ax.set_yticks([r + 0.5 for r in range(len(shown))])
    ax.set_yticklabels(
        [
            f"{row.name}" + (f"  [{row.layers}]" if row.layers and "*" in row.name else "")
            for row in shown
        ],
        fontsize=7,
    )
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    more = f" (first {len(shown)} of {len(rows)})" if len(rows) > len(shown) else ""
    ax.set_title(f"Parameter layouts per mesh axis{more}", loc="left", fontsize=11, pad=22)
    if not columns:  # every axis of one device: nothing is split
        ax.text(0.5, 0.5, "every tensor whole on every device", ha="center", transform=ax.transAxes)


def overview_figure(plan: Plan, dpi: int = 80) -> Figure:
    """The three views on one page: timeline on top, memory and layouts below."""
    rows = min(len(layout_rows(plan)), MAX_LAYOUT_ROWS)
    stages = max(plan.parallelism.pp, 1)
    timeline_h = 1.6 + 0.45 * stages
    bottom_h = max(3.6, 0.22 * rows + 1.2)
    figure = Figure(figsize=(13, timeline_h + bottom_h + 0.9), dpi=dpi)
    grid = figure.add_gridspec(2, 2, height_ratios=[timeline_h, bottom_h], width_ratios=[1, 1.25])
    draw_timeline(figure.add_subplot(grid[0, :]), plan)
    draw_memory(figure.add_subplot(grid[1, 0]), plan)
    draw_layouts(figure.add_subplot(grid[1, 1]), plan)
    e = plan.estimate
    figure.suptitle(
        f"{plan.model} on {plan.mesh.describe()}: {format_seconds(e.step_time_s)} per step, "
        f"MFU {100 * e.mfu:.0f}%",
        x=0.01,
        ha="left",
        fontsize=13,
        fontweight="bold",
    )
    figure.tight_layout()
    return figure


def single_figure(plan: Plan, view: str, dpi: int = 100) -> Figure:
    """One view on its own (``timeline``, ``memory`` or ``layouts``), for the HTML report."""
    if view == "timeline":
        figure = Figure(figsize=(12, 1.6 + 0.45 * max(plan.parallelism.pp, 1)), dpi=dpi)
        draw_timeline(figure.add_subplot(), plan)
    elif view == "memory":
        figure = Figure(figsize=(7, 4), dpi=dpi)
        draw_memory(figure.add_subplot(), plan)
    else:
        rows = min(len(layout_rows(plan)), MAX_LAYOUT_ROWS)
        figure = Figure(figsize=(8, 0.24 * rows + 1.4), dpi=dpi)
        draw_layouts(figure.add_subplot(), plan)
    figure.tight_layout()
    return figure


def _cell(x: float, y: float, colour: str):  # type: ignore[no-untyped-def]
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.03, y + 0.06), 0.94, 0.88, color=colour, linewidth=0)


def _placement_cell(placement: Shard | Replicate | Partial) -> tuple[str, str]:
    if isinstance(placement, Shard):
        return DIM_COLOURS[placement.dim % len(DIM_COLOURS)] + "99", f"split dim {placement.dim}"
    if isinstance(placement, Partial):
        return PARTIAL, "partial"
    return REPLICATED, "whole"


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _byte_unit(size: float) -> tuple[float, str]:
    for unit, value in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= value:
            return 1 / value, unit
    return 1.0, "B"


__all__: Sequence[str] = (
    "draw_layouts",
    "draw_memory",
    "draw_timeline",
    "overview_figure",
    "single_figure",
)
