"""The course site (scripts/build_site.py, docs/site.md): its pieces without a browser, and
the built pages in headless chromium.

The browser tests open the site that `python3 scripts/dev.py docs` built (build/site, or
$LABKIT_SITE_DIR) from the notebooks CI executed: a notebook page whose plotly figure must
draw (an SVG with its trace) and whose tables must show, and a second notebook page. Where no
site was built they skip and say how to build one, unless LABKIT_SITE_REQUIRED is set (CI sets
it: .ci/run builds the site first), where that is a failure.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import build_site as site  # noqa: E402

SITE = os.environ.get("LABKIT_SITE_DIR") or os.path.join(ROOT, "build", "site")
CHROMIUM = "/usr/bin/chromium"
VBOX, FIG, HTML = "a" * 32, "b" * 32, "c" * 32


def _executed_notebook() -> dict:
    """A notebook as nbclient saves it: a view (a VBox of an HTML title and a plotly
    FigureWidget, as anywidget keeps it) and its static copy, and a bare plotly figure."""
    state = {
        VBOX: {
            "model_name": "VBoxModel",
            "state": {
                "_model_name": "VBoxModel",
                "children": [f"IPY_MODEL_{HTML}", f"IPY_MODEL_{FIG}"],
            },
        },
        HTML: {
            "model_name": "HTMLModel",
            "state": {"_model_name": "HTMLModel", "value": "<b>title</b>"},
        },
        FIG: {
            "model_name": "AnyModel",
            "state": {
                "_model_name": "AnyModel",
                "_widget_data": [{"type": "bar", "x": [0, 1], "y": [3, 4]}],
                "_widget_layout": {"title": {"text": "bytes"}},
            },
        },
    }
    view = {"model_id": VBOX, "version_major": 2, "version_minor": 0}
    outputs = [
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {site.WIDGET_MIME: view, "text/plain": "a view"},
        },
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {"text/html": "<table><tr><td>rank 0</td></tr></table>"},
        },
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {
                site.PLOTLY_MIME: {"data": [{"type": "scatter", "y": [1]}], "layout": {}},
                "text/plain": "<figure>",
            },
        },
    ]
    cell = {
        "cell_type": "code",
        "source": "labkit.show_comm(lab)",
        "metadata": {},
        "outputs": outputs,
        "execution_count": 1,
    }
    return {
        "cells": [cell],
        "metadata": {"widgets": {site.STATE_MIME: {"state": state}}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def test_widgets_become_figures_and_the_static_copy_stays() -> None:
    nb = _executed_notebook()
    assert site.static_outputs(nb) == 2
    view, static, bare = (o["data"] for o in nb["cells"][0]["outputs"])
    assert site.WIDGET_MIME not in view and "plotly-graph-div" in view["text/html"]
    assert '"y":[3,4]' in view["text/html"].replace(" ", "")  # the figure's own data
    assert "<b>title</b>" not in view["text/html"]  # a view gives its figures; tables follow
    assert static["text/html"].startswith("<table>")
    assert site.PLOTLY_MIME not in bare and "plotly-graph-div" in bare["text/html"]
    assert "widgets" not in nb["metadata"]  # no state left for a CDN widget manager to load


def test_a_widget_without_figures_shows_its_html() -> None:
    nb = _executed_notebook()
    state = nb["metadata"]["widgets"][site.STATE_MIME]["state"]
    state[VBOX]["state"]["children"] = [f"IPY_MODEL_{HTML}"]
    site.static_outputs(nb)
    assert nb["cells"][0]["outputs"][0]["data"]["text/html"] == "<b>title</b>"


def test_missing_and_stale_executed_notebooks_are_named(tmp_path) -> None:
    with open(os.path.join(site.NOTEBOOKS, "00_start.ipynb")) as f:
        nb = json.load(f)
    (tmp_path / "00_start.ipynb").write_text(json.dumps(nb))
    stale = copy.deepcopy(nb)
    next(c for c in stale["cells"] if c["cell_type"] == "code")["source"] = "changed = 1"
    (tmp_path / "01_views_tour.ipynb").write_text(json.dumps(stale))
    names = ["00_start.ipynb", "01_views_tour.ipynb", "10_process_groups.ipynb"]
    assert site.executed_problems(str(tmp_path), names) == [
        "01_views_tour.ipynb: its code changed since it was executed",
        f"10_process_groups.ipynb: not in {tmp_path}",
    ]


def test_broken_internal_links_and_anchors_are_found(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "index.html").write_text(
        '<a href="sub/page.html#here">ok</a><a href="sub/page.html#gone">anchor</a>'
        '<a href="missing.html">file</a><a href="https://example.org/x">external</a>'
        '<a href="#top">self</a><p id="top"></p><img src="sub/pic.png">'
    )
    (tmp_path / "sub" / "page.html").write_text(
        '<h1 id="here">x</h1><a href="../index.html">up</a>'
    )
    assert site.check_links(str(tmp_path)) == [
        "index.html: sub/page.html#gone (no such anchor)",
        "index.html: missing.html (no such file)",
        "index.html: sub/pic.png (no such file)",
    ]


def test_the_index_lists_the_curriculum_in_the_readme_order() -> None:
    rows = site.curriculum_rows()
    names = sorted(n for n in os.listdir(site.NOTEBOOKS) if n.endswith(".ipynb"))
    assert [f"{nb}.ipynb" for nb, _ in rows] == names  # every notebook, in order, once


def test_a_saved_notebook_keeps_widget_state_without_anywidget_bundles() -> None:
    from nbformat import from_dict

    from labkit.tools.cli import _drop_widget_bundles

    nb = from_dict(_executed_notebook())
    nb.metadata.widgets[site.STATE_MIME]["state"][FIG]["state"]["_esm"] = "x" * 1000
    _drop_widget_bundles(nb)
    kept = nb.metadata.widgets[site.STATE_MIME]["state"][FIG]["state"]
    assert "_esm" not in kept and kept["_widget_data"][0]["y"] == [3, 4]


# ------------------------------------------------------------------ the built site, in chromium


@pytest.fixture(scope="module")
def built() -> str:
    index = os.path.join(SITE, "index.html")
    if not os.path.exists(index):
        why = f"no course site at {SITE}: build it with `python3 scripts/dev.py docs`"
        if os.environ.get("LABKIT_SITE_REQUIRED"):
            pytest.fail(why)
        pytest.skip(why)
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (CI installs Debian's chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return SITE


@pytest.mark.browser
@pytest.mark.parametrize(
    "page, tables",
    [("notebooks/01_views_tour.html", 4), ("notebooks/31_pipeline_parallel.html", 1)],
)
def test_a_built_notebook_page_draws_its_plots_and_tables(built, page, tables) -> None:
    from playwright.sync_api import sync_playwright

    path = os.path.join(built, page)
    assert os.path.exists(path), f"{page} is not in the site at {built}"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            tab = browser.new_page()
            errors: list[str] = []
            tab.on("pageerror", lambda exc: errors.append(str(exc)))
            tab.goto(f"file://{path}")
            # plotly.js (from the site's _static, nothing fetched) drew a figure: an SVG with
            # at least one trace in it
            tab.wait_for_selector(".plotly-graph-div .main-svg .trace", timeout=30_000)
            assert tab.locator(".plotly-graph-div .main-svg").count() >= 1
            rows = tab.locator(".cell_output table tr")
            assert tab.locator(".cell_output table").count() >= tables
            assert rows.count() > tables and rows.first.is_visible()
            assert not errors, f"JavaScript errors on {page}: {errors}"
        finally:
            browser.close()
