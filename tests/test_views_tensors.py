"""show_tensors: panels per rank, panel kinds, shared colour scale, before/after, snapshots."""

from __future__ import annotations

import pytest
import torch
from test_views_fakes import FakeLab

from labkit.views import TensorView, show_tensors
from labkit.views.tensor_data import downsample, to_info

pytestmark = pytest.mark.filterwarnings("error::labkit.views.ViewWarning")


def _types(view: TensorView) -> list[str]:
    return [f.data[0].type for f in view.figures]


def test_one_panel_per_rank_with_kind_by_shape() -> None:
    values = {0: torch.arange(4.0), 1: torch.ones(3, 3), 2: torch.randn(64, 64), 3: torch.tensor(7)}
    view = show_tensors(values)
    assert len(view.figures) == 4
    assert _types(view) == ["bar", "heatmap", "heatmap", "bar"]
    summary = view.figures[2]
    assert "(64, 64) float32" in summary.layout.title.text
    assert "norm" in summary.layout.title.text  # summarised, not drawn cell by cell
    assert len(summary.data[0].z) == 32 and len(summary.data[0].z[0]) == 32
    assert "scalar int64" in view.figures[3].layout.title.text


def test_headers_name_rank_shape_dtype_device() -> None:
    view = show_tensors({0: torch.zeros(2, 3, dtype=torch.float64), 1: torch.zeros(2, 3)})
    titles = [f.layout.title.text for f in view.figures]
    assert titles == ["rank 0 · (2, 3) float64 · cpu", "rank 1 · (2, 3) float32 · cpu"]


def test_colour_scale_is_shared_and_diverging_across_zero() -> None:
    view = show_tensors({0: torch.tensor([[1.0, 2.0]]), 1: torch.tensor([[-5.0, 0.0]])})
    zs = [(f.data[0].zmin, f.data[0].zmax) for f in view.figures]
    assert zs == [(-5.0, 5.0), (-5.0, 5.0)]
    assert view.figures[0].data[0].colorscale == view.figures[1].data[0].colorscale

    bars = show_tensors({0: torch.tensor([1.0, 2.0]), 1: torch.tensor([3.0, 9.0])})
    assert {(f.data[0].marker.cmin, f.data[0].marker.cmax) for f in bars.figures} == {(1.0, 9.0)}
    assert bars.figures[0].layout.yaxis.range == bars.figures[1].layout.yaxis.range


def test_small_values_written_in_cells_large_ones_not() -> None:
    view = show_tensors({0: torch.tensor([[1.0, 2.5], [3.0, 4.0]]), 1: torch.zeros(20, 20)})
    small, big = (f.data[0] for f in view.figures)
    assert [list(row) for row in small.text] == [["1", "2.5"], ["3", "4"]]
    assert small.texttemplate == "%{text}"
    assert big.text is None


def test_before_after_side_by_side_on_one_scale() -> None:
    before = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([3.0, 4.0])}
    after = {0: torch.tensor([4.0, 6.0]), 1: torch.tensor([4.0, 6.0])}
    view = show_tensors(None, before=before, after=after, title="all_reduce")
    assert len(view.figures) == 4
    titles = [f.layout.title.text for f in view.figures]
    assert titles[0].startswith("before · rank 0") and titles[3].startswith("after · rank 1")
    assert {f.layout.yaxis.range[1] for f in view.figures} == {
        view.figures[0].layout.yaxis.range[1]
    }
    assert view.scale.zmin == 1.0 and view.scale.zmax == 6.0


def test_snapshots_slider_steps_through_states() -> None:
    snaps = [(f"step {i}", {0: torch.full((2, 2), float(i)), 1: torch.zeros(2)}) for i in range(5)]
    view = show_tensors(None, snapshots=snaps)
    assert view.slider is not None
    assert (view.slider.min, view.slider.max) == (0, len(snaps) - 1)
    assert view.figures[0].data[0].z[0][0] == 0
    view.slider.value = 3
    assert view.figures[0].data[0].z[0][0] == 3
    assert view.figures[0].layout.title.text.startswith("step 3 · rank 0")
    assert view.figures[0].data[0].zmax == 4.0  # scale over every snapshot, not just this one


def test_lab_pull_and_rank_device_in_header() -> None:
    lab = FakeLab(2, device="cuda:0")
    for r, ns in enumerate(lab.namespaces):
        ns["x"] = torch.arange(3.0) + 10 * r
    view = show_tensors(lab, "x")
    assert ("pull", "x") in lab.calls
    assert [f.data[0].y[-1] for f in view.figures] == [2.0, 12.0]
    assert all(f.layout.title.text.endswith("cuda:0") for f in view.figures)
    with pytest.raises(ValueError, match="name"):
        show_tensors(lab)


def test_static_html_has_values_and_no_network() -> None:
    view = show_tensors({0: torch.tensor([[1.0, 2.0]]), 1: torch.randn(50, 50)}, title="w")
    page = view.to_html()
    assert ">2</td>" in page and "(50, 50) float32" in page and "min" in page
    assert "http" not in page and "<script" not in page
    assert view._repr_mimebundle_()["text/html"] == page
    assert view.static()._repr_html_() == page


def test_non_numeric_value_names_the_rank() -> None:
    with pytest.raises(ValueError, match="rank 1"):
        show_tensors({0: torch.zeros(2), 1: "oops"})


def test_downsample_is_block_mean() -> None:
    a = torch.arange(16.0).reshape(4, 4).numpy()
    assert downsample(a, 2).tolist() == [[2.5, 4.5], [10.5, 12.5]]
    assert to_info(torch.tensor([True, False])).array.tolist() == [1.0, 0.0]


def test_before_from_a_saved_pull_after_from_the_lab() -> None:
    lab = FakeLab(2)
    for r, ns in enumerate(lab.namespaces):
        ns["x"] = torch.tensor([1.0, 2.0]) * (r + 1)
    saved = lab.pull("x")
    for ns in lab.namespaces:
        ns["x"] = torch.tensor([3.0, 6.0])
    view = show_tensors(lab, "x", before=saved)
    assert [s[0] for s in view.states] == ["before", "after"]
    assert [list(f.data[0].y) for f in view.figures] == [[1, 2], [2, 4], [3, 6], [3, 6]]
    assert view.children[0].value == "<b>x</b>"  # the name is the default title


def test_nd_tensor_rows_are_its_leading_dims() -> None:
    view = show_tensors({0: torch.zeros(2, 3, 4)})
    z = view.figures[0].data[0].z
    assert (len(z), len(z[0])) == (6, 4) and "(2, 3, 4) float32" in view.figures[
        0
    ].layout.title.text


def test_one_shared_colour_bar_and_panels_in_an_even_grid() -> None:
    from labkit.views.tensor_view import PANEL_MIN_WIDTH, grid_css

    view = show_tensors({r: torch.arange(12.0).reshape(3, 4) + 12 * r for r in range(4)})
    # no panel has a colour bar of its own; the view has one, on the panels' scale
    assert not any(f.data[0].showscale for f in view.figures)
    assert view.scale.zmin == 0.0 and view.scale.zmax == 47.0
    bar = view.colour_bar  # HTML: the scale's gradient, its ends and middle labelled
    assert "rgb(68, 1, 84) 0%" in bar and "rgb(253, 231, 37) 100%" in bar  # Viridis
    assert ">0</span><span>23.5</span><span>47<" in bar
    assert view.children[-2].value == bar
    # panels take their cell's width (no width of their own) and leave room for tick labels
    assert all(f.layout.width is None and f.layout.yaxis.automargin for f in view.figures)
    # 4 panels: 1, 2 or 4 columns (never 3 + 1), as many as fit at PANEL_MIN_WIDTH px
    css = grid_css(4)
    assert f"min-width: {2 * PANEL_MIN_WIDTH}px" in css and "repeat(2," in css
    assert f"min-width: {4 * PANEL_MIN_WIDTH}px" in css and "repeat(4," in css
    assert "repeat(3," not in css
    assert "repeat(3," in grid_css(3) and "repeat(2," not in grid_css(3)


def test_panel_data_are_plain_lists_and_bars_have_colours() -> None:
    from labkit.views.tensor_view import bar_colours

    view = show_tensors({0: torch.arange(3.0), 1: torch.ones(2, 2)})
    bars, heat = (f.data[0] for f in view.figures)
    assert isinstance(heat.z, tuple | list)
    # bars carry colours, not values: plotly.js picks the colour of the text inside a bar by
    # contrast with the bar's colour and logs "Invalid color specifier: number ..." for a value
    assert list(bars.marker.color) == bar_colours([0.0, 1.0, 2.0], view.scale)
    assert bars.marker.color[0] == "rgb(68, 1, 84)" and bars.marker.color[2] == "rgb(253, 231, 37)"
