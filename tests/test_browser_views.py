"""Every view fits the output area, in JupyterLab in headless Chromium, at the widths people use.

The views of tests/browser_scenes.py's VIEWS run in one notebook at a wide output area (about
1200 px: JupyterLab on a large screen), then the window is narrowed twice without rerunning
(about 860 px: the file browser open on a laptop; about 600 px: a narrow Notebook 7 column),
as a user resizes. At each width, for each view:

- every drawn element (plotly's SVG, legends, titles, tick labels, colour bars, tables and
  widgets) lies inside the output area, and each legend inside its figure;
- y tick labels end left of the plot area (not under a heat map), each figure has its data,
  and a box that holds one figure is no taller than it (no empty band under it);
- table headers do not run together (padding between them) and are not cut off (a table
  wider than a narrow area, even with its cells wrapped, scrolls inside a box that fits);
- the tensor panels fill their rows evenly (4 panels as 1 x 4 or 2 x 2, never 3 + 1).

And the browser console holds no warning or error from the views (plotly's, the widgets'),
from the run and from every resize. With LABKIT_SCREENSHOTS=folder each view is saved there as
`<name>.png` at the middle width (what docs/screenshots holds):

    LABKIT_SCREENSHOTS=docs/screenshots pytest tests/test_browser_views.py

Skips (with the reason) when /usr/bin/chromium or the playwright package is missing.
"""

from __future__ import annotations

import os
import sys

import nbformat
import pytest
import test_browser
from browser_scenes import VIEW_SETUP, VIEWS
from test_browser import _code_cells, _launch, _open, _run_all, _screenshot, _wait_all_ran

server = test_browser.server  # the fixtures, shared with tests/test_browser.py
jupyter = test_browser.jupyter

pytestmark = pytest.mark.browser

WIDTHS = (1200, 860, 600)  # output area widths checked, widest first (the run's)
PICTURE_WIDTH = 860  # the screenshots' width
# SCENES in tests/browser_scenes.py saves progress.png (its whole cell); one tensors.png is enough
NO_PICTURE = {"progress", "tensor_bars"}
MAX_PNG_BYTES = 150_000

# Console lines that are JupyterLab's own, not the views' (they come with every notebook).
JUPYTER_NOISE = (
    "Failed to load resource",  # the favicon, a missing optional settings file
    "[Violation]",
    "to activate",  # "Plugin @jupyterlab/... is taking too long to activate" on a busy machine
)

# Run in the page on one view's output area: a list of what does not fit, in words.
CHECK_FIT = """(area) => {
    const problems = [];
    const out = area.querySelector('.jp-OutputArea-output');
    if (!out) return ['no output'];
    const box = out.getBoundingClientRect();
    const shown = (el) => {
        const r = el.getBoundingClientRect();
        return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== 'hidden';
    };
    const name = (el) => el.getAttribute('class') || el.tagName;
    const inside = (r, b, slack) => r.left >= b.left - slack && r.right <= b.right + slack
        && r.top >= b.top - slack && r.bottom <= b.bottom + slack;
    const fmt = (r) => `[${Math.round(r.left)}, ${Math.round(r.right)}] x `
        + `[${Math.round(r.top)}, ${Math.round(r.bottom)}]`;
    const selectors = ['.main-svg', '.legend', '.gtitle', '.xtick text', '.ytick text',
        '.g-xtitle', '.g-ytitle', '.colorbar', 'table', 'th', '.widget-box > *',
        '.widget-html', '.widget-label', '.widget-button', '.widget-progress'];
    for (const sel of selectors) {
        for (let el of out.querySelectorAll(sel)) {
            // a table too wide for a narrow area scrolls inside its own box: that box must fit
            if (sel === 'table' || sel === 'th') el = el.closest('.labkit-scroll') || el;
            if (!shown(el)) continue;
            const r = el.getBoundingClientRect();
            if (!inside(r, {left: box.left, right: box.right, top: -1e9, bottom: 1e9}, 1))
                problems.push(`${sel} '${name(el)}' ${fmt(r)} outside the output area ${fmt(box)}`);
        }
    }
    for (const plot of out.querySelectorAll('.js-plotly-plot')) {
        if (!(plot.data && plot.data.length)) problems.push('a figure drawn without its data');
        const holder = plot.parentElement;  // a box holding the figure alone: no empty band
        if (holder && holder.children.length === 1 && shown(holder)) {
            const gap = holder.getBoundingClientRect().height - plot.getBoundingClientRect().height;
            if (gap > 8) problems.push(`${Math.round(gap)} px of empty box under a figure`);
        }
        const svg = plot.querySelector('.main-svg');
        if (!svg) { problems.push('a figure without its SVG'); continue; }
        const fig = svg.getBoundingClientRect();
        for (const sel of ['.legend', '.gtitle', '.colorbar', '.g-xtitle', '.g-ytitle']) {
            for (const el of plot.querySelectorAll(sel)) {
                if (shown(el) && !inside(el.getBoundingClientRect(), fig, 1))
                    problems.push(`${sel} ${fmt(el.getBoundingClientRect())} cut off by its `
                        + `figure ${fmt(fig)}`);
            }
        }
        for (const drag of plot.querySelectorAll('.draglayer .xy .nsewdrag')) {
            const left = drag.getBoundingClientRect().left;
            for (const t of plot.querySelectorAll('.yaxislayer-above .ytick text')) {
                const r = t.getBoundingClientRect();
                if (shown(t) && r.right > left + 1 && r.left < left)
                    problems.push(`y tick label '${t.textContent}' ${fmt(r)} runs under the `
                        + `plot area (left edge ${Math.round(left)})`);
            }
        }
    }
    for (const th of out.querySelectorAll('th')) {
        if (!shown(th) || !th.textContent) continue;
        const s = getComputedStyle(th);
        const pad = parseFloat(s.paddingLeft) + parseFloat(s.paddingRight);
        if (pad < 8) problems.push(`header '${th.textContent}' has ${pad} px of padding`);
        if (th.scrollWidth > th.clientWidth + 1)
            problems.push(`header '${th.textContent}' is cut off`);
    }
    return problems;
}"""

# The tensor panels' rows: how many panels each row of the grid holds.
PANEL_ROWS = """(area) => {
    const panels = '.jp-OutputArea-output [class*=lk-tensor-grid] .js-plotly-plot';
    const tops = [...area.querySelectorAll(panels)]
        .map(p => Math.round(p.getBoundingClientRect().top));
    const rows = {};
    for (const t of tops) rows[t] = (rows[t] || 0) + 1;
    return Object.keys(rows).sort((a, b) => a - b).map(k => rows[k]);
}"""


def _views_notebook(path: str) -> list[tuple[str, int]]:
    """Write the views' notebook: each view's name with the index of its code cell."""
    cells = [nbformat.v4.new_code_cell(src) for src in VIEW_SETUP]
    marks = []
    for name, sources in VIEWS:
        cells += [nbformat.v4.new_code_cell(src) for src in sources]
        marks.append((name, len(cells) - 1))
    cells.append(nbformat.v4.new_code_cell("lab.stop()"))
    nb = nbformat.v4.new_notebook(cells=cells)
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["kernelspec"] = kernel
    nbformat.write(nb, path)
    return marks


def _output_width(page, cell) -> float:
    return cell.locator(".jp-OutputArea-output").first.evaluate(
        "el => el.getBoundingClientRect().width"
    )


def _resize(page, cell, width: int) -> None:
    """Resize the window so that `cell`'s output area is about `width` px wide, and wait for
    the figures to follow (plotly redraws on the window's resize, after a short delay)."""
    viewport = page.viewport_size
    for _ in range(3):  # the chrome around the output area is constant: one correction is enough
        now = _output_width(page, cell)
        if abs(now - width) <= 8:
            break
        page.set_viewport_size({"width": int(viewport["width"] + width - now), "height": 1000})
        viewport = page.viewport_size
        page.wait_for_timeout(600)
    page.wait_for_timeout(1200)


def _picture(page, output, png: str) -> None:
    """Save `output` as `png`; a view taller than the window gets a window tall enough for it
    for the picture (else the picture ends in JupyterLab's status bar), then the old one back."""
    viewport = page.viewport_size
    height = output.evaluate("el => el.getBoundingClientRect().height")
    if height > viewport["height"] - 300:
        page.set_viewport_size({"width": viewport["width"], "height": int(height) + 400})
        page.wait_for_timeout(1500)  # the figures follow the window's resize after a delay
    try:
        output.scroll_into_view_if_needed()
        output.screenshot(path=png, animations="disabled")
    finally:
        if page.viewport_size != viewport:
            page.set_viewport_size(viewport)
            page.wait_for_timeout(600)


def _views_console(messages: list[tuple[str, str]]) -> list[str]:
    return [
        f"{kind}: {text}"
        for kind, text in messages
        if kind in ("warning", "error") and not any(n in text for n in JUPYTER_NOISE)
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("jupyter", [("views.ipynb", "lab")], indirect=True)
def test_views_fit_the_output_area_and_log_nothing(jupyter) -> None:
    from playwright.sync_api import sync_playwright

    url, path = jupyter
    marks = _views_notebook(path)
    folder = os.environ.get("LABKIT_SCREENSHOTS")
    with sync_playwright() as pw:
        browser = _launch(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        messages: list[tuple[str, str]] = []
        page.on("console", lambda m: messages.append((m.type, m.text)))
        step = "views open"
        try:
            _open(page, url)
            page.add_style_tag(content=".Toastify {display: none !important}")  # news toasts
            page.keyboard.press("Control+b")  # hide the file browser
            step = "views run all"
            _run_all(page)
            _wait_all_ran(page, len(VIEW_SETUP) + sum(len(c) for _, c in VIEWS) + 1, 400_000)
            page.mouse.move(0, 0)
            first = _code_cells(page).nth(marks[0][1])
            problems: list[str] = []
            for width in WIDTHS:
                step = f"views at {width} px"
                _resize(page, first, width)
                for name, index in marks:
                    cell = _code_cells(page).nth(index)
                    cell.scroll_into_view_if_needed()
                    page.wait_for_timeout(200)
                    area = cell.locator(".jp-OutputArea").first
                    text = area.inner_text()
                    assert "Error displaying widget" not in text and "Traceback" not in text, (
                        f"{name}: {text[:500]}"
                    )
                    found = area.evaluate(CHECK_FIT)
                    problems += [f"{name} at {width} px: {p}" for p in found]
                    if name.startswith("tensor"):
                        rows = area.evaluate(PANEL_ROWS)
                        if sum(rows) != 4 or len(set(rows)) != 1:
                            problems.append(f"{name} at {width} px: panels per row {rows}")
                    if folder and width == PICTURE_WIDTH and name not in NO_PICTURE:
                        png = os.path.join(folder, f"{name}.png")
                        os.makedirs(folder, exist_ok=True)
                        _picture(page, area.locator(".jp-OutputArea-output").first, png)
                        size = os.path.getsize(png)
                        assert size < MAX_PNG_BYTES, f"{png} is {size} bytes: make it smaller"
            logged = _views_console(messages)
            problems = [f"console: {line}" for line in logged] + problems
            assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:60])
        except BaseException:
            _screenshot(page, step)
            print("console:", *(f"{k}: {t}" for k, t in messages[-40:]), sep="\n", file=sys.stderr)
            raise
        finally:
            browser.close()
