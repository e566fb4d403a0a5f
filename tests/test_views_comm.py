"""show_comm and the bandwidth helpers: traffic matrix, per-op table, nccl-tests factors."""

from __future__ import annotations

import pytest
from test_views_fakes import FakeLab

from labkit.views import algbw, busbw, busbw_factor, op_summary, show_comm, traffic_matrix
from labkit.views._common import op_colour
from labkit.views.bandwidth import canonical_op
from labkit.wire.records import CommRecord

pytestmark = pytest.mark.filterwarnings("error::labkit.views.ViewWarning")
G = (0, 1, 2)


def _rec(rank: int, op: str, seq: int, nbytes: int, dur: float, peer: int | None = None,
         group: tuple[int, ...] = G, cell: int = 1) -> CommRecord:  # fmt: skip
    return CommRecord(rank=rank, op=op, seq=seq, group=group, peer=peer, bytes=nbytes,
                      start=10.0, end=10.0 + dur, cell=cell)  # fmt: skip


def _records() -> list[CommRecord]:
    return [
        _rec(0, "send", 1, 300, 0.01, peer=2),
        _rec(2, "recv", 1, 300, 0.02, peer=0),
        *(_rec(r, "all_reduce", 2, 600, d) for r, d in zip(G, (0.1, 0.2, 0.3), strict=True)),
        *(_rec(r, "broadcast", 3, 90, 0.1, peer=1) for r in G),
        *(_rec(r, "all_to_all_single", 4, 90, 0.1, cell=2) for r in G),
    ]


def test_busbw_factors_match_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert busbw_factor("all_reduce", 1) == 0.0
    for op in ("reduce_scatter", "all_gather", "all_to_all", "all_gather_into_tensor"):
        assert busbw_factor(op, 4) == pytest.approx(0.75), op
    for op in ("broadcast", "reduce", "send"):
        assert busbw_factor(op, 8) == 1.0
    with pytest.raises(ValueError, match=">= 1"):
        busbw_factor("all_reduce", 0)
    assert algbw(1e9, 0.5) == 2e9 and algbw(10, 0) == 0.0
    assert busbw("all_reduce", 1e9, 1.0, 2) == pytest.approx(1e9)


def test_single_ops_of_torch_2_13_get_the_ring_factor() -> None:
    # dist.all_gather_single / reduce_scatter_single (and what DTensor's functional collectives
    # are recorded as) move (n-1)/n of S per rank, like all_gather / reduce_scatter
    for op, like in (("all_gather_single", "all_gather"),
                     ("reduce_scatter_single", "reduce_scatter")):  # fmt: skip
        assert canonical_op(op) == like
        assert busbw_factor(op, 4) == pytest.approx(0.75), op
        assert op_colour(op) == op_colour(like)
        recs = [_rec(r, op, 1, 600, 0.1 * (r + 1)) for r in G]
        assert traffic_matrix(recs) == [[0, 400, 0], [0, 0, 400], [400, 0, 0]], op
        (row,) = op_summary(recs)
        assert row["algbw"] == pytest.approx(600 / 0.3)
        assert row["busbw"] == pytest.approx(600 / 0.3 * 2 / 3), op


def test_traffic_matrix_for_hand_made_records() -> None:
    m = traffic_matrix(_records())
    assert m[0][2] == pytest.approx(300 + 30)  # send (recv not counted again) + all_to_all
    assert m[0][1] == pytest.approx(800 + 30)  # ring all_reduce: 2(n-1)/n * 600 to the next
    assert m[1][2] == pytest.approx(800 + 90 + 30)  # + broadcast from root 1 to rank 2
    assert m[2][0] == pytest.approx(800 + 90 + 30)  # + broadcast forwarded 2 -> 0
    assert m[1][0] == pytest.approx(30) and m[2][1] == pytest.approx(30)
    assert [m[r][r] for r in G] == [0, 0, 0]
    assert len(traffic_matrix(_records(), world_size=5)) == 5


def test_p2p_pairs_only() -> None:
    recs = [_rec(0, "isend", 1, 100, 0.1, peer=1, group=(0, 1)),
            _rec(1, "send", 1, 50, 0.1, peer=0, group=(0, 1))]  # fmt: skip
    assert traffic_matrix(recs) == [[0, 100], [50, 0]]
    ops = {o["op"]: o for o in op_summary(recs)}
    assert ops["isend"]["calls"] == 1 and ops["send"]["calls"] == 1


def test_op_summary_counts_calls_not_records() -> None:
    ops = {o["op"]: o for o in op_summary(_records())}
    ar = ops["all_reduce"]
    assert (ar["calls"], ar["bytes"], ar["seconds"]) == (1, 600, pytest.approx(0.3))
    assert ar["algbw"] == pytest.approx(2000.0)  # 600 B over the slowest rank's 0.3 s
    assert ar["busbw"] == pytest.approx(2000.0 * 4 / 3)
    assert ops["all_to_all_single"]["busbw"] == pytest.approx(900 * 2 / 3)
    assert ops["send"]["calls"] == 1 and ops["recv"]["calls"] == 1


def test_view_figures_table_and_lab() -> None:
    view = show_comm(_records())
    heat, bars = view.figures
    assert heat.data[0].type == "heatmap" and list(heat.data[0].z[0]) == view.matrix[0]
    assert list(heat.data[0].x) == ["rank 0", "rank 1", "rank 2"]
    assert [t.name for t in bars.data] == ["busbw", "algbw"]
    assert "all_reduce" in view.children[2].value and "2.67 kB/s" in view.children[2].value
    lab = FakeLab(4, records=_records())
    view = show_comm(lab, cell=2)
    assert ("trace", 2) in lab.calls and len(view.matrix) == 4
    assert [o["op"] for o in view.ops] == ["all_to_all_single"]
    page = view.to_html()
    assert "bytes sent" in page and "<script" not in page


def test_empty_trace() -> None:
    view = show_comm([])
    assert view.figures == [] and view.matrix == [] and "no collective" in view.children[0].value


def test_bandwidth_chart_takes_the_width_it_is_given_and_shows_its_legend() -> None:
    from labkit.views.comm_view import MATRIX_MAX, matrix_size

    view = show_comm(_records())
    matrix, ops = view.figures
    assert ops.layout.width is None and ops.layout.autosize  # as wide as its box
    assert ops.layout.legend.orientation == "h" and ops.layout.legend.yanchor == "bottom"
    assert ops.layout.legend.y >= 1  # above the bars, inside the figure's top margin
    assert [t.name for t in ops.data] == ["busbw", "algbw"]
    assert matrix.layout.width == matrix_size(3)[0]
    assert matrix_size(16) == (MATRIX_MAX, MATRIX_MAX)  # fits a narrow output area
    assert view.children[1] is ops  # under the matrix, as wide as the output area
