"""The report as a person sees it: no two words drawn over each other in any view, in the
PNG or in the page laid out by a browser at two widths; the timeline readable at hundreds
of microbatches; one number for the bubble wherever it is shown."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import autopar
from autopar.report.figures import Zoom, overview_figure, single_figure
from autopar.report.html import write_report
from autopar.report.views import stage_times
from autopar_cost_model.schedule import simulate
from autopar_examples.models import build
from autopar_plans.plan import Plan
from autopar_plans.units import format_seconds
from tests.autopar.report.browser import INSTALL, chromium, measure, screenshot
from tests.autopar.report.overlaps import collisions, figure_boxes, figure_outside

WIDTHS = (1280, 720)  # a laptop's browser window, and half a wide screen


@pytest.fixture(scope="module")
def deep() -> Plan:
    """16 pipeline stages (one node of 2 each) and 512 microbatches: the views at their
    most crowded (16 memory bars, 16 timeline rows of 1,024 blocks each)."""
    model, inputs = build("gpt-tiny", n_layer=16, device="meta", batch_size=1)
    mesh = autopar.Mesh.cluster(nodes=16, gpus_per_node=2, device="h100-sxm")
    hints = {"pipeline": {"stages": 16, "microbatches": 512}}
    return autopar.plan(model, mesh, inputs, global_batch=512, hints=hints)


@pytest.fixture(scope="module")
def flat() -> Plan:
    """No pipeline, a 2x2 mesh: one memory bar, one timeline row."""
    model, inputs = build("gpt-tiny", device="meta", batch_size=4)
    return autopar.plan(model, autopar.Mesh((2, 2), device="h100-sxm"), inputs, global_batch=8)


@pytest.fixture(params=["deep", "flat"])
def plan(request: pytest.FixtureRequest) -> Plan:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def pages(deep: Plan, flat: Plan, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each plan's report, written once."""
    folder = tmp_path_factory.mktemp("reports")
    return {
        name: write_report(made, folder / f"{name}.html")[0]
        for name, made in (("deep", deep), ("flat", flat))
    }


@pytest.mark.parametrize("view", ["overview", "timeline", "memory", "layouts"])
def test_no_two_words_of_a_figure_overlap_or_leave_it(plan: Plan, view: str) -> None:
    figure = overview_figure(plan) if view == "overview" else single_figure(plan, view)
    assert collisions(figure_boxes(figure)) == []
    assert figure_outside(figure) == []


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["deep", "flat"])
def test_the_page_in_a_browser_has_no_overlapping_words(
    pages: dict[str, Path], name: str, width: int, tmp_path: Path
) -> None:
    """Laid out by Chromium: every run of the page's text and every word of its (inline
    SVG) figures, no two boxes intersecting, and nothing wider than the window. The
    screenshot is kept under ``$AUTOPAR_SCREENSHOTS`` when set, to look at."""
    if chromium() is None:
        pytest.skip(INSTALL)
    boxes, page_width = measure(pages[name], width, tmp_path)
    assert len(boxes) > 100  # the figures' words are in it, not pictures of them
    assert collisions(boxes) == []
    assert page_width <= width
    keep = os.environ.get("AUTOPAR_SCREENSHOTS")
    if keep:
        shot = screenshot(pages[name], width, tmp_path / f"{name}-{width}.png")
        shutil.copy(shot, Path(keep) / shot.name)


def test_hundreds_of_microbatches_show_the_ends_and_count_the_middle(deep: Plan) -> None:
    """At 512 microbatches the warm-up and the cool-down are drawn block by block; the
    steady state between them is one band per stage that counts what it stands for, and
    the blocks drawn and counted are all of them."""
    p = deep.parallelism
    forward, backward = stage_times(deep)
    tasks = simulate(p.schedule, p.pp, p.microbatches, p.chunks, forward, backward)
    zoom = Zoom.of(tasks, p.pp)
    assert zoom.active
    drawn = [t for t in tasks if not zoom.hides(t)]
    counted = zoom.hidden_per_device(tasks, p.pp)
    assert len(drawn) + sum(f + b for f, b in counted) == len(tasks) == 2 * 16 * 512
    assert {t.microbatch for t in drawn} >= {0, 1, 510, 511}
    assert all(f > 400 and b > 400 for f, b in counted)
    figure = single_figure(deep, "timeline")
    words = {box.text for box in figure_boxes(figure)}
    assert any(" fwd · " in w for w in words)


def test_a_short_schedule_is_drawn_whole(flat: Plan) -> None:
    p = flat.parallelism
    forward, backward = stage_times(flat)
    tasks = simulate("none", 1, p.microbatches, 1, forward, backward)
    assert not Zoom.of(tasks, 1).active


def test_the_bubble_is_one_number_in_every_view(deep: Plan, pages: dict[str, Path]) -> None:
    """The timeline's title and the step-time table show the plan's bubble, the same
    figure (docs/cli.md defines it); no other idle share is printed."""
    figure = single_figure(deep, "timeline")
    title = figure.axes[0].get_title(loc="left")
    bubble = format_seconds(deep.estimate.bubble_s)
    assert f"bubble {bubble}" in title
    page = pages["deep"].read_text()
    assert f'<td class="num">{bubble}</td>' in page
    assert "idle " not in title


def test_axes_of_one_device_have_no_column_and_the_stages_a_heading(
    deep: Plan, pages: dict[str, Path]
) -> None:
    """Inside a stage the node axis is one device: every tensor is whole on it, so the
    layout grid leaves it out; the stage table is titled."""
    figure = single_figure(deep, "layouts")
    headers = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert headers and not any(h.startswith("node") for h in headers)
    assert deep.parallelism.axis_roles[0] == ""  # nor has it a role in the plan's words
    page = pages["deep"].read_text()
    assert '<h3 id="stages">Pipeline stages</h3>' in page
