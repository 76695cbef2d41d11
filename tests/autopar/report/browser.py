"""A headless Chromium (Debian's ``chromium`` package) that lays out a report page as a
reader's browser would: the boxes of its words, whether it fits the window, a screenshot.

The page is measured by a script appended to a copy of it: every run of HTML text (its
line boxes, from a ``Range``) and every SVG ``<text>`` (the figures' words) as a box in
CSS pixels, printed into the DOM that ``--dump-dom`` returns."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.autopar.report.overlaps import Box

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
INSTALL = (
    "the report's browser tests need Chromium: .ci/run installs Debian's package "
    "(apt-get install chromium); without it they cannot run here"
)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio")

MEASURE = """
<script>
(() => {
  const boxes = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const parent = node.parentElement;
    if (!node.textContent.trim() || parent.closest("script, style, svg")) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    for (const r of range.getClientRects()) {
      if (r.width > 0 && r.height > 0)
        boxes.push([node.textContent.trim(), r.left, r.top, r.right, r.bottom]);
    }
  }
  for (const text of document.querySelectorAll("svg text")) {
    const r = text.getBoundingClientRect();
    if (text.textContent.trim() && r.width > 0 && r.height > 0)
      boxes.push([text.textContent.trim(), r.left, r.top, r.right, r.bottom]);
  }
  const page = {boxes: boxes, scrollWidth: document.documentElement.scrollWidth,
                innerWidth: window.innerWidth};
  const out = document.createElement("pre");
  out.id = "autopar-measure";
  out.textContent = JSON.stringify(page);
  document.body.appendChild(out);
})();
</script>
"""


def chromium() -> str | None:
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


def measure(page: Path, width: int, folder: Path, height: int = 2400) -> tuple[list[Box], int]:
    """The page's text boxes at a window ``width`` pixels wide, and the width it takes
    (more than ``width``: it scrolls sideways); the measuring copy goes in ``folder``."""
    browser = chromium()
    assert browser is not None, INSTALL
    measured = folder / f"{page.stem}.measure{width}.html"
    text = page.read_text(encoding="utf-8")
    measured.write_text(text.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    done = subprocess.run(
        [browser, *FLAGS, f"--window-size={width},{height}", "--dump-dom", measured.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = done.stdout.split('<pre id="autopar-measure">', 1)[1].split("</pre>", 1)[0]
    data = json.loads(found.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    boxes = [Box(t, left, top, right, bottom) for t, left, top, right, bottom in data["boxes"]]
    return boxes, int(data["scrollWidth"])


def screenshot(page: Path, width: int, out: Path, height: int = 2400) -> Path:
    browser = chromium()
    assert browser is not None, INSTALL
    subprocess.run(
        [browser, *FLAGS, f"--window-size={width},{height}", f"--screenshot={out}", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    return out
