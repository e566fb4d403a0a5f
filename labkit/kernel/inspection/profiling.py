"""`labkit.profile(lab, code)` and `%%ranks --profile`: one cell under torch.profiler (kernel side).

The cell runs on the ranks as `labkit.rank.profiling.ProfiledCell` (as a `%%ranks` cell, inside
`torch.profiler.profile`); then the kernel pulls each rank's profiler events, shifts them to the
kernel's clock by the rank's clock offset (as `lab.trace()` shifts its records) and keeps them
for `save_trace`, which merges them into the export of that cell: each rank's operators appear
under its process, beside labkit's records of the same cell. Only the lab's last profile is kept.
"""

from __future__ import annotations

import weakref
from typing import Any

from labkit.rank.profiling import PROFILE_NAME, ProfiledCell

__all__ = ["last_profile", "profile", "profile_start", "profiler_events"]

PROFILER_TID = 2000  # the profiler's tracks come after labkit's host and device tracks

# one rank's profile: {"origin": s, "events": [...]}, each event's `ts` in microseconds since
# `origin`, in seconds on the kernel's clock
Profile = dict[str, Any]
_PROFILES: weakref.WeakKeyDictionary[Any, tuple[int, dict[int, Profile]]]
_PROFILES = weakref.WeakKeyDictionary()  # lab -> (cell, {rank: Profile}) of its last profile


def profile(lab: Any, code: str, ranks: Any = None, timeout: float | None = None) -> Any:
    """Run `code` on the ranks (all, or `ranks`) under torch.profiler; return its `Results`.

    `labkit.save_trace(lab, path)` then writes the cell's operators (CPU, and CUDA kernels on
    GPU ranks) with labkit's records. A rank's error is in the results, as from `lab.run`.
    Kernel side; each rank runs the cell inside torch.profiler. Example::

        labkit.profile(lab, "y = model(x); dist.all_reduce(y)")
        labkit.save_trace(lab, "profiled.json")  # labkit's records and torch's operators
    """
    if not isinstance(code, str):
        raise TypeError(
            f"profile() takes a cell's code as a string, got {type(code).__name__}: "
            'labkit.profile(lab, "y = model(x)")'
        )
    targets = lab.ranks(ranks)
    results = lab.run(ProfiledCell(code), targets, timeout)
    pulled = lab.pull(PROFILE_NAME, targets)
    by_rank: dict[int, Profile] = {}
    cell = 0
    for rank, kept in pulled.items():
        origin = kept["base_s"] - lab.offsets.get(rank, 0.0)
        by_rank[rank], cell = {"origin": origin, "events": kept["events"]}, kept["cell"]
    _PROFILES[lab] = (cell, by_rank)
    return results


def last_profile(lab: Any) -> tuple[int, dict[int, Profile]] | None:
    """(cell, {rank: Profile}) of the lab's last `profile`, or None."""
    try:
        return _PROFILES.get(lab)
    except TypeError:  # not weak-referenceable: plain data, never profiled
        return None


def profile_start(by_rank: dict[int, Profile]) -> float | None:
    """A microsecond before the first profiled slice starts (kernel clock, seconds), or None:
    seconds in a float carry a quarter of a microsecond, and no slice may start before 0."""
    starts = [
        p["origin"] + e["ts"] / 1e6
        for p in by_rank.values()
        for e in p["events"]
        if e.get("ph") == "X"
    ]
    return min(starts) - 1e-6 if starts else None


def profiler_events(by_rank: dict[int, Profile], t0: float) -> list[dict[str, Any]]:
    """The profiler's slices as Chrome trace events under each rank's process. Pure.

    Each profiler thread (or, on GPU, stream) becomes a track of the rank's process, numbered
    from `PROFILER_TID` and named after it ("torch.profiler: thread 4242 (python)"); its
    complete events keep their name, category, duration and args, with `ts` in microseconds
    since `t0` (kernel clock, seconds), as labkit's own records in the same file. The
    profiler's flows (CPU launch to GPU kernel) and instant events are left out, and a slice
    that ends after the one it starts in is cut at that one's end (the profiler's slices can
    overlap by nanoseconds; a track's slices must nest).
    """
    out: list[dict[str, Any]] = []
    for rank, kept in sorted(by_rank.items()):
        events = kept["events"]
        shift = round((kept["origin"] - t0) * 1e6, 3)  # one shift per rank keeps the nesting
        names: dict[tuple[Any, Any], str] = {}
        procs: dict[Any, str] = {}
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                names[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
        tids: dict[tuple[Any, Any], int] = {}
        for e in events:
            if e.get("ph") != "X" or not isinstance(e.get("dur"), int | float):
                continue
            key = (e.get("pid"), e.get("tid"))
            if key not in tids:
                tids[key] = tid = PROFILER_TID + len(tids)
                thread = names.get(key) or f"thread {key[1]}"
                proc = procs.get(key[0], "")
                label = thread if proc in ("", "python") else f"{proc} {thread}"
                meta = {"ph": "M", "pid": rank, "tid": tid, "ts": 0}
                out.append(
                    {**meta, "name": "thread_name", "args": {"name": f"torch.profiler: {label}"}}
                )
                out.append({**meta, "name": "thread_sort_index", "args": {"sort_index": tid}})
            out.append(
                {
                    "ph": "X",
                    "name": e.get("name", ""),
                    "cat": e.get("cat", "torch.profiler"),
                    "pid": rank,
                    "tid": tids[key],
                    "ts": round(e["ts"] + shift, 3),
                    "dur": max(0.0, round(e["dur"], 3)),
                    "args": e.get("args", {}),
                }
            )
    return _nest(out)


def _nest(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cut each slice that starts inside another of its track but ends after it."""
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in tracks.values():
        open_ends: list[float] = []
        for e in sorted(track, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            if open_ends and e["ts"] + e["dur"] > open_ends[-1]:
                e["dur"] = round(open_ends[-1] - e["ts"], 3)
            open_ends.append(e["ts"] + e["dur"])
    return events
