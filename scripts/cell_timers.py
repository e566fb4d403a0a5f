"""Where a no-op cell's time goes, piece by piece, in the kernel and in a rank (a dev tool).

    python scripts/cell_timers.py [--ranks 4] [--cells 300]

Starts a lab, times four pieces of a rank's work alone on rank 0, warm (`timeit`: decoding a
signed `exec` request, encoding a `done` reply, the Stop check and the output check), then wraps
timers around the functions a no-op `lab.run` goes through (in the kernel and, with a first
cell, in each rank's serving loop), runs `--cells` no-op cells after 20 ms of quiet and as many
back to back, and prints medians in microseconds:

- kernel: when its first and last request left and its first and last reply came, counted from
  the moment `lab.run` began, and the whole call;
- rank: each piece of serving one `exec` (decoding the request, looking for a Stop pressed
  before it, compiling and running the code, checking the output pipes, encoding and sending
  the reply), and the whole, from the request read to the reply sent (the median over ranks of
  each rank's median).

The wrappers cost a little themselves; compare runs of this script, not its figures with the
benchmark's (`python -m labkit.bench`).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import labkit

RANK_TIMERS = """
import collections as _c, statistics as _st, sys as _s, time as _t
import labkit.rank.worker as _w
from labkit.rank import trace as _tr
_f = _s._getframe()
while _f.f_code.co_name != "serve":  # the serving loop's frame holds the handlers
    _f = _f.f_back
_R, _H = _f.f_locals["self"], _f.f_locals["handlers"]
_P = _c.defaultdict(list)
_read_at = [0.0]
def _timed(name, fn):
    def inner(*a, **k):
        t = _t.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _P[name].append(_t.perf_counter() - t)
    return inner
def _stamped(fn):
    def inner(*a, **k):
        frames = fn(*a, **k)
        _read_at[0] = _t.perf_counter()
        return frames
    return inner
def _whole(fn):
    def inner(msg):
        fn(msg)
        _P["request read to reply sent"].append(_t.perf_counter() - _read_at[0])
    return inner
_R.ctrl.recv_multipart = _stamped(_R.ctrl.recv_multipart)
_R.codec.decode = _timed("decode", _R.codec.decode)
_R._take_stop = _timed("Stop check", _R._take_stop)
_w.run_code = _timed("compile and run", _w.run_code)
_R.capture.flush = _timed("output check", _R.capture.flush)
_tr.progress = _timed("progress", _tr.progress)
_R.codec.encode = _timed("encode", _R.codec.encode)
_R.ctrl.send_multipart = _timed("send", _R.ctrl.send_multipart)
_H["exec"] = _whole(_H["exec"])
"""

WARM = """
import sys as _s, timeit as _ti
from labkit.wire.codec import Codec as _Codec
from labkit.wire.messages import Done as _Done
_f = _s._getframe()
while _f.f_code.co_name != "serve":
    _f = _f.f_back
_R = _f.f_locals["self"]
_sender = _Codec(_R.cfg.key)  # signs as the kernel does (a sender of its own)
_it = iter([_sender.encode({"type": "exec", "id": 10**9, "display": True, "code": "pass"})
            for _ in range({calls})])
_done = dict(type="done", id=5, duration=0.1, error=None, t_end=1.0, stream_seq=3,
             progress=None, rank=0, gen=1)
def _stop():
    _R._take_stop(10**9)
_pieces = dict(
    decode=lambda: _R.codec.decode(next(_it)),
    encode=lambda: _R.codec.encode(_Done(**_done)),
    stop=_stop,
    output=_R.capture.flush,
)
{k: _ti.timeit(fn, number={calls}) / {calls} for k, fn in _pieces.items()}
"""

RANK_PIECES = (  # in the order a rank goes through them
    "decode",
    "Stop check",
    "compile and run",
    "output check",
    "progress",
    "encode",
    "send",
    "request read to reply sent",
)


def kernel_timers(lab: labkit.Lab) -> tuple[dict[str, list[float]], list[float]]:
    """Wrap the channel's send and receive; returns the marks and the call's start (to set)."""
    marks: dict[str, list[float]] = collections.defaultdict(list)
    began = [0.0]
    ch = lab.channel
    send, receive = ch.send, ch._receive

    def timed_send(ranks, *a, **k):
        marks["first request out"].append(time.perf_counter() - began[0])
        send(ranks, *a, **k)
        marks["last request out"].append(time.perf_counter() - began[0])

    def timed_receive(*a, **k):
        msg = receive(*a, **k)
        marks["replies"].append(time.perf_counter() - began[0])
        return msg

    ch.send, ch._receive = timed_send, timed_receive
    return marks, began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--cells", type=int, default=300)
    args = ap.parse_args()
    lab = labkit.Lab(args.ranks, device="cpu")
    try:
        lab.server.wait_warm()
        calls = 2000
        warm = lab.run(WARM.replace("{calls}", str(calls)), ranks=0, display=False)[0]
        if warm.error:
            raise RuntimeError(f"the warm timers failed on rank 0: {warm.error['message']}")
        print(f"rank 0, warm (each piece alone, timeit, {calls} calls; us)")
        print("warm:   " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in warm.value.items()))
        lab.run(RANK_TIMERS)
        marks, began = kernel_timers(lab)
        for _ in range(50):
            lab.run("pass")
        for quiet in (0.02, 0.0):
            lab.run("_P.clear()")
            marks.clear()
            calls = []
            for _ in range(args.cells):
                time.sleep(quiet)
                began[0] = time.perf_counter()
                lab.run("pass")
                calls.append(time.perf_counter() - began[0])
            replies = marks.pop("replies")
            n = args.ranks
            marks["first reply in"] = replies[0::n]
            marks["last reply in"] = replies[n - 1 :: n]
            marks["lab.run"] = calls
            kernel = ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in marks.items())
            ranks = lab.run("{k: _st.median(v) for k, v in _P.items()}", display=False)
            when = f"after {quiet * 1e3:.0f} ms of quiet" if quiet else "back to back"
            print(f"\n{args.ranks} ranks, {args.cells} no-op cells, {when} (medians, us)")
            print("kernel: " + kernel)
            print(
                "rank:   "
                + ", ".join(
                    f"{k} {statistics.median(r.value[k] for r in ranks.values()) * 1e6:.0f}"
                    for k in RANK_PIECES
                )
            )
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
