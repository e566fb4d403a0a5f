"""`labkit.flight_recorder(lab)` and `%lab logs --fr`: torch's Flight Recorder per rank (kernel
side).

torch records every collective of a process group in a ring buffer, its Flight Recorder, when
`TORCH_FR_BUFFER_SIZE` is set before the group is made; labkit sets it on each rank (200
entries; `TORCH_FR_BUFFER_SIZE=0` in the kernel's environment before the lab starts turns it
off). Between cells the kernel asks each rank for its entries (labkit.rank.flight_recorder):
per collective its sequence number, op, group, state (`completed`, or `scheduled`: entered and
not finished), sizes and dtypes, and on GPUs its duration; every rank's whole recorder is
merged into a hang verdict (`.verdict`, printed first: labkit.kernel.inspection.hang_verdict).
While a cell runs, `lab.stacks()` and a stuck cell's message show each rank's last entries and
the verdict (they come with the stacks).
"""

from __future__ import annotations

import functools
from typing import Any

from labkit.kernel.inspection.hang_verdict import HangVerdict, merge
from labkit.kernel.results import LabError
from labkit.rank import flight_recorder as on_rank

LAST = 20  # entries shown per rank by default


class RankFlightRecorder(dict):
    """{rank: [entry, ...]} oldest first, or {rank: why there are none} (a str); each entry a
    dict with seq, op, group, state, input_sizes, output_sizes, dtypes, duration_ms, ...
    `verdict`: every rank's whole recorder merged (labkit.kernel.inspection.hang_verdict)."""

    verdict: HangVerdict | None = None

    def __str__(self) -> str:
        parts = [self.verdict.text] if self.verdict is not None else []
        for r, got in sorted(self.items()):
            if isinstance(got, str):
                body = f"    ({got})"
            else:
                body = "\n".join(f"    {on_rank.entry_text(e)}" for e in got) or "    (none yet)"
            parts.append(f"--- rank {r} ---\n{body}")
        return "\n".join(parts)

    __repr__ = __str__

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython shows it as plain text
        p.text(str(self))


def flight_recorder(lab: Any, ranks: Any = None, last: int = LAST) -> RankFlightRecorder:
    """The last `last` collectives each rank's Flight Recorder holds (between cells).

    Kernel side; each rank reads torch's Flight Recorder (its ring of recent collectives).
    Returns {rank: [entry, ...]}, oldest first, each a dict (seq, op, group, state, sizes,
    dtypes; duration on GPUs). Example: ``labkit.flight_recorder(lab, ranks=[0], last=4)``
    (as `%lab logs --fr 0 --lines 4`).
    """
    if not isinstance(last, int) or isinstance(last, bool) or last < 1:
        raise ValueError(f"last must be a whole number of at least 1, got {last!r}")
    if lab.closed or not lab.running:
        raise LabError("the lab's ranks are not running, so they have no Flight Recorder")
    shown = set(lab.ranks(ranks))
    # every rank's whole recorder, for the verdict; `last` entries of the ranks asked, to show
    results = lab.run(functools.partial(on_rank.snapshot, on_rank.SETTLE_S))
    got, snaps = RankFlightRecorder(), {}
    for r, res in sorted(results.items()):
        if res.error is not None:
            snaps[r] = f"{res.error['type']}: {res.error['message']}"
        else:
            snaps[r] = res.value
        if r in shown:
            snap = snaps[r]
            if snap is None:
                got[r] = f"the Flight Recorder is off on this rank ({on_rank.ENV} is not set, or 0)"
            else:
                got[r] = snap if isinstance(snap, str) else snap["entries"]
                got[r] = got[r] if isinstance(got[r], str) else got[r][-last:]
    got.verdict = merge(snaps, world=sorted(results))
    return got
