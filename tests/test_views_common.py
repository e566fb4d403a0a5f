"""Shared view machinery: figure wrapping (FigureWidget or plotly JSON), HTML, units, warnings."""

from __future__ import annotations

import importlib.util

import ipywidgets as widgets
import plotly.graph_objects as go
import pytest

from labkit.views import human_bytes
from labkit.views._common import (
    PLOTLY_MIME,
    View,
    html_table,
    human_rate,
    oversubscription,
    wrap_figure,
)

pytestmark = pytest.mark.filterwarnings("error::labkit.views.ViewWarning")


def test_figure_is_a_figure_widget_or_plotly_json_output() -> None:
    fig = go.Figure(go.Bar(y=[1, 2]), layout={"title": {"text": "t"}})
    widget, handle = wrap_figure(fig)
    if importlib.util.find_spec("anywidget") is not None:
        assert isinstance(widget, go.FigureWidget) and handle is widget
    else:  # plotly 7's FigureWidget needs anywidget; JupyterLab renders the JSON instead
        assert isinstance(widget, widgets.Output) and handle is fig
        (output,) = widget.outputs
        assert output["data"][PLOTLY_MIME]["data"][0]["y"] == [1, 2]
        assert output["data"]["text/plain"] == "<t>"
    assert list(handle.data[0].y) == [1, 2]


def test_view_bundle_carries_static_html() -> None:
    view = View()
    view.add_figure(go.Figure())
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "text/html" in bundle
    assert len(view.figures) == 1


def test_html_table_escapes() -> None:
    page = html_table(["a<b"], [["<script>"]], caption="c&d")
    assert "&lt;script&gt;" in page and "a&lt;b" in page and "c&amp;d" in page
    assert "<script>" not in page


def test_units() -> None:
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
    assert human_rate(2.5e9) == "2.50 GB/s" and human_rate(12) == "12 B/s"


def test_oversubscription_per_host() -> None:
    class Lab:
        def ranks_info(self) -> list[dict]:
            return [{"rank": r, "host": "a" if r < 3 else "b", "device": "cpu", "num_cpus": 2}
                    for r in range(4)]  # fmt: skip

    text = oversubscription(range(4), Lab())
    assert text is not None and "3 ranks on 2 CPU cores (a)" in text and "(b)" not in text
    assert oversubscription(range(2), num_cpus=2) is None


def test_figure_widgets_follow_their_box_width() -> None:
    # plotly's widget sizes a figure once; labkit's adds a ResizeObserver at its render
    pytest.importorskip("anywidget")
    import plotly.graph_objects as go

    from labkit.views.figure_widget import figure_widget_class, resizing_esm

    cls = figure_widget_class()
    assert cls.__name__ == "ResizingFigureWidget", "plotly's bundle changed: see figure_widget.py"
    widget = cls(go.Figure())
    assert "new ResizeObserver(()=>" in widget._esm and "autosizeFigure()" in widget._esm
    assert resizing_esm("export default {render({el}) {}}") is None


@pytest.mark.parametrize("esm", ["patched", "unpatchable"])
def test_a_figure_widget_opens_its_comm_with_the_whole_figure(monkeypatch, esm) -> None:
    # plotly's own FigureWidget opens its comm before it sets its data and layout (they follow
    # as updates, which a view drawn early never sees); labkit's opens it with them
    pytest.importorskip("anywidget")
    import comm
    import plotly.graph_objects as go

    from labkit.views import figure_widget

    opened: list[dict] = []

    class Comm:
        kernel = None  # no kernel: updates are not sent, only the opening message counts
        comm_id = "c"

        def __init__(self, **kwargs) -> None:
            opened.append(kwargs["data"]["state"])

        def on_msg(self, callback) -> None: ...

        def close(self, *args, **kwargs) -> None: ...

    monkeypatch.setattr(comm, "create_comm", Comm)
    figure_widget.figure_widget_class.cache_clear()
    if esm == "unpatchable":
        monkeypatch.setattr(figure_widget, "resizing_esm", lambda bundle: None)
    try:
        fig = go.Figure(go.Bar(y=[1, 2]), layout={"height": 250})
        go.FigureWidget(fig)
        assert opened[-1]["_widget_data"] == [], "plotly opens its comm with the data: see why"
        widget = figure_widget.figure_widget_class()(fig)
    finally:
        figure_widget.figure_widget_class.cache_clear()
    state = opened[-1]
    assert len(opened) == 2 and widget.comm is not None
    assert [list(t["y"]) for t in state["_widget_data"]] == [[1, 2]]
    assert state["_widget_layout"]["height"] == 250
