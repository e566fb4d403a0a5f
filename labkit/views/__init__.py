"""Views of a lab (kernel side): per-rank tensors, parameter placement, timeline, time
breakdown, traffic.

`save_trace` writes the same trace records as a Chrome Trace Event file (Perfetto, HTA).
Every view takes a lab or plain data (tensors, placement rows, trace records), returns an
ipywidgets container of plotly figures (`.figures`), and has `.to_html()`, a static fallback
that needs no JavaScript and no network. Views never talk to ranks except through the lab's
public `pull`, `run`, `trace` and `ranks_info`.
"""

from labkit.views._common import ViewWarning, human_bytes
from labkit.views.bandwidth import algbw, busbw, busbw_factor
from labkit.views.breakdown_data import Breakdown, breakdown, compare
from labkit.views.breakdown_view import BreakdownView, show_breakdown
from labkit.views.comm_view import CommView, op_summary, show_comm, traffic_matrix
from labkit.views.placement_data import memory_by_rank, merge_placement
from labkit.views.placement_view import PlacementView, show_placement
from labkit.views.tensor_view import TensorView, show_tensors
from labkit.views.timeline_view import TimelineView, show_timeline, timeline_summary
from labkit.views.trace_export import save_trace

__all__ = [
    "Breakdown",
    "BreakdownView",
    "CommView",
    "PlacementView",
    "TensorView",
    "TimelineView",
    "ViewWarning",
    "algbw",
    "breakdown",
    "busbw",
    "busbw_factor",
    "compare",
    "human_bytes",
    "memory_by_rank",
    "merge_placement",
    "op_summary",
    "save_trace",
    "show_breakdown",
    "show_comm",
    "show_placement",
    "show_tensors",
    "show_timeline",
    "timeline_summary",
    "traffic_matrix",
]
