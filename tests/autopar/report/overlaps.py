"""Where the words of a drawn plan collide: text boxes that intersect, measured the way a
reader meets them (matplotlib's renderer for the PNG, a browser's layout for the page)."""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

TOUCH = 1.0  # pixels two boxes may share (anti-aliased edges) before they collide


@dataclass(frozen=True)
class Box:
    text: str
    left: float
    top: float
    right: float
    bottom: float

    def collides(self, other: Box) -> bool:
        wide = min(self.right, other.right) - max(self.left, other.left)
        tall = min(self.bottom, other.bottom) - max(self.top, other.top)
        return wide > TOUCH and tall > TOUCH


def collisions(boxes: list[Box]) -> list[tuple[str, str]]:
    """Every pair of boxes that intersect, by their words."""
    return [(a.text, b.text) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.collides(b)]


def figure_boxes(figure: Figure) -> list[Box]:
    """The visible, non-empty texts of ``figure`` as drawn (ticks, titles, labels, legend)."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = []
    unseen = _ticks_out_of_view(figure)
    for artist in figure.findobj(Text):
        if not artist.get_visible() or not artist.get_text().strip() or id(artist) in unseen:
            continue
        extent = artist.get_window_extent(renderer)
        if extent.width <= 0 or extent.height <= 0:
            continue
        # display coordinates grow upwards: flip to top and bottom
        boxes.append(Box(artist.get_text(), extent.x0, -extent.y1, extent.x1, -extent.y0))
    return boxes


def figure_outside(figure: Figure) -> list[str]:
    """Texts that run past the figure's edges (cut off in the picture)."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    width, height = canvas.get_width_height()
    return [
        box.text
        for box in figure_boxes(figure)
        if box.left < -TOUCH
        or box.right > width + TOUCH
        or -box.bottom < -TOUCH
        or -box.top > height + TOUCH
    ]


def _ticks_out_of_view(figure: Figure) -> set[int]:
    """Tick labels matplotlib keeps but does not draw: their tick is outside the view."""
    hidden = set()
    for ax in figure.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            margin = 1e-9 * max(abs(low), abs(high), 1.0)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - margin <= tick.get_loc() <= high + margin:
                    hidden.update((id(tick.label1), id(tick.label2)))
    return hidden
