"""One cell under torch.profiler, on a rank (built in the kernel, called on every rank).

`ProfiledCell(code)` travels to the ranks as the function of an `exec` request, like
`labkit.rank.script.Script`. Each rank runs the code as a `%%ranks` cell runs (in its
persistent namespace, the last expression's value coming back) inside `torch.profiler.profile`
(CPU, and CUDA when the rank's device is a GPU), then keeps the profiler's events in its
namespace under `PROFILE_NAME` for the kernel to pull (`labkit.kernel.inspection.profiling`), so the
cell's value and the lab's trace of it stay what they would be without the profiler.

The events are the profiler's own Chrome trace (`export_chrome_trace`): `ts` in microseconds
since `base_s`, its `baseTimeNanoseconds` in seconds, which is Unix time, the clock of this
rank's `time.time()` and so of labkit's trace records. They stay apart, since their sum in
seconds would lose the profiler's nanoseconds.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from labkit.rank.trace_state import STATE
from labkit.rank.user_code import run_code

PROFILE_NAME = "__labkit_profile__"  # where a rank keeps its last profile, for `lab.pull`


@dataclass(frozen=True)
class ProfiledCell:
    """A cell's code to run under torch.profiler on every target rank."""

    code: str

    def __call__(self) -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile

        ns = sys.modules["__main__"].__dict__  # the rank's namespace (labkit.rank.worker)
        activities = [ProfilerActivity.CPU]
        device = ns.get("device")
        if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        ns.pop(PROFILE_NAME, None)
        prof = profile(activities=activities)
        try:
            with prof:
                return run_code(self.code, f"<cell-{STATE.cell}>", ns)
        finally:  # a cell that raised is profiled up to the error
            ns[PROFILE_NAME] = {"cell": STATE.cell, **_events(prof)}


def _events(prof: Any) -> dict[str, Any]:
    """The profiler's trace events (`ts` in microseconds since `base_s`, Unix time)."""
    fd, path = tempfile.mkstemp(prefix="labkit-profile-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    finally:
        os.unlink(path)
    events = [
        e
        for e in doc.get("traceEvents", [])
        if isinstance(e, dict) and isinstance(e.get("ts"), int | float)
    ]
    return {"base_s": doc.get("baseTimeNanoseconds", 0) / 1e9, "events": events}
