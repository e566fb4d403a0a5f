"""plotly's FigureWidget, made to follow its box's width (kernel side).

plotly 7's FigureWidget is an anywidget whose front end sizes a figure without a width once,
when it first draws (often before it is on the page: 700 px whatever the output area), and
never again: anywidget does not pass JupyterLab's resize messages on, and nothing else tells it.
So a figure drawn wide overflows once the window narrows or the file browser opens, and one
drawn in a hidden box keeps plotly's default width.

It also opens its comm only once the figure is complete. plotly's FigureWidget opens it in
ipywidgets' constructor, before it sets the figure's data and layout (`_widget_data`,
`_widget_layout`), which then follow as updates; its front end reads them once, when it draws,
and a view drawn before those updates were applied stays an empty 700 x 360 px plot (seen in
JupyterLab on a busy machine: one or two figures of a view, a different one each run).
Deferring the opening puts the whole figure in the comm's first message.

`ResizingFigureWidget` sends plotly's own front end with one change at its `render`: a
ResizeObserver on the widget's element calls the view's own `autosizeFigure()` (what plotly
runs on JupyterLab's resize messages) whenever the element's width changes. Figures with a
width of their own are left as they are (autosizeFigure skips them). The change is made to the
text of plotly's bundle; when the bundle no longer has the `render` it expects (another plotly
release), `figure_widget_class()` returns plotly's FigureWidget unchanged and the browser test
(tests/test_browser_views.py) fails on the first view that does not fit.
"""

from __future__ import annotations

import pathlib
import re
from functools import cache
from typing import Any

__all__ = ["figure_widget_class", "resizing_esm"]

# plotly 7's (minified) `render({el}) {let view = new FigureView(model, el); return
# view.perform_render(), () => view.remove()}`
_RENDER = re.compile(
    r"render\(\{el:(?P<el>\w+)\}\)\{let (?P<view>\w+)=new (?P<cls>\w+)\((?P<model>\w+),(?P=el)\);"
    r"return (?P=view)\.perform_render\(\),\(\)=>(?P=view)\.remove\(\)\}"
)


def resizing_esm(bundle: str) -> str | None:
    """plotly's widget bundle with a ResizeObserver added at its `render`, or None when the
    bundle has no `render` of the expected form."""
    match = _RENDER.search(bundle)
    needed = ("autosizeFigure(){", "plotlywidget-after-render")
    if match is None or not all(text in bundle for text in needed):
        return None
    el, view, cls, model = (match[k] for k in ("el", "view", "cls", "model"))
    # Observing starts once the view has drawn its figure (plotly's widget announces it with a
    # "plotlywidget-after-render" event), so a resize never races the first draw. Only a
    # change of width resizes: plotly's autosize also takes the element's height, and an
    # element a few pixels taller than its figure would grow it on every round; the height is
    # pinned to the figure's own first, so autosize keeps it.
    render = (
        f"render({{el:{el}}}){{let {view}=new {cls}({model},{el});"
        "let lkWidth=0;let lkObserver=new ResizeObserver(()=>{"
        f"let w=Math.round({el}.getBoundingClientRect().width);"
        "if(!w||w===lkWidth)return;lkWidth=w;"
        f"if({el}._fullLayout){el}.style.height={el}._fullLayout.height+'px';"
        f"{view}.autosizeFigure()}});"
        f"let lkStart=(e)=>{{if(e.detail.element!=={el})return;"
        "document.removeEventListener('plotlywidget-after-render',lkStart);"
        f"lkObserver.observe({el})}};"
        "document.addEventListener('plotlywidget-after-render',lkStart);"
        f"{view}.perform_render();"
        "return()=>{document.removeEventListener('plotlywidget-after-render',lkStart);"
        f"lkObserver.disconnect();{view}.remove()}}}}"
    )
    return bundle[: match.start()] + render + bundle[match.end() :]


@cache
def figure_widget_class() -> type | None:
    """The FigureWidget class to use: `ResizingFigureWidget`; when plotly's bundle cannot be
    changed, a FigureWidget that only opens its comm complete; None without anywidget (plotly
    7's FigureWidget needs it)."""
    try:
        import anywidget  # noqa: F401
    except ImportError:
        return None
    import plotly.graph_objects as go

    esm = go.FigureWidget._esm
    bundle = esm.read_text() if isinstance(esm, pathlib.Path) else str(esm)
    patched = resizing_esm(bundle)
    namespace: dict[str, Any] = {"__init__": _init, "open": _open, "__module__": __name__}
    if patched is not None:
        namespace["_esm"] = patched
    name = "ResizingFigureWidget" if patched is not None else "WholeFigureWidget"
    return type(name, (go.FigureWidget,), namespace)


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    """FigureWidget's constructor with the comm opened at its end (module doc)."""
    import plotly.graph_objects as go

    self._lk_building = True
    try:
        go.FigureWidget.__init__(self, *args, **kwargs)
    finally:
        self._lk_building = False
    self.open()


def _open(self: Any) -> None:
    import plotly.graph_objects as go

    if not getattr(self, "_lk_building", False):
        go.FigureWidget.open(self)
